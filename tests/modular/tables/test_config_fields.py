"""Every field of torchrec's table configs, honoured or refused (issue 49, Note [table config
fields], Note [shard init]).

docs/table_configs.md lists each field of the pinned torchrec's `EmbeddingBagConfig` and
`EmbeddingConfig`; a pure test holds that list to the dataclasses (a torchrec upgrade that adds a
field fails it) and to `REFUSED_FIELDS`. Rank bodies at world 2 check that meta tables whose
configs carry a seeded-normal `init_fn` hold the unsharded module's values under every sharding
type (torchrec's own TestSparseNN, and an EmbeddingCollection), that `weight_init_min/max`
reach the shards through torchrec's default init_fn, drawn as Note [shard init] says, that a table
over `WHOLE_TABLE_INIT_BYTES` runs init_fn once per shard as documented, and that each refused
field raises ShardingError on every rank naming the table and the field.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

import modular
from modular.tables import meta_init
from modular.tables.config_fields import REFUSED_FIELDS
from planners.types import ShardingPlan, ShardingType, TablePlacement
from tests.dist import run_on_ranks
from tests.modular.compare import full_value

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "table_configs.md"
TIMEOUT_S = 120.0
WORLD = 2
CASES = ["row_wise", "column_wise", "table_row_wise", "table_wise", "data_parallel"]


# -- the doc's table, against the pinned dataclasses (pure) ----------------------------------------


def _doc_rows() -> dict[str, list[str]]:
    """field -> its row's cells after the field, from docs/table_configs.md's fields table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `(\w+)` \|(.*)\|$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


def test_the_doc_lists_exactly_the_fields_of_the_pinned_configs() -> None:
    rows = _doc_rows()
    for column, cls in ((0, EmbeddingBagConfig), (1, EmbeddingConfig)):
        listed = {f for f, cells in rows.items() if cells[column] == "yes"}
        fields = {f.name for f in dataclasses.fields(cls)}
        assert listed == fields, (
            f"docs/table_configs.md lists for {cls.__name__} {sorted(listed - fields)} that it does "
            f"not have, and misses {sorted(fields - listed)}: say for each whether modular honours "
            "or refuses it"
        )
    refused = {f for f, cells in rows.items() if cells[2].startswith("refused")}
    assert refused == set(REFUSED_FIELDS), (refused, set(REFUSED_FIELDS))
    for field, cells in rows.items():
        assert re.match(r"(honoured|refused)\b", cells[2]), (field, cells[2])
        tests = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", cells[3])
        assert tests, f"{field}: its row names no test"
        for path, name in tests:
            assert f"def {name}(" in (ROOT / path).read_text(), f"{field}: {path}::{name} does not exist"


# -- init_fn on meta tables ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SeededNormal:
    """An init_fn that decides its values itself: normal, from its own seeded generator."""

    seed: int

    def __call__(self, weight: torch.Tensor) -> None:
        if weight.is_meta:  # torchrec's EmbeddingCollection calls init_fn on meta weights too
            return
        generator = torch.Generator(device=weight.device).manual_seed(self.seed)
        with torch.no_grad():
            weight.normal_(0.0, 0.5, generator=generator)


def _seeded_tables(cls, names: list[str], rows: list[int], dims: list[int]) -> list:
    return [
        cls(name=n, num_embeddings=r, embedding_dim=d, feature_names=[f"f_{n}"], init_fn=SeededNormal(100 + i))
        for i, (n, r, d) in enumerate(zip(names, rows, dims))
    ]


def _placement(case: str, i: int) -> TablePlacement:
    return {
        "row_wise": TablePlacement(ShardingType.ROW_WISE),
        "column_wise": TablePlacement(ShardingType.COLUMN_WISE, ranks=(1, 0, 1)),  # rank 1: two pieces
        "table_row_wise": TablePlacement(ShardingType.TABLE_ROW_WISE, ranks=(0, 1)),
        "table_wise": TablePlacement(ShardingType.TABLE_WISE, ranks=(i % WORLD,)),
        "data_parallel": TablePlacement(ShardingType.DATA_PARALLEL),
    }[case]


