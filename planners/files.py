"""Reading tables, constraints and plans from files, with one-line errors that say where.

Tables: a YAML or JSON list of records (or {"tables": [...]}) with the fields of `Table`, or a
CSV file with those fields as columns (lists such as features are ';'-separated in CSV; a
`managed_collision` cell is the zch_size):

    - {name: t_user, num_embeddings: 10000000, embedding_dim: 128, features: [user_id]}
    - {name: t_geo, num_embeddings: 50000, embedding_dim: 64, batch_fraction: 0.125}
    - {name: t_raw, num_embeddings: 100000, embedding_dim: 64, managed_collision: {zch_size: 100000}}

    name,num_embeddings,embedding_dim,features,pooling_factor,dtype,weighted
    t_user,10000000,128,user_id,1.0,fp32,false

Constraints: a YAML or JSON mapping of table name to the fields of `TableConstraint`:

    t_user: {sharding_types: [row_wise, column_wise], min_shards: 2}
    t_item: {ranks: [0, 1, 2, 3]}

Every error is a `FileFormatError` whose message starts with "path:line:" where the line is
known, names the field, and fits on one line.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
from typing import Any, Mapping

import yaml

from planners.inputs import DataType, ManagedCollision, Table, TableConstraint
from planners.suggest import did_you_mean
from planners.tier_cost import DEFAULT_ZIPF_ALPHA
from planners.types import PlanError, ShardingPlan

__all__ = [
    "FileFormatError", "constraint_record", "load_constraints", "load_plan", "load_tables",
    "recorded_constraints", "recorded_tables", "save_plan", "tables_digest",
]  # fmt: skip

_TABLE_FIELDS = ("name", "num_embeddings", "embedding_dim", "features", "pooling_factor",
                 "dtype", "weighted", "sequence", "batch_fraction", "managed_collision")  # fmt: skip
_CONSTRAINT_FIELDS = (
    "sharding_types", "ranks", "min_shards", "max_shards", "cache_load_factor", "cache_policy",
    "hit_rate", "zipf_alpha", "allow_tier",
)


class FileFormatError(PlanError):
    """A file the planner cannot read; the message is one line: 'path:line: what and the fix'."""


def _where(path: str, line: int | None) -> str:
    return f"{path}:{line}" if line else path


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise FileFormatError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise FileFormatError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _kind(path: str, allowed: tuple[str, ...]) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    ext = {"yml": "yaml"}.get(ext, ext)
    if ext not in allowed:
        raise FileFormatError(
            f"{path}: unknown file type {('.' + ext) if ext else '(no extension)'}; "
            f"use {', '.join('.' + a for a in allowed)}"
        )
    return ext


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    text = did_you_mean(str(word), choices)
    return text + " " if text else ""


def _unknown_field(word: Any, fields: tuple[str, ...], kind: str = "field") -> PlanError:
    return PlanError(f"unknown {kind} {word!r}; {_suggest(str(word), fields)}the {kind}s are "
                     f"{', '.join(fields)}")  # fmt: skip


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _parse_structured(path: str, text: str, kind: str) -> tuple[Any, Any]:
    """The data and, where it can be had, the YAML node tree (for line numbers)."""
    if kind == "json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise FileFormatError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if kind == "yaml":
            data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        if kind == "json":
            return data, None  # valid JSON that PyYAML reads differently: no line numbers
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(e, "problem", None) or str(e)
        raise FileFormatError(f"{_where(path, line)}: invalid YAML: {_one_line(problem)}") from None
    return data, node


def _node_for(node: Any, key: str) -> Any:
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if getattr(k, "value", None) == key:
                return v
    return None


def _line(node: Any) -> int | None:
    return node.start_mark.line + 1 if node is not None else None


def _field_lines(node: Any) -> dict[str, int]:
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {str(k.value): v.start_mark.line + 1 for k, v in node.value}


def _int(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise PlanError(f"field {field!r} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = float("nan")
            if number == number and number.is_integer():
                return int(number)
    raise PlanError(f"field {field!r} must be an integer, got {value!r}")


def _float(value: Any, field: str) -> float:
    if isinstance(value, bool):
        raise PlanError(f"field {field!r} must be a number, got {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        raise PlanError(f"field {field!r} must be a number, got {value!r}") from None


def _bool(value: Any, field: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "1"):
        return True
    if text in ("false", "no", "0", ""):
        return False
    raise PlanError(f"field {field!r} must be true or false, got {value!r}")


def _list(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [v.strip() for v in value.replace(",", ";").split(";") if v.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def table_from_record(record: Mapping[str, Any]) -> Table:
    """A `Table` from one record of a table file (values may be strings, as in CSV)."""
    if not isinstance(record, Mapping):
        raise PlanError(f"a table record must be a mapping of field: value, got {record!r}")
    unknown = sorted(set(record) - set(_TABLE_FIELDS), key=str)
    if unknown:
        raise _unknown_field(unknown[0], _TABLE_FIELDS)
    for required in ("name", "num_embeddings", "embedding_dim"):
        if record.get(required) in (None, ""):
            raise PlanError(f"missing field {required!r}")
    kwargs: dict[str, Any] = {
        "name": str(record["name"]).strip(),
        "num_embeddings": _int(record["num_embeddings"], "num_embeddings"),
        "embedding_dim": _int(record["embedding_dim"], "embedding_dim"),
    }
    if record.get("features") not in (None, ""):
        kwargs["features"] = tuple(str(f) for f in _list(record["features"]))
    if record.get("pooling_factor") not in (None, ""):
        pf = [_float(v, "pooling_factor") for v in _list(record["pooling_factor"])]
        kwargs["pooling_factor"] = pf[0] if len(pf) == 1 else tuple(pf)
    if record.get("dtype") not in (None, ""):
        kwargs["dtype"] = DataType.parse(str(record["dtype"]))
    if record.get("weighted") not in (None, ""):
        kwargs["weighted"] = _bool(record["weighted"], "weighted")
    if record.get("sequence") not in (None, ""):
        kwargs["sequence"] = _bool(record["sequence"], "sequence")
    if record.get("batch_fraction") not in (None, ""):
        bf = [_float(v, "batch_fraction") for v in _list(record["batch_fraction"])]
        kwargs["batch_fraction"] = bf[0] if len(bf) == 1 else tuple(bf)
    mc = record.get("managed_collision")
    if mc not in (None, ""):
        kwargs["managed_collision"] = ManagedCollision.of(
            mc if isinstance(mc, Mapping) else _int(mc, "managed_collision"))
    return Table(**kwargs)


def load_tables(path: str) -> tuple[Table, ...]:
    """The tables of a YAML, JSON or CSV table file (see the module docstring for the format)."""
    kind = _kind(path, ("yaml", "json", "csv"))
    text = _read(path)
    if kind == "csv":
        return _load_csv(path, text)
    data, node = _parse_structured(path, text, kind)
    if isinstance(data, Mapping) and "tables" in data:
        data, node = data["tables"], _node_for(node, "tables")
    if not isinstance(data, list):
        raise FileFormatError(
            f"{_where(path, _line(node))}: expected a list of table records (or a mapping "
            f"with a 'tables' list), got {type(data).__name__}"
        )
    tables, seen = [], _Seen(path)
    items = node.value if isinstance(node, yaml.SequenceNode) else [None] * len(data)
    for i, (record, item) in enumerate(zip(data, items)):
        try:
            table = table_from_record(record)
        except PlanError as e:
            lines = _field_lines(item)
            field = next((f for f in lines if f"{f!r}" in str(e)), None)
            line = lines.get(field) if field else _line(item)
            raise FileFormatError(f"{_where(path, line)}: table record {i + 1}: {_one_line(e)}") from None
        seen.add(table, _line(item), f"table record {i + 1}")
        tables.append(table)
    if not tables:
        raise FileFormatError(f"{path}: no table records")
    return tuple(tables)


class _Seen:
    """Table names and features met so far, with their lines: a second table of one name, or
    a feature looked up in two tables, is an error at the second one's line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.names: dict[str, int | None] = {}
        self.features: dict[str, tuple[str, int | None]] = {}

    def add(self, table: Table, line: int | None, what: str) -> None:
        def at(n: int | None) -> str:
            return f" (line {n})" if n else ""

        if table.name in self.names:
            raise FileFormatError(
                f"{_where(self.path, line)}: {what}: a second table named {table.name!r}; the "
                f"first is at {_where(self.path, self.names[table.name])}; table names must be "
                "unique, rename one"
            )
        self.names[table.name] = line
        for f in table.features:
            if f in self.features:
                other, other_line = self.features[f]
                raise FileFormatError(
                    f"{_where(self.path, line)}: {what}: feature {f!r} of table {table.name!r} is "
                    f"also looked up in table {other!r}{at(other_line)}; a feature belongs to "
                    "one table"
                )
            self.features[f] = (table.name, line)


