"""The tier's fields of TableConstraint: checked, and through a constraints file and back."""

from __future__ import annotations

import pytest
import yaml

from planners import TableConstraint
from planners.errors import PlanError
from planners.files import FileFormatError, constraint_record, load_constraints


def test_fields_round_trip(tmp_path):
    c = TableConstraint(cache_load_factor=0.05, cache_policy="lfu")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"t": constraint_record(c)}))
    assert load_constraints(str(path))["t"] == c
    assert "cache_load_factor" not in constraint_record(TableConstraint())


@pytest.mark.parametrize("kw, says", [
    ({"cache_load_factor": 0}, "cache_load_factor"),
    ({"cache_load_factor": 1.5}, "at most 1"),
    ({"cache_load_factor": 0.1, "cache_policy": "fifo"}, "cache_policy"),
])  # fmt: skip
def test_bad_fields(kw, says, tmp_path):
    with pytest.raises(PlanError, match=says):
        TableConstraint(**kw)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"t": kw}))
    with pytest.raises(FileFormatError, match=f"constraint for 't'.*{says}"):
        load_constraints(str(path))
