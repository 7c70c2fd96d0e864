"""Bit-for-bit snapshots of a rank's model and optimizer state, to check that a failed call
changed nothing (issue 48: every rank fails together, and fails clean)."""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from torch import nn

from modular.tables.forms import is_sharded, local_pieces


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes (so NaNs and -0.0 compare by their bits)."""
    t = t.detach().cpu().reshape(-1).clone()
    return t.view(torch.uint8) if t.numel() else t


def _flatten(prefix: str, value: Any, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        if is_sharded(value):
            for i, piece in enumerate(local_pieces(value)):
                out[f"{prefix}[{i}]"] = _bits(piece.tensor)
        else:
            out[prefix] = _bits(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(f"{prefix}[{i}]", v, out)
    elif isinstance(value, (int, float, str, bool, type(None))):
        out[prefix] = torch.tensor(list(repr(value).encode()), dtype=torch.uint8)


def snapshot(model: nn.Module, optimizer: Optional[Any] = None) -> dict[str, torch.Tensor]:
    """Every local tensor of the model's state dict and the optimizer's state, as bytes."""
    out: dict[str, torch.Tensor] = {}
    _flatten("model", model.state_dict(), out)
    if optimizer is not None:
        _flatten("optimizer", optimizer.state_dict(), out)
    return out


def assert_unchanged(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], where: str) -> None:
    assert before.keys() == after.keys(), (where, sorted(before.keys() ^ after.keys()))
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"{where}: state changed in {changed}"


def rejected(
    module: nn.Module, optimizer: Optional[Any], batch: Any, where: str
) -> tuple[str, str, float]:
    """(error class, message, seconds) of `module(batch)`, which must raise, leaving the module's
    and the optimizer's state as they were, bit for bit."""
    before = snapshot(module, optimizer)
    start = time.monotonic()
    try:
        module(batch)
    except Exception as e:  # the error under test
        got = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        raise AssertionError(f"{where}: the batch was accepted")
    assert_unchanged(before, snapshot(module, optimizer), where)
    return got