def _load_csv(path: str, text: str) -> tuple[Table, ...]:
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    if not header:
        raise FileFormatError(f"{path}:1: empty CSV; the first line must name the columns "
                              f"({', '.join(_TABLE_FIELDS)})")  # fmt: skip
    unknown = [h for h in header if h not in _TABLE_FIELDS]
    if unknown:
        raise FileFormatError(f"{path}:1: {_unknown_field(unknown[0], _TABLE_FIELDS, 'column')}")
    reader.fieldnames = header
    tables, seen = [], _Seen(path)
    try:
        for row in reader:
            if None in row:
                raise FileFormatError(f"{path}:{reader.line_num}: more cells than the "
                                      f"{len(header)} columns of the header")  # fmt: skip
            if not any((v or "").strip() for v in row.values()):
                continue
            try:
                table = table_from_record({k: v for k, v in row.items() if v is not None})
            except PlanError as e:
                raise FileFormatError(f"{path}:{reader.line_num}: {_one_line(e)}") from None
            seen.add(table, reader.line_num, f"table {table.name!r}")
            tables.append(table)
    except csv.Error as e:
        raise FileFormatError(f"{path}:{reader.line_num}: invalid CSV: {e}") from None
    if not tables:
        raise FileFormatError(f"{path}: no table rows after the header")
    return tuple(tables)


