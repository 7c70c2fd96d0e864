"""`modular.prefetch(model, kjt)`: which sharded collections of a model a prefetched batch is for.

The per-module machinery is modular/routing/prefetcher.py (Note [prefetched input dist]); this is
the model-level call, apart from modular/sharding.py so that neither outgrows one idea.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.agreed_options import disagreement, settings_that_differ
from modular.errors import InputError, ShardingError
from modular.managed_collisions import managed_owner
from modular.optim import fuse_marked
from modular.sharding import sharded_modules

__all__ = ["prefetch"]


def prefetch(
    model: nn.Module, features: KeyedJaggedTensor, *, modules: Optional[Iterable[str]] = None
) -> nn.Module:
    """Prefetches `features` for the sharded collections of `model`: their input dist runs in
    the background from the module's next wait on (Note [prefetched input dist] in
    modular/routing/prefetcher.py), and a later `model(...)` whose sharded modules receive this
    same KJT object uses it. Returns `model`. Call it on every rank, in the same order.

    `modules` (FQNs) names the collections that take this KJT. A model whose collections read
    different features (an EBC's batch and an EC's) must name them, one call per batch:

        modular.prefetch(model, batch.sparse, modules=["sparse"])
        modular.prefetch(model, batch.sequences, modules=["seq"])

    or, where the model hands one KJT that carries all their features to several collections
    (each reads its own, Note [batches with more features] in modular/routing/router.py), one
    call naming them all: `modular.prefetch(model, batch.sparse, modules=["sparse", "seq"])`.

    Without it every sharded collection gets `features`, which is only allowed when they all
    read the same features (Note [choosing what to prefetch for]); the KJT may then carry more
    features than they read.

    The first call with a given `modules=` checks that every rank prefetches for the same
    collections of a model with the same sharded collections; where one differs, every rank
    raises `ShardingError` naming the ranks and what each holds, before any batch is armed (Note
    [agreeing on what to prefetch]). Later calls with that `modules=` run no collective."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"prefetch takes a KeyedJaggedTensor, got {type(features).__name__}")
    fuse_marked(model)  # a one-process model's fused tables (Note [fusing at shard])
    found = dict(sharded_modules(model))
    if not found:
        raise ValueError(
            "prefetch: the model has no sharded EmbeddingBagCollection or EmbeddingCollection "
            "(call modular.shard first)"
        )
    asked = None if modules is None else tuple(modules)
    names, problem = [], None
    try:
        names = _prefetch_targets(found) if asked is None else list(asked)
        unknown = [n for n in names if n not in found]
        if unknown:
            raise ShardingError(
                f"prefetch: modules {unknown} are not sharded collections of the model; its "
                f"sharded collections are {sorted(found)}"
            )
        remapped = [(n, owner[0]) for n in names if (owner := managed_owner(model, n)) is not None]
        if remapped:
            name, owner = remapped[0]
            others = sorted(n for n in found if managed_owner(model, n) is None)
            raise ShardingError(
                f"prefetch: {name!r} is the inner collection of the managed-collision module "
                f"{owner!r}: it looks up the ids that module's collision collection remaps in the "
                "model's forward, so its input dist cannot run ahead on the raw batch; leave it "
                f"out (`modules=`; the model's other sharded collections: {others})"
            )
    except (InputError, ShardingError) as e:
        problem = e
    agree_on_modules(model, found, asked, names, problem)  # Note [agreeing on what to prefetch]
    for name in names:
        found[name].prefetch(features)
    return model


def _prefetch_targets(found: dict[str, nn.Module]) -> list[str]:
    """Every sharded collection, when `prefetch` is not told which ones take the batch.

    # Note [choosing what to prefetch for]
    A collection handed a KJT it never receives keeps it pending, and the 9th such raises. Which
    collections take a batch cannot be read from the batch: a rank whose batch is wrong would
    choose other modules than its peers and hang the prefetch group, where a bad batch must
    raise InputError on every rank. It is read from the model instead, which every rank holds
    alike (`shard` agreed on each module's tables and features): collections that all read the
    same features take one batch (two that read the same features from different batches need
    `modules=` too); otherwise every rank raises the same InputError, before any batch is armed
    (in the agreement of Note [agreeing on what to prefetch]).

    A batch may carry more features than a collection reads (Note [batches with more features]
    in modular/routing/router.py), and that does not widen the rule. Collections that read the
    same features may take it, as before: each selects its own. But collections that read
    different features cannot be told apart by the model: one combined KJT for all of them and a
    KJT for one of them look alike until the batch's keys are read, and its keys are the batch
    (a rank whose keys are wrong would choose differently from its peers). So the caller names
    them, `modules=[...]` listing every collection the combined KJT goes to."""
    by_features: dict[frozenset, list[str]] = {}
    for name, m in found.items():
        by_features.setdefault(frozenset(m.layout.features), []).append(name)
    if len(by_features) > 1:
        reads = "; ".join(f"{names} read {sorted(f)}" for f, names in by_features.items())
        raise InputError(
            f"prefetch: the model's sharded collections read different features ({reads}), so "
            "which of them this batch is for is the caller's to say: pass modules=[...] (their "
            f"FQNs), e.g. modules={next(iter(by_features.values()))}, the same on every rank; for "
            "one KJT that the model hands to all of them (each reads its own features), "
            f"modules={list(found)}"
        )
    return list(found)


