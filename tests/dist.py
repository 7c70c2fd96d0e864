"""Gloo ranks for runtime tests: persistent pools (`run_on_ranks`) and one-shot spawns (`spawn_ranks`).

Write the per-rank body as a module-level function (it is pickled by reference, so the workers
import its module) and call it from a test::

    def _sum_of_ranks() -> torch.Tensor:
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t

    def test_sum_of_ranks() -> None:
        assert [t.item() for t in run_on_ranks(3, _sum_of_ranks)] == [3.0, 3.0, 3.0]

Every rank runs the function with the default process group initialised (gloo, CPU). A failure on
any rank raises `RankError` with every failing rank's traceback; a hang raises `TimeoutError` with
the stack of each rank that did not answer. What a rank prints is replayed on the test's stdout, so
pytest shows it next to a failure.
"""

from __future__ import annotations

import atexit
import dataclasses
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.util
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple, NoReturn

import torch
import torch.distributed as dist
from tqdm import tqdm

# Note [persistent rank pools]
# Importing torch + torchrec costs ~3 s per process, so spawning ranks per test would dominate the
# suite. Instead one pool of gloo ranks per world size lives for the whole pytest session and runs
# many test bodies. Workers come from a multiprocessing "forkserver" whose server preloads torch and
# torchrec once: forking from it is cheap, and safe because the server never ran a torch op (no
# OpenMP pool), unlike the pytest process. The parent hosts each pool's TCPStore on a free port.
#
# A pool is kept only while it is known to be in step. After a call in which a rank raised, every
# rank all-reduces a one under a short deadline; if that fails, or a rank died, or a call timed out,
# or ranks were still busy `_SETTLE_S` after another rank failed (a peer left alone in a collective
# would otherwise sit there for the whole collective timeout), the pool is killed and the next call
# starts a fresh one. Process groups a test creates are destroyed after each call so sockets and
# threads do not pile up; the default group must survive the call.

COLLECTIVE_TIMEOUT_S = float(os.environ.get("MODULAR_TEST_COLLECTIVE_TIMEOUT_S", "60"))
"""Gloo collective timeout of pooled ranks: a mismatched collective errors after this long."""

_STARTUP_TIMEOUT_S = 120.0
_SETTLE_S = 3.0
_HEALTH_TIMEOUT_S = 10.0
_STACK_DUMP_WAIT_S = 0.5
_OUTPUT_LIMIT_CHARS = 20_000
_PRELOAD = ["torch", "torch.distributed", "torchrec", "fbgemm_gpu", "pytest"]
_REPO_ROOT = str(Path(__file__).resolve().parents[1])


class RankFailure(NamedTuple):
    """Why one rank failed: an exception it raised, or how its process died."""

    exc_type: str
    message: str
    traceback: str


class RankError(RuntimeError):
    """One or more ranks failed; `errors` maps each failing rank to its `RankFailure`."""

    def __init__(self, summary: str, errors: dict[int, RankFailure], details: str = "") -> None:
        self.errors = dict(sorted(errors.items()))
        parts = [summary]
        for rank, failure in self.errors.items():
            parts.append(f"--- rank {rank}: {failure.exc_type}: {failure.message}\n{failure.traceback}")
        super().__init__("\n".join(parts) + details)


@dataclasses.dataclass(frozen=True)
class RankOutcome:
    """What one rank of `spawn_ranks` did: returned `result`, raised `error`, died, or timed out."""

    rank: int
    result: Any = None
    error: RankFailure | None = None
    exitcode: int | None = None
    timed_out: bool = False
    output: str = ""


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on every rank of the pooled world of `world_size`; results by rank.

    Raises `RankError` if any rank raised or died, `TimeoutError` if the call took over `timeout`
    seconds (pool start-up is not counted). See Note [persistent rank pools].
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.call(fn, args, kwargs, timeout=timeout)


