"""The testbed's command line: ``python -m testbed up|status|link|clear-link|add-host|remove-host|down``
(as root; the package docstring shows each)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import testbed
from testbed.bed import Testbed
from testbed.links import DELAYER_COMMAND, PROFILES, delayer_main
from testbed.system import TestbedError


def _shape_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.profile:
        return dict(PROFILES[args.profile])
    return {
        "delay_ms": args.delay_ms,
        "jitter_ms": args.jitter_ms,
        "rate_mbit": args.rate_mbit,
        "loss_pct": args.loss_pct,
    }


def _add_shape_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", choices=sorted(PROFILES), help="a named link profile")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (round trip: twice)")
    parser.add_argument("--jitter-ms", type=float, default=0.0)
    parser.add_argument("--rate-mbit", type=float, default=None)
    parser.add_argument("--loss-pct", type=float, default=0.0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m testbed", description=testbed.__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="create a testbed and print its hosts as JSON")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--subnet-index", type=int, default=None)
    up.add_argument("--profile", choices=sorted(PROFILES), help="shape every host's link")
    down = commands.add_parser("down", help="remove a testbed")
    down.add_argument("--force", action="store_true", help="remove by name even without its state directory")
    commands.add_parser("status", help="print a testbed's state as JSON")
    link = commands.add_parser("link", help="shape one host's link")
    link.add_argument("--host", required=True)
    _add_shape_options(link)
    clear = commands.add_parser("clear-link", help="remove one host's link shaping")
    clear.add_argument("--host", required=True)
    add = commands.add_parser("add-host", help="add a host to a testbed that is up; print it as JSON")
    add.add_argument(
        "--authorized-keys",
        metavar="FILE",
        default=None,
        help="keys the host's sshd accepts instead of the testbed key",
    )
    add.add_argument(
        "--user",
        dest="users",
        action="append",
        default=[],
        help="a login name the host's sshd allows (repeatable; default: any)",
    )
    remove = commands.add_parser("remove-host", help="remove a host for good")
    remove.add_argument("--host", required=True)
    delayer = commands.add_parser(DELAYER_COMMAND)  # internal: started by set_link()
    delayer.add_argument("--netns", required=True)
    delayer.add_argument("--queue", type=int, default=0)
    delayer.add_argument("--delay-ms", type=float, default=0.0)
    delayer.add_argument("--jitter-ms", type=float, default=0.0)
    delayer.add_argument("--loss-pct", type=float, default=0.0)
    delayer.add_argument("--log", required=True)
    for sub in (up, down, link, clear, add, remove, delayer, commands.choices["status"]):
        sub.add_argument("--name", "--testbed", dest="name", required=True, help="testbed name")
        if sub is not delayer:
            sub.add_argument("--state-dir", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == DELAYER_COMMAND:
        return delayer_main(args)
    try:
        if args.command == "up":
            testbed = Testbed(args.name, args.hosts, subnet_index=args.subnet_index, state_dir=args.state_dir)
            testbed.up()
            if args.profile:
                for host in testbed.hosts:
                    testbed.set_profile(host, args.profile)
            print(json.dumps(testbed.status(), indent=2))
        elif args.command == "down" and args.force:
            Testbed.remove_leftovers(args.name, state_dir=args.state_dir)
        else:
            testbed = Testbed.existing(args.name, state_dir=args.state_dir)
            if args.command == "down":
                testbed.down()
            elif args.command == "status":
                print(json.dumps(testbed.status(), indent=2))
            elif args.command == "link":
                testbed.set_link(args.host, **_shape_from_args(args))
            elif args.command == "clear-link":
                testbed.clear_link(args.host)
            elif args.command == "add-host":
                keys = Path(args.authorized_keys).read_text() if args.authorized_keys else None
                print(json.dumps(asdict(testbed.add_host(keys, users=args.users)), indent=2))
            elif args.command == "remove-host":
                testbed.remove_host(testbed.host(args.host))
    except (TestbedError, ValueError) as exc:
        print(f"testbed {args.name}: error: {exc}", file=sys.stderr)
        return 1
    return 0
