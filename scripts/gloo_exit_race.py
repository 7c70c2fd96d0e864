"""The gloo exit race of issue 40, made to happen on purpose: torch alone aborts, `import modular` exits 1.

    python scripts/gloo_exit_race.py                # torch alone: some ranks die of SIGABRT
    python scripts/gloo_exit_race.py --modular      # with modular's exit hook: every rank exits 1

Each run starts two gloo ranks of a six-line torch program (`rank_program`: an all-gather of
views, then an exception, so its process groups are never destroyed), each under gdb. gdb holds
every gloo worker thread right after it completed a work, until its rank has begun to exit (the
first atexit hook to run writes a file) and `--late` seconds more: the worker still holds the
all-gather's work, whose views Python let go of, as a worker descheduled at the wrong moment
does. Released while the interpreter finalizes, the worker asks for the GIL to free them,
CPython ends it with `pthread_exit`, and the unwinding through the work's destructor calls
`std::terminate` (Note [exit after destroy_process_group] in modular/exit.py; the backtrace is
in docs/troubleshooting.md). Needs gdb and Linux; not part of any test suite.

The same file is gdb's script (`gdb -x`): run under gdb, it installs the hold and starts the
program.
"""

from __future__ import annotations

import os
import sys
import time

try:
    import gdb  # type: ignore[import-not-found]  # present only inside gdb
except ImportError:
    gdb = None


def rank_program() -> None:
    """What each rank runs: an all-gather into views of one tensor, then an exception."""
    import atexit

    if os.environ.get("GLOO_RACE_MODULAR") == "1":
        import modular  # noqa: F401  its exit hook (registered first, so it runs after the flag)
    import torch
    import torch.distributed as dist

    atexit.register(lambda: open(os.environ["GLOO_RACE_EXIT_FLAG"], "w").close())  # runs first
    dist.init_process_group("gloo")
    out = torch.empty(2, 4)
    dist.all_gather(list(out.unbind(0)), torch.ones(4))  # the views die with this line
    raise RuntimeError("fails on purpose right after an all-gather")


def hold_gloo_workers() -> None:
    """gdb's part: a worker that finished `AsyncWork::execute` waits until the flag file exists
    and `GLOO_RACE_LATE_S` more before it goes on to drop the work."""
    flag, late = os.environ["GLOO_RACE_EXIT_FLAG"], float(os.environ["GLOO_RACE_LATE_S"])

    class AfterWork(gdb.FinishBreakpoint):
        def stop(self) -> bool:
            while not os.path.exists(flag):
                time.sleep(0.0005)
            time.sleep(late)
            return False

        def out_of_scope(self) -> None:
            pass

    class Work(gdb.Breakpoint):
        def stop(self) -> bool:
            AfterWork(gdb.newest_frame(), internal=True)
            return False

    for command in ("set pagination off", "set non-stop on", "set breakpoint pending on",
                    "handle SIGPIPE nostop noprint pass"):  # fmt: skip
        gdb.execute(command)
    Work("c10d::ProcessGroupGloo::AsyncWork::execute")
    gdb.execute("run")


def launch(modular: bool, late: float, runs: int) -> int:
    import subprocess
    import tempfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root))
    from examples.ports import free_port

    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                       OMP_NUM_THREADS="1", GLOO_RACE_MODULAR=str(int(modular)), GLOO_RACE_LATE_S=str(late),
                       PYTHONPATH=str(root))  # fmt: skip
            procs = []
            for rank in range(2):
                flag = Path(tmp) / f"run{run}_rank{rank}.exiting"
                procs.append(subprocess.Popen(
                    ["gdb", "-q", "-batch", "-x", __file__, "--args", sys.executable, __file__, "--rank-program"],
                    env=dict(env, RANK=str(rank), GLOO_RACE_EXIT_FLAG=str(flag)),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                ))  # fmt: skip
            for rank, p in enumerate(procs):
                out = p.communicate(timeout=300)[0]
                if "received signal SIGABRT" in out:
                    outcomes.append("SIGABRT")
                elif "exited with code" in out:
                    outcomes.append("exit " + out.split("exited with code ")[-1].split("]")[0])
                else:
                    outcomes.append("exit 00" if "exited normally" in out else "?")
                print(f"run {run} rank {rank}: {outcomes[-1]}", flush=True)
    aborted = outcomes.count("SIGABRT")
    print(f"{'with' if modular else 'without'} modular, workers {late} s late: {aborted} of {len(outcomes)} ranks aborted")
    return 0


if __name__ == "__main__":
    if gdb is not None:
        hold_gloo_workers()
    elif "--rank-program" in sys.argv:
        rank_program()
    else:
        import argparse

        p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
        p.add_argument("--modular", action="store_true", help="import modular (its exit hook) in each rank")
        p.add_argument("--late", type=float, default=0.001, help="seconds a worker stays held after its rank began to exit")
        p.add_argument("--runs", type=int, default=5)
        a = p.parse_args()
        sys.exit(launch(a.modular, a.late, a.runs))
