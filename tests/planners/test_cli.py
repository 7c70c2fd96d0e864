"""The CLI: plan -> show -> compare round trip; bad files give one line and exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from planners import ShardingPlan
from planners.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRITEO = os.path.join(ROOT, "examples", "tables_criteo_1tb.yaml")
CLUSTER = ["--world-size", "16", "--ranks-per-host", "8", "--device-memory", "80GiB",
           "--batch-size", "512"]  # fmt: skip


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_show_compare_round_trip(tmp_path, capsys):
    plan_path = str(tmp_path / "plan.json")
    code, out, _ = run(capsys, "plan", CRITEO, *CLUSTER, "-o", plan_path)
    assert code == 0
    assert "slowest rank" in out and "lower bound" in out and f"wrote {plan_path}" in out
    with open(plan_path) as f:
        data = json.load(f)
    assert data["planner"]["batch_size"] == 512
    plan = ShardingPlan.from_dict(data)
    assert plan.world_size == 16 and len(plan.modules[""]) == 26

    png = str(tmp_path / "ranks.png")
    code, shown, _ = run(capsys, "show", plan_path, "--tables", CRITEO, "--plot", png)
    assert code == 0
    assert shown.split("\n\n")[0] == out.split("\n\n")[0]  # the same per-rank table
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"

    other = str(tmp_path / "other.json")
    code, _, _ = run(capsys, "plan", CRITEO, *CLUSTER, "--constraints",
                     _write(tmp_path, "c.yaml", "t_cat_0: {sharding_types: [row_wise]}\n"), "-o", other)  # fmt: skip
    assert code == 0
    code, out, _ = run(capsys, "compare", plan_path, other, "--tables", CRITEO)
    assert code == 0
    assert "tables placed differently: " in out and "slowest / bound" in out


def test_csv_and_json_tables(tmp_path, capsys):
    csv_path = _write(tmp_path, "t.csv", "name,num_embeddings,embedding_dim,features,pooling_factor\n"
                      "t_a,1000,64,a;b,1;20\nt_b,50000,32,,2.5\n")  # fmt: skip
    json_path = _write(tmp_path, "t.json", json.dumps({"tables": [
        {"name": "t_a", "num_embeddings": 1000, "embedding_dim": 64, "features": ["a", "b"],
         "pooling_factor": [1, 20]},
        {"name": "t_b", "num_embeddings": 50000, "embedding_dim": 32, "pooling_factor": 2.5}]}))  # fmt: skip
    out_csv, out_json = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    assert run(capsys, "plan", csv_path, "--world-size", "2", "--batch-size", "64", "-o", out_csv)[0] == 0
    assert run(capsys, "plan", json_path, "--world-size", "2", "--batch-size", "64", "-o", out_json)[0] == 0
    with open(out_csv) as a, open(out_json) as b:
        assert json.load(a)["modules"] == json.load(b)["modules"]


def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD_FILES = [
    ("bad.yaml", "- {name: t_a, num_embeddings: 10, embedding_dim: 8}\n- {name: t_b, num_embeddings: [\n",
     r"bad\.yaml:3: invalid YAML"),
    ("bad.json", '[\n  {"name": "t_a", "num_embeddings": 10,\n  "embedding_dim": 8,}\n]\n',
     r"bad\.json:3: invalid JSON"),
    ("field.yaml", "- name: t_a\n  num_embeddings: 10\n  embedding_dim: 8\n- name: t_b\n"
     "  num_embeddings: lots\n  embedding_dim: 8\n",
     r"field\.yaml:5: table record 2: field 'num_embeddings' must be an integer, got 'lots'"),
    ("missing.json", '[{"name": "t_a", "num_embeddings": 10, "embedding_dim": 8},\n'
     ' {"name": "t_b", "embedding_dim": 8}]\n', r"missing\.json:2: table record 2: missing field 'num_embeddings'"),
    ("neg.csv", "name,num_embeddings,embedding_dim\nt_a,10,8\nt_b,-5,8\n",
     r"neg\.csv:3: table 't_b': num_embeddings must be a positive integer, got -5"),
    ("cols.csv", "name,rows,embedding_dim\nt_a,10,8\n", r"cols\.csv:1: unknown column 'rows'"),
    ("extra.yaml", "- {name: t_a, num_embeddings: 10, embedding_dim: 8, colour: red}\n",
     r"extra\.yaml:1: table record 1: unknown field 'colour'"),
    ("notalist.yaml", "name: t_a\n", r"notalist\.yaml:1: expected a list of table records"),
    ("tables.txt", "whatever\n", r"tables\.txt: unknown file type \.txt"),
]  # fmt: skip


@pytest.mark.parametrize("name,text,pattern", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_table_files_give_one_line_and_exit_2(tmp_path, capsys, name, text, pattern):
    import re

    path = _write(tmp_path, name, text)
    code, out, err = run(capsys, "plan", path, "--world-size", "2", "--batch-size", "8")
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    assert re.search(pattern, err), err


def test_missing_file_and_bad_constraints(tmp_path, capsys):
    code, _, err = run(capsys, "plan", str(tmp_path / "nope.yaml"), "--world-size", "2", "--batch-size", "8")
    assert code == 2 and "nope.yaml: cannot read" in err and err.count("\n") == 1
    cons = _write(tmp_path, "c.yaml", "t_cat_0:\n  sharding_types: [sideways]\n")
    code, _, err = run(capsys, "plan", CRITEO, *CLUSTER, "--constraints", cons)
    assert code == 2 and "c.yaml:2: constraint for 't_cat_0': unknown sharding type 'sideways'" in err


@pytest.mark.parametrize("flag,value,what", [("--device-memory", "lots", "memory size"),
                                             ("--memory-bandwidth", "-1", "bandwidth")])  # fmt: skip
def test_bad_byte_flags_say_what_a_byte_count_looks_like(capsys, flag, value, what):
    with pytest.raises(SystemExit) as done:
        main(["plan", CRITEO, "--world-size", "2", "--batch-size", "8", flag, value])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert f"argument {flag}: {what} must be a byte count like '80GiB'" in err, err
    assert f"got {value!r}" in err and "invalid" not in err


def test_no_plan_exits_1_with_the_explanation(capsys):
    code, out, err = run(capsys, "plan", CRITEO, "--world-size", "1", "--device-memory", "16GiB",
                         "--batch-size", "512", "--no-auto-tier")  # fmt: skip
    assert code == 1 and out == ""
    assert err.startswith("error: no plan fits: ") and "use at least" in err


def test_show_rejects_a_plan_for_other_tables(tmp_path, capsys):
    plan_path = str(tmp_path / "plan.json")
    assert run(capsys, "plan", CRITEO, *CLUSTER, "-o", plan_path)[0] == 0
    other = _write(tmp_path, "o.yaml", "- {name: t_x, num_embeddings: 10, embedding_dim: 8}\n")
    code, _, err = run(capsys, "show", plan_path, "--tables", other)
    assert code == 2 and "plan.json" in err and err.count("\n") == 1


def test_module_entry_point_and_help():
    done = subprocess.run([sys.executable, "-m", "planners", "plan", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0
    assert "examples:" in done.stdout and "--world-size" in done.stdout
    done = subprocess.run([sys.executable, "-m", "planners", "plan", "missing.yaml",
                           "--world-size", "2", "--batch-size", "8"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr


# Three equal tables on four ranks: kept whole under the exact row statistic, cut into column
# pieces under per_shard (as in test_plan.py).
THREE = "".join(f"- {{name: t{i}, num_embeddings: 100000, embedding_dim: 128, pooling_factor: 5}}\n"
                for i in range(3))  # fmt: skip
FOUR = ["--world-size", "4", "--batch-size", "128"]


def _table_part(out: str) -> str:
    return out.split("\n\n")[0]  # the per-rank table, before the summary


def test_column_wise_statistic_is_recorded_and_priced_back(tmp_path, capsys):
    tables = _write(tmp_path, "three.yaml", THREE)
    exact, per_shard = str(tmp_path / "exact.json"), str(tmp_path / "per_shard.json")
    code, out_exact, _ = run(capsys, "plan", tables, *FOUR, "-o", exact)
    assert code == 0
    code, out_per_shard, _ = run(capsys, "plan", tables, *FOUR, "--column-wise-statistic",
                                 "per_shard", "-o", per_shard)  # fmt: skip
    assert code == 0
    assert "optimizer rowwise_adagrad (column_wise_statistic per_shard)" in out_per_shard
    with open(exact) as f:
        assert json.load(f)["planner"]["column_wise_statistic"] == "exact"
    with open(per_shard) as f:
        data = json.load(f)
    assert data["planner"]["column_wise_statistic"] == "per_shard"
    assert {p["sharding_type"] for p in data["modules"][""].values()} == {"column_wise"}

    # show prices the plan as it was planned; the flag overrides the record, as --optimizer does
    code, shown, _ = run(capsys, "show", per_shard, "--tables", tables)
    planned = "".join(line for line in out_per_shard.splitlines(keepends=True)
                      if not line.startswith(("planned in", "wrote")))  # fmt: skip
    assert code == 0 and shown == planned  # the same numbers, the summary's statistic included
    code, as_exact, _ = run(capsys, "show", per_shard, "--tables", tables,
                            "--column-wise-statistic", "exact")  # fmt: skip
    assert as_exact.startswith("override: column_wise_statistic exact (the plan records per_shard)\n")
    as_exact = as_exact.split("\n", 1)[1]
    assert code == 0 and _table_part(as_exact) != _table_part(shown)
    assert "column_wise_statistic" not in as_exact

    # a plan file from before the setting: priced with the exact statistic
    del data["planner"]["column_wise_statistic"]
    old = _write(tmp_path, "old.json", json.dumps(data))
    code, shown_old, _ = run(capsys, "show", old, "--tables", tables)
    assert code == 0 and shown_old == as_exact

    # compare prices each plan with its own record: per_shard's cut plan is the faster one
    code, out, _ = run(capsys, "compare", exact, per_shard, "--tables", tables)
    assert code == 0
    ratio = float(out.rsplit(": ", 1)[1])
    assert ratio < 0.8, out
    code, out, _ = run(capsys, "compare", exact, per_shard, "--tables", tables,
                       "--column-wise-statistic", "exact")  # fmt: skip
    assert code == 0 and float(out.rsplit(": ", 1)[1]) > 1.0, out


def test_bad_column_wise_statistic_in_a_flag_or_a_plan_file(tmp_path, capsys):
    tables = _write(tmp_path, "three.yaml", THREE)
    with pytest.raises(SystemExit) as done:
        main(["plan", tables, *FOUR, "--column-wise-statistic", "approx"])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert ("argument --column-wise-statistic: invalid choice: 'approx' "
            "(choose from 'exact', 'per_shard')") in err, err  # fmt: skip
    plan_path = str(tmp_path / "plan.json")
    assert run(capsys, "plan", tables, *FOUR, "-o", plan_path)[0] == 0
    with open(plan_path) as f:
        data = json.load(f)
    data["planner"]["column_wise_statistic"] = "approx"
    bad = _write(tmp_path, "bad.json", json.dumps(data))
    code, out, err = run(capsys, "show", bad, "--tables", tables)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert ("bad.json: unknown column_wise_statistic 'approx'; "
            "expected one of: exact, per_shard") in err  # fmt: skip


def test_comm_dtype_is_recorded_and_priced_back(tmp_path, capsys):
    # FP16 comms halve the output dist's bytes and add the low-precision copies to memory
    # (Note [wire copies]); plan records the setting, show prices with it, a flag overrides it.
    import planners
    from planners.files import load_tables

    tables = _write(tmp_path, "three.yaml", THREE)
    low = str(tmp_path / "fp16.json")
    code, out, _ = run(capsys, "plan", tables, *FOUR, "--comm-dtype", "fp16", "-o", low)
    assert code == 0 and "optimizer rowwise_adagrad, comm_dtype fp16" in out
    with open(low) as f:
        data = json.load(f)
    assert data["planner"]["comm_dtype"] == "fp16"
    plan = ShardingPlan.from_dict(data)
    want = planners.plan_stats(plan, load_tables(tables), planners.Topology(4),
                               batch_size=128, comm_dtype="fp16")  # fmt: skip
    code, shown, _ = run(capsys, "show", low, "--format", "json")
    got = json.loads(shown)["stats"]
    assert code == 0 and got["comm_dtype"] == "fp16"
    assert [r["memory"] for r in got["ranks"]] == [r.memory for r in want.ranks]
    assert [r["output_dist"] for r in got["ranks"]] == [r.output_dist for r in want.ranks]

    code, as_fp32, _ = run(capsys, "show", low, "--comm-dtype", "fp32", "--format", "json")
    fp32 = json.loads(as_fp32)
    assert code == 0 and fp32["overrides"] == ["comm_dtype fp32 (the plan records fp16)"]
    for a, b in zip(fp32["stats"]["ranks"], got["ranks"]):
        assert a["output_dist"] == pytest.approx(2 * b["output_dist"])
        assert a["memory"] <= b["memory"]

    # compare names the setting the two plans were priced under
    fp32_plan = str(tmp_path / "fp32.json")
    assert run(capsys, "plan", tables, *FOUR, "-o", fp32_plan)[0] == 0
    code, out, _ = run(capsys, "compare", fp32_plan, low)
    assert code == 0 and "DIFFERENT comm_dtype: fp32 vs fp16" in out

    # a plan file from before the setting: priced with FP32 comms, and the summary says nothing
    del data["planner"]["comm_dtype"]
    old = _write(tmp_path, "old.json", json.dumps(data))
    code, shown_old, _ = run(capsys, "show", old)
    assert code == 0 and "comm_dtype" not in shown_old
    code, as_fp32_table, _ = run(capsys, "show", low, "--comm-dtype", "fp32")
    assert _table_part(shown_old) == _table_part(as_fp32_table.split("\n", 1)[1])

    # a bad value in a flag or a plan file: one line, exit 2
    with pytest.raises(SystemExit) as done:
        main(["plan", tables, *FOUR, "--comm-dtype", "fp8"])
    assert done.value.code == 2 and "invalid choice: 'fp8'" in capsys.readouterr().err
    data["planner"]["comm_dtype"] = "fp8"
    bad = _write(tmp_path, "bad.json", json.dumps(data))
    code, out, err = run(capsys, "show", bad)
    assert code == 2 and out == "" and "bad.json: unknown dtype 'fp8'" in err
