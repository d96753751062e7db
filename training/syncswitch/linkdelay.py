"""Delay a host's network link: the network straggler of the original (``tc netem delay`` on a worker's
interface), and the userspace delayer that stands in for netem where the kernel lacks it.

    python -m syncswitch.linkdelay --address 10.0.0.12 --delay-ms 30 --duration 60
        delay every round trip through the interface that holds 10.0.0.12 by 30 ms for 60 s (or until
        SIGTERM), then restore the link
    python -m syncswitch.linkdelay clear
        remove whatever an earlier run left (after a SIGKILL)

The launcher forks this on a straggling worker's host through that host's fork server (request
``"program": "linkdelay"``), so it runs in the host's network namespace with the fork server's rights.

Two mechanisms, the first that works:
- ``netem``: a root ``netem delay`` qdisc with our handle on the interface (outbound packets wait).
- ``nfqueue``: an iptables rule (mangle PREROUTING, commented ``syncswitch-linkdelay``) queues inbound
  packets to this process, which releases them after the delay. Some VM kernels, this project's CI
  machine among them, have no sch_netem; NFQUEUE only needs netfilter. Delaying inbound rather than
  outbound packets adds the same time to every round trip, without holding packets that TCP small
  queues still charge to a sending socket. ``--queue-bypass``: if this process dies by SIGKILL, the
  rule lets packets through undelayed instead of dropping them; ``clear`` then removes the rule.

Either way the added round-trip time to every peer is ``delay_ms``. Needs CAP_NET_ADMIN: root, or
``sudo -n`` for tc and iptables. Stdlib only: the testbed (testing/testbed/links.py) runs the
delayer from here.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator

RULE_COMMENT = "syncswitch-linkdelay"
NETEM_HANDLE = "5353:"
QUEUE_NUM = 17  # the testbed's own link delayer uses queue 0 (raw table)
SELECT_SLICE_S = 0.2  # how often the delay loop looks at its stop flag while no packet is due


def _tool(name: str) -> list[str]:
    return [name] if os.geteuid() == 0 else ["sudo", "-n", name]


def _run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


class Nfqueue:
    """One NFQUEUE (netfilter queue) in a given network namespace, over raw netlink.

    Packets an iptables `-j NFQUEUE` rule sends to the queue wait in the kernel until we give a
    verdict; copy mode "meta" means only the packet id and hook reach us, not the payload.
    """

    NETLINK_NETFILTER = 12
    SUBSYS_QUEUE = 3
    MSG_PACKET, MSG_VERDICT, MSG_CONFIG, MSG_VERDICT_BATCH = 0, 1, 2, 3
    CFG_CMD, CFG_PARAMS, CFG_QUEUE_MAXLEN, CFG_MASK, CFG_FLAGS = 1, 2, 3, 4, 5
    CMD_BIND = 1
    COPY_META = 1
    FLAG_GSO = 4  # take GSO packets whole instead of making the kernel segment them for us
    ATTR_PACKET_HDR, ATTR_VERDICT_HDR = 1, 2
    NLM_F_REQUEST, NLM_F_ACK = 1, 4
    NLMSG_ERROR = 2
    NF_DROP, NF_ACCEPT = 0, 1
    HOOK_PRE_ROUTING, HOOK_LOCAL_OUT = 0, 3
    SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5
    SO_RCVBUFFORCE = 33

    def __init__(self, queue_num: int, *, netns: str | None = None, max_len: int = 65536) -> None:
        self.queue_num = queue_num
        self._seq = 0
        self.sock = self._socket_in(netns)
        self._configure(max_len)

    def _socket_in(self, netns: str | None) -> socket.socket:
        """A netlink socket belongs to the namespace it was created in: create it there, come back."""
        if netns is None:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, self.NETLINK_NETFILTER)
        else:
            home = os.open("/proc/self/ns/net", os.O_RDONLY)
            try:
                setns(f"/run/netns/{netns}")
                try:
                    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, self.NETLINK_NETFILTER)
                finally:
                    setns_fd(home)
            finally:
                os.close(home)
        sock.bind((0, 0))
        sock.setsockopt(socket.SOL_SOCKET, self.SO_RCVBUFFORCE, 16 << 20)
        # Lost notifications are harmless (the next batch verdict releases those packets too), so
        # never fail a recv with ENOBUFS.
        sock.setsockopt(self.SOL_NETLINK, self.NETLINK_NO_ENOBUFS, 1)
        return sock

    def _configure(self, max_len: int) -> None:
        self._request(self.MSG_CONFIG, [(self.CFG_CMD, struct.pack(">BBH", self.CMD_BIND, 0, 0))])
        self._request(
            self.MSG_CONFIG,
            [
                (self.CFG_PARAMS, struct.pack(">IB", 0, self.COPY_META)),
                (self.CFG_QUEUE_MAXLEN, struct.pack(">I", max_len)),
                (self.CFG_MASK, struct.pack(">I", self.FLAG_GSO)),
                (self.CFG_FLAGS, struct.pack(">I", self.FLAG_GSO)),
            ],
        )

    def _message(self, msg_type: int, attrs: list[tuple[int, bytes]], flags: int) -> bytes:
        payload = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(self.queue_num))
        for attr_type, value in attrs:
            attr = struct.pack("=HH", 4 + len(value), attr_type) + value
            payload += attr + b"\0" * (-len(attr) % 4)
        self._seq += 1
        header = struct.pack(
            "=IHHII",
            16 + len(payload),
            (self.SUBSYS_QUEUE << 8) | msg_type,
            self.NLM_F_REQUEST | flags,
            self._seq,
            0,
        )
        return header + payload

    def _request(self, msg_type: int, attrs: list[tuple[int, bytes]]) -> None:
        """Send a configuration message and wait for the kernel's acknowledgement (or its error)."""
        self.sock.send(self._message(msg_type, attrs, self.NLM_F_ACK))
        reply = self.sock.recv(65536)
        _length, reply_type = struct.unpack_from("=IH", reply)
        if reply_type == self.NLMSG_ERROR:
            (error,) = struct.unpack_from("=i", reply, 16)
            if error:
                raise OSError(-error, f"NFQUEUE {self.queue_num} config: {os.strerror(-error)}")

    def verdict(self, packet_id: int, verdict: int) -> None:
        attr = (self.ATTR_VERDICT_HDR, struct.pack(">II", verdict, packet_id))
        self.sock.send(self._message(self.MSG_VERDICT, [attr], 0))

    def accept_up_to(self, packet_id: int) -> None:
        """Accept every queued packet with an id up to packet_id, in one message."""
        attr = (self.ATTR_VERDICT_HDR, struct.pack(">II", self.NF_ACCEPT, packet_id))
        self.sock.send(self._message(self.MSG_VERDICT_BATCH, [attr], 0))

    def packets(self, buffer: bytearray) -> Iterator[tuple[int, int]]:
        """(packet id, hook) of each packet waiting on the socket, without blocking."""
        while True:
            try:
                size = self.sock.recv_into(buffer, len(buffer), socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            offset = 0
            while offset + 16 <= size:
                length, msg_type = struct.unpack_from("=IH", buffer, offset)
                if length < 16:
                    break
                if msg_type == (self.SUBSYS_QUEUE << 8) | self.MSG_PACKET:
                    header = self._attribute(buffer, offset + 20, offset + length, self.ATTR_PACKET_HDR)
                    if header is not None:
                        packet_id, _proto, hook = struct.unpack_from(">IHB", buffer, header)
                        yield packet_id, hook
                offset += (length + 3) & ~3

    @staticmethod
    def _attribute(buffer: bytearray, start: int, end: int, wanted: int) -> int | None:
        while start + 4 <= end:
            attr_len, attr_type = struct.unpack_from("=HH", buffer, start)
            if attr_len < 4:
                return None
            if attr_type & 0x3FFF == wanted:
                return start + 4
            start += (attr_len + 3) & ~3
        return None


def setns_fd(fd: int) -> None:
    if hasattr(os, "setns"):  # Python >= 3.12
        os.setns(fd, os.CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        setns_fd(fd)
    finally:
        os.close(fd)


def set_timer_slack_ns(nanoseconds: int) -> None:
    """Wake up within microseconds of a packet's release time instead of the default 50 us slack."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(29, nanoseconds, 0, 0, 0)  # PR_SET_TIMERSLACK


def run_delayer(
    queue: Nfqueue,
    *,
    round_trip_s: float,
    jitter_s: float = 0.0,
    loss: float = 0.0,
    stop: threading.Event | None = None,
    until: float | None = None,
) -> None:
    """Hold inbound packets for ``round_trip_s``; drop a ``loss`` fraction of packets both ways.

    Runs until ``stop`` is set or ``until`` (time.monotonic()) passes, then releases every packet it
    still holds. Release times never decrease (jitter does not reorder packets), so the packets due at
    any moment are exactly those up to the last due id and one batch verdict releases them all.
    """
    waiting: deque[tuple[float, int]] = deque()  # (release time, packet id)
    last_release = 0.0
    last_id: int | None = None
    buffer = bytearray(1 << 16)
    while not (stop is not None and stop.is_set()) and (until is None or time.monotonic() < until):
        timeout = max(0.0, waiting[0][0] - time.monotonic()) if waiting else None
        if stop is not None or until is not None:
            timeout = SELECT_SLICE_S if timeout is None else min(timeout, SELECT_SLICE_S)
        readable, _, _ = select.select([queue.sock], [], [], timeout)
        if readable:
            now = time.monotonic()
            for packet_id, hook in queue.packets(buffer):
                last_id = packet_id
                if loss and random.random() < loss:
                    queue.verdict(packet_id, Nfqueue.NF_DROP)
                elif hook != Nfqueue.HOOK_PRE_ROUTING:  # outbound packets only go through for loss
                    queue.verdict(packet_id, Nfqueue.NF_ACCEPT)
                else:
                    release = now + round_trip_s + (random.uniform(-jitter_s, jitter_s) if jitter_s else 0.0)
                    last_release = max(release, last_release)
                    waiting.append((last_release, packet_id))
        now = time.monotonic()
        due_id = None
        while waiting and waiting[0][0] <= now:
            due_id = waiting.popleft()[1]
        if due_id is not None:
            queue.accept_up_to(due_id)
    if last_id is not None:  # let go of everything still held: a closed queue would drop it
        queue.accept_up_to(last_id)


# ---- the straggler: one host's link ------------------------------------------------------------------


def interface_of(address: str) -> str:
    """The interface that holds ``address`` in this network namespace."""
    listing = _run(["ip", "-o", "addr", "show"]).stdout
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[3].split("/")[0] == address:
            return fields[1].split("@")[0]
    raise OSError(f"no interface here holds {address}")


def _mangle(action: str, interface: str) -> list[str]:
    return [
        *_tool("iptables"),
        "-w",
        "-t",
        "mangle",
        action,
        "PREROUTING",
        "-i",
        interface,
        "-m",
        "comment",
        "--comment",
        RULE_COMMENT,
        "-j",
        "NFQUEUE",
        "--queue-num",
        str(QUEUE_NUM),
        "--queue-bypass",
    ]


def _our_rules() -> list[str]:
    """The interfaces that our leftover NFQUEUE rules name."""
    done = _run([*_tool("iptables"), "-w", "-t", "mangle", "-S", "PREROUTING"], check=False)
    interfaces = []
    for line in done.stdout.splitlines():
        fields = line.split()
        if RULE_COMMENT in line and "-i" in fields:
            interfaces.append(fields[fields.index("-i") + 1])
    return interfaces


def clear() -> list[str]:
    """Remove every delay an earlier run left in this namespace; returns what was removed."""
    removed = []
    for interface in _our_rules():
        _run(_mangle("-D", interface), check=False)
        removed.append(f"nfqueue rule on {interface}")
    listing = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in listing.splitlines():
        interface = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
        qdiscs = _run(["tc", "qdisc", "show", "dev", interface], check=False).stdout if interface else ""
        if f"netem {NETEM_HANDLE}" in qdiscs:
            _run([*_tool("tc"), "qdisc", "del", "dev", interface, "root"], check=False)
            removed.append(f"netem on {interface}")
    return removed


def _apply_netem(interface: str, delay_ms: float) -> bool:
    # Replaces the interface's root qdisc; deleting ours later puts the kernel's default back (a
    # hand-made root qdisc, e.g. a rate limit, is not restored).
    add = [*_tool("tc"), "qdisc", "replace", "dev", interface, "root", "handle", NETEM_HANDLE]
    return _run([*add, "netem", "delay", f"{delay_ms:g}ms"], check=False).returncode == 0


def delay_link(address: str, delay_ms: float, duration_s: float, stop: threading.Event) -> str:
    """Delay the link of ``address`` by ``delay_ms`` per round trip for ``duration_s`` (or until
    ``stop``), then restore it. Returns the mechanism used."""
    interface = interface_of(address)
    until = time.monotonic() + duration_s
    if _apply_netem(interface, delay_ms):
        try:
            stop.wait(max(until - time.monotonic(), 0.0))
        finally:
            _run([*_tool("tc"), "qdisc", "del", "dev", interface, "root"], check=False)
        return "netem"
    queue = Nfqueue(QUEUE_NUM)  # bound before the rule: a queued packet with no listener is dropped
    try:
        _run(_mangle("-A", interface))
        set_timer_slack_ns(1000)
        try:
            run_delayer(queue, round_trip_s=delay_ms / 1000, stop=stop, until=until)
        finally:
            _run(_mangle("-D", interface), check=False)
            run_delayer(queue, round_trip_s=0.0, until=time.monotonic() + SELECT_SLICE_S)
    finally:
        queue.sock.close()
    return "nfqueue"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["clear"]:
        for what in clear():
            print(f"linkdelay: removed {what}", flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="python -m syncswitch.linkdelay")
    parser.add_argument("--address", required=True, help="an address of this host: its interface is delayed")
    parser.add_argument("--delay-ms", type=float, required=True, help="added to every round trip")
    parser.add_argument("--duration", type=float, required=True, help="seconds")
    opts = parser.parse_args(args)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    for what in clear():
        print(f"linkdelay: removed {what} left by an earlier run", flush=True)
    print(
        f"linkdelay: {opts.address} +{opts.delay_ms:g} ms per round trip for {opts.duration:g} s", flush=True
    )
    mechanism = delay_link(opts.address, opts.delay_ms, opts.duration, stop)
    print(f"linkdelay: {opts.address} restored ({mechanism})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
