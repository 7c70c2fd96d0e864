"""Running an example script as a user runs it, in its own session, bounded by a timeout that
kills its ranks too (tests/examples/test_train_dlrm*.py)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_script(command: list[str], cwd: Path, *, timeout: float = 300) -> str:
    """`command`'s stdout once it exits 0; AssertionError with its output's tail otherwise, or
    when it runs past `timeout` seconds (the load then, since a loaded machine is the usual
    cause: an example's run costs ~12 CPU-seconds over three processes, ~20 s on 2 idle cores
    and over 120 s at load 16-20, measured). A hang in a collective is the script's own
    `--collective-timeout` to catch; this only bounds a slow machine. Its own session, so that a
    timeout kills the ranks too and does not leave them loading the machine behind the test."""
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
        env=dict(os.environ, PYTHONWARNINGS="ignore"), start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"{Path(command[1]).name} still running after {timeout:.0f} s (load {os.getloadavg()}); "
            f"killed it and its ranks.\n--- stdout:\n{stdout[-3000:]}\n--- stderr:\n{stderr[-3000:]}"
        ) from None
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{stdout[-3000:]}{stderr[-3000:]}"
    return stdout