def _plan(modules: dict[str, list], case: str) -> ShardingPlan:
    return ShardingPlan(
        world_size=WORLD,
        modules={fqn: {c.name: _placement(case, i) for i, c in enumerate(cfgs)} for fqn, cfgs in modules.items()},
    )


def _differences(model, ref, prefix: str) -> dict[str, float]:
    """Per table of `ref` under `prefix`: the largest difference from `model`'s assembled table."""
    mine = dict(model.named_parameters())
    out = {}
    for name, want in ref.named_parameters():
        if name.startswith(prefix):
            got = full_value(mine[name])
            out[name] = float((got - want.detach()).abs().max()) if got.shape == want.shape else float("inf")
    return out


def _test_sparse_nn(case: str) -> dict[str, float]:
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    tables = lambda: _seeded_tables(EmbeddingBagConfig, ["t0", "t1", "t2"], [20, 13, 7], [8, 12, 4])  # noqa: E731
    weighted = lambda: _seeded_tables(EmbeddingBagConfig, ["w0", "w1"], [11, 6], [4, 8])  # noqa: E731
    torch.manual_seed(0)
    ref = TestSparseNN(tables=tables(), weighted_tables=weighted(), dense_device=torch.device("cpu"), sparse_device=torch.device("cpu"))
    model = TestSparseNN(tables=tables(), weighted_tables=weighted(), dense_device=torch.device("meta"), sparse_device=torch.device("meta"))
    modular.shard(model, _plan({"sparse.ebc": tables(), "sparse.weighted_ebc": weighted()}, case))
    return _differences(model, ref, "sparse.")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", CASES)
def test_seeded_init_fn_on_a_meta_test_sparse_nn_gives_the_unsharded_values(case: str) -> None:
    for rank, diffs in enumerate(run_on_ranks(WORLD, _test_sparse_nn, case, timeout=TIMEOUT_S)):
        assert len(diffs) == 5, diffs
        assert all(d == 0.0 for d in diffs.values()), f"rank {rank}, {case}: {diffs}"


def _sequence(case: str) -> dict[str, float]:
    tables = lambda: _seeded_tables(EmbeddingConfig, ["s0", "s1"], [17, 9], [8, 8])  # noqa: E731
    ref = EmbeddingCollection(tables=tables())
    model = EmbeddingCollection(tables=tables(), device=torch.device("meta"))
    modular.shard(model, _plan({"": tables()}, case))
    return _differences(model, ref, "")


@pytest.mark.timeout(120)
def test_seeded_init_fn_on_a_meta_embedding_collection_gives_the_unsharded_values() -> None:
    for case in ("row_wise", "column_wise"):
        for rank, diffs in enumerate(run_on_ranks(WORLD, _sequence, case, timeout=TIMEOUT_S)):
            assert len(diffs) == 2 and all(d == 0.0 for d in diffs.values()), f"rank {rank}, {case}: {diffs}"


LOW, HIGH = 0.25, 0.75


def _weight_init_bounds() -> dict[str, object]:
    """torchrec's default init_fn (uniform between weight_init_min and weight_init_max, from the
    global generator) draws a meta table whole from the generator seeded by `table_seed`."""
    torch.manual_seed(7)  # every rank alike
    cfgs = [EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["f"], weight_init_min=LOW, weight_init_max=HIGH)]
    ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
    modular.shard(ebc, _plan({"": cfgs}, "row_wise"))
    got = full_value(ebc.embedding_bags["b"].weight)
    want = torch.empty(30, 8)
    with torch.random.fork_rng():
        torch.manual_seed(meta_init.table_seed("b"))
        cfgs[0].init_fn(want)
    return {"min": float(got.min()), "max": float(got.max()), "std": float(got.std()), "equal": torch.equal(got, want)}


@pytest.mark.timeout(120)
def test_weight_init_bounds_reach_meta_shards_through_torchrecs_default_init_fn() -> None:
    for rank, r in enumerate(run_on_ranks(WORLD, _weight_init_bounds, timeout=TIMEOUT_S)):
        assert LOW <= r["min"] and r["max"] <= HIGH and r["std"] > (HIGH - LOW) / 10, (rank, r)
        assert r["equal"], f"rank {rank}: the table is not the one drawn from table_seed('b')"


