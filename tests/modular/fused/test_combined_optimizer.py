"""`CombinedOptimizer` (pure, one process): its param_groups are its parts' groups, live, so an LR
scheduler still reaches every part after a `load_state_dict` replaced the parts' group dicts."""

from __future__ import annotations

import pytest
import torch

import modular


def _parts() -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)
    return torch.optim.Adam(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.2)


def test_a_scheduler_reaches_every_part_after_a_load() -> None:
    adam, sgd = _parts()
    combined = modular.CombinedOptimizer({"adam": adam, "sgd": sgd})
    combined.load_state_dict(combined.state_dict())  # torch replaces each part's group dicts
    scheduler = torch.optim.lr_scheduler.StepLR(combined, step_size=1, gamma=0.5)
    combined.step()
    scheduler.step()
    assert [g["lr"] for g in combined.param_groups] == [0.05, 0.1]
    assert adam.param_groups[0]["lr"] == 0.05 and sgd.param_groups[0]["lr"] == 0.1


def test_its_groups_are_the_parts_groups() -> None:
    adam, sgd = _parts()
    combined = modular.CombinedOptimizer({"adam": adam, "sgd": sgd})
    assert combined.param_groups[0] is adam.param_groups[0]
    with pytest.raises(AttributeError, match="change those instead"):
        combined.param_groups = [{"params": []}]
