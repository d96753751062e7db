"""A cluster of separate "hosts" on one Linux machine: one network namespace per host.

Each host is a network namespace with its own interface, address and sshd on port 22, joined to the
other hosts by one Linux bridge per testbed; this machine keeps an address on the bridge (the
gateway). Only the network is separate: the filesystem, the PID namespace and the users are shared
(docs/testbed.md says what that means for tests). Links can be shaped per host (delay, jitter, rate,
loss), hosts can be "lost" (every process killed, link down) and revived, and an outside namespace on
another subnet can check that a host port is not reachable from outside the cluster network.

Its parts: ``system`` (commands, namespaces and their processes, prerequisites), ``sshd`` (each
host's sshd), ``links`` (link shaping: tc, or the NFQUEUE delayer of ``syncswitch.linkdelay`` where
the kernel has no netem), ``bed`` (the Testbed: hosts' lifecycle and state) and ``cli``. The package
is the workspace's ``syncswitch-testing`` distribution (``testing/``), installed with the dev group,
so the tests, benchmarks and the Celery deployment import it as ``testbed``; as root:

    .venv/bin/python -m testbed up --name ss --hosts 4 [--profile same-zone]
    .venv/bin/python -m testbed status --name ss
    .venv/bin/python -m testbed link --name ss --host ss-h2 --profile cross-region
    .venv/bin/python -m testbed clear-link --name ss --host ss-h2
    .venv/bin/python -m testbed add-host --name ss [--authorized-keys FILE]
    .venv/bin/python -m testbed remove-host --name ss --host ss-h4
    .venv/bin/python -m testbed down --name ss [--force]

Every name derives from the testbed name (at most 8 characters, [a-z0-9], a letter first, because
Linux interface names are limited to 15 characters): bridge ``ssbr-<name>``, outside bridge
``ssbo-<name>``, host namespaces ``<name>-h<i>`` with bridge-side veths ``ssv-<name>-<i>``, outside
namespace ``<name>-out`` with veth ``ssvo-<name>``, iptables rules commented ``syncswitch-testbed:<name>``.
That is what lets ``down --force`` find and remove a testbed whose state directory was lost.
"""

from testbed.bed import OutsideNamespace, Testbed, TestHost
from testbed.links import PROFILES, LinkShape
from testbed.system import SSH_PORT, TestbedError, ensure_prerequisites, link_names, netns_names

__all__ = [
    "PROFILES",
    "SSH_PORT",
    "LinkShape",
    "OutsideNamespace",
    "TestHost",
    "Testbed",
    "TestbedError",
    "ensure_prerequisites",
    "link_names",
    "netns_names",
]
