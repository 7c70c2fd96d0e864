"""examples/parent_death.py: processes a launcher starts end when it is killed by SIGKILL.

Pure and single-process (no ranks, no torch): a small launcher starts two children, one asking to
end with it (`end_with_parent`, as examples/train_dlrm.py's `launch` does for each rank) and one
not, and the test kills the launcher with SIGKILL. The first child must be gone within seconds;
the second, still running, shows that the check would have seen an orphan.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_DEADLINE_S = 10.0
_LAUNCHER = """
import subprocess, sys, time
from examples.parent_death import end_with_parent
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
ended = subprocess.Popen(sleeper, preexec_fn=end_with_parent())
orphan = subprocess.Popen(sleeper)
print(ended.pid, orphan.pid, flush=True)
time.sleep(60)
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for an init that may reap it late)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_that_asked_ends_when_its_launcher_is_killed() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER], cwd=_ROOT, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(_ROOT)),
    )  # fmt: skip
    ended = orphan = None
    try:
        ended, orphan = (int(pid) for pid in launcher.stdout.readline().split())
        assert _running(ended) and _running(orphan), "the launcher's children did not start"
        launcher.kill()
        launcher.wait(timeout=_DEADLINE_S)
        deadline = time.monotonic() + _DEADLINE_S
        while _running(ended) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(ended), f"the child that asked to end with its launcher still runs {_DEADLINE_S:g} s after SIGKILL"
        assert _running(orphan), "the child that did not ask ended too: this test could not see an orphan"
    finally:
        launcher.kill()
        launcher.wait()
        for pid in (ended, orphan):
            if pid is not None and _running(pid):
                os.kill(pid, signal.SIGKILL)
