"""Interpreter exit after a finished distributed run: `import modular` makes it exit 0.

Installs `release_process_groups` as an `atexit` hook (Note [exit after destroy_process_group]).
Nothing to call: a script that ends as PyTorch's docs end one (`dist.destroy_process_group()`,
then return) exits with its own status. `modular.exit.release_process_groups()` may also be called
by hand, e.g. before `os.fork` or at the end of a long-lived process that trains more than once.
"""

from __future__ import annotations

import atexit
import gc

from torch.distributed.tensor._collective_utils import MeshTopoInfo
from torch.distributed.tensor._redistribute import _gen_transform_infos, clear_redistribute_planner_cache
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from modular.routing.prefetcher import release_side_groups

__all__ = ["release_process_groups"]

# Note [exit after destroy_process_group]
# A gloo process group owns threads: two `pt_gloo_runloop` workers and a `gloo_tcp_loop` per
# group, and on the rank that hosts the rendezvous store a `pt_tcpstore_uv` server.
# `dist.destroy_process_group()` unregisters every group and calls `shutdown()`, which for gloo
# stops none of them (nor does `abort()`): they stop only when the C++ `ProcessGroupGloo` is
# freed, when its last reference goes. Once `fully_shard` has run (our `apply_fully_shard`, or
# FSDP2 with no modular at all), that last reference is not the user's: DTensor's caches hold
# DTensorSpecs or planners, each holds its DeviceMesh, and a mesh holds its process groups
# (`DeviceMesh._pg_registry`). On torch 2.13 four caches do (`_DTENSOR_CACHES` below); one of
# them is C++ (the fast-path sharding-propagation cache), invisible to `gc`. Measured with gloo
# on 2 ranks, FSDP2 alone: after `destroy_process_group()`, return and `gc.collect()`,
# `/proc/self/task` still lists the threads above and two DeviceMeshes are alive; with these
# caches cleared and garbage collected, none (tests/modular/exit_job.py checks it at exit). Without that, the threads run on
# through interpreter finalization and C++ exit-time destructors, when Python is gone, which is
# when the reported aborts happen ("terminate called without an active exception", SIGABRT,
# status -6 / 134, after a finished run). The likely last step, not captured here (none of ~60
# finished runs aborted on this machine while this was written): a C++ thread or destructor
# that needs the GIL after finalization has begun is ended by CPython 3.11 with `pthread_exit`,
# whose forced unwinding through a `noexcept` destructor calls `std::terminate` (the hazard
# torch's own `destroy_process_group` avoids for Python work hooks, see the comment before its
# `_wait_for_pending_works` call). Either way it is a race with teardown, hence its rate varies
# with the machine's load ("1 run in 3" when the issue was filed).
#
# Ours did the same: `modular.prefetch` keeps a background group and thread per module group in
# a module-level dict, which kept both groups alive after `destroy_process_group()`
# (examples/train_dlrm.py: eight gloo threads per rank at exit); the hook forgets them once the
# default group is destroyed (`release_side_groups` in modular/routing/prefetcher.py).
#
# The workaround, while the interpreter is still whole (atexit hooks run before finalization):
# clear those caches (they are only caches; the next DTensor op refills them) and collect garbage
# (FSDP modules sit in reference cycles). The destroyed groups are then freed on the main thread,
# which joins their threads, before Python starts to finalize. It cannot free a group the program
# still reaches: a model kept in a module-level global, or a group never destroyed, lives on as
# before (docs/troubleshooting.md). The hook needs no process group and is harmless without one,
# so it is installed on import. Upstream, the fix belongs in torch: `destroy_process_group` could
# clear these caches, or they could hold meshes weakly (the planner cache already keys on a
# weakref, but its value holds the mesh strongly).


# Every cache of torch 2.13 that keeps a DeviceMesh (so its process groups) after the run; found
# by walking gc referrers from the meshes still alive at exit in tests/modular/exit_job.py.
_DTENSOR_CACHES = (
    _clear_sharding_prop_cache,  # op -> output sharding, in Python and in C++ (invisible to gc)
    _gen_transform_infos.cache_clear,  # (source spec, target spec) -> redistribute steps
    clear_redistribute_planner_cache,  # keyed by weakref(mesh), but the planner holds the mesh
    MeshTopoInfo.build_from_mesh.cache_clear,  # mesh -> its topology, for collective costs
)


def release_process_groups() -> None:
    """Frees process groups that `destroy_process_group` left alive, joining their threads.

    Runs by itself at interpreter exit (installed by `import modular`). Clears the DTensor caches
    that hold device meshes (the next DTensor op refills them), then runs `gc.collect()`; groups
    the program still references, or has not destroyed, are not touched.
    """
    release_side_groups()  # ours: `modular.prefetch`'s background groups, keyed by module group
    for clear in _DTENSOR_CACHES:
        clear()
    gc.collect()


atexit.register(release_process_groups)
