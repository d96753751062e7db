"""A StatsD sink: a UDP port on this machine that keeps every metric sent to it, for the tests and the
benchmarks that turn Airflow's metrics on (``[metrics] statsd_on``).

    with StatsdSink() as sink:          # listens on 127.0.0.1:<sink.port> until the block ends
        ...                             # an Airflow with statsd_host/statsd_port pointing at it
        sink.received("airflow.syncswitch.")   # [Sample(name, value, kind, tags)], in arrival order

Each datagram holds lines of ``name[,tag=value...]:value|kind[|@rate]`` (the tags are there with
``statsd_influxdb_enabled``); a line that does not parse is kept as it came (``unparsed``).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field
from types import TracebackType


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    kind: str  # "g" gauge, "c" counter, "ms" timing
    tags: dict[str, str] = field(default_factory=dict)


def parse_line(line: str) -> Sample | None:
    """One StatsD line as a Sample, or None if it is not one."""
    head, sep, rest = line.rpartition(":")
    if not sep or "|" not in rest:
        return None
    value, kind = rest.split("|")[:2]
    name, *tags = head.split(",")
    try:
        number = float(value)
    except ValueError:
        return None
    pairs = dict(tag.split("=", 1) for tag in tags if "=" in tag)
    return Sample(name, number, kind, pairs)


class StatsdSink:
    """Listens on ``host``:``port`` (any free port by default) in a thread of its own."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._socket.bind((host, port))
        self._socket.settimeout(0.2)
        self.host, self.port = self._socket.getsockname()
        self._lock = threading.Lock()
        self._samples: list[Sample] = []
        self.unparsed: list[str] = []
        self.datagrams = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="statsd-sink", daemon=True)

    def __enter__(self) -> StatsdSink:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()

    def _receive(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._socket.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            self._take(data.decode("utf-8", errors="replace"))

    def _take(self, text: str) -> None:
        with self._lock:
            self.datagrams += 1
            for line in filter(None, text.splitlines()):
                sample = parse_line(line)
                if sample is None:
                    self.unparsed.append(line)
                else:
                    self._samples.append(sample)

    def received(self, prefix: str = "") -> list[Sample]:
        """Every sample so far whose name starts with ``prefix``, in arrival order."""
        with self._lock:
            return [s for s in self._samples if s.name.startswith(prefix)]

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()
            self.unparsed.clear()
            self.datagrams = 0