def expect_errors_on_all_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[str]:
    """Run `fn` like `run_on_ranks` and return each rank's error message, by rank.

    Fails the test (AssertionError) unless every rank raised.
    """
    try:
        run_on_ranks(world_size, fn, *args, timeout=timeout, **kwargs)
    except RankError as e:
        missing = sorted(set(range(world_size)) - set(e.errors))
        if missing:
            raise AssertionError(f"{_name(fn)}: expected every rank to raise, but ranks {missing} did not") from e
        return [e.errors[rank].message for rank in range(world_size)]
    raise AssertionError(f"{_name(fn)}: expected every rank to raise, but all {world_size} returned")


def spawn_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    fresh_interpreter: bool = False,
    collective_timeout: float = COLLECTIVE_TIMEOUT_S,
    **kwargs: Any,
) -> list[RankOutcome]:
    """Run `fn` once on fresh, unpooled ranks and report what each did, for tests that break ranks.

    Never raises for a rank's failure: each `RankOutcome` says whether the rank returned, raised,
    died (`exitcode`) or was killed at `timeout` seconds (start-up included). `env` is applied in
    each rank before the process group is created; pass `fresh_interpreter=True` for variables that
    must be seen when torch is imported (the ranks then start by "spawn", ~3 s each).
    """
    deadline = time.monotonic() + timeout
    blob = pickle.dumps((fn, args, kwargs))
    ranks = _Ranks(world_size, env=env or {}, fresh_interpreter=fresh_interpreter, collective_timeout=collective_timeout)
    try:
        started = ranks.gather(set(range(world_size)), deadline, settle_s=None)
        if not (started.deaths or started.waiting):
            ranks.send_all(("call", blob))
            gathered = ranks.gather(set(range(world_size)), deadline, settle_s=None)
        else:
            gathered = started
        outputs = {rank: ranks.read_output(rank) for rank in gathered.deaths}
        outputs.update(ranks.dump_stacks(gathered.waiting) if gathered.waiting else {})
        ranks.kill(gathered.waiting)
        exitcodes = ranks.stop(graceful=True)
        outcomes = []
        for rank in range(world_size):
            kind, value, output = gathered.replies.get(rank, ("", None, outputs.get(rank, "")))
            outcomes.append(
                RankOutcome(
                    rank=rank,
                    result=value if kind == "ok" else None,
                    error=value if kind == "err" else None,
                    exitcode=exitcodes[rank],
                    timed_out=rank in gathered.waiting,
                    output=output,
                )
            )
        return outcomes
    except BaseException:
        ranks.stop(graceful=False)
        raise


def prestart_fork_server() -> None:
    """Start the fork server's preload of torch now, in the background, to overlap other work."""
    mp.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def shutdown_pools() -> None:
    """Stop every pooled rank (the session hook in conftest.py calls this)."""
    for pool in _POOLS.values():
        pool.stop(graceful=True)
    _POOLS.clear()
    # Stop and reap the fork server now: left to exit with pytest it would be orphaned, and not
    # every container's init reaps orphans promptly. Python 3.11 has no public way to do this.
    multiprocessing.forkserver._forkserver._stop()


# ---------------------------------------------------------------------------------------------
# Parent side


class _Gathered(NamedTuple):
    replies: dict[int, tuple[str, Any, str]]  # rank -> ("ok" | "err" | "ready", value, output)
    deaths: dict[int, int]  # rank -> exit code
    waiting: set[int]  # ranks that had not answered by the deadline


