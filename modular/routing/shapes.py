"""The shapes of a batch's tensors, checked before anything reads them (issue 48).

# Note [a batch's shapes]
A KeyedJaggedTensor's values, lengths (or offsets) and per-sample weights are 1-D, one entry per
id (per bag for lengths). torchrec does not check it, and a 2-D tensor (`values.view(-1, 1)`)
gets surprisingly far: the checks' reductions broadcast it (blaming ids that are all valid), a
one-rank module looks it up, and on several ranks the input dist's `torch.cat` raises torch's
"Tensors must have same number of dimensions" on that rank alone, before the agreement, leaving
its peers waiting in it until the collective timeout. So `Router.accept` looks at the shapes
first, on the host (no tensor is read), and a wrong one is the rank's `Rejection` like any bad
batch: it travels in the header of the ids' all-to-all (Note [ids with their header]) and every
rank raises `InputError`. A good batch pays a few attribute reads, no collective.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.routing.checks import Problem, Rejection


def check_shapes(
    kjt: KeyedJaggedTensor, *, module: str, features: tuple[str, ...]
) -> Optional[Rejection]:
    """A `Rejection` (Problem.SHAPE) if the batch's values, lengths, offsets or weights are not
    1-D tensors; None otherwise. `features`: the module's, the first of which the rejection
    names when none of the batch's keys is one of them."""
    keys = list(kjt.keys())
    parts = {
        "ids (values)": kjt.values(),
        "lengths": kjt.lengths_or_none(),
        "offsets": kjt.offsets_or_none(),
        # checked in an unweighted module too: fbgemm's permutation of shuffled features moves them
        "per-sample weights": kjt.weights_or_none(),
    }
    for name, t in parts.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            fault = f"its {name} are a {type(t).__name__}, not a tensor"
        elif t.dim() != 1:
            fault = f"its {name} have shape {tuple(t.shape)} ({t.dim()}-D), not 1-D"
        else:
            continue
        named = [k for k in keys if k in features]
        feature = features.index(named[0]) if named else (0 if features else -1)
        rank = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
        return Rejection(
            Problem.SHAPE,
            feature,
            f"{rank}the batch for module {module!r} (features {keys}) has the wrong shape: "
            f"{fault}. A KeyedJaggedTensor holds 1-D values, lengths and per-sample weights, "
            "one entry per id (per bag for lengths) over all its features; flatten them first "
            "(e.g. values.view(-1)) (Note [a batch's shapes])",
        )
    return None
