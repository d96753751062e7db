"""Link shaping: a host's delay, jitter, rate and loss, by tc (HTB for the rate, netem for the rest)
or, where the kernel has no netem, by a userspace NFQUEUE delayer (``syncswitch.linkdelay``)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from syncswitch import linkdelay

from testbed.system import HOST_INTERFACE, cmdline, kill_and_wait, run

DELAYER_COMMAND = "_delay"  # the hidden CLI command that runs a host's userspace delayer

# Link profiles for Google Cloud, as the link between one host and the rest of the cluster. The delay
# is one-way: a host with delay d has a round trip of 2*d to an unshaped host (and to the gateway);
# between two shaped hosts the round trips add up (2*d1 + 2*d2), as if each host sat d away from a
# common switch. Sources:
# - "Locations within regions tend to have round-trip network latencies of <1ms in the 95th
#   percentile" (Google Cloud, Best practices for Compute Engine region selection); measured
#   intra-zone round trips are ~0.1-0.2 ms (netperf TCP_RR on same-zone VMs, e.g. PerfKitBenchmarker
#   runs), so same-zone 0.05 ms one-way (0.1 ms to a lan host, 0.2 ms between two same-zone hosts) and
#   cross-zone 0.4 ms one-way (0.8 ms to a lan host, under the documented 1 ms).
# - Compute Engine caps a VM's egress at 2 Gbit/s per vCPU (up to 16-32 Gbit/s by machine type):
#   10 Gbit/s is a mid-size VM's cap; across zones we take 5 Gbit/s for a single training flow.
# - Cross-region round trips are tens of ms (us-central1 <-> us-east1 ~25-35 ms, across the US
#   ~60-70 ms): 20 ms one-way, with a few hundred Mbit/s per flow and a little loss. Li et al.,
#   "Speeding up Deep Learning with Transient Servers" (ICAC'19, arXiv:1903.00045), the Sync-Switch
#   authors' earlier study, found workers in another region up to 48% slower, which is the effect this
#   profile is there to reproduce.
PROFILES: dict[str, dict[str, float | None]] = {
    "lan": {"delay_ms": 0.0, "jitter_ms": 0.0, "rate_mbit": None, "loss_pct": 0.0},
    "same-zone": {"delay_ms": 0.05, "jitter_ms": 0.0, "rate_mbit": 10000.0, "loss_pct": 0.0},
    "cross-zone": {"delay_ms": 0.4, "jitter_ms": 0.05, "rate_mbit": 5000.0, "loss_pct": 0.0},
    "cross-region": {"delay_ms": 20.0, "jitter_ms": 1.0, "rate_mbit": 300.0, "loss_pct": 0.01},
}


@dataclass(frozen=True)
class LinkShape:
    """How a host's link is shaped; see Testbed.set_link() for where each part is applied."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_mbit: float | None = None
    loss_pct: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss_pct <= 100:
            raise ValueError(f"bad link shape {self}: delays must be >= 0 and loss in [0, 100]")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError(f"bad link shape {self}: rate_mbit must be > 0 (None: no rate limit)")

    @property
    def needs_delayer(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    @property
    def is_unshaped(self) -> bool:
        return not self.needs_delayer and self.rate_mbit is None

    def describe(self) -> str:
        if self.is_unshaped:
            return "unshaped"
        rate = f"{self.rate_mbit:g} Mbit/s" if self.rate_mbit else "no rate limit"
        return (
            f"one-way delay {self.delay_ms:g} ms (+-{self.jitter_ms:g} ms), {rate}, loss {self.loss_pct:g}%"
        )


def probe_delay_mechanism(bridge: str) -> str:
    """netem when the kernel has it; else the userspace NFQUEUE delayer (some VM kernels lack it)."""
    probe = run(["tc", "qdisc", "add", "dev", bridge, "root", "netem", "delay", "1ms"], check=False)
    if probe.returncode != 0:
        return "nfqueue"
    run(["tc", "qdisc", "del", "dev", bridge, "root"], check=False)
    return "netem"


def shape_rate(tc: list[str], device: str, rate_mbit: float | None) -> None:
    if rate_mbit is None:
        return
    # quantum: HTB's default (rate / 10) is out of range at Gbit rates; one class needs no fairness.
    run([*tc, "qdisc", "add", "dev", device, "root", "handle", "1:", "htb", "default", "1"])
    rate = f"{rate_mbit:g}mbit"
    htb = ["htb", "rate", rate, "ceil", rate, "quantum", "200000"]
    run([*tc, "class", "add", "dev", device, "parent", "1:", "classid", "1:1", *htb])


def shape_netem(tc: list[str], device: str, shape: LinkShape, *, delay_ms: float, jitter_ms: float) -> None:
    shape_rate(tc, device, shape.rate_mbit)
    if not (delay_ms or jitter_ms or shape.loss_pct):
        return
    parent = ["parent", "1:1", "handle", "10:"] if shape.rate_mbit else ["root"]
    netem = ["netem", "limit", "100000", "delay", f"{delay_ms:g}ms"]
    if jitter_ms:
        netem.append(f"{jitter_ms:g}ms")
    if shape.loss_pct:
        netem += ["loss", f"{shape.loss_pct:g}%"]
    run([*tc, "qdisc", "add", "dev", device, *parent, *netem])


def start_delayer(testbed: str, netns: str, shape: LinkShape, host_dir: Path) -> None:
    """The host's userspace delayer (a process in the root namespace, so not in the host's process
    table), then the rules that queue the host's inbound packets to it."""
    delay = ["--delay-ms", str(shape.delay_ms), "--jitter-ms", str(shape.jitter_ms)]
    started = run(
        [
            sys.executable,
            "-m",
            "testbed",
            DELAYER_COMMAND,
            *("--testbed", testbed, "--netns", netns, "--queue", "0"),
            *delay,
            *("--loss-pct", str(shape.loss_pct), "--log", str(host_dir / "delayer.log")),
        ]
    )
    (host_dir / "delayer.pid").write_text(started.stdout.strip())
    # Rules after the queue is bound: a queued packet with no listener would be dropped.
    iptables = ["ip", "netns", "exec", netns, "iptables", "-w", "-t", "raw", "-A"]
    queue = ["-j", "NFQUEUE", "--queue-num", "0"]
    run([*iptables, "PREROUTING", "-i", HOST_INTERFACE, *queue])
    if shape.loss_pct:
        run([*iptables, "OUTPUT", "-o", HOST_INTERFACE, *queue])


def stop_delayer(testbed: str, netns: str, host_dir: Path) -> None:
    pid_file = host_dir / "delayer.pid"
    if not pid_file.exists():
        return
    for chain in ("PREROUTING", "OUTPUT"):
        run(["ip", "netns", "exec", netns, "iptables", "-w", "-t", "raw", "-F", chain], check=False)
    pid = int(pid_file.read_text())
    if is_delayer_of(pid, testbed):
        kill_and_wait(pid)
    pid_file.unlink()


def is_delayer_of(pid: int, testbed: str) -> bool:
    argv = cmdline(pid)
    return DELAYER_COMMAND in argv and f"--testbed\0{testbed}\0" in "\0".join(argv) + "\0"


def delayer_pids(testbed: str) -> list[int]:
    """The testbed's delayers, found by command line (they live in the root namespace)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and is_delayer_of(int(e), testbed)]


def delayer_main(args: argparse.Namespace) -> int:
    """Bind the host's queue (errors go to the caller), then detach and serve it until killed."""
    shape = LinkShape(delay_ms=args.delay_ms, jitter_ms=args.jitter_ms, loss_pct=args.loss_pct)
    queue = linkdelay.Nfqueue(args.queue, netns=args.netns)
    child = os.fork()
    if child:
        print(child, flush=True)  # the caller records it; we return at once so it never waits on us
        return 0
    os.setsid()
    with open(args.log, "a") as log_file:
        os.dup2(log_file.fileno(), 1)
        os.dup2(log_file.fileno(), 2)
    with open(os.devnull) as null:
        os.dup2(null.fileno(), 0)
    linkdelay.set_timer_slack_ns(1000)
    print(f"delayer for {args.netns}: {shape}", flush=True)
    try:
        linkdelay.run_delayer(
            queue,
            round_trip_s=2 * shape.delay_ms / 1000,
            jitter_s=shape.jitter_ms / 1000,
            loss=shape.loss_pct / 100,
        )
    except BaseException:
        traceback.print_exc()
    os._exit(1)  # a forked child must never return into the code that called main()
