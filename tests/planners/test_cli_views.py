"""The CLI as a placement engineer uses it: which table went where, and why (issue 30).

Pure and single-process: `planners.__main__.main` in this process, files under tmp_path.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re

import pytest

import planners
from planners import (
    NoPlanError, Optimizer, ShardingPlan, ShardingType, Table, TablePlacement, Topology,
)  # fmt: skip
from planners.__main__ import main

T = ShardingType
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRITEO = os.path.join(ROOT, "examples", "tables_criteo_1tb.yaml")
SIXTEEN = ["--world-size", "16", "--ranks-per-host", "8", "--device-memory", "80GiB",
           "--batch-size", "512"]  # fmt: skip
EIGHT = ["--world-size", "8", "--device-memory", "80GiB", "--batch-size", "512"]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def without_progress(out: str) -> str:
    return "".join(line for line in out.splitlines(keepends=True)
                   if not line.startswith(("planned in", "wrote")))  # fmt: skip


@pytest.fixture(scope="module")
def criteo16(tmp_path_factory):
    """The Criteo tables planned on 16 ranks: (plan path, plan stdout, PlanStats)."""
    path = str(tmp_path_factory.mktemp("plans") / "p16.json")
    out = io.StringIO()
    import contextlib

    with contextlib.redirect_stdout(out):
        assert main(["plan", CRITEO, *SIXTEEN, "-o", path]) == 0
    tables = planners.files.load_tables(CRITEO)
    plan, _ = planners.files.load_plan(path)
    stats = planners.plan_stats(plan, tables, Topology(16, ranks_per_host=8), batch_size=512)
    return path, out.getvalue(), stats


# -- the per-table view -------------------------------------------------------------------------


def test_plan_prints_every_table_with_its_type_ranks_and_shard_sizes(criteo16):
    _, out, stats = criteo16
    view = out.split("\n\n")[1]
    lines = view.splitlines()
    assert lines[0].split() == ["table", "type", "ranks", "shard", "sizes", "mem/shard",
                                "us/shard", "us", "total"]  # fmt: skip
    assert len(lines) == 1 + 26
    for t in stats.tables:
        (line,) = [x for x in lines if x.split()[0] == t.name]
        assert line.split()[1] == t.sharding_type.value
        if t.sharding_type is T.COLUMN_WISE:  # the widths of the pieces, in columns
            sizes = re.search(r" ((?:\d+x)?\d+(?:\+(?:\d+x)?\d+)*) cols", line).group(1)
            widths = sum(int(a) * int(b) if "x" in p else int(p)
                         for p in sizes.split("+") for a, _, b in [p.partition("x")])  # fmt: skip
            assert widths == t.embedding_dim
        if t.sharding_type is T.TABLE_WISE:
            assert line.split()[2] == str(t.ranks[0]) and "whole" in line
    assert any(t.sharding_type is T.COLUMN_WISE for t in stats.tables)  # the check above ran


def test_table_flag_shows_each_shard_and_sort_orders_by_cost(criteo16, capsys):
    path, _, stats = criteo16
    cut = next(t for t in stats.tables if len(t.shards) > 1 and t.sharding_type is T.COLUMN_WISE)
    code, out, _ = run(capsys, "show", path, "--table", cut.name)
    assert code == 0
    shard_lines = [x for x in out.splitlines() if x.lstrip().startswith("rank ")]
    assert len(shard_lines) == len(cut.shards)
    for s, line in zip(cut.shards, shard_lines):
        assert line.split()[1] == str(s.rank)
        assert f"cols {s.col_offset}..{s.col_offset + s.num_cols}" in line
        assert "cw-stat" in line  # exact row-wise Adagrad: the pieces exchange statistics
    # why: the alternatives of each type, and the one chosen
    assert f"chosen: column_wise over {len(cut.shards)} (" in out
    why = out[out.index("  why: "):out.index("  chosen: ")].splitlines()[1:]
    assert {x.split()[0] for x in why} == {k.value for k in T}
    whole = next(x for x in why if x.split()[0] == "table_wise")
    assert ("(slower than the slowest rank)" in whole) == (
        re.search(r"largest shard (\S+) us", whole) is not None
        and float(re.search(r"largest shard (\S+) us", whole).group(1)) > 1e6 * stats.max_cost)
    code, out, _ = run(capsys, "show", path, "--sort", "cost", "--top", "5")
    names = [x.split()[0] for x in out.split("\n\n")[1].splitlines()[1:6]]
    expected = sorted(stats.tables, key=lambda t: (-t.max_cost, t.name))[:5]
    assert names == [t.name for t in expected]
    assert "... 21 more tables (--top)" in out


def test_table_flag_suggests_the_closest_name(criteo16, capsys):
    code, out, err = run(capsys, "show", criteo16[0], "--table", "t_cat_2O")
    assert code == 2 and out == ""
    assert "--table 't_cat_2O': no such table in the plan; did you mean 't_cat_20'?" in err


def test_json_and_csv_formats_carry_every_shard(criteo16, capsys):
    path, _, stats = criteo16
    code, out, _ = run(capsys, "show", path, "--format", "json")
    assert code == 0
    data = json.loads(out)
    assert data["stats"]["bound_ratio"] == pytest.approx(stats.bound_ratio)
    assert [t["table"] for t in data["stats"]["tables"]] == [t.name for t in stats.tables]
    assert data["settings"]["world_size"] == 16 and data["overrides"] == []
    code, out, err = run(capsys, "show", path, "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    for t in stats.tables:
        mine = [r for r in rows if r["table"] == t.name]
        assert [int(r["rank"]) for r in mine] == list(t.ranks)
        if t.sharding_type is T.COLUMN_WISE:
            assert sum(int(r["num_cols"]) for r in mine) == t.embedding_dim
        if t.sharding_type in (T.ROW_WISE, T.TABLE_ROW_WISE):
            assert sum(int(r["num_rows"]) for r in mine) == t.num_embeddings
        assert sum(float(r["cost_s"]) for r in mine) == pytest.approx(t.total_cost)


# -- the plan file records what it was planned from ---------------------------------------------


def test_show_and_compare_report_what_plan_reported_with_constraints(tmp_path, capsys):
    cons = write(tmp_path, "cons.yaml", "t_cat_0: {sharding_types: [row_wise]}\n"
                 "t_cat_22: {ranks: [3]}\n")  # fmt: skip
    plan_path, free_path = str(tmp_path / "p.json"), str(tmp_path / "free.json")
    code, planned, _ = run(capsys, "plan", CRITEO, *SIXTEEN, "--constraints", cons, "-o", plan_path)
    assert code == 0
    code, free, _ = run(capsys, "plan", CRITEO, *SIXTEEN, "-o", free_path)
    bound = re.search(r"lower bound (\S+ \S+); slowest rank / bound = (\S+)", planned).groups()
    assert bound != re.search(r"lower bound (\S+ \S+); slowest rank / bound = (\S+)", free).groups()
    # no --tables, no --constraints: the plan file has them
    code, shown, _ = run(capsys, "show", plan_path)
    assert code == 0 and shown == without_progress(planned)
    code, out, _ = run(capsys, "compare", plan_path, plan_path)
    assert code == 0
    row = next(x for x in out.splitlines() if x.startswith("slowest / bound"))
    assert row.split()[-2:] == [bound[1], bound[1]]
    # a flag given again overrides the record, and the output says so
    code, out, _ = run(capsys, "show", plan_path, "--batch-size", "256")
    assert out.startswith("override: batch_size 256 (the plan records 512)\n")
    code, out, _ = run(capsys, "show", plan_path, "--constraints", write(tmp_path, "none.yaml", "{}\n"))
    assert out.startswith("override: constraints ")
    assert re.search(r"slowest rank / bound = (\S+)", out).group(1) != bound[1]


def test_a_plan_file_without_its_tables_asks_for_them(tmp_path, capsys, criteo16):
    with open(criteo16[0]) as f:
        data = json.load(f)
    del data["planner"]["tables"]
    old = write(tmp_path, "old.json", json.dumps(data))
    code, _, err = run(capsys, "show", old)
    assert code == 2 and "does not record the tables it was planned from" in err
    assert "pass --tables FILE" in err
    assert run(capsys, "show", old, "--tables", CRITEO)[0] == 0


# -- compare --------------------------------------------------------------------------------------


def test_compare_names_moved_tables_and_mismatched_settings(tmp_path, capsys, criteo16):
    small = str(tmp_path / "p8.json")
    assert run(capsys, "plan", CRITEO, *EIGHT, "-o", small)[0] == 0
    code, out, _ = run(capsys, "compare", criteo16[0], small)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "DIFFERENT world size: 16 vs 8"
    assert "the global batches differ (8_192 vs 4_096 samples per step)" in out
    a, b = (ShardingPlan.from_dict(json.load(open(p))) for p in (criteo16[0], small))
    moved = {n for n, p in a.modules[""].items()
             if not (p.sharding_type is b.modules[""][n].sharding_type is T.DATA_PARALLEL)
             and p != b.modules[""][n]}  # fmt: skip
    assert f"tables placed differently: {len(moved)} of 26" in out
    named = {x.split()[0] for x in lines if x.startswith("  ") and "->" in x}
    assert named == moved and moved
    line = next(x for x in lines if x.startswith("  ") and "->" in x)
    name = line.split()[0]
    pa, pb = a.modules[""][name], b.modules[""][name]
    assert f"{pa.sharding_type.value} on" in line.split("->")[0]
    assert f"{pb.sharding_type.value} on" in line.split("->")[1]
    assert lines[-1].startswith("slowest rank of ")
    code, out, _ = run(capsys, "compare", criteo16[0], small, "--format", "json")
    data = json.loads(out)
    assert {m["table"] for m in data["moved"]} == moved
    assert data["differences"][0] == "DIFFERENT world size: 16 vs 8"
    assert [s["world_size"] for s in data["stats"]] == [16, 8]


# -- bad input: units, file:line, did you mean, no-fit advice -----------------------------------


def test_a_memory_size_needs_a_unit(capsys):
    with pytest.raises(SystemExit) as done:
        main(["plan", CRITEO, "--world-size", "2", "--batch-size", "8", "--device-memory", "80"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert "memory size needs a unit: '80' would be 80 bytes; write e.g. '80GiB'" in err


@pytest.mark.parametrize("text,expected", [
    ("- {name: a, num_embeddings: 10, embedding_dim: 8}\n"
     "- {name: b, num_embeddings: 10, embedding_dim: 8}\n"
     "- {name: a, num_embeddings: 20, embedding_dim: 8}\n",
     r"t\.yaml:3: table record 3: a second table named 'a'; the first is at .*t\.yaml:1"),
    ("- {name: a, num_embeddings: 10, embedding_dim: 8, features: [f]}\n"
     "- {name: b, num_embeddings: 10, embedding_dim: 8, features: [g, f]}\n",
     r"t\.yaml:2: table record 2: feature 'f' of table 'b' is also looked up in table 'a' \(line 1\)"),
    ("- name: a\n  num_embeddings: 10\n  embeding_dim: 8\n",
     r"t\.yaml:3: table record 1: unknown field 'embeding_dim'; did you mean 'embedding_dim'\?"),
])  # fmt: skip
def test_record_level_errors_give_file_line_and_suggestions(tmp_path, capsys, text, expected):
    path = write(tmp_path, "t.yaml", text)
    code, _, err = run(capsys, "plan", path, "--world-size", "2", "--batch-size", "8")
    assert code == 2 and err.count("\n") == 1
    assert re.search(expected, err), err


def test_csv_duplicate_table_names_give_the_line(tmp_path, capsys):
    path = write(tmp_path, "t.csv", "name,num_embeddings,embedding_dim\na,10,8\nb,10,8\na,5,8\n")
    code, _, err = run(capsys, "plan", path, "--world-size", "2", "--batch-size", "8")
    assert code == 2 and re.search(r"t\.csv:4: table 'a': a second table named 'a'; the first "
                                   r"is at .*t\.csv:2", err), err  # fmt: skip


def test_constraints_for_an_unknown_table_or_field_suggest_the_closest(tmp_path, capsys):
    cons = write(tmp_path, "c.yaml", "t_cat_1: {ranks: [0]}\nt_cat_O: {ranks: [1]}\n")
    code, _, err = run(capsys, "plan", CRITEO, *SIXTEEN, "--constraints", cons)
    assert code == 2
    assert re.search(r"c\.yaml:2: constraint for 't_cat_O', which is not a table of the table "
                     r"file; did you mean 't_cat_0'\?", err), err  # fmt: skip
    cons = write(tmp_path, "d.yaml", "t_cat_1:\n  ranks: [0]\n  max_shard: 2\n")
    code, _, err = run(capsys, "plan", CRITEO, *SIXTEEN, "--constraints", cons)
    assert code == 2
    assert "d.yaml:3: constraint for 't_cat_1': unknown field 'max_shard'; did you mean " \
           "'max_shards'?" in err, err
    cons = write(tmp_path, "e.yaml", "t_cat_1:\n  sharding_types: [row_wise]\n  ranks: [0, 16]\n")
    code, _, err = run(capsys, "plan", CRITEO, *SIXTEEN, "--constraints", cons)
    assert code == 2
    assert "e.yaml:3: constraint for 't_cat_1': field 'ranks' pins the table to rank 16 but the " \
           "world size is 16" in err, err


def test_batch_advice_is_a_batch_that_fits_at_every_batch_size():
    tables = [Table(f"t{i}", 1000, 256, pooling_factor=500.0) for i in range(50)]
    topo = Topology(2, device_memory="4GiB")
    for batch in (200_000, 20_000):
        with pytest.raises(NoPlanError) as e:
            planners.plan(tables, topo, batch_size=batch, auto_tier=False)
        most = int(re.search(r"use a batch size of at most (\d+)", str(e.value)).group(1))
        assert 1 <= most < batch
        model = planners.CostModel(topo, most)
        arrays = planners.cost.TableArrays.of(tables)
        assert model.batch_buffer_bytes(arrays) < topo.capacity  # the advice fits...
        assert planners.CostModel(topo, most + 1).batch_buffer_bytes(arrays) >= topo.capacity
    # ...and where even one sample does not fit, no batch size is suggested
    wide = [Table(f"t{i}", 10, 4096, features=tuple(f"f{i}_{j}" for j in range(200)))
            for i in range(200)]  # fmt: skip
    with pytest.raises(NoPlanError) as e:
        planners.plan(wide, Topology(1, device_memory="512MiB"), batch_size=1, auto_tier=False)
    assert "no batch size helps" in str(e.value) and "at most" not in str(e.value)


# -- one optimizer vocabulary -----------------------------------------------------------------------


def test_the_planner_takes_modular_optimizer_names(capsys, tmp_path):
    tables = [Table("a", 100_000, 64, pooling_factor=4.0), Table("b", 1000, 32)]
    topo = Topology(4)
    for ours, fused in (("sgd", "exact_sgd"), ("adagrad", "exact_adagrad"),
                        ("rowwise_adagrad", "exact_rowwise_adagrad")):  # fmt: skip
        assert Optimizer.parse(fused) is Optimizer.parse(ours)
        assert Optimizer.parse(ours).fused_name == fused
        assert planners.plan(tables, topo, batch_size=64, optimizer=fused) == planners.plan(
            tables, topo, batch_size=64, optimizer=ours)
    for name in ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb"):  # one name each
        assert Optimizer.parse(name).fused_name == name
    with pytest.raises(planners.PlanError, match=r"unknown optimizer 'exact_adam'.*adagrad \(exact_adagrad\), adam, "):
        Optimizer.parse("exact_adam")
    path = write(tmp_path, "t.yaml", "- {name: a, num_embeddings: 1000, embedding_dim: 16}\n")
    code, out, _ = run(capsys, "plan", path, "--world-size", "2", "--batch-size", "8",
                       "--optimizer", "exact_rowwise_adagrad")  # fmt: skip
    assert code == 0 and "optimizer rowwise_adagrad" in out and "note:" not in out
    for name in ("adam", "lamb"):  # fused now: no report calls them unfused
        code, out, _ = run(capsys, "plan", path, "--world-size", "2", "--batch-size", "8",
                           "--optimizer", name)  # fmt: skip
        assert code == 0 and f"optimizer {name}" in out and "note:" not in out, out


def test_state_bytes_of_the_adam_family_per_row():
    # adam and lamb: two fp32 moments per element; partial_rowwise: one per element and a
    # second moment per row.
    assert [Optimizer.parse(n).state_bytes_per_row(16) for n in
            ("adam", "lamb", "partial_rowwise_adam", "partial_rowwise_lamb", "rowwise_adagrad")] == [
        128, 128, 68, 68, 4]  # fmt: skip
    tables = [Table("a", 1000, 16)]
    plans = {n: planners.plan_with_stats(tables, Topology(1), batch_size=8, optimizer=n).stats
             for n in ("adam", "partial_rowwise_adam")}  # fmt: skip
    assert plans["adam"].ranks[0].memory - plans["partial_rowwise_adam"].ranks[0].memory == 1000 * (128 - 68)


# -- names of the cost components ----------------------------------------------------------------


def test_column_piece_statistics_are_not_data_parallel_sync():
    tables = [Table("wide", 10_000, 128, pooling_factor=5.0)]
    plan = ShardingPlan(4, {"": {"wide": TablePlacement(T.COLUMN_WISE, (0, 1))}})
    stats = planners.plan_stats(plan, tables, Topology(4), batch_size=128)
    assert all(r.grad_sync == 0 for r in stats.ranks)
    assert stats.ranks[0].stat_exchange > 0 and stats.ranks[2].stat_exchange == 0
    head = stats.format_ranks().splitlines()[0].split()
    assert "cw-stat" in head and "dp-grad" not in head  # no data-parallel table, no column
    assert "  cw-stat: column-piece row-statistic exchange" in stats.format_ranks()
    dp = ShardingPlan(4, {"": {"wide": TablePlacement(T.DATA_PARALLEL)}})
    stats = planners.plan_stats(dp, tables, Topology(4), batch_size=128)
    assert all(r.grad_sync > 0 and r.stat_exchange == 0 for r in stats.ranks)
    assert "dp-grad" in stats.format_ranks().splitlines()[0].split()


# -- repr, str, plurals, units of time, defaults ---------------------------------------------------


def test_plans_and_stats_read_well():
    tables = [Table("only", 1000, 16)]
    result = planners.plan_with_stats(tables, Topology(2), batch_size=8)
    assert repr(result.plan) == ("ShardingPlan(world_size=2, ranks_per_host=2, 1 table in 1 "
                                 "module: " + result.plan.modules[""]["only"].sharding_type.value
                                 + " 1)")  # fmt: skip
    assert "mappingproxy" not in str(result.plan)
    lines = str(result.plan).splitlines()
    assert lines[1] == "  priced for batch 8 per rank, rowwise_adagrad (exact column statistic), fp32 comms, 1D"
    assert lines[3].split()[0] == "only"
    text = result.stats.format()
    assert text.startswith(" rank ") and "cost ns" in text  # a small plan reads in ns...
    assert "0.000 ms" not in text and " 0.000 " not in text.splitlines()[1]  # ...not 0.000 ms
    assert "1 table on 2 ranks" in text and "1 tables" not in text
    assert repr(result.stats).startswith("PlanStats(1 table on 2 ranks, slowest rank")
    assert "H100 defaults in effect" in text and "device memory 80 GiB" in text
    mine = Topology(2, device_memory="16GiB", device_memory_bandwidth=1e11,
                    intra_host_bandwidth=1e10, cross_host_bandwidth=1e9)  # fmt: skip
    assert "defaults" not in planners.plan_with_stats(tables, mine, batch_size=8).stats.format()


# -- the plot ---------------------------------------------------------------------------------------


def _inside(inner, outer, slack: float = 1.0) -> bool:
    return (inner.x0 >= outer.x0 - slack and inner.y0 >= outer.y0 - slack
            and inner.x1 <= outer.x1 + slack and inner.y1 <= outer.y1 + slack)  # fmt: skip


def test_the_plot_names_tables_labels_hosts_and_keeps_legends_inside(criteo16):
    from planners.plot import compare_figure, stats_figure

    stats = criteo16[2]
    fig = stats_figure(stats)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = fig.bbox
    ax_cost, ax_tab, ax_mem = fig.axes[:3]
    assert ax_cost.get_ylabel() == "cost per step (us)" and ax_mem.get_xlabel() == "rank"
    legends = [ax.get_legend() for ax in (ax_cost, ax_tab, ax_mem)]
    assert all(leg is not None for leg in legends)
    for leg in legends:
        box = leg.get_window_extent(renderer)
        assert _inside(box, frame), (box, frame)
    labels = {t.get_text() for t in legends[0].get_texts()}
    assert {"lookup", "input dist", "output dist", "data-parallel\ngradient sync",
            "column-piece\nstatistic exchange"} <= labels  # fmt: skip
    assert {t.get_text() for t in legends[1].get_texts()} == {
        t.sharding_type.value for t in stats.tables}
    # the tables: a block per shard, the large ones named inside their rank's bar
    named = [t for t in ax_tab.texts if t.get_gid() == "table-label"]
    assert named and {t.get_text() for t in named} <= {t.name for t in stats.tables}
    for text in named:
        name, rank = text.get_text(), round(text.get_position()[0])
        assert rank in stats.table(name).ranks
        assert _inside(text.get_window_extent(renderer), ax_tab.get_window_extent(renderer))
    assert len(ax_tab.patches) == sum(len(t.shards) for t in stats.tables)
    hosts = [t.get_text() for ax in ax_cost.child_axes for t in ax.get_xticklabels()]
    assert hosts == ["host 0", "host 1"]
    fig.clf()

    fig = compare_figure([stats, stats], ["a.json", "b.json"])
    fig.canvas.draw()
    assert len([ax for ax in fig.axes if ax.get_ylabel()]) == 6
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles[0].startswith("a.json: 26 tables") and titles[1].startswith("b.json: 26 tables")
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is not None:
            assert _inside(leg.get_window_extent(fig.canvas.get_renderer()), fig.bbox)


def test_plot_flags_on_plan_show_and_compare_write_pngs(tmp_path, capsys, criteo16):
    tables = write(tmp_path, "t.yaml", "- {name: a, num_embeddings: 1000, embedding_dim: 16}\n"
                   "- {name: b, num_embeddings: 50000, embedding_dim: 64, pooling_factor: 8}\n")  # fmt: skip
    plan_path, png = str(tmp_path / "p.json"), str(tmp_path / "p.png")
    code, out, _ = run(capsys, "plan", tables, "--world-size", "4", "--batch-size", "64",
                       "-o", plan_path, "--plot", png, "--plot-by", "table")  # fmt: skip
    assert code == 0 and f"wrote {png}" in out
    both = str(tmp_path / "both.png")
    code, out, _ = run(capsys, "compare", plan_path, plan_path, "--plot", both)
    assert code == 0 and f"wrote {both}" in out
    for path in (png, both):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    assert Image.open(both).size[0] > Image.open(png).size[0]  # side by side
    assert math.isfinite(os.path.getsize(both))
