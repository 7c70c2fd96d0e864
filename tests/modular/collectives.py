"""`no_collectives`: proves that an error is raised before any collective it could hang in.

A rank that raises after its peers entered a collective leaves them blocked until the timeout;
an error on bad input must therefore be found before the first collective (or after only the
collectives every rank is known to join, named in `allow`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch.distributed as dist

_COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "monitored_barrier",
)


class CollectiveCalled(RuntimeError):
    """Raised by `no_collectives` when code under it starts a collective."""


@contextlib.contextmanager
def no_collectives(allow: tuple[str, ...] = ()) -> Iterator[None]:
    """Makes every torch.distributed collective but those in `allow` raise `CollectiveCalled`.

    Used to prove that an error is raised before any collective it could hang in (or, with
    `allow`, after only the collectives every rank is known to join).
    """
    import torch.distributed.distributed_c10d as c10d

    saved: list[tuple[object, str, Callable]] = []

    def refuse(name: str) -> Callable:
        def call(*args, **kwargs):
            raise CollectiveCalled(f"collective {name} was called")

        return call

    for module in (dist, c10d):
        for name in _COLLECTIVES:
            if hasattr(module, name) and name not in allow:
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, refuse(name))
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)

