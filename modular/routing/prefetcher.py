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
collectives on gloo ("gloo", or `init_process_group()` with no backend); on CUDA see Note
[prefetch on a side stream]; a 2D mesh's shard group counts as spanning the world (every rank
makes every shard group's second group); elsewhere (a module on another subgroup) `prefetch` runs
the input dist at once on the module's group, which is correct but does not overlap. On CPU it
pays when each rank is pinned to its own cores: unpinned, the background thread and gloo's
threads of one rank preempt another rank's main thread, and on 2 cores the step got no faster
(measured in docs/benchmarks.md, with and without pinning).

# Note [prefetch on a side stream]
On a CUDA module the prefetched input dist (the copy of a CPU batch to the GPU, its checks, its
routing and its all-to-alls) is queued on a side stream, one per device, so that its kernels and
copies run beside the step's on the current stream. Which thread queues it (`Overlap`):
  * a world of one (no collective): the background thread, no second group;
  * a group that spans the world and runs its CUDA collectives on gloo (two ranks on one GPU, as
    tests/gpu runs them): the background thread on its second gloo group, as on CPU;
  * anything else, NCCL included: the calling thread, at `prefetch`, on the module's group. Two
    threads issuing NCCL collectives on two communicators can launch them in different orders on
    different ranks and deadlock, so this path queues in program order, like TorchRec's pipeline;
    its host syncs then wait in the calling thread.
