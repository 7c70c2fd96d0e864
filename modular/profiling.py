"""The profiler labels of a sharded model's step and of the calls around it, named in one place.

# Note [profiler labels]
Every phase a user may wait on runs under a `torch.profiler.record_function` range named
`modular::<phase>`, as FSDP2 names its phases `FSDP::...`, so a trace (`torch.profiler.profile`;
README.md, "Reading a trace") shows the step by name:

  forward   INPUT_DIST, LOOKUP, OUTPUT_DIST: `ShardedCollection`'s three steps, once per sharded
            module and forward (modular/collection.py; a prefetched batch's input dist runs on
            the prefetch thread);
  backward  OUTPUT_DIST_BACKWARD: the pooled gradients' all-to-all (`_PooledAllToAll.backward`
            in modular/comm.py; a world of one sends nothing and shows none); LOOKUP_BACKWARD:
            each kernel group's backward (`KernelLookup.backward` in modular/kernels/base.py, or
            the node of fbgemm's own autograd, `label_backward`). The ids carry no gradient, so
            the input dist has no backward and no label;
  update    FUSED_UPDATE: every fused optimizer update, where it runs: inside fbgemm's backward
            for `FusedKernel` (nested in that kernel's LOOKUP_BACKWARD), once at the end of
            backward for the deferred and emulated kernels and the Adam family
            (`EndOfBackward.run` in modular/fused/backward.py);
  2D        REPLICA_SYNC: under replica_sync="exact", each step's gathers of every replica
            group's batches or gradients (modular/kernels/exact_replicas.py, `take_every_pending` in
            modular/fused/emulated.py), inside FUSED_UPDATE or a dense kernel's
            LOOKUP_BACKWARD; the replay of the merged batch that follows is the kernel's own
            backward or update, under those labels. And `modular.sync_replicas`;
  calls     RESHARD (`modular.reshard`), CHECKPOINT_SAVE and CHECKPOINT_LOAD (`modular.checkpoint`).

A range opens only while a profiler runs (`torch.autograd.profiler._is_profiler_enabled`, the
check torch's own dynamo and inductor make): `record_function` costs about 7 us a range with no
profiler on (a 2-core CPU host), and a module's step opens ten or so; the check costs nothing
measurable. fbgemm's backward is labelled by hooks its forward attaches, so only where the forward
ran under the profiler too: profile whole steps. One range per phase and call, per kernel group
for LOOKUP_BACKWARD (and FUSED_UPDATE inside fbgemm's), never per table or feature
(tests/modular/test_step_python.py counts the step's Python work). tests/modular/test_profile.py
finds every label in profiled steps.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, ContextManager, TypeVar

import torch
import torch.autograd.profiler as _profiler
from torch.autograd.profiler import record_function

__all__ = [
    "CHECKPOINT_LOAD", "CHECKPOINT_SAVE", "FUSED_UPDATE", "INPUT_DIST", "LABELS", "LOOKUP",
    "LOOKUP_BACKWARD", "OUTPUT_DIST", "OUTPUT_DIST_BACKWARD", "REPLICA_SYNC", "RESHARD",
    "STEP_LABELS", "label", "label_backward", "labelled",
]  # fmt: skip

INPUT_DIST = "modular::input_dist"
LOOKUP = "modular::lookup"
OUTPUT_DIST = "modular::output_dist"
OUTPUT_DIST_BACKWARD = "modular::output_dist_backward"
LOOKUP_BACKWARD = "modular::lookup_backward"
FUSED_UPDATE = "modular::fused_update"
REPLICA_SYNC = "modular::replica_sync"
RESHARD = "modular::reshard"
CHECKPOINT_SAVE = "modular::checkpoint_save"
CHECKPOINT_LOAD = "modular::checkpoint_load"

# A fused 1D training step's labels, in the order they first open.
STEP_LABELS = (INPUT_DIST, LOOKUP, OUTPUT_DIST, OUTPUT_DIST_BACKWARD, LOOKUP_BACKWARD, FUSED_UPDATE)
LABELS = (*STEP_LABELS, REPLICA_SYNC, RESHARD, CHECKPOINT_SAVE, CHECKPOINT_LOAD)

_F = TypeVar("_F", bound=Callable[..., Any])
_NO_RANGE = contextlib.nullcontext()


def label(name: str) -> ContextManager:
    """`with label(REPLICA_SYNC): ...`: a profiler range named `name` around the block while a
    profiler runs, else nothing (Note [profiler labels])."""
    return record_function(name) if _profiler._is_profiler_enabled else _NO_RANGE


def labelled(name: str) -> Callable[[_F], _F]:
    """A decorator: every call of the function runs under `label(name)`."""

    def decorate(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not _profiler._is_profiler_enabled:
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate


def label_backward(out: torch.Tensor, *names: str) -> torch.Tensor:
    """Returns `out`, whose autograd node (one that is not ours to edit: fbgemm's TBE) then runs
    its backward under ranges named `names`, the first outermost, when the forward ran under a
    profiler (Note [profiler labels]): a hook before the node opens them, one after closes them."""
    node = out.grad_fn
    if node is None or not _profiler._is_profiler_enabled:
        return out
    opened: list[record_function] = []

    def open_ranges(grad_outputs: Any) -> None:
        opened.extend(record_function(n).__enter__() for n in names)

    def close_ranges(grad_inputs: Any, grad_outputs: Any) -> None:
        while opened:
            opened.pop().__exit__(None, None, None)

    node.register_prehook(open_ranges)
    node.register_hook(close_ranges)
    return out
