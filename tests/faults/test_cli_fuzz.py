"""Fuzzing the planner CLI's file parsing: malformed input exits 2 with one line, never a traceback.

Hypothesis writes table files (YAML, JSON, CSV), constraints files and plan files that are
arbitrary text, arbitrary JSON/YAML values, or valid files with one value replaced by junk, and
runs `planners.__main__.main` in this process on `plan`, `show` and `compare`. A file that happens
to be valid may plan (exit 0) or not fit (exit 1); anything else must exit 2 with exactly one line
on stderr. tests/planners/test_cli.py has the hand-written bad files; a few subprocess runs here
check the same through `python -m planners`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planners.__main__ import main

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: the profile's (100)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER = ["--world-size", "2", "--batch-size", "8", "--device-memory", "1GiB"]
GOOD_TABLES = [
    {"name": "t_a", "num_embeddings": 1000, "embedding_dim": 16, "features": ["a", "b"], "pooling_factor": [1, 4]},
    {"name": "t_b", "num_embeddings": 50, "embedding_dim": 8, "dtype": "fp16", "weighted": True},
]
GOOD_CONSTRAINTS = {"t_a": {"sharding_types": ["row_wise", "table_wise"], "min_shards": 1}, "t_b": {"ranks": [0, 1]}}

_DIR = tempfile.mkdtemp(prefix="cli-fuzz-")


def _write(name: str, content: str | bytes) -> str:
    path = os.path.join(_DIR, name)
    with open(path, "wb") as f:
        f.write(content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content)
    return path


def _run(*argv: str) -> tuple[int, str]:
    """Exit code and stderr of the CLI; any exception escaping `main` fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, err.getvalue()


def _check(code: int, err: str, *, malformed: bool) -> None:
    assert code in ((2,) if malformed else (0, 1, 2)), (code, err)
    assert "Traceback" not in err, err
    if code == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), err


def _tables_file() -> str:
    return _write("good.yaml", yaml.safe_dump(GOOD_TABLES))


_PLAN_TEXT: dict[str, str] = {}


def _good_plan() -> dict[str, Any]:
    """A plan file of GOOD_TABLES written by the CLI itself (computed once)."""
    if not _PLAN_TEXT:
        path = os.path.join(_DIR, "good_plan.json")
        code, err = _run("plan", _tables_file(), *CLUSTER, "-o", path)
        assert code == 0, err
        with open(path) as f:
            _PLAN_TEXT["plan"] = f.read()
    return json.loads(_PLAN_TEXT["plan"])


# -- strategies ------------------------------------------------------------------------------------

SCALARS = (
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12) | st.sampled_from(["", "row_wise", "fp16", "1e3", "-1", "nan", "1_000", "yes", "a;b"])
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


def _dump(value: Any, kind: str) -> str:
    if kind == "json":
        return json.dumps(value)
    return yaml.safe_dump(value)


@st.composite
def mutated(draw, good: Any) -> Any:
    """`good` with one value somewhere in it replaced by junk, or one key dropped or added."""
    good = json.loads(json.dumps(good))
    node, path = good, []
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append((node, key))
        node = node[key]
    if not path:
        return draw(VALUES)
    parent, key = path[-1]
    action = draw(st.sampled_from(["replace", "drop", "add"]))
    if action == "drop":
        del parent[key]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8))] = draw(VALUES)
    else:
        parent[key] = draw(VALUES)
    return good


def _csv_cell() -> st.SearchStrategy[str]:
    return st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r"), max_size=10) | st.sampled_from(["", "1000", "16", "a;b", "-3", "1.5", "true", '"'])


# -- tables ----------------------------------------------------------------------------------------


@FUZZ
@given(st.text(max_size=200), st.sampled_from(["yaml", "json", "csv"]))
def test_any_text_as_a_table_file(text: str, kind: str) -> None:
    _check(*_run("plan", _write(f"t.{kind}", text), *CLUSTER), malformed=False)


@FUZZ
@given(st.binary(max_size=64), st.sampled_from(["yaml", "json", "csv"]))
def test_any_bytes_as_a_table_file(data: bytes, kind: str) -> None:
    _check(*_run("plan", _write(f"t.{kind}", data), *CLUSTER), malformed=False)


