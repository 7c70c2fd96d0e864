"""Keeps PyTorch's ShardedTensor deprecation warning out of users' logs for modular's own ops.

# Note [ShardedTensor warnings]
Every torch op on a `ShardedTensor` (even `.size()` or `.detach()`) emits a FutureWarning, "Please
use DTensor instead and we are deprecating ShardedTensor", on the pinned torch. The tables are
ShardedTensors by default (docs/design.md), so modular's own work on them (building them, the
fused optimizer's state, `state_dict`, checkpoints, export) would print it from calls that the
user never wrote on a ShardedTensor: a 3-rank checkpoint load of a small DLRM printed 21. The
entry points that touch ShardedTensors run under `quiet_sharded_tensor`, which ignores that one
message (and nothing else) for their duration; a user's own op on a ShardedTensor, outside
them, still warns, because the warning is theirs to act on (`tensor_type="dtensor"` avoids it).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Callable, Iterator, TypeVar

__all__ = ["quiet_sharded_tensor", "quietly"]

# torch/distributed/_shard/_utils.py DEPRECATE_MSG, matched from its start.
_MESSAGE = r"Please use DTensor instead and we are deprecating ShardedTensor"

F = TypeVar("F", bound=Callable)


@contextlib.contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """Ignores the ShardedTensor deprecation warning inside (Note [ShardedTensor warnings])."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_MESSAGE, category=FutureWarning)
        yield


def quietly(fn: F) -> F:
    """`fn` run under `quiet_sharded_tensor`."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with quiet_sharded_tensor():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
