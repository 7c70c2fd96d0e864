"""Input dist of the next batch while this step computes: `modular.prefetch(model, kjt)`.

# Note [prefetched input dist]
A step of a sharded EBC waits on its input dist (routing every id, then one or two all-to-alls)
before any lookup can start. The ids of the *next* batch are known a step early, so they can travel
while this step looks up, trains and steps the optimizer, as TorchRec's TrainPipelineSparseDist
does, but without wrapping the model or the training loop:

    modular.prefetch(model, next_kjt)   # next_kjt's input dist will run in the background
    loss = model(kjt)                   # uses kjt's prefetched input dist, if there is one
    ...
    kjt = next_kjt

`prefetch` arms the batch; the module hands it to a background thread when its own thread is
next about to wait (at the output all-to-all of the current forward, or at once when a forward
wants that very batch), so the routing's CPU work fills a wait instead of slowing the lookup
(measured: the lookup took 4.6 ms instead of 2.7 when the thread started at `prefetch`). The
thread runs the same input dist on a second process group over the same ranks (both made by the
first prefetch, one per process group and shared by its modules, so input dists run in the order
they were released, the same on every rank), so its collectives never interleave with the step's
own on the module's group. A batch prefetched but never used costs no collective. A later
`forward(kjt)` with the same KeyedJaggedTensor object takes the result (or raises the error input
dist raised, e.g. `InputError` for a bad batch, on every rank as usual); a forward without one
runs input dist itself. The batch is the prefetching rank's own: each rank prefetches its next
batch, every rank in the same order (prefetch is collective, like forward). Do not change a KJT's
tensors after prefetching it.

# Note [prefetch on every rank]
A rank that prefetches a batch its peers did not (or skips one they prefetched) runs that input
dist on the other group: each side then waits for a peer that is waiting elsewhere, and both fail
at the group's timeout (the prefetch group takes the module group's). Telling this apart from a
dead peer would cost a collective every step, so instead the input dist's agreement names
prefetch as a likely cause whenever this module prefetches.

The background thread overlaps on CPU modules over a group that spans the world and runs its CPU
collectives on gloo ("gloo", or `init_process_group()` with no backend); elsewhere
(NCCL on CUDA, where a second stream would be needed, or a module on a subgroup) `prefetch` runs
the input dist at once on the module's group, which is correct but does not overlap. On CPU it
pays when each rank is pinned to its own cores: unpinned, the background thread and gloo's threads
of one rank preempt another rank's main thread, and on 2 cores the step got no faster (measured
in docs/benchmarks.md, with and without pinning).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.comm import backend_for
from modular.routing.exchange import IdsExchange
from modular.routing.router import Received
from modular.tables.layout import RankLayout

__all__ = ["MAX_PENDING", "Prefetcher", "release_side_groups"]

# More batches than this prefetched and not yet looked up is a loop that prefetches batches it
# never runs (each holds its KJT, and once released its routed ids, in memory).
MAX_PENDING = 8

# Input dist on a given exchange (the module's own, or the prefetch thread's).
InputDist = Callable[[KeyedJaggedTensor, Optional[IdsExchange]], Received]


class Prefetcher:
    """One sharded EBC's prefetched input dists (Note [prefetched input dist])."""

    def __init__(
        self,
        input_dist: InputDist,
        make_exchange: Callable[[Optional[ProcessGroup]], IdsExchange],
        *,
        at: RankLayout,
    ) -> None:
        """`input_dist` and `make_exchange` are the module's; `at` says where it lives."""
        module, group, device, local = at.module, at.group, at.device, at.local
        self._input_dist = input_dist
        self._module = module
        self._group = group
        self._pending: dict[int, tuple[KeyedJaggedTensor, Future]] = {}
        self._armed: list[tuple[KeyedJaggedTensor, Future]] = []  # started, not yet released
        self._side = None if local else _side_group(group, device)
        self._exchange = make_exchange(self._side[0]) if self._side is not None else None

    @property
    def overlaps(self) -> bool:
        return self._side is not None

    def start(self, features: KeyedJaggedTensor) -> None:
        entry = self._pending.get(id(features))
        if entry is not None and entry[0] is features:
            return  # already on its way
        if len(self._pending) >= MAX_PENDING:
            raise RuntimeError(
                f"module {self._module!r} has {len(self._pending)} prefetched batches "
                "that no forward has used. A forward uses a prefetched batch only when given that "
                "same KeyedJaggedTensor object, not a copy (kjt.to(device), a rebuilt or "
                "re-collated KJT are new objects): prefetch the object the forward will get, "
                "shortly before that forward (Note [prefetched input dist] in modular/routing/prefetcher.py)"
            )
        future: Future = Future()
        if self._side is not None:
            self._armed.append((features, future))  # the thread gets it at `release`
        else:
            try:
                future.set_result(self._input_dist(features, None))
            except Exception as e:  # raised by the forward that takes it, as with the thread
                future.set_exception(e)
        self._pending[id(features)] = (features, future)

    def release(self) -> None:
        """Hands the armed input dists to the background thread, in the order they were
        prefetched; the module calls it when its own thread is about to wait on a collective."""
        armed, self._armed = self._armed, []
        for features, future in armed:
            self._side[1].submit(self._run, features, future)

    def _run(self, features: KeyedJaggedTensor, future: Future) -> None:
        try:
            future.set_result(self._input_dist(features, self._exchange))
        except BaseException as e:  # raised by the forward that takes it
            future.set_exception(e)

    def describe(self, what: str, group: Optional[ProcessGroup]) -> str:
        """The input dist's agreement `what` on `group`, as its error names it (Note [a failed
        peer]), with a hint at prefetch (Note [prefetch on every rank])."""
        batch = "a batch not prefetched" if group is self._group else "a prefetched batch"
        return (
            f"{what} (for {batch}; if the ranks did not all prefetch this batch, each waits on "
            "another group: call modular.prefetch on every rank for the same batches, Note "
            "[prefetch on every rank])"
        )

    def take(self, features: KeyedJaggedTensor) -> Optional[Received]:
        """The prefetched input dist of this very KJT, or None; raises what it raised."""
        entry = self._pending.get(id(features))
        if entry is None or entry[0] is not features:
            return None
        del self._pending[id(features)]
        if any(f is features for f, _ in self._armed):
            self.release()  # not started yet: start it (and those before it) now
        return entry[1].result()