@FUZZ
@given(mutated(GOOD_TABLES), st.sampled_from(["yaml", "json"]))
def test_table_records_with_junk(tables: Any, kind: str) -> None:
    _check(*_run("plan", _write(f"t.{kind}", _dump(tables, kind)), *CLUSTER), malformed=False)


@FUZZ
@given(st.sampled_from(["yaml", "json"]), st.integers(1, 80))
def test_truncated_table_files(kind: str, cut: int) -> None:
    text = json.dumps(GOOD_TABLES) if kind == "json" else "- {name: t_a, num_embeddings: 1000, embedding_dim: 16}\n"
    text = text[: min(cut, len(text.rstrip()) - 1)]  # the closing bracket is always gone
    code, err = _run("plan", _write(f"t.{kind}", text), *CLUSTER)
    _check(code, err, malformed=True)


@FUZZ
@given(st.lists(st.sampled_from(["name", "num_embeddings", "embedding_dim", "features", "pooling_factor", "dtype", "weighted", "bogus", ""]), min_size=1, max_size=5),
       st.lists(st.lists(_csv_cell(), max_size=6), max_size=4))  # fmt: skip
def test_csv_tables_with_junk(header: list[str], rows: list[list[str]]) -> None:
    text = "\n".join([",".join(header)] + [",".join(r) for r in rows]) + "\n"
    _check(*_run("plan", _write("t.csv", text), *CLUSTER), malformed=False)


# -- constraints -----------------------------------------------------------------------------------


@FUZZ
@given(mutated(GOOD_CONSTRAINTS) | VALUES, st.sampled_from(["yaml", "json"]))
def test_constraints_with_junk(constraints: Any, kind: str) -> None:
    path = _write(f"c.{kind}", _dump(constraints, kind))
    _check(*_run("plan", _tables_file(), *CLUSTER, "--constraints", path), malformed=False)


# -- plans -----------------------------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_plan_files_with_junk_in_show_and_compare(data) -> None:
    plan = data.draw(mutated(_good_plan()) | VALUES | st.text(max_size=100).map(lambda t: {"__text__": t}))
    text = plan["__text__"] if isinstance(plan, dict) and "__text__" in plan else json.dumps(plan)
    path = _write("p.json", text)
    good = _write("good_plan.json", _PLAN_TEXT["plan"])
    _check(*_run("show", path, "--tables", _tables_file()), malformed=False)
    _check(*_run("compare", good, path, "--tables", _tables_file()), malformed=False)


SETTINGS = ["batch_size", "optimizer", "column_wise_statistic", "module", "device_memory",
            "reserved_fraction", "device_memory_bandwidth", "intra_host_bandwidth",
            "cross_host_bandwidth"]  # fmt: skip


@FUZZ
@given(st.sampled_from(SETTINGS + ["world_size", "ranks_per_host"]), VALUES | st.integers(2**20, 2**90))
def test_junk_in_a_plan_files_settings_or_sizes(field: str, junk: Any) -> None:
    # Found by the fuzzer: `device_memory: []` in the settings raised TypeError from parse_bytes,
    # and `world_size: 2**80` a numpy ValueError from the per-rank arrays.
    plan = _good_plan()
    (plan if field in ("world_size", "ranks_per_host") else plan["planner"])[field] = junk
    _check(*_run("show", _write("p.json", json.dumps(plan)), "--tables", _tables_file()), malformed=False)


# -- through `python -m planners` ------------------------------------------------------------------


def test_malformed_files_exit_2_with_one_line_in_a_subprocess(tmp_path) -> None:
    bad = {
        "t.yaml": "- {name: t_a, num_embeddings: [1, 2], embedding_dim: 16}\n",
        "t.json": '[{"name": "t_a", "num_embeddings": 1000, "embedding_dim": 16',
        "t.csv": "name,num_embeddings,embedding_dim\nt_a,many,16\n",
    }
    for name, text in bad.items():
        path = tmp_path / name
        path.write_text(text)
        done = subprocess.run([sys.executable, "-m", "planners", "plan", str(path), *CLUSTER],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 2, (name, done.stderr)
        assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, (name, done.stderr)
        assert str(path) in done.stderr, done.stderr
