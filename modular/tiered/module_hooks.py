"""What a sharded collection with tiered tables adds around its kernels: its stores made current
whenever its state is read or written, and a prefetched batch's rows brought into the caches
(Note [tiered tables] in modular/tiered/__init__.py)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from modular.routing.received import Received
from modular.tiered.kernel import TieredKernel

__all__ = ["watch_tiers", "with_row_prefetch"]


def watch_tiers(module: nn.Module, sync: Callable[[], None]) -> None:
    """Has `module.state_dict()` and `module.load_state_dict()` run `sync` (dirty cached rows
    written back, caches emptied) before they read its table weights (the stores), and the load
    again after it wrote them, so that the next lookups read what was loaded. DCP's save and
    load read and write the tensors `state_dict()` returns: the same stores."""
    module.register_state_dict_pre_hook(lambda *_: sync())
    module.register_load_state_dict_pre_hook(lambda *_: sync())
    module.register_load_state_dict_post_hook(lambda *_: sync())


def with_row_prefetch(input_dist: Callable, kernels: list) -> Callable:
    """`input_dist`, followed, where any of `kernels` is tiered, by bringing the received
    batch's rows into their caches.

    # Note [tiered prefetch]
    `modular.prefetch` runs a batch's input dist in the background (Note [prefetched input
    dist] in modular/routing/prefetcher.py); with a tier it then also reads the batch's missing
    rows (and their state) into the caches, in the same background thread, while the current
    step looks up, runs backward and updates. It evicts only slots the current step does not
    use (they are pinned until its update), so it never touches a row that step updates, and
    the next forward takes the batch only once the thread is done, so the step finds every row
    in its cache: no miss inside the step. A table whose free slots cannot take the batch's
    rows is left to the step, which reads them itself (and grows the cache if it must).
    """
    if not any(isinstance(k, TieredKernel) for k in kernels):
        return input_dist

    def run(features, exchange=None) -> Received:
        received = input_dist(features, exchange)
        prefetch_rows(kernels, received)
        return received

    return run


def prefetch_rows(kernels: list, received: Received) -> None:
    """Each tiered kernel's `prefetch_rows` with its tables' ids of `received` (route by
    route, the kernels taking consecutive routes)."""
    routes = sum(len(k.group.routes) for k in kernels)
    if received.vbe is None:
        counts = received.lengths.sum(1)
    else:  # each route's bags from every rank, route by route
        features = torch.tensor([r.feature for k in kernels for r in k.group.routes])
        bags = received.vbe.strides[:, features].sum(0)
        route_of = torch.repeat_interleave(torch.arange(routes), bags)
        counts = torch.zeros(routes, dtype=torch.int64).index_add_(0, route_of, received.lengths.long())
    pieces = torch.split(received.values, counts.tolist())
    first = 0
    for k in kernels:
        n = len(k.group.routes)
        if isinstance(k, TieredKernel):
            mine = pieces[first : first + n]
            ftm = k.group.feature_table_map
            k.prefetch_rows([torch.cat([p for p, u in zip(mine, ftm) if u == t]) for t in range(len(k.sizes))])
        first += n