def load_constraints(
    path: str, tables: tuple[Table, ...] | None = None, world_size: int | None = None
) -> dict[str, TableConstraint]:
    """Per-table constraints from a YAML or JSON mapping (see the module docstring).

    With `tables`, a constraint naming no table is an error at its line, with the closest name;
    with `world_size`, so is a pin to a rank the world does not have."""
    kind = _kind(path, ("yaml", "json"))
    data, node = _parse_structured(path, _read(path), kind)
    return _constraints(data, node, path, tables, world_size)


def _constraints(data: Any, node: Any, path: str, tables: tuple[Table, ...] | None,
                 world_size: int | None = None) -> dict[str, TableConstraint]:  # fmt: skip
    if not isinstance(data, Mapping):
        raise FileFormatError(f"{path}: expected a mapping of table name to constraint, "
                              f"got {type(data).__name__}")  # fmt: skip
    names = [t.name for t in tables] if tables is not None else None
    out = {}
    for name, record in data.items():
        item = _node_for(node, str(name))
        key_line = None
        if isinstance(node, yaml.MappingNode):
            key_line = next((_line(k) for k, _ in node.value if getattr(k, "value", None) == str(name)), None)
        if names is not None and str(name).rsplit(".", 1)[-1] not in names:
            raise FileFormatError(
                f"{_where(path, key_line)}: constraint for {name!r}, which is not a table of the "
                f"table file; {_suggest(str(name), names)}the tables are "
                f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"
            )
        try:
            if not isinstance(record, Mapping):
                raise PlanError(f"expected a mapping with fields {', '.join(_CONSTRAINT_FIELDS)}")
            unknown = sorted(set(record) - set(_CONSTRAINT_FIELDS), key=str)
            if unknown:
                raise _unknown_field(unknown[0], _CONSTRAINT_FIELDS)
            max_shards = record.get("max_shards")
            out[str(name)] = TableConstraint(
                sharding_types=tuple(_list(record.get("sharding_types", []))),
                ranks=tuple(_int(r, "ranks") for r in _list(record.get("ranks", []))),
                min_shards=_int(record.get("min_shards", 1), "min_shards"),
                max_shards=None if max_shards is None else _int(max_shards, "max_shards"),
                cache_load_factor=record.get("cache_load_factor"),
                cache_policy=str(record.get("cache_policy", "lru")),
                hit_rate=record.get("hit_rate"),
                zipf_alpha=record.get("zipf_alpha", DEFAULT_ZIPF_ALPHA),
                allow_tier=record.get("allow_tier", True),
            )
            bad = [r for r in out[str(name)].ranks if world_size is not None and r >= world_size]
            if bad:
                raise PlanError(f"field 'ranks' pins the table to rank {bad[0]} but the world size "
                                f"is {world_size}; pin it to ranks in [0, {world_size - 1}]")  # fmt: skip
        except PlanError as e:
            lines = _field_lines(item)
            field = next((f for f in lines if f"{f!r}" in str(e)), None)
            if field:
                line = lines[field]
            else:
                line = _line(item.value[0][0]) if isinstance(item, yaml.MappingNode) and item.value else _line(item)
            raise FileFormatError(f"{_where(path, line)}: constraint for {name!r}: {_one_line(e)}") from None
    return out