# The `modules=` each model has prefetched for since every rank agreed on them, with its sharded
# collections then: (None or the names given, the collections' FQNs) (Note [agreeing on what to
# prefetch]). Keyed by the model, so a model that goes away takes its entries with it.
_AGREED: "weakref.WeakKeyDictionary[nn.Module, set[tuple]]" = weakref.WeakKeyDictionary()
_FIX = "call {call} with the same modules=, in the same order, on models sharded alike"
_NOTE = "Note [agreeing on what to prefetch]"


def agree_on_modules(
    model: nn.Module, found: dict[str, nn.Module], asked: Optional[tuple[str, ...]],
    names: list[str], problem: Optional[ValueError],
) -> None:
    """Raises on every rank, at the first prefetch of `model` with `asked` (its `modules=`), if
    the ranks prefetch for other collections or hold other sharded collections (`found`), or if
    a rank refused the call (`problem`); returns at once where the same call was agreed before.

    # Note [agreeing on what to prefetch]
    Which collections a batch is prefetched for decides which input dists run on the background
    group (Note [prefetched input dist] in modular/routing/prefetcher.py): a rank that prefetches
    for 'seq' while its peer prefetches for 'bags' runs another all-to-all than its peer, and
    both wait until the group's timeout, or worse, exchange ids of different sizes. Nothing in
    the input dist can catch it cheaply: the ids' header (Note [ids with their header]) is only
    read once the slots, whose sizes are the module's own, have arrived. An agreement at every
    prefetch would be a collective a step (prefetch runs every step, Note [prefetch on every
    rank]). So every rank agrees once per model and `modules=`: the first call with a given
    `modules=` gathers what each rank prefetches for and the model's sharded collections (one
    `all_gather_object` of a few names on the collections' group; every rank where they are
    2D: an object collective, on the CPU where the group has a CPU backend) and, where one
    differs, every rank raises `ShardingError` naming the ranks and what each holds, before any
    batch is armed. A rank that refused the call (an unknown module, InputError of Note
    [choosing what to prefetch for]) says so in the same gather and every rank raises its error,
    in its class. A later call with a `modules=` already agreed
    runs no collective: one that differs from its peers only in the order of calls (a rank
    prefetching 'bags' then 'seq', its peer 'seq' then 'bags', both agreed before) is not
    caught, and fails at the timeout as Note [prefetch on every rank] says. Collections of
    one process (`fuse_optimizer`'s, never sharded) run no collective and agree on nothing.
    """
    key = (asked, tuple(found))
    agreed = _AGREED.setdefault(model, set())
    if problem is None and key in agreed:
        return
    spread = [m for m in found.values() if not m.is_local]
    if not spread:
        if problem is not None:
            raise problem
        return
    group = _agreement_group(spread[0])
    settings = {
        "modules=": "not given (every sharded collection)" if asked is None else repr(list(asked)),
        "prefetched for": repr(names),
        "the model's sharded collections": repr(sorted(found)),
    }
    gathered: list = [None] * dist.get_world_size(group)
    mine = None if problem is None else (type(problem).__name__, str(problem))
    dist.all_gather_object(gathered, (settings, mine), group=group)
    refused = [(r, p) for r, (_, p) in enumerate(gathered) if p is not None]
    if problem is not None:
        raise problem
    if refused:
        (first, (kind, message)) = refused[0]
        raise (InputError if kind == "InputError" else ShardingError)(
            f"rank {first} refused modular.prefetch: {message} (ranks {[r for r, _ in refused]} "
            "refused it; this rank stops too so that no rank hangs)"
        )
    differing = settings_that_differ([s for s, _ in gathered])
    if differing:
        raise ShardingError(disagreement("modular.prefetch", differing, _FIX, _NOTE))
    agreed.add(key)


def _agreement_group(module: nn.Module) -> Optional[ProcessGroup]:
    """The group whose ranks all prefetch for `module`: its own, or every rank in 2D, where
    every shard group prefetches alike."""
    return None if module.replicas is not None else module.process_group