class _Ranks:
    """The processes of one gloo world, each with a pipe to the parent and a log file."""

    def __init__(self, world_size: int, *, env: dict[str, str], fresh_interpreter: bool, collective_timeout: float) -> None:
        if fresh_interpreter:
            ctx = mp.get_context("spawn")
        else:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs (see prestart_fork_server)
        self.world_size = world_size
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=collective_timeout))
        self.log_dir = tempfile.mkdtemp(prefix=f"dist-ranks-{world_size}-")
        self.log_paths = [os.path.join(self.log_dir, f"rank{rank}.log") for rank in range(world_size)]
        self.conns: list[mp.connection.Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        for rank in range(world_size):
            Path(self.log_paths[rank]).touch()
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, child_conn, self.store.port, collective_timeout, self.log_paths[rank], env),
                name=f"rank{rank}-of-{world_size}",
            )
            proc.start()
            child_conn.close()
            self.conns.append(parent_conn)
            self.procs.append(proc)

    def alive(self) -> bool:
        return all(proc.is_alive() for proc in self.procs)

    def send_all(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message)
        for conn in self.conns:
            conn.send_bytes(data)

    def gather(self, ranks: set[int], deadline: float, *, settle_s: float | None) -> _Gathered:
        """Wait for a reply or death from each of `ranks` until `deadline`.

        With `settle_s`, stop waiting that long after the first failure: the rest are likely stuck.
        """
        replies: dict[int, tuple[str, Any, str]] = {}
        deaths: dict[int, int] = {}
        waiting = set(ranks)
        while waiting and time.monotonic() < deadline:
            handles = [self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting]
            ready = mp.connection.wait(handles, timeout=max(0.0, deadline - time.monotonic()))
            for rank in sorted(waiting):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                waiting.discard(rank)
                if conn.poll():
                    try:
                        replies[rank] = _loads_reply(conn.recv_bytes())
                        continue
                    except EOFError:
                        pass
                proc.join(timeout=5.0)
                deaths[rank] = proc.exitcode if proc.exitcode is not None else -signal.SIGKILL
            failed = deaths or any(reply[0] == "err" for reply in replies.values())
            if settle_s is not None and failed:
                deadline = min(deadline, time.monotonic() + settle_s)
        return _Gathered(replies, deaths, waiting)

    def dump_stacks(self, ranks: set[int]) -> dict[int, str]:
        """Ask `ranks` to write their Python stacks (faulthandler on SIGUSR1); their output so far."""
        for rank in ranks:
            os.kill(self.procs[rank].pid, signal.SIGUSR1)
        time.sleep(_STACK_DUMP_WAIT_S)
        return {rank: self.read_output(rank) for rank in ranks}

    def read_output(self, rank: int) -> str:
        return _tail(Path(self.log_paths[rank]).read_text(errors="replace"))

    def kill(self, ranks: set[int]) -> None:
        for rank in ranks:
            self.procs[rank].kill()
        for rank in ranks:
            self.procs[rank].join()

    def stop(self, *, graceful: bool) -> list[int | None]:
        """End the processes (asking idle ones to exit first if `graceful`); their exit codes."""
        if graceful:
            idle = [rank for rank, proc in enumerate(self.procs) if proc.is_alive()]
            for rank in idle:
                self.conns[rank].send_bytes(pickle.dumps(("exit",)))
            deadline = time.monotonic() + 5.0
            for rank in idle:
                self.procs[rank].join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill({rank for rank, proc in enumerate(self.procs) if proc.exitcode is None})
        for conn in self.conns:
            conn.close()
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return [proc.exitcode for proc in self.procs]


