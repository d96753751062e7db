"""Each BSP worker's round trip to its peers: the straggler signal of a slow link.

In lockstep a slow link does not raise the straggling worker's own compute time (every worker waits
in the all-reduce alike), so the detector also needs to know whose link is slow. A worker times a TCP
connect (one SYN / SYN-ACK round trip) to each peer's TensorFlow server every second. A worker with
a slow link sees it to every peer; a healthy worker only towards the slow one, so the minimum over
the peers singles out the straggler (with at least three workers; two see the same link).

A worker that has finished also waits here for the chief to exit (``wait_until_gone``): the chief may
still be fetching the worker's share of the last all-reduce from the worker's server.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

PROBE_INTERVAL_SECONDS = 1.0
CONNECT_TIMEOUT_SECONDS = 2.0
# How long a finished BSP worker waits for the chief to go, at most (the launcher stops it sooner).
CHIEF_WAIT_SECONDS = 60.0


class PeerProbe:
    """Times a TCP connect to each of ``peers`` ("host:port") every second on a daemon thread;
    ``rtt`` is the latest round's minimum over the peers, in seconds (None before the first)."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = [host_port(p) for p in peers]
        self.rtt: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peer-probe", daemon=True)

    def start(self) -> PeerProbe:
        if self.peers:
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(PROBE_INTERVAL_SECONDS):
            times = [t for t in map(self._connect_time, self.peers) if t is not None]
            if times:
                self.rtt = min(times)

    @staticmethod
    def _connect_time(peer: tuple[str, int]) -> float | None:
        started = time.perf_counter()
        try:
            with socket.create_connection(peer, timeout=CONNECT_TIMEOUT_SECONDS):
                return time.perf_counter() - started
        except OSError:  # a peer that is gone or not listening yet says nothing about the link
            return None


def accepts(address: str) -> bool:
    """Whether something accepts a TCP connection at ``address`` ("host:port") within the connect
    timeout; the connection is closed at once, without a word (a fork server takes that as a lease
    given back)."""
    try:
        with socket.create_connection(host_port(address), timeout=CONNECT_TIMEOUT_SECONDS):
            return True
    except (OSError, ValueError):
        return False


def wait_until_gone(address: str, *, timeout: float = CHIEF_WAIT_SECONDS) -> bool:
    """Wait until nothing listens at ``address`` ("host:port") any more: its process exited (a
    connect is refused) or its host is gone (a connect times out). One connection is held open
    meanwhile, so the wait costs nothing until its peer closes it. True once gone, False after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            conn = socket.create_connection(host_port(address), timeout=min(left, CONNECT_TIMEOUT_SECONDS))
        except OSError:
            return True
        with conn:
            try:
                conn.settimeout(left)
                while conn.recv(4096):  # whatever the server greets with, until it closes
                    conn.settimeout(max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                return False
            except OSError:
                pass  # reset by the peer: look again whether it still listens
    return False


def host_port(address: str) -> tuple[str, int]:
    """("host", port) of a TF_CONFIG address: "10.0.0.2:2222", "node-1:2222" or "[::1]:2222"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def bsp_peers(tf_config: dict, task: int) -> list[str]:
    """The other BSP workers' addresses, from TF_CONFIG."""
    workers = tf_config.get("cluster", {}).get("worker", [])
    return [address for i, address in enumerate(workers) if i != task]


def probe_peers_of(task: int) -> PeerProbe:
    """A started probe of all-reduce worker ``task``'s peers, as its TF_CONFIG names them."""
    return PeerProbe(bsp_peers(json.loads(os.environ.get("TF_CONFIG", "{}")), task)).start()
