"""Straggler detection from per-worker step timings: pure logic, no Airflow, no TF, no I/O.

Input: ``worker_step`` events (``syncswitch.events``), fed incrementally in wall-time order.

Signal. In BSP every worker's ``step_time`` is the same (the all-reduce is a barrier), so the signal
is ``compute_time``: the local forward and backward pass before the all-reduce. A straggler shows a
high compute time (and almost no all-reduce wait). A slow link does not raise it (every worker waits
in the all-reduce alike), so where workers report ``peer_rtt`` (their smallest round trip to a peer,
syncswitch.peers) the BSP signal is ``compute_time + (n - 1) * peer_rtt`` for n workers: a ring
all-reduce crosses each worker's link 2(n - 1) times a step, each half a round trip. In ASP each worker
closes its own steps, so the signal is the worker's ``step_time``, which a slow link raises directly.
The other protocols go by their topology (syncswitch.protocols): compressed BSP and local SGD as BSP
(a local SGD step has no wait: its own share is the step), SSP as ASP.
A SIGSTOP duty-cycled worker and a delayed link raise exactly these.

Windows. Time is cut into windows of ``window_seconds`` aligned on the first sample. A window is
closed once a sample at least ``lateness`` seconds past its end has been seen, so events that reach
storage a little late (gs:// uploads are batched) still land in their window.

Per window and worker the statistic is the mean of the signal, not its median: a duty-cycled
straggler (CPU quota throttling, the injector's SIGSTOP cycles) slows only the steps its stops fall
in, and where those are a minority of its steps a median skips them and reads it healthy. Each
worker is compared with the cluster's own baseline: the median of the *other* workers' statistics in
the same window, so no threshold is tied to a model or a machine, and a cluster that slows down as a
whole is not a straggler. ``factor = stat / baseline``; a worker is flagged when ``factor >=
threshold``. In ASP a worker with too few samples in a window is measured by the step it is still
in (time since its last completed step, a lower bound), so a worker that slows to a crawl or
freezes is still named.

Hysteresis: ``raise_after`` consecutive flagged windows raise the verdict, ``clear_after``
consecutive clean windows clear it. Windows without evidence (fewer than two workers measured)
leave the counters as they are.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from syncswitch.protocols import ALLREDUCE, PROTOCOLS, family

SIGNALS = ("auto", "compute_time", "step_time")


@dataclass(frozen=True)
class DetectorConfig:
    window_seconds: float = 5.0
    threshold: float = 1.5  # slowdown factor vs the other workers' median that flags a worker
    raise_after: int = 2  # K consecutive flagged windows to raise
    clear_after: int = 3  # M consecutive clean windows to clear
    lateness: float = 2.5  # s a window stays open after its end for late-arriving events
    min_samples: int = 2  # samples a worker needs in a window to be measured
    skip_first: int = 1  # each worker's first samples (graph tracing, warm-up) are ignored
    signal: str = "auto"  # auto: compute_time in BSP, step_time in ASP

    def __post_init__(self) -> None:
        if self.window_seconds <= 0:
            raise ValueError(f"window_seconds must be > 0, got {self.window_seconds}")
        if self.threshold <= 1.0:
            raise ValueError(f"threshold must be > 1, got {self.threshold}")
        if self.raise_after < 1 or self.clear_after < 1:
            raise ValueError("raise_after and clear_after must be >= 1")
        if self.lateness < 0 or self.min_samples < 1 or self.skip_first < 0:
            raise ValueError("lateness and skip_first must be >= 0, min_samples >= 1")
        if self.signal not in SIGNALS:
            raise ValueError(f"signal {self.signal!r} is not one of {SIGNALS}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DetectorConfig:
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WorkerStat:
    """One worker in one window."""

    worker: int
    mean: float  # of the signal, seconds
    samples: int
    factor: float | None  # mean / baseline of the other workers; None without a baseline
    open_step: bool = False  # the mean was raised by a step still in progress at window end

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerStat:
        values = dict(data)
        if "median" in values:  # a verdict recorded before the statistic became the mean
            values["mean"] = values.pop("median")
        return cls(**values)


@dataclass(frozen=True)
class Verdict:
    """The detector's state after one closed window."""

    straggling: bool
    workers: list[int]  # the straggling workers (of the last flagged window while straggling)
    slowdown: float  # largest factor among ``workers``; largest factor in the window when clean
    since: float | None  # wall time of the onset of the current (or just cleared) episode
    window_start: float
    window_end: float
    stats: dict[int, WorkerStat]
    signal: str
    change: str | None = None  # "raised" | "cleared" when this window changed the state
    baseline: float = 0.0  # median of the healthy workers' mean signals, s
    extra_time: float = 0.0  # s the slowest straggler's signal exceeds the baseline by
    step_time: float = 0.0  # median raw step_time of all workers in the window, s
    global_step: float = 0.0  # largest global_step seen so far
    evidence: bool = True  # False: fewer than two workers measured; counters unchanged

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        # JSON object keys are strings; keep the worker ids readable after a round trip.
        data["stats"] = {str(w): asdict(s) for w, s in self.stats.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        values = dict(data)
        values["stats"] = {int(w): WorkerStat.from_dict(s) for w, s in values.get("stats", {}).items()}
        values["workers"] = [int(w) for w in values.get("workers", [])]
        return cls(**values)


@dataclass
class _Window:
    """Samples of one window: per worker the signal values and the wall time of the last one."""

    signal: dict[int, list[float]] = field(default_factory=dict)
    last_wall_time: dict[int, float] = field(default_factory=dict)
    step_times: list[float] = field(default_factory=list)


class StragglerDetector:
    """Feed ``worker_step`` events with :meth:`feed`; it returns one Verdict per window it closes.

    ``straggling_since`` starts the detector in the straggling state (for a segment started because
    of a straggler), so that it reports ``cleared`` after ``clear_after`` clean windows.
    """

    def __init__(
        self,
        config: DetectorConfig | None = None,
        *,
        protocol: str = "bsp",
        straggling_since: float | None = None,
        straggling_workers: Iterable[int] = (),
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
        self.config = config or DetectorConfig()
        self.protocol = protocol
        self.signal = self._choose_signal()
        self._samples_seen: dict[int, int] = {}  # per worker, warm-up samples included
        self._last_wall_time: dict[int, float] = {}  # per worker, over the closed windows
        self._windows: dict[int, _Window] = {}  # open windows by number since the origin
        self._next_to_close = 0
        self._origin: float | None = None
        self._max_wall_time = float("-inf")
        self._global_step = 0.0
        self._straggling = straggling_since is not None
        self._since = straggling_since
        self._workers = sorted(straggling_workers)
        self._slowdown = 0.0
        self._flagged_run = 0
        self._clean_run = 0
        self._run_onset: float | None = None
        self.dropped_late = 0  # samples that arrived after their window was closed

    @property
    def straggling(self) -> bool:
        return self._straggling

    @property
    def origin(self) -> float | None:
        """Wall time of the first counted sample: where window 0 starts."""
        return self._origin

    def _choose_signal(self) -> str:
        if self.config.signal != "auto":
            return self.config.signal
        return "compute_time" if family(self.protocol).topology == ALLREDUCE else "step_time"

    # ---- input ---------------------------------------------------------------------------------

    def feed(self, events: Iterable[Mapping[str, Any]]) -> list[Verdict]:
        """Add events (other event types are ignored); returns the verdicts of windows closed."""
        verdicts: list[Verdict] = []
        for event in events:
            if event.get("event", "worker_step") == "worker_step":
                verdicts.extend(self._add(event))
        return verdicts

    def _add(self, event: Mapping[str, Any]) -> list[Verdict]:
        wall_time = float(event["wall_time"])
        worker = int(event["worker"])
        self._global_step = max(self._global_step, float(event.get("global_step", 0.0)))
        self._samples_seen[worker] = self._samples_seen.get(worker, 0) + 1
        value = self._signal_value(event)
        if self._samples_seen[worker] <= self.config.skip_first or value is None:
            return []
        if self._origin is None:
            self._origin = wall_time
        number = int((wall_time - self._origin) // self.config.window_seconds)
        if number < self._next_to_close:
            self.dropped_late += 1
            return []
        window = self._windows.setdefault(number, _Window())
        window.signal.setdefault(worker, []).append(value)
        window.last_wall_time[worker] = max(window.last_wall_time.get(worker, wall_time), wall_time)
        if event.get("step_time") is not None:
            window.step_times.append(float(event["step_time"]))
        self._max_wall_time = max(self._max_wall_time, wall_time)
        return self._close_ready_windows()

    def _signal_value(self, event: Mapping[str, Any]) -> float | None:
        if self.signal == "compute_time":
            compute = event.get("compute_time")
            if compute is not None and float(compute) > 0:
                link_crossings = max(len(self._samples_seen) - 1, 1)
                return float(compute) + link_crossings * float(event.get("peer_rtt") or 0.0)
        step = event.get("step_time")
        if step is not None and float(step) > 0:
            return float(step)
        return None

    # ---- windows -------------------------------------------------------------------------------

    def _bounds(self, number: int) -> tuple[float, float]:
        assert self._origin is not None
        start = self._origin + number * self.config.window_seconds
        return start, start + self.config.window_seconds

    def _close_ready_windows(self) -> list[Verdict]:
        """Close, in order, every window that ended ``lateness`` s before the latest sample."""
        verdicts: list[Verdict] = []
        while True:
            start, end = self._bounds(self._next_to_close)
            if self._max_wall_time < end + self.config.lateness:
                return verdicts
            window = self._windows.pop(self._next_to_close, _Window())
            self._next_to_close += 1
            verdicts.append(self._close(window, start, end))

    def _close(self, window: _Window, start: float, end: float) -> Verdict:
        means = self._window_means(window, end)
        self._last_wall_time.update(window.last_wall_time)
        stats = self._compare(means)
        threshold = self.config.threshold
        flagged = sorted(w for w, s in stats.items() if s.factor is not None and s.factor >= threshold)
        evidence = sum(1 for s in stats.values() if s.factor is not None) >= 2
        change = self._advance(flagged, stats, start, evidence)
        healthy = [s.mean for w, s in stats.items() if w not in flagged]
        baseline = statistics.median(healthy) if healthy else 0.0
        worst = max((stats[w].mean for w in flagged), default=baseline)
        factors = [s.factor for s in stats.values() if s.factor is not None]
        slowdown = self._slowdown if self._straggling else max(factors, default=0.0)
        return Verdict(
            straggling=self._straggling,
            workers=list(self._workers) if self._straggling else [],
            slowdown=slowdown,
            since=self._since if self._straggling or change == "cleared" else None,
            window_start=start,
            window_end=end,
            stats=stats,
            signal=self.signal,
            change=change,
            baseline=baseline,
            extra_time=max(worst - baseline, 0.0),
            step_time=statistics.median(window.step_times) if window.step_times else 0.0,
            global_step=self._global_step,
            evidence=evidence,
        )

    def _window_means(self, window: _Window, end: float) -> dict[int, tuple[float, int, bool]]:
        """worker -> (mean, samples, raised by an open step)."""
        means: dict[int, tuple[float, int, bool]] = {}
        for worker in sorted(set(self._last_wall_time) | set(window.signal)):
            values = window.signal.get(worker, [])
            if len(values) >= self.config.min_samples:
                means[worker] = (statistics.fmean(values), len(values), False)
                continue
            # In ASP a worker that barely finishes a step in a window is slow; the time since its
            # last completed step is a lower bound on the step it is still in. In BSP a missing
            # worker stalls everyone, so there is nothing to compare and the worker is left out.
            last = window.last_wall_time.get(worker, self._last_wall_time.get(worker))
            if self.signal != "step_time" or last is None:
                continue
            open_step = end - last
            mean = statistics.fmean(values) if values else 0.0
            means[worker] = (max(mean, open_step), len(values), open_step > mean)
        return means

    @staticmethod
    def _compare(means: dict[int, tuple[float, int, bool]]) -> dict[int, WorkerStat]:
        stats: dict[int, WorkerStat] = {}
        for worker, (mean, samples, open_step) in sorted(means.items()):
            others = [m for w, (m, _, _) in means.items() if w != worker]
            baseline = statistics.median(others) if others else 0.0
            factor = round(mean / baseline, 4) if baseline > 0 else None
            stats[worker] = WorkerStat(worker, mean, samples, factor, open_step)
        return stats

    def _advance(
        self, flagged: list[int], stats: dict[int, WorkerStat], start: float, evidence: bool
    ) -> str | None:
        """Update the hysteresis counters; returns "raised" / "cleared" when the state flips."""
        if not evidence:
            return None
        if flagged:
            self._clean_run = 0
            self._flagged_run += 1
            if self._flagged_run == 1:
                self._run_onset = start
            if self._straggling:
                self._workers = flagged
                self._slowdown = max(stats[w].factor or 0.0 for w in flagged)
                return None
            if self._flagged_run >= self.config.raise_after:
                self._straggling = True
                self._since = self._run_onset
                self._workers = flagged
                self._slowdown = max(stats[w].factor or 0.0 for w in flagged)
                return "raised"
            return None
        self._flagged_run = 0
        self._clean_run += 1
        if self._straggling and self._clean_run >= self.config.clear_after:
            self._straggling = False
            return "cleared"
        return None