# One second group and one thread per process group, shared by the modules on it: their prefetches
# then run one at a time, in the order the modules were prefetched, which is the same on every
# rank, so the second group's collectives match across ranks.
_SIDE_GROUPS: dict[object, tuple[ProcessGroup, ThreadPoolExecutor]] = {}


def _side_group(
    group: Optional[ProcessGroup], device: torch.device
) -> Optional[tuple[ProcessGroup, ThreadPoolExecutor]]:
    """The background group and thread for a module's process group, made on first use; None
    where prefetching does not overlap: a device other than the CPU, a group whose CPU
    collectives do not run on gloo, or a process group smaller than the world (a new group is a
    collective of the whole world, which the ranks outside it would not join)."""
    if device.type != "cpu":
        return None
    pg = group if group is not None else dist.group.WORLD
    cpu_backend = backend_for("cpu", dist.get_backend_config(pg))
    if cpu_backend != dist.Backend.GLOO or dist.get_world_size(pg) != dist.get_world_size():
        return None
    side = _SIDE_GROUPS.get(pg)
    if side is None:
        # The module's group's timeout: a prefetch that waits on a peer fails when a forward on
        # the module's group would (see Note [prefetch on every rank]).
        timeout = pg._get_backend(device).options._timeout
        group = dist.new_group(backend=dist.Backend.GLOO, timeout=timeout)
        side = _SIDE_GROUPS[pg] = (group, ThreadPoolExecutor(1, "modular-input-dist"))
    return side


def release_side_groups() -> None:
    """Forgets every background group and thread once `destroy_process_group()` has run.

    `_SIDE_GROUPS` would otherwise keep those groups, and the module groups they are keyed by,
    alive until interpreter exit, with their gloo threads (Note [exit after destroy_process_group]
    in modular/exit.py). While the default group lives, prefetching still uses them: nothing.
    """
    if dist.is_initialized():
        return
    for _, executor in _SIDE_GROUPS.values():
        executor.shutdown(wait=True)
    _SIDE_GROUPS.clear()