The memory discipline is the caching allocator's (see `torch.Tensor.record_stream`):
  * the side stream first waits for what the current stream had queued when `prefetch` was
    called, when the batch is already on the GPU (its tensors may still be being written there);
    a batch on the CPU is pinned and copied with `non_blocking=True` on the side stream instead,
    and nothing waits for the step (the pinned copy is freed only once the copy is done: torch's
    pinned-memory allocator records the copy's stream);
  * the input dist ends by recording an event on the side stream; the forward that takes the
    batch makes its current stream wait for that event, then calls `record_stream(current)` on
    every tensor of the result (`hand_over`), so that memory allocated on the side stream is not
    handed to the next prefetch while this step's forward and backward still read it;
  * the batch itself stays referenced (`_pending`) until that forward: the side stream's reads of
    it are then ordered before anything the current stream does after the forward.
A CPU batch given to a CUDA module is accepted only through `prefetch` (a forward without one
rejects it, as before: move it with `kjt.to(device)`), so prefetch every batch, the first too.
Not run on a GPU yet (docs/gpu.md, "Prefetch on CUDA").
"""

from __future__ import annotations

import enum
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.comm import backend_for
from modular.routing.exchange import IdsExchange
from modular.routing.received import Received
from modular.tables.layout import RankLayout

__all__ = ["MAX_PENDING", "Overlap", "Prefetcher", "hand_over", "overlap_for", "release_side_groups"]

# More batches than this prefetched and not yet looked up is a loop that prefetches batches it
# never runs (each holds its KJT, and once released its routed ids, in memory).
MAX_PENDING = 8

# Input dist on a given exchange (the module's own, or the prefetch thread's).
InputDist = Callable[[KeyedJaggedTensor, Optional[IdsExchange]], Received]
T = TypeVar("T")


class Overlap(enum.Enum):
    """Where a module's prefetched input dists run (Notes [prefetched input dist], [prefetch on a
    side stream])."""

    SIDE_GROUP = "the background thread, on a second gloo group"
    THREAD = "the background thread, with no collective to run (a world of one)"
    AT_ONCE = "the calling thread, at prefetch, on the module's group"


def overlap_for(
    *, device_type: str, backend: Optional[str], spans_world: bool, world: int, local: bool
) -> Overlap:
    """Where prefetched input dists of a module run, from where it lives: its device's type, the
    backend its group runs that device's collectives on, whether the group spans the world, its
    world size, and whether it is a one-process (`local`) module."""
    if local or device_type not in ("cpu", "cuda"):
        return Overlap.AT_ONCE
    if device_type == "cuda" and world == 1:
        return Overlap.THREAD
    if backend == dist.Backend.GLOO and spans_world:
        return Overlap.SIDE_GROUP
    return Overlap.AT_ONCE


class _OnStream(NamedTuple):
    """A prefetched input dist queued on a side stream, and the event that ends it."""

    received: Received
    done: torch.cuda.Event


def hand_over(received: T, done: torch.cuda.Event, stream: torch.cuda.Stream) -> T:
    """`received` (an input dist's result, made on a side stream that recorded `done` after it)
    for use on `stream`: the stream waits for `done`, and every tensor in `received`, at any
    depth (tuples, lists, KeyedJaggedTensors), is recorded on it (Note [prefetch on a side
    stream])."""
    stream.wait_event(done)
    _record(received, stream)
    return received


def _record(value: object, stream: torch.cuda.Stream) -> None:
    if isinstance(value, torch.Tensor):
        value.record_stream(stream)
    elif isinstance(value, KeyedJaggedTensor):
        value.record_stream(stream)
    elif isinstance(value, (tuple, list)):
        for item in value:
            _record(item, stream)


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
        self._device = device
        self._pending: dict[int, tuple[KeyedJaggedTensor, Future]] = {}
        self._armed: list[tuple[KeyedJaggedTensor, Future]] = []  # started, not yet released
        # On CUDA, what an armed batch already on the GPU waits for, by id(future).
        self._ready: dict[int, torch.cuda.Event] = {}
        # A 2D mesh's shard groups (its rows) partition the world: each gets its second group.
        rows = at.replicas.mesh.mesh.tolist() if at.replicas and at.replicas.mesh else None
        self._side = _side_group(group, device, world=at.world, local=local, shard_groups=rows)
        self._exchange = None
        if self._side is not None and self._side[0] is not None:
            self._exchange = make_exchange(self._side[0])
        # Note [prefetch on a side stream]
        self._stream = _side_stream(device) if device.type == "cuda" else None

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
        ready = None
        if self._stream is not None and features.values().device.type != "cpu":
            # The batch may still be being written on the current stream (Note [prefetch on a
            # side stream]): the side stream starts after what is queued there now.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
        if self._side is not None:
            self._armed.append((features, future))  # the thread gets it at `release`
            if ready is not None:
                self._ready[id(future)] = ready
        else:
            try:
                future.set_result(self._compute(features, ready, None))
            except Exception as e:  # raised by the forward that takes it, as with the thread
                future.set_exception(e)
        self._pending[id(features)] = (features, future)

    def release(self) -> None:
        """Hands the armed input dists to the background thread, in the order they were
        prefetched; the module calls it when its own thread is about to wait on a collective."""
        armed, self._armed = self._armed, []
        for features, future in armed:
            ready = self._ready.pop(id(future), None)
            self._side[1].submit(self._run, features, future, ready, self._exchange)

    def _run(
        self,
        features: KeyedJaggedTensor,
        future: Future,
        ready: Optional[torch.cuda.Event],
        exchange: Optional[IdsExchange],
    ) -> None:
        try:
            future.set_result(self._compute(features, ready, exchange))
        except BaseException as e:  # raised by the forward that takes it
            future.set_exception(e)

    def _compute(
        self,
        features: KeyedJaggedTensor,
        ready: Optional[torch.cuda.Event],
        exchange: Optional[IdsExchange],
    ) -> Received | _OnStream:
        """The input dist of `features` on `exchange` (None: the module's); on CUDA queued on
        the side stream (Note [prefetch on a side stream])."""
        if self._stream is None:
            return self._input_dist(features, exchange)
        return self._on_side_stream(features, ready, exchange)

    def _on_side_stream(
        self,
        features: KeyedJaggedTensor,
        ready: Optional[torch.cuda.Event],
        exchange: Optional[IdsExchange],
    ) -> _OnStream:
        # The current device and stream are per thread: set both, in whichever thread runs this.
        with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
            if ready is not None:
                self._stream.wait_event(ready)
            elif features.values().device.type == "cpu":  # copied here, beside the step
                if not features.values().is_pinned():
                    features = features.pin_memory()
                features = features.to(self._device, non_blocking=True)
            try:
                received = self._input_dist(features, exchange)
            except BaseException:
                # Raised in the forward that takes the batch, which then never waits for this
                # stream: let what it queued on the batch finish before the batch can be freed.
                self._stream.synchronize()
                raise
            done = torch.cuda.Event()
            done.record(self._stream)
        return _OnStream(received, done)

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
        result = entry[1].result()
        if self._stream is None:
            return result
        return hand_over(result.received, result.done, torch.cuda.current_stream(self._device))


# One second group and one thread per process group, shared by the modules on it: their prefetches
# then run one at a time, in the order the modules were prefetched, which is the same on every
# rank, so the second group's collectives match across ranks. CUDA modules in a world of one share
# a thread per device and no group (they run no collective).
_SIDE_GROUPS: dict[object, tuple[Optional[ProcessGroup], ThreadPoolExecutor]] = {}
# One side stream per device for the prefetched input dists of its modules (Note [prefetch on a
# side stream]).
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _side_group(
    group: Optional[ProcessGroup], device: torch.device, *, world: int, local: bool,
    shard_groups: Optional[list[list[int]]] = None,
) -> Optional[tuple[Optional[ProcessGroup], ThreadPoolExecutor]]:
    """The background group (None if its input dists run no collective) and thread for a
    module's process group, made on first use; None where prefetching runs at once
    (`overlap_for`): a group that does not run the device's collectives on gloo, or one smaller
    than the world (a new group is a collective of the whole world, which the ranks outside it
    would not join) unless it is one of a 2D mesh's `shard_groups`, whose ranks every rank of
    the world makes alike (`new_subgroups_by_enumeration`)."""
    if local:
        return None
    pg = group if group is not None else dist.group.WORLD
    overlap = overlap_for(
        device_type=device.type,
        backend=backend_for(device.type, dist.get_backend_config(pg)),
        spans_world=dist.get_world_size(pg) == dist.get_world_size() or shard_groups is not None,
        world=world,
        local=local,
    )
    if overlap is Overlap.AT_ONCE:
        return None
    if overlap is Overlap.THREAD:
        key = ("no collective", device)
        if key not in _SIDE_GROUPS:
            _SIDE_GROUPS[key] = (None, ThreadPoolExecutor(1, "modular-input-dist"))
        return _SIDE_GROUPS[key]
    side = _SIDE_GROUPS.get(pg)
    if side is None:
        # The module's group's timeout: a prefetch that waits on a peer fails when a forward on
        # the module's group would (see Note [prefetch on every rank]).
        timeout = pg._get_backend(device).options._timeout
        if shard_groups is None:
            group = dist.new_group(backend=dist.Backend.GLOO, timeout=timeout)
        else:
            group, _ = dist.new_subgroups_by_enumeration(
                shard_groups, timeout=timeout, backend=dist.Backend.GLOO
            )
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
