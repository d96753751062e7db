"""The embedded Airflow supervisor's log rotation, with a real writer holding its log open as the
components do (stdout in append mode)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from proc_utils import wait_for
from syncswitch_airflow.tools.airflow_supervisor import rotate_log

WRITER = """
import sys, time
for i in range(1_000_000):
    print(f"line {i}", flush=True)
    time.sleep(0.002)
"""


def test_a_rotated_log_keeps_its_old_lines_and_the_writer_goes_on_at_the_start(tmp_path: Path) -> None:
    path = tmp_path / "api-server.log"
    with open(path, "ab") as out:
        writer = subprocess.Popen([sys.executable, "-c", WRITER], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: path.stat().st_size > 20_000, timeout=30, what="the writer to write 20 kB")
        before = path.stat().st_size
        rotate_log(str(path))
        kept = (tmp_path / "api-server.log.1").read_text()
        assert len(kept) >= before and kept.startswith("line 0\n")
        time.sleep(0.5)
    finally:
        writer.kill()
        writer.wait()
    after = path.read_bytes()
    # Appended at the new end (0), not at the old offset: no hole of NUL bytes, and much smaller.
    assert after and b"\0" not in after and len(after) < len(kept)
    first = int(after.decode().splitlines()[0].split()[1])
    last_kept = int(kept.splitlines()[-1].split()[1])
    assert first > last_kept  # the lines go on from where the copy ended (a few may fall between)
