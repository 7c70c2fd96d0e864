"""Interpreter exit after a distributed run: `import modular` makes it exit with its own status.

Installs `release_process_groups` as an `atexit` hook (Note [exit after destroy_process_group]).
Nothing to call: a script that ends as PyTorch's docs end one (`dist.destroy_process_group()`,
then return) exits 0, and one that raised exits 1 with its traceback, not with SIGABRT.
`modular.exit.release_process_groups()` may also be called by hand, e.g. before `os.fork` or at
the end of a long-lived process that trains more than once.
"""

from __future__ import annotations

import atexit
import gc
import time
from pathlib import Path

from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from modular.routing.prefetcher import release_side_groups

__all__ = ["release_process_groups"]

# Note [exit after destroy_process_group]
# A gloo process group owns threads: two `pt_gloo_runloop` workers and a `gloo_tcp_loop` per
# group, and on the rank that hosts the rendezvous store a `pt_tcpstore_uv` server. Every gloo
# collective, a synchronous one too, runs on a worker, and the work it runs holds the tensors it
# was handed until that worker drops it, a moment after the caller's `wait()` returned. If
# Python let go of those tensors meanwhile, the work keeps them and their Python objects alive,
# and the worker needs the GIL to free them. During interpreter finalization CPython ends a
# thread that asks for the GIL with `pthread_exit`, whose forced unwinding through the work's
# `noexcept` destructor calls `std::terminate`: "terminate called without an active exception",
# SIGABRT, status -6 / 134, after a run that finished (issue 40: the backtrace, and a script with
# no project code that shows it, are in docs/troubleshooting.md). So it takes a gloo worker still
# alive when `Py_FinalizeEx` starts, and a collective that finished just before the exit: a race
# with teardown, whose rate grows with the machine's load.
#
# `dist.destroy_process_group()` unregisters every group and calls `shutdown()`, which for gloo
# stops none of the threads (nor does `abort()`): they stop only when the C++ `ProcessGroupGloo`
# is freed, when its last reference goes; its destructor joins them, with the GIL released, so a
# worker still holding a work frees it then. Once `fully_shard` has run (our
# `apply_fully_shard`, or FSDP2 with no modular at all), that last reference is not the user's:
# DTensor's caches hold DTensorSpecs or planners, each holds its DeviceMesh, and a mesh holds its
# process groups (`DeviceMesh._pg_registry`). On torch 2.13 four caches do (`_DTENSOR_CACHES`
# below); one of them is C++ (the fast-path sharding-propagation cache), invisible to `gc`.
# Measured with gloo on 2 ranks, FSDP2 alone: after `destroy_process_group()`, return and
# `gc.collect()`, `/proc/self/task` still lists the threads above and two DeviceMeshes are alive;
# with these caches cleared and garbage collected, none. Ours did the same: `modular.prefetch`
# keeps a background group and thread per module group in a module-level dict, which kept both
# groups alive after `destroy_process_group()` (examples/train_dlrm.py: eight gloo threads per
# rank at exit); the hook forgets them once the default group is destroyed
# (`release_side_groups` in modular/routing/prefetcher.py).
#
# The workaround, while the interpreter is still whole (atexit hooks run before finalization):
# forget prefetch's groups, clear those caches (they are only caches; the next DTensor op refills
# them) and collect garbage (FSDP modules sit in reference cycles). The destroyed groups are then
# freed on the main thread, which joins their threads, before Python starts to finalize. After a
# finished run no gloo thread is left then, in every job shape the tests use (fused and unfused,
# data-parallel copies, column-wise exact, FSDP2 and DDP, prefetch, DTensor tables, compile,
# EC): tests/modular/exit_job.py prints the threads left at exit, scripts/exit_stress.py runs
# hundreds of such jobs under load. What outlives the hook: every group of a job that raised (it
# never reached `destroy_process_group`; the worker that ran its last collective is then often
# still waiting for the GIL when the traceback has been printed), and a group the program still
# reaches (a model kept in a module-level global, a group never destroyed; docs/troubleshooting.md).
# For those the hook waits, up to `IDLE_WAIT_S`, until every gloo worker sleeps (idle, or blocked
# in a collective), with the GIL free meanwhile, so that none is half-way through dropping a
# finished work when finalization starts (`_wait_for_idle_gloo_threads`; Linux, it reads /proc).
# A collective still in flight at exit (a peer that never joins it) is beyond it. And modular's
# own collectives return only once gloo has let go of their tensors (Note [collectives release
# their tensors] in modular/comm.py), so no work of theirs ever needs the GIL. The hook needs no
# process group and is harmless without one, so it is installed on import. Upstream, the fix
# belongs in torch: `destroy_process_group` could clear these caches (or they could hold meshes
# weakly: the planner cache already keys on a weakref, but its value holds the mesh strongly),
# and a gloo work could drop its tensors on the caller's thread, in `wait()`.


# Every cache of torch 2.13 that keeps a DeviceMesh (so its process groups) after the run; found
# by walking gc referrers from the meshes still alive at exit in tests/modular/exit_job.py.
_DTENSOR_CACHES = (
    _clear_sharding_prop_cache,  # op -> output sharding, in Python and in C++ (invisible to gc)
    _gen_transform_infos.cache_clear,  # (source spec, target spec) -> redistribute steps
    clear_redistribute_planner_cache,  # keyed by weakref(mesh), but the planner holds the mesh
    MeshTopoInfo.build_from_mesh.cache_clear,  # mesh -> its topology, for collective costs
)


IDLE_WAIT_S = 1.0
"""How long the exit hook waits for the gloo threads of groups that outlive it to go idle."""


def release_process_groups() -> None:
    """Frees process groups that `destroy_process_group` left alive, joining their threads.

    Runs by itself at interpreter exit (installed by `import modular`). Clears the DTensor caches
    that hold device meshes (the next DTensor op refills them), then runs `gc.collect()`; groups
    the program still references, or has not destroyed, are not touched, but the hook waits (up
    to `IDLE_WAIT_S`) until their gloo threads are idle (Note [exit after destroy_process_group]).
    """
    release_side_groups()  # ours: `modular.prefetch`'s background groups, keyed by module group
    for clear in _DTENSOR_CACHES:
        clear()
    gc.collect()
    _wait_for_idle_gloo_threads(IDLE_WAIT_S)


_TASKS = Path("/proc/self/task")


def _gloo_threads() -> list[Path]:
    """This process's gloo worker threads, as /proc entries (none where there is no /proc)."""
    if not _TASKS.is_dir():
        return []
    found = []
    for task in _TASKS.iterdir():
        try:
            if (task / "comm").read_text().strip() == "pt_gloo_runloop":
                found.append(task)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _asleep(task: Path) -> bool:
    try:
        stat = (task / "stat").read_text()
    except OSError:  # ended
        return True
    return stat[stat.rindex(")") + 2] == "S"  # "tid (name) S ...": waiting, not running or runnable


def _wait_for_idle_gloo_threads(limit_s: float) -> None:
    """Returns once every gloo worker thread was asleep in two samples in a row, or after
    `limit_s`. Sleeps between samples with the GIL released, so that a worker that needs the
    GIL to free a finished work's tensors gets it before the interpreter finalizes."""
    threads = _gloo_threads()
    deadline = time.monotonic() + limit_s
    quiet = 0
    while threads and quiet < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
        quiet = quiet + 1 if all(_asleep(t) for t in threads) else 0


atexit.register(release_process_groups)