def _over_the_whole_table_limit() -> dict[str, float]:
    """A table over WHOLE_TABLE_INIT_BYTES: init_fn runs on each shard, as documented."""
    cfgs = _seeded_tables(EmbeddingBagConfig, ["big", "small"], [20, 4], [8, 4])  # 640 and 64 bytes
    ref = EmbeddingBagCollection(tables=_seeded_tables(EmbeddingBagConfig, ["big", "small"], [20, 4], [8, 4]))
    ebc = EmbeddingBagCollection(tables=cfgs, device=torch.device("meta"))
    limit = meta_init.WHOLE_TABLE_INIT_BYTES
    meta_init.WHOLE_TABLE_INIT_BYTES = 100  # the same on every rank, as the module constant is
    try:
        modular.shard(ebc, _plan({"": cfgs}, "row_wise"))
    finally:
        meta_init.WHOLE_TABLE_INIT_BYTES = limit
    out = _differences(ebc, ref, "")
    piece = ebc.embedding_bags["big"].weight.local_shards()[0].tensor
    want = torch.empty_like(piece)
    cfgs[0].init_fn(want)  # the shard drawn alone: the first rows of the seeded stream
    out["per shard"] = float((piece - want).abs().max())
    return out


@pytest.mark.timeout(120)
def test_a_table_over_the_limit_runs_init_fn_per_shard_as_documented() -> None:
    for rank, r in enumerate(run_on_ranks(WORLD, _over_the_whole_table_limit, timeout=TIMEOUT_S)):
        assert r["embedding_bags.small.weight"] == 0.0, (rank, r)  # under the limit: exact
        assert r["embedding_bags.big.weight"] > 0.1, (rank, r)  # over it: not the unsharded values
        assert r["per shard"] == 0.0, (rank, r)


# -- refused fields --------------------------------------------------------------------------------

# A value each refused field is set to (its default is tested by every other test).
SET = {
    "num_embeddings_post_pruning": 3,
    "need_pos": True,
    "input_dim": 5,
    "total_num_buckets": 4,
    "use_virtual_table": True,
    "enable_embedding_update": True,
    "stash_weights": True,
}


def _eviction_policy():
    from torchrec.modules.embedding_configs import NoEvictionPolicy

    return NoEvictionPolicy()


def _refusals(only_rank: int | None) -> dict[str, str]:
    """Shards, for each refused field and each kind, a meta collection whose table 'r' sets it
    (on every rank, or on `only_rank` alone); the message each raised, or 'built'."""
    values = {**SET, "virtual_table_eviction_policy": _eviction_policy()}
    out = {}
    for field in REFUSED_FIELDS:
        for cls, kind in ((EmbeddingBagConfig, EmbeddingBagCollection), (EmbeddingConfig, EmbeddingCollection)):
            cfg = cls(name="r", num_embeddings=8, embedding_dim=4, feature_names=["f"])
            if only_rank in (None, dist.get_rank()):
                setattr(cfg, field, values[field])
            module = kind(tables=[cfg], device=torch.device("meta"))
            plan = ShardingPlan(world_size=WORLD, modules={"m": {"r": TablePlacement(ShardingType.ROW_WISE)}})
            model = torch.nn.Module()
            model.m = module
            try:
                modular.shard(model, plan)
                out[f"{field}/{kind.__name__}"] = "built"
            except modular.ShardingError as e:
                out[f"{field}/{kind.__name__}"] = str(e)
            if type(model.m) is not kind:
                raise AssertionError(f"{field}: the model was changed by a refused shard")
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("only_rank", [None, 1])
def test_each_refused_field_raises_on_every_rank_naming_the_table_and_field(only_rank) -> None:
    results = run_on_ranks(WORLD, _refusals, only_rank, timeout=TIMEOUT_S)
    for rank, messages in enumerate(results):
        assert len(messages) == 2 * len(REFUSED_FIELDS)
        for key, message in messages.items():
            field = key.split("/")[0]
            default = REFUSED_FIELDS[field].default
            assert f"table 'r' of module 'm' sets {field}=" in message, (rank, key, message)
            assert f"Leave {field} at {default!r}" in message, (rank, key, message)
            if only_rank is not None and rank != only_rank:
                assert message.startswith(f"rank {only_rank} rejected the plan"), (rank, key, message)
