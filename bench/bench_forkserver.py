"""The fork server's preload: CPU and wall seconds of its imports, as shipped and as before 641e760.

Every cluster's fork server (one per host of a hosts or gce cluster, one per local cluster) imports
TensorFlow and Keras once before it forks nodes (``syncswitch.forkserver.preload``): a segment's first
nodes wait for it, and on 2 cores it competes with whatever else runs. Since 641e760 it leaves out
scikit-learn and SciPy, which Keras (its scikit-learn wrappers) and TensorFlow (TF 1 Keras's sparse
input) import when installed. "as before" imports them first, as the old preload did, so that Keras
and TensorFlow find them. The variants alternate, each in a fresh interpreter.

    .venv/bin/python bench/bench_forkserver.py               # 5 of each, ~2 minutes
    .venv/bin/python bench/bench_forkserver.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from _common import log, machine_line, markdown_table

# Each prints {"cpu": user+system seconds, "wall": the preload's seconds} when its imports are done.
_MEASURE = """
import json, resource, sys, time
started = time.monotonic()
{before}
from syncswitch import forkserver
forkserver.preload()
usage = resource.getrusage(resource.RUSAGE_SELF)
loaded = sorted(m for m in ("sklearn", "scipy", "pandas", "matplotlib") if m in sys.modules)
print(json.dumps({{"cpu": usage.ru_utime + usage.ru_stime, "wall": time.monotonic() - started,
                  "optional": loaded}}))
"""
VARIANTS = {
    "as shipped": "",
    # The old preload imported these inside its block of matplotlib and pandas.
    "as before (scikit-learn, SciPy)": "\n".join(
        [
            "for name in ('matplotlib', 'pandas'): sys.modules[name] = None",
            "import scipy.sparse, sklearn.datasets, sklearn.model_selection",
            "for name in ('matplotlib', 'pandas'): del sys.modules[name]",
        ]
    ),
}


def measure(before: str) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", _MEASURE.format(before=before)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5, help="runs of each variant, alternating")
    args = parser.parse_args()

    samples: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        # Alternate which variant goes first, so that neither always meets a warmer page cache.
        order = list(VARIANTS) if repeat % 2 == 0 else list(reversed(VARIANTS))
        for name in order:
            result = measure(VARIANTS[name])
            samples[name].append(result)
            log(
                f"repeat {repeat + 1}/{args.repeats} {name}: {result['cpu']:.2f} s CPU, "
                f"{result['wall']:.2f} s wall, loaded {result['optional'] or 'none of them'}"
            )

    before = statistics.median(s["cpu"] for s in samples["as before (scikit-learn, SciPy)"])
    rows = []
    for name, runs in samples.items():
        cpu, wall = [s["cpu"] for s in runs], [s["wall"] for s in runs]
        rows.append(
            [
                name,
                str(len(runs)),
                f"{statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f})",
                f"{statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f})",
                f"{statistics.median(cpu) / before:.2f}",
                ", ".join(runs[0]["optional"]) or "none",
            ]
        )
    print(machine_line() + "\n")
    headers = ["preload", "runs", "CPU s, median (range)", "wall s, median (range)", "CPU / before", "loaded"]
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    main()
