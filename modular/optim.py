"""The optimizers a training loop holds: `fuse_optimizer` (the tables' update inside backward, no
dense gradient), its `FusedOptimizer`, and `CombinedOptimizer` over several.

The fused optimizer itself (its kernels, which kernel each group gets, its state, its config)
is in modular/fused/; Note [fused tables] in modular/fused/choice.py says what it does.
"""
from __future__ import annotations

import copy
import weakref
from typing import Any, Callable, Optional

import torch
from torch import nn

from modular import lifecycle
from modular.errors import ShardingError
from modular.fused.config import ColumnWiseStatistic, FusedConfig, FusedOptimizerKind
from modular.fused.state import check_fused_state, fused_state, load_fused_state
from modular.kernels.table_dtypes import check_table_dtypes
from modular.sharded_types import SHARDED_COLLECTIONS, kind_of, sharded_class, tables_name
from modular.sharding import sharded_modules
from modular.tables.deprecation import quietly

__all__ = ["CombinedOptimizer", "FusedOptimizer", "fuse_optimizer"]


def fuse_optimizer(
    model: nn.Module,
    optimizer: str,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    column_wise_statistic: str | ColumnWiseStatistic = "exact",
    stochastic_rounding: bool = True,
) -> FusedOptimizer:
    """Fuses `optimizer` into every EmbeddingBagCollection and EmbeddingCollection of
    `model`, in place.

        opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1, eps=1e-8)
        loss.backward()          # the tables are updated here
        opt.step()               # a no-op for the tables; kept so loops look the same

    Call it before `modular.shard` (Note [order of sharding calls] in modular/compose/fsdp.py;
    on a sharded model it raises `ShardingError`). It marks each collection, and `modular.shard`
    builds its shards fused directly, so each rank only ever allocates its own shards (Note
    [fusing at shard]). A materialised collection used before any `shard` (its forward, or this
    optimizer's state, step or load) is fused then, in place, as a one-process fused module, which
    `modular.shard` later cuts into fused shards (optimizer state included): the model is also
    usable unsharded.

    `optimizer`: "exact_sgd", "exact_adagrad", "exact_rowwise_adagrad", or fbgemm's Adam family
    "adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb" (`betas` are theirs; Note
    [fused Adam and LAMB] in modular/fused/adam.py pins what they do: only the rows a step
    touched move, bias correction by the module's step count, state `exp_avg`, `exp_avg_sq` and
    `step`). Every plan trains them as the unsharded table, column pieces included.
    `weight_decay`: under row-wise Adagrad fbgemm's L2 mode (added to the gradient of the rows a
    step touched; fbgemm's CPU kernel ignores it, measured with fbgemm-gpu-cpu 1.8.0, so on CPU
    a model with weight decay runs every table through the exact emulated update instead); under
    the Adam family decoupled, as fbgemm's kernels apply it; the other two have none.

    `column_wise_statistic` (row-wise Adagrad only) says what row statistic a table cut into
    column pieces keeps:
      "exact" (the default): the whole row's mean of grad**2 over all its columns, so training
          equals the unsharded table's whatever the plan; the pieces run fbgemm's backward twice
          and exchange one float per id (Note [row statistics across column shards]).
      "per_shard": each piece its own, over its own columns only, as if it were a table of its
          own: TorchRec's approximation. One fused pass and no exchange (faster), but the result
          and the optimizer state (one column per piece, Note [fused tables]) depend on the plan.
    Tables not cut into column pieces train identically either way. Exact SGD and Adagrad keep
    no row statistic, so for them only "exact" is accepted (a ValueError otherwise).

    `stochastic_rounding` (FP16/BF16 tables): how fbgemm rounds an update into the table,
    passed to fbgemm's kernels as it is; True is fbgemm's default, which its CUDA kernels honour
    (unbiased, so small updates are not lost to round-to-nearest) and its CPU kernels ignore
    (they round to nearest). The torch emulation always rounds to nearest, so data-parallel
    copies stay bit-identical (Note [low-precision tables] in modular/kernels/table_dtypes.py).
    The optimizer state is FP32 whatever the table's dtype.
    Returns the optimizer that owns the tables' state: `state_dict()`, `load_state_dict`,
    `param_groups` (a torch LR scheduler can drive it), `zero_grad()` (a no-op).
    """
    kind = FusedOptimizerKind.parse(optimizer)
    statistic = ColumnWiseStatistic.parse(column_wise_statistic)
    if not lr > 0:
        raise ValueError(f"fused {kind.value}: lr must be positive, got {lr}")
    if not eps > 0:
        raise ValueError(f"fused {kind.value}: eps must be positive, got {eps}")
    if weight_decay < 0:
        raise ValueError(f"fused {kind.value}: weight_decay must be >= 0, got {weight_decay}")
    if weight_decay and not (kind.rowwise() or kind.adam_family()):
        raise ValueError(
            f"fused {kind.value}: weight_decay={weight_decay} is not supported: fbgemm's "
            f"{kind.value} kernel has no weight decay (exact_rowwise_adagrad and the Adam "
            "family have one)"
        )
    betas = tuple(betas)
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"fused {kind.value}: betas must be two numbers in [0, 1), got {betas}")
    if statistic is not ColumnWiseStatistic.EXACT and not kind.rowwise():
        raise ValueError(
            f"fused {kind.value}: column_wise_statistic={statistic.value!r} applies to "
            f"exact_rowwise_adagrad only: {kind.value}'s column pieces always train exactly "
            "(they keep no row statistic, or combine the whole row's across the pieces); leave "
            "it at 'exact'"
        )
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if kind_of(m) is not None
    ]
    if not targets:
        raise ValueError(
            "fuse_optimizer found no EmbeddingBagCollection or EmbeddingCollection in the model"
        )
    sharded = [name for name, m in targets if _is_sharded(m)]
    if sharded:
        raise ShardingError(
            f"modules {sharded} are already sharded: call modular.fuse_optimizer before "
            "modular.shard (Note [order of sharding calls]). Fusing a sharded module would hold "
            "every shard twice while its kernels are swapped (4.18 GiB against 2.27 GiB a rank "
            "in benchmarks/shard_memory.py); fused first, shard builds the fused shards directly"
        )
    fused = [
        name
        for name, m in targets
        if getattr(m, "fused", None) is not None or lifecycle.pending_fuse(m) is not None
    ]
    if fused:
        raise ValueError(f"modules {fused} are already fused; fuse a model only once")
    group = {"lr": lr, "eps": eps, "weight_decay": weight_decay}
    if kind.adam_family():
        group["betas"] = betas
    config = FusedConfig(
        kind,
        group,
        column_wise_statistic=statistic,
        stochastic_rounding=bool(stochastic_rounding),
    )
    for name, m in targets:
        if not _on_meta(m):  # what building it would refuse, refused now
            device = next(iter(m.parameters())).device
            check_table_dtypes(kind_of(m).read_tables(m, name), name, device)
    for name, m in targets:  # fused when modular.shard builds its shards (Note [fusing at shard])
        lifecycle.set_pending_fuse(m, config)
        if not _on_meta(m):  # or, used before any shard, fused then
            m.forward = _FuseThenForward(m, name)
    return FusedOptimizer(model, config)