def constraint_record(c: TableConstraint) -> dict[str, Any]:
    """A constraint as a constraints file (and a plan file's record) writes it."""
    out: dict[str, Any] = {}
    if c.sharding_types:
        out["sharding_types"] = [k.value for k in c.sharding_types]
    if c.ranks:
        out["ranks"] = list(c.ranks)
    if c.min_shards != 1:
        out["min_shards"] = c.min_shards
    if c.max_shards is not None:
        out["max_shards"] = c.max_shards
    if c.cache_load_factor is not None:
        out["cache_load_factor"] = c.cache_load_factor
        out["cache_policy"] = c.cache_policy
    if c.hit_rate is not None:
        out["hit_rate"] = c.hit_rate
    if c.zipf_alpha != DEFAULT_ZIPF_ALPHA:
        out["zipf_alpha"] = c.zipf_alpha
    if not c.allow_tier:
        out["allow_tier"] = False
    return out


def tables_digest(tables: tuple[Table, ...]) -> str:
    """A hash of the tables as planned: two plans of the same tables have the same digest."""
    text = json.dumps([t.to_dict() for t in tables], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def recorded_tables(settings: Mapping[str, Any], path: str) -> tuple[Table, ...] | None:
    """The tables a plan file says it was planned from (None: it does not record them)."""
    records = settings.get("tables")
    if records is None:
        return None
    if not isinstance(records, list) or not records:
        raise FileFormatError(f"{path}: the recorded 'tables' must be a non-empty list of table "
                              "records; pass --tables")  # fmt: skip
    tables, seen = [], _Seen(path)
    for i, record in enumerate(records):
        try:
            table = table_from_record(record)
        except PlanError as e:
            raise FileFormatError(f"{path}: recorded table {i + 1}: {_one_line(e)}") from None
        seen.add(table, None, f"recorded table {i + 1}")
        tables.append(table)
    return tuple(tables)


def recorded_constraints(settings: Mapping[str, Any], path: str) -> dict[str, TableConstraint]:
    """The constraints a plan file records ({} when none)."""
    data = settings.get("constraints")
    if data is None:
        return {}
    try:
        return _constraints(data, None, path, None)
    except FileFormatError as e:
        raise FileFormatError(f"{path}: the recorded {str(e)[len(path) + 2:]}") from None


def load_plan(path: str) -> tuple[ShardingPlan, dict[str, Any]]:
    """A plan file written by `save_plan` (or any ShardingPlan JSON), and its 'planner'
    settings block ({} when absent)."""
    _kind(path, ("json",))
    data, _ = _parse_structured(path, _read(path), "json")
    try:
        plan = ShardingPlan.from_dict(data)
    except PlanError as e:
        raise FileFormatError(f"{path}: not a sharding plan: {_one_line(e)}") from None
    settings = data.get("planner", {}) if isinstance(data, Mapping) else {}
    return plan, dict(settings) if isinstance(settings, Mapping) else {}


def save_plan(path: str, plan: ShardingPlan, settings: Mapping[str, Any] | None = None) -> None:
    """Writes the plan JSON; `settings` (topology, batch size...) go under a 'planner' key,
    which ShardingPlan.from_json ignores, so `show` and `compare` can price the plan again."""
    data = plan.to_dict()
    if settings:
        data["planner"] = dict(settings)
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=2) + "\n")
