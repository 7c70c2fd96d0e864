"""Managed-collision tables in a checkpoint: read split across ranks, put in last (Note [a
collision table in a checkpoint] in modular/mc/table_state.py)."""

from __future__ import annotations

from typing import Any, Optional

from modular.mc.table_state import collision_of

__all__ = ["collision_entries", "read_collisions"]


def collision_entries(state: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """(module, key) of each entry of `state` that is a split collision table's column."""
    return {k: c for k, v in state.items() if (c := collision_of(v)) is not None}


def read_collisions(
    entries: dict[str, tuple[Any, str]], values: dict[str, Any], *, source: str
) -> tuple[list[tuple[Any, tuple]], Optional[str]]:
    """Takes the collision tables' columns out of `values` (local pieces read by DCP, keyed as
    `entries`) and prepares each module's new shard: (module, prepared) in the same order on
    every rank, or the first problem (the same on every rank). Collective per module."""
    pieces: dict[int, tuple[Any, dict[str, Any]]] = {}
    for fqn, (module, key) in entries.items():  # the state's order: the same on every rank
        pieces.setdefault(id(module), (module, {}))[1][key] = values.pop(fqn)
    out, problem = [], None
    for module, columns in pieces.values():
        prepared, why = module.read_split(columns, where=source)
        if why is not None:
            problem = problem or why
        else:
            out.append((module, prepared))
    return out, problem