class _FuseThenForward:
    """The `forward` of a materialised collection that `fuse_optimizer` marked: the first call
    fuses it in place, then runs its fused forward.

    # Note [fusing at shard]
    `fuse_optimizer` fuses nothing: it marks each collection, and `modular.shard` builds each
    rank's shards fused, straight from the collection's weights (on meta: from its init_fn). A
    materialised model fused at once would hold a fused copy of every table on every rank beside
    the model's own until `shard` swapped it in: measured, a rank's peak memory grew by 1.9-2.5x
    what the plan prices it for (issue 51). A marked collection that is used before any `shard`
    (a one-process model: its forward, or the FusedOptimizer's state, step or load) is fused
    then, in place, as a one-process fused module (`fuse_now`); `shard` then cuts that one.
    `modular.local_parameters` leaves a marked collection's tables out, as it leaves out fused
    ones: a dense optimizer never holds them."""

    def __init__(self, module: nn.Module, name: str) -> None:
        self._module, self._name = weakref.ref(module), name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        fuse_now(module, self._name)
        return module(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> _FuseThenForward:
        """A copy of a marked module (`copy.deepcopy(model)`) is marked alike: the copy is in
        `memo` while its attributes are copied (copied alone, this stays its module's)."""
        original = self._module()
        copy_ = memo.get(id(original)) if original is not None else None
        if copy_ is None:
            return self
        config = lifecycle.pending_fuse(original)
        if config is not None:
            lifecycle.set_pending_fuse(copy_, copy.deepcopy(config, memo))
        return _FuseThenForward(copy_, self._name)


def fuse_now(module: nn.Module, name: str) -> None:
    """Fuses a collection `fuse_optimizer` marked, in place, as a one-process fused module
    (Note [fusing at shard]); nothing for one that is not marked."""
    config = lifecycle.pending_fuse(module)
    if config is None or _is_sharded(module) or _on_meta(module):
        return
    module.__dict__.pop("forward", None)
    local = sharded_class(kind_of(module)).unsharded(module, module=name, fused=config)
    lifecycle.clear_pending_fuse(module)
    lifecycle.replace_module(module, "", local)


def fuse_marked(model: nn.Module) -> None:
    """`fuse_now` on every collection of `model` that `fuse_optimizer` marked and no `shard`
    built yet: what a one-process model's FusedOptimizer, prefetch, unshard and checkpoints need
    first. Free once nothing is marked (`shard` clears the marks of what it built), as on every
    step of a sharded model."""
    if not lifecycle.any_pending_fuse():
        return
    for name, m in list(model.named_modules()):
        if kind_of(m) is not None and lifecycle.pending_fuse(m) is not None:
            fuse_now(m, name)


def _is_sharded(m: nn.Module) -> bool:
    return isinstance(m, SHARDED_COLLECTIONS) and not m.is_local


def _on_meta(ebc: nn.Module) -> bool:
    return any(p.is_meta for p in ebc.parameters())


class FusedOptimizer(torch.optim.Optimizer):
    """The optimizer of a model's fused tables; it finds them in the model on every call, so it
    keeps working after `modular.shard` rebuilds them."""

    def __init__(self, model: nn.Module, config: FusedConfig) -> None:
        defaults = {"lr": config.lr, "eps": config.eps, "weight_decay": 0.0}
        super().__init__([{"params": []}], defaults)
        self.param_groups = [config.param_group]
        config.param_group.setdefault("params", [])
        self._model: Optional[nn.Module] = model
        self._place: Optional[tuple[Any, str]] = None  # see _current_model
        self._config = config

    @property
    def kind(self) -> FusedOptimizerKind:
        return self._config.optimizer

    @property
    def column_wise_statistic(self) -> ColumnWiseStatistic:
        """The row statistic of column-cut tables under row-wise Adagrad (`fuse_optimizer`)."""
        return self._config.column_wise_statistic

    def _current_model(self) -> nn.Module:
        """The model this optimizer was made for, or what stands in its place in a larger
        model once `shard` replaced it; held weakly then, so that neither the replaced module
        nor later ones stay alive through this optimizer."""
        if self._model is not None:
            place = lifecycle.place_of(self._model)
            if place is None:
                return self._model
            self._model, self._place = None, place
        root, fqn = self._place
        model = root()
        if model is None:
            raise ShardingError(
                f"the model whose module {fqn!r} this FusedOptimizer was made for is gone; make "
                "the optimizer on the model you train"
            )
        return model.get_submodule(fqn)

    def _fused_modules(self):
        model = self._current_model()  # a collection `shard` replaced: what is in its place
        fuse_marked(model)  # a one-process model's, fused at its first use (Note [fusing at shard])
        return [(fqn, m) for fqn, m in sharded_modules(model) if m.fused is not None]

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """The tables were updated in backward; this only runs `closure` if given."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Fused tables have no gradients: nothing to clear."""

    @quietly  # Note [ShardedTensor warnings]
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, dict[str, torch.Tensor]] = {}
        for fqn, m in self._fused_modules():
            prefix = f"{fqn}." if fqn else ""
            tables = tables_name(m)
            for table, tensors in fused_state(m.fused_tables, m.table_weights()).items():
                state[f"{prefix}{tables}.{table}.weight"] = tensors
        group = {k: v for k, v in self._config.param_group.items() if k != "params"}
        group["optimizer"] = self._config.optimizer.value
        group["params"] = sorted(state)
        return {"state": state, "param_groups": [group]}

    @quietly
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads state saved by `state_dict()`: every module's is checked before anything (the
        learning rate included) changes, so a refused load leaves this optimizer as it was."""
        groups = state_dict.get("param_groups", [])
        if groups:
            saved = groups[0].get("optimizer", self._config.optimizer.value)
            if saved != self._config.optimizer.value:
                raise ValueError(
                    f"the state is for fused {saved!r} but this optimizer is "
                    f"{self._config.optimizer.value!r}; fuse with {saved!r} to load it"
                )
        state = state_dict.get("state", {})
        keeps = bool(self._config.optimizer.state_names())
        loads = []
        for fqn, m in self._fused_modules():
            prefix = f"{fqn}." if fqn else ""
            per_table = {}
            for table in m.table_weights():
                key = f"{prefix}{tables_name(m)}.{table}.weight"
                if key in state:
                    per_table[table] = state[key]
                elif keeps:
                    raise KeyError(f"the optimizer state has no entry for table weight {key!r}")
            if keeps:
                check_fused_state(m.fused_tables, per_table)
            loads.append((m, per_table))
        if groups:
            for key in ("lr", "eps", "betas"):
                if key in groups[0] and key in self._config.param_group:
                    self._config.param_group[key] = groups[0][key]
        for m, per_table in loads:
            load_fused_state(m.fused_tables, per_table)


class CombinedOptimizer(torch.optim.Optimizer):
    """One optimizer-shaped object over several: e.g. fused tables plus a dense torch optimizer.

        opt = CombinedOptimizer({"tables": fused, "dense": torch.optim.Adam(dense_params)})
        opt.zero_grad(); loss.backward(); opt.step()

    `param_groups` concatenates the parts' groups (an LR scheduler scales them all);
    `state_dict()` nests each part's under its name.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)
        super().__init__([{"params": []}], {})

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The parts' groups, read live: a torch optimizer's `load_state_dict` (every
        `modular.checkpoint.load`) replaces its group dicts, and an LR scheduler must reach
        the new ones."""
        return [g for o in self.optimizers.values() for g in o.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list) -> None:
        # torch.optim.Optimizer.__init__ assigns its own, empty, groups: the parts' are the groups.
        if groups:
            raise AttributeError(
                "CombinedOptimizer.param_groups are its parts' groups: change those instead"
            )

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        loss = closure() if closure is not None else None
        for o in self.optimizers.values():
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: o.state_dict() for name, o in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = set(self.optimizers) - set(state_dict)
        if missing:
            raise KeyError(f"the state has no entry for optimizers {sorted(missing)}")
        for name, o in self.optimizers.items():
            o.load_state_dict(state_dict[name])
