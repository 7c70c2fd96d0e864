"""`modular.prefetch(model, kjt)`: which sharded collections of a model a prefetched batch is for.

The per-module machinery is modular/routing/prefetcher.py (Note [prefetched input dist]); this is
the model-level call, apart from modular/sharding.py so that neither outgrows one idea.
"""

from __future__ import annotations

from typing import Iterable, Optional

from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from modular.errors import InputError
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
    features than they read."""
    if not isinstance(features, KeyedJaggedTensor):
        raise TypeError(f"prefetch takes a KeyedJaggedTensor, got {type(features).__name__}")
    found = dict(sharded_modules(model))
    if not found:
        raise ValueError(
            "prefetch: the model has no sharded EmbeddingBagCollection or EmbeddingCollection "
            "(call modular.shard first)"
        )
    names = _prefetch_targets(found) if modules is None else list(modules)
    unknown = [n for n in names if n not in found]
    if unknown:
        raise ValueError(
            f"prefetch: modules {unknown} are not sharded collections of the model; its sharded "
            f"collections are {sorted(found)}"
        )
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
    `modules=` too); otherwise every rank raises the same InputError, before any collective.

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
