"""The "comm" contender of step_time.py: ours' collectives alone, the same calls with the same
sizes, without any of the work between them.

A sharded step must move its ids to the ranks that hold their rows and the pooled columns (and
their gradients) back; on CPU those bytes cross loopback TCP through gloo's threads, on the same
core as the step. `record` runs one step of ours with torch.distributed's collectives wrapped and
keeps each call's kind, sizes and dtype; `replay` makes a step that issues exactly those calls
on buffers made once. Its time is what the transport costs a step on this machine (waiting for a
slower peer included), a cost any framework moving those bytes pays too, so the CPU overhead
figures (step_targets.py) can be read against it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

# modular.comm's all_gather calls `all_gather_single` (one output tensor): without it a step's
# gathers (the data-parallel tables', dense and fused) would be left out of the replay.
_WRAPPED = (
    "all_to_all_single", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce",
    "broadcast",
)


def record(step: Callable, kjt) -> list[tuple]:
    """(kind, arguments to remake) of every collective one `step(kjt)` issues, in order."""
    calls: list[tuple] = []
    originals = {name: getattr(dist, name) for name in _WRAPPED}

    def wrap(name: str) -> Callable:
        original = originals[name]

        def recording(*args, **kwargs):
            calls.append((name, _shape_of(name, args, kwargs)))
            return original(*args, **kwargs)

        return recording

    for name in _WRAPPED:
        setattr(dist, name, wrap(name))
    try:
        step(kjt)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return calls


def _shape_of(name: str, args: tuple, kwargs: dict) -> tuple:
    group = kwargs.get("group")
    if name == "all_to_all_single":
        out, inp = args[0], args[1]
        out_splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
        in_splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        return (out.numel(), inp.numel(), inp.dtype, inp.device, out_splits, in_splits, group)
    if name == "all_gather":
        outs, inp = args[0], args[1]
        return (len(outs), inp.numel(), inp.dtype, inp.device, group)
    if name in ("all_gather_into_tensor", "all_gather_single"):
        out, inp = args[0], args[1]
        return (out.numel(), inp.numel(), inp.dtype, inp.device, group)
    t = args[0]  # all_reduce, broadcast
    src = args[1] if name == "broadcast" and len(args) > 1 else kwargs.get("src", 0)
    return (t.numel(), t.dtype, t.device, src, group)


def replay(calls: list[tuple]) -> Callable:
    """A step that issues `calls` again, on buffers made once (its argument is ignored)."""
    ops: list[Callable[[], None]] = []
    for name, shape in calls:
        if name == "all_to_all_single":
            n_out, n_in, dtype, device, out_splits, in_splits, group = shape
            out, inp = torch.empty(n_out, dtype=dtype, device=device), torch.zeros(n_in, dtype=dtype, device=device)
            ops.append(lambda o=out, i=inp, os_=out_splits, is_=in_splits, g=group:
                       dist.all_to_all_single(o, i, os_, is_, group=g))  # fmt: skip
        elif name == "all_gather":
            n, numel, dtype, device, group = shape
            outs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(n)]
            inp = torch.zeros(numel, dtype=dtype, device=device)
            ops.append(lambda o=outs, i=inp, g=group: dist.all_gather(o, i, group=g))
        elif name in ("all_gather_into_tensor", "all_gather_single"):
            n_out, n_in, dtype, device, group = shape
            out, inp = torch.empty(n_out, dtype=dtype, device=device), torch.zeros(n_in, dtype=dtype, device=device)
            gather = getattr(dist, name)
            ops.append(lambda o=out, i=inp, g=group, f=gather: f(o, i, group=g))
        else:
            numel, dtype, device, src, group = shape
            t = torch.zeros(numel, dtype=dtype, device=device)
            if name == "all_reduce":
                ops.append(lambda t=t, g=group: dist.all_reduce(t, group=g))
            else:
                ops.append(lambda t=t, s=src, g=group: dist.broadcast(t, s, group=g))

    def step(_kjt) -> None:
        for op in ops:
            op()

    return step
