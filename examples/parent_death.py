"""`end_with_parent`: a rank process that a launcher starts ends when the launcher dies, however.

`examples/train_dlrm.py --world-size 2` starts its ranks itself and waits on them. Killed by
SIGKILL (an OOM killer, `kill -9`, a CI job's timeout), the launcher has no chance to end them:
the ranks would go on training, or sit in a collective until its timeout, holding the cores and
memory of a job that nobody waits for any more. Linux can signal a process when its parent dies
(prctl PR_SET_PDEATHSIG); `end_with_parent` asks for SIGTERM, which the ranks leave at its default
action, so they end at once. Like the other launcher helpers (examples/ports.py), it imports no
torch, so a launcher can use it before or without torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def end_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the child gets `sig` when this process dies.

    Call it in the launcher, once per child, and pass what it returns as `preexec_fn`; it runs in
    the child between fork and exec, and the request survives the exec. On systems other than
    Linux it does nothing. Linux sends the signal when the *thread* that started the child ends,
    so start the children from a thread that lives as long as the launcher (the main thread).
    """
    if not sys.platform.startswith("linux"):
        return lambda: None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls into it
    parent = os.getpid()

    def in_child() -> None:
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed in a launched rank: {os.strerror(errno)}")
        if os.getppid() != parent:  # the launcher died before the request was made
            os.kill(os.getpid(), sig)

    return in_child
