"""Finished 2-rank jobs exit 0, every time, under load: the stress test of issue 40.

    python scripts/exit_stress.py                       # 200 jobs, 2 at a time, 1 CPU burner
    python scripts/exit_stress.py --jobs 40 --time-limit 600 --out /tmp/exit_stress

Each job is tests/modular/exit_job.py started as two plain processes with torchrun's environment
variables, in one of its shapes (fused and unfused, data-parallel copies, column-wise exact,
FSDP2 and DDP, prefetch, DTensor tables, compile, EC: see that file), taken in turn. Beside them
run `--load` CPU-bound processes (a busy loop each), so that gloo's worker threads get
descheduled at awkward moments, which is when the race of Note [exit after destroy_process_group]
(modular/exit.py) shows. A job passes when both ranks exit 0, report every step, and report no
process-group thread alive at exit; a "raise" job (every `--raise-every`th) passes when its
failing rank exits 1 with its traceback and its peer exits 1 with `CollectiveError`.

Not part of the test suite (a few minutes of two cores): tests/modular/test_exit.py runs a quick
version. The figures of the last run are in docs/troubleshooting.md. Exit status 0 if every job
passed; 1 otherwise, with the logs of every failed job kept under `--out`.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.ports import free_port  # noqa: E402

JOB = ROOT / "tests" / "modular" / "exit_job.py"
FINISHED_SHAPES = ("fsdp", "ddp", "compile", "ec", "plain")
STEPS = 3  # exit_job.STEPS: every finished rank reports each step's loss
THREADS_NONE = "process group threads at exit: []"


class Job(NamedTuple):
    number: int
    shape: str
    procs: list[subprocess.Popen]
    logs: list[Path]
    deadline: float


class Verdict(NamedTuple):
    passed: bool
    aborted: bool  # a rank died of a signal (SIGABRT: the race this script hunts)
    threads_left: bool  # a rank reported process-group threads alive at exit
    why: str


def start(number: int, shape: str, out: Path, timeout: float) -> Job:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONFAULTHANDLER="1")  # fmt: skip  (an abort prints every thread's Python stack)
    logs = [out / f"job{number:04d}_{shape}_rank{rank}.log" for rank in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), shape],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=logs[rank].open("w"),
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    return Job(number, shape, procs, logs, time.monotonic() + timeout)


def finish(job: Job) -> tuple[list[int], list[str]]:
    codes = []
    for p in job.procs:
        try:
            codes.append(p.wait(timeout=max(0.1, job.deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes, [log.read_text(errors="replace") for log in job.logs]


def judge(shape: str, codes: list[int], logs: list[str]) -> Verdict:
    aborted = any(c < 0 or c == 134 for c in codes)
    threads_left = any(THREADS_NONE not in log for log in logs)
    if shape == "raise":
        ok = (
            codes == [1, 1]
            and "rank 1 fails on purpose" in logs[1] and "Traceback" in logs[1]
            and "CollectiveError" in logs[0]
        )  # fmt: skip
        why = "" if ok else f"exit {codes}: want [1, 1], rank 1's traceback and rank 0's CollectiveError"
        return Verdict(ok, aborted, False, why)
    steps = [sum(line.startswith(f"rank {r} step ") for line in log.splitlines()) for r, log in enumerate(logs)]
    ok = codes == [0, 0] and not threads_left and steps == [STEPS, STEPS]
    why = "" if ok else f"exit {codes}, steps reported {steps}, threads left at exit: {threads_left}"
    return Verdict(ok, aborted, threads_left, why)


def burners(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=200, help="finished jobs to run (default 200)")
    p.add_argument("--at-once", type=int, default=2, help="jobs running together (default 2)")
    p.add_argument("--load", type=int, default=1, help="CPU-bound processes beside them (default 1)")
    p.add_argument("--shapes", default=",".join(FINISHED_SHAPES), help="exit_job.py shapes, in turn")
    p.add_argument("--raise-every", type=int, default=10, help="every Nth job is a 'raise' job (0: none)")
    p.add_argument("--time-limit", type=float, default=3600.0, help="start no job after this many seconds")
    p.add_argument("--job-timeout", type=float, default=300.0, help="seconds before a job's ranks are killed")
    p.add_argument("--out", default=None, help="where the logs go (default: a temporary directory)")
    a = p.parse_args(argv)
    shapes = a.shapes.split(",")
    unknown = sorted(set(shapes) - set(FINISHED_SHAPES))
    if unknown:
        p.error(f"--shapes: unknown {unknown}; the finished shapes are {', '.join(FINISHED_SHAPES)}")
    out = Path(a.out or tempfile.mkdtemp(prefix="exit_stress_"))
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    load = burners(a.load)
    running: collections.deque[Job] = collections.deque()
    verdicts: dict[str, list[Verdict]] = collections.defaultdict(list)
    failed: list[tuple[Job, Verdict]] = []
    number = 0

    def settle(job: Job) -> None:
        codes, logs = finish(job)
        v = judge(job.shape, codes, logs)
        verdicts[job.shape].append(v)
        if v.passed:
            for log in job.logs:
                log.unlink()
        else:
            failed.append((job, v))
            print(f"job {job.number} ({job.shape}) FAILED: {v.why}; logs: {job.logs[0].parent}", flush=True)

    try:
        started = 0  # finished-shape jobs started
        while started < a.jobs and time.monotonic() - began < a.time_limit:
            if len(running) == a.at_once:
                settle(running.popleft())
            raising = a.raise_every and (number + 1) % a.raise_every == 0
            shape = "raise" if raising else shapes[started % len(shapes)]
            started += not raising
            running.append(start(number, shape, out, a.job_timeout))
            number += 1
        while running:
            settle(running.popleft())
    finally:
        for b in load:
            b.kill()
            b.wait()
    seconds = time.monotonic() - began
    done = {shape: len(v) for shape, v in verdicts.items()}
    finished = sum(n for shape, n in done.items() if shape != "raise")
    aborts = sum(v.aborted for vs in verdicts.values() for v in vs)
    left = sum(v.threads_left for vs in verdicts.values() for v in vs)
    print(
        f"{finished} finished 2-rank jobs and {done.get('raise', 0)} raising ones in {seconds:.0f} s "
        f"({', '.join(f'{s} {n}' for s, n in sorted(done.items()))}), {a.at_once} at a time beside "
        f"{a.load} CPU burner(s): {len(failed)} failed, {aborts} aborted, {left} with process-group "
        f"threads at exit; os.cpu_count()={os.cpu_count()}, load average {os.getloadavg()[0]:.1f}"
    )
    if finished < a.jobs:
        print(f"stopped at --time-limit {a.time_limit:.0f} s after {finished} of {a.jobs} finished jobs")
    return 1 if failed or finished < a.jobs else 0


if __name__ == "__main__":
    sys.exit(main())