class _Pool:
    """Persistent ranks of one world size; see Note [persistent rank pools]."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks: _Ranks | None = None

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *, timeout: float) -> list[Any]:
        blob = pickle.dumps((fn, args, kwargs))
        ranks = self._ready_ranks()
        everyone = set(range(self.world_size))
        ranks.send_all(("call", blob))
        got = ranks.gather(everyone, time.monotonic() + timeout, settle_s=_SETTLE_S)
        stacks = ranks.dump_stacks(got.waiting) if got.waiting else {}
        for rank in sorted(got.replies):
            _replay_output(rank, got.replies[rank][2])

        errors = {rank: reply[1] for rank, reply in got.replies.items() if reply[0] == "err"}
        for rank, code in got.deaths.items():
            errors[rank] = RankFailure("RankDied", f"rank {rank} exited with {_describe_exit(code)}", ranks.read_output(rank))
        name = _name(fn)
        if got.deaths or got.waiting or (errors and not self._healthy(ranks)):
            self.stop(graceful=False)

        if got.waiting and not errors:
            answered = sorted(everyone - got.waiting)
            lines = [
                f"run_on_ranks({self.world_size}, {name}) timed out after {timeout:g} s: ranks {sorted(got.waiting)} "
                f"had not answered (ranks {answered} had); the pool was killed and restarts on next use."
            ]
            lines += [f"--- rank {rank} output and stack:\n{stacks[rank]}" for rank in sorted(stacks)]
            raise TimeoutError("\n".join(lines))
        if errors:
            summary = f"run_on_ranks({self.world_size}, {name}) failed on ranks {sorted(errors)}"
            if got.waiting:
                summary += f"; ranks {sorted(got.waiting)} were still running {_SETTLE_S:g} s later and were killed"
            details = "".join(f"\n--- rank {rank} (still running) output and stack:\n{stacks[rank]}" for rank in sorted(stacks))
            raise RankError(summary, errors, details)
        return [got.replies[rank][1] for rank in range(self.world_size)]

    def _ready_ranks(self) -> _Ranks:
        if self.ranks is not None and not self.ranks.alive():
            self.stop(graceful=False)  # a rank died between calls (e.g. OOM-killed)
        if self.ranks is None:
            ranks = _Ranks(self.world_size, env={}, fresh_interpreter=False, collective_timeout=COLLECTIVE_TIMEOUT_S)
            got = ranks.gather(set(range(self.world_size)), time.monotonic() + _STARTUP_TIMEOUT_S, settle_s=None)
            if got.deaths or got.waiting:
                outputs = "\n".join(f"--- rank {rank}:\n{ranks.read_output(rank)}" for rank in range(self.world_size))
                ranks.stop(graceful=False)
                raise RuntimeError(
                    f"could not start a pool of {self.world_size} gloo ranks within {_STARTUP_TIMEOUT_S:g} s: "
                    f"died {got.deaths}, not ready {sorted(got.waiting)}\n{outputs}"
                )
            self.ranks = ranks
        return self.ranks

    def _healthy(self, ranks: _Ranks) -> bool:
        ranks.send_all(("health",))
        got = ranks.gather(set(range(self.world_size)), time.monotonic() + _HEALTH_TIMEOUT_S, settle_s=0.0)
        return not (got.deaths or got.waiting) and all(reply[0] == "ok" for reply in got.replies.values())

    def stop(self, *, graceful: bool) -> None:
        if self.ranks is not None:
            self.ranks.stop(graceful=graceful)
            self.ranks = None


_POOLS: dict[int, _Pool] = {}
atexit.register(shutdown_pools)


def _loads_reply(data: bytes) -> tuple[str, Any, str]:
    try:
        return pickle.loads(data)
    except Exception as e:  # a rank's return value that the parent cannot rebuild is that rank's failure
        return ("err", RankFailure(type(e).__name__, f"cannot unpickle the rank's reply: {e}", traceback.format_exc()), "")


def _replay_output(rank: int, output: str) -> None:
    if output:
        sys.stdout.write(f"----- rank {rank} output -----\n{output}")
        if not output.endswith("\n"):
            sys.stdout.write("\n")


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"exit code {code} (killed by {signal.Signals(-code).name})"
    return f"exit code {code}"


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _tail(text: str) -> str:
    return text if len(text) <= _OUTPUT_LIMIT_CHARS else "...\n" + text[-_OUTPUT_LIMIT_CHARS:]


# ---------------------------------------------------------------------------------------------
# Rank side


def _worker_main(
    rank: int,
    world_size: int,
    conn: mp.connection.Connection,
    store_port: int,
    collective_timeout: float,
    log_path: str,
    env: dict[str, str],
) -> None:
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    # fds 1 and 2 go to the log, so C++ output (gloo, faulthandler) is captured too.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\._shard")
    warnings.filterwarnings("ignore", category=FutureWarning, message=r".*deprecating ShardedTensor")
    # tqdm's default lock holds a multiprocessing semaphore (torch.fx makes a bar in every
    # torch.compile), which a rank that is killed, or ends itself with os._exit, never unlinks (see
    # `_exit_rank`). A rank's bars need no lock shared with other processes: each has its own log.
    tqdm.set_lock(threading.RLock())
    torch.set_num_threads(1)

    timeout = timedelta(seconds=collective_timeout)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    world = dist.group.WORLD
    conn.send_bytes(pickle.dumps(("ready", None, "")))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone
            _exit_rank()
        if message[0] == "exit":
            _exit_rank()
        if message[0] == "health":
            conn.send_bytes(_health_check(world_size))
        else:
            conn.send_bytes(_run_call(message[1], world, log_fd, log_path, rank))


def _exit_rank() -> NoReturn:
    # os._exit skips what multiprocessing runs after a process's target returns (Process._bootstrap
    # calls util._exit_function): among its finalizers, those that unlink the semaphores the rank
    # made (a test's multiprocessing lock or queue) and tell the parent's resource tracker. Skipped,
    # each stays in /dev/shm until the tracker unlinks it as pytest exits, warning
    # "resource_tracker: There appear to be N leaked semaphore objects". The finalizers also shut
    # down inductor's compile workers. The interpreter's own teardown (atexit hooks, module
    # cleanup) is still skipped, as before.
    multiprocessing.util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run_call(blob: bytes, world: dist.ProcessGroup, log_fd: int, log_path: str, rank: int) -> bytes:
    os.ftruncate(log_fd, 0)
    fn = None
    try:
        fn, args, kwargs = pickle.loads(blob)
        reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        if not dist.is_initialized() or dist.group.WORLD is not world:
            raise RuntimeError("the default process group was destroyed or replaced; the test harness owns it")
    except BaseException as e:  # noqa: B036 - pytest.skip/fail and SystemExit are the test's failures too
        reply = ("err", _failure(e))
    for group in list(dist.distributed_c10d._world.pg_map):
        if group is not world:
            dist.destroy_process_group(group)
    # DTensor's caches key on meshes that compare equal by ranks and dim names, and keep the mesh
    # they first saw: a later test's mesh of the same shape would get the destroyed groups back
    # ("Could not resolve the process group"). Note [exit after destroy_process_group] in
    # modular/exit.py lists them; they are only caches.
    from modular.exit import _DTENSOR_CACHES

    for clear in _DTENSOR_CACHES:
        clear()
    torch.set_num_threads(1)
    sys.stdout.flush()
    sys.stderr.flush()
    output = _tail(Path(log_path).read_text(errors="replace"))
    try:
        return pickle.dumps((*reply, output))
    except Exception as e:  # an unpicklable return value is the test's bug; report it like a raise
        failure = RankFailure(type(e).__name__, f"rank {rank}: cannot pickle the return value of {_name(fn)}: {e}", traceback.format_exc())
        return pickle.dumps(("err", failure, output))


def _health_check(world_size: int) -> bytes:
    try:
        ones = torch.ones(1)
        dist.all_reduce(ones)
        if ones.item() != world_size:
            raise RuntimeError(f"health all_reduce of ones gave {ones.item()}, expected {world_size}")
        return pickle.dumps(("ok", None, ""))
    except Exception as e:  # reported to the parent, which then replaces the pool
        return pickle.dumps(("err", _failure(e), ""))


def _failure(e: BaseException) -> RankFailure:
    return RankFailure(type(e).__name__, str(e), "".join(traceback.format_exception(e)))
