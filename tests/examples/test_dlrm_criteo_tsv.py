import math
import re
from pathlib import Path

import pytest
import torch

from examples.dlrm.data import concat_batches, read_criteo_tsv
from examples.dlrm.make_sample import DEFAULT_OUT, sample_lines
from examples.dlrm.model import CRITEO_TB

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "criteo_sample.tsv"
ROWS = [min(n, 1000) for n in CRITEO_TB]


def test_sample_file_is_what_make_sample_writes() -> None:
    assert SAMPLE == DEFAULT_OUT
    assert SAMPLE.read_text() == "".join(line + "\n" for line in sample_lines(256, seed=0))


def test_reads_sample_file_field_by_field() -> None:
    batches = list(read_criteo_tsv(SAMPLE, ROWS, batch_size=64))
    assert len(batches) == 4
    assert batches[0].sparse.keys() == [f"f_cat_{i}" for i in range(26)]
    dense = torch.cat([b.dense for b in batches])
    labels = torch.cat([b.labels for b in batches])
    keys = batches[0].sparse.keys()
    ids = {k: torch.cat([b.sparse[k].values() for b in batches]) for k in keys}
    lines = SAMPLE.read_text().splitlines()
    assert any("" in line.split("\t")[1:14] for line in lines), "sample should have missing dense"
    assert any("" in line.split("\t")[14:] for line in lines), "sample should have missing ids"
    for i, line in enumerate(lines):
        fields = line.split("\t")
        assert labels[i].item() == int(fields[0])
        for j, s in enumerate(fields[1:14]):
            expected = math.log1p(max(int(s), 0)) if s else 0.0
            assert dense[i, j].item() == pytest.approx(expected, rel=1e-6)
        for j, s in enumerate(fields[14:]):
            assert ids[f"f_cat_{j}"][i].item() == (int(s, 16) % ROWS[j] if s else 0)


def test_ranks_read_stripes_whose_concatenation_is_the_global_batch() -> None:
    whole = list(read_criteo_tsv(SAMPLE, ROWS, batch_size=96))
    per_rank = [
        list(read_criteo_tsv(SAMPLE, ROWS, batch_size=32, rank=r, world_size=3)) for r in range(3)
    ]
    # 256 lines in windows of 96: two full windows, the last 64 lines are dropped.
    assert len(whole) == 2 and [len(b) for b in per_rank] == [2, 2, 2]
    for step in range(2):
        glob = concat_batches([per_rank[r][step] for r in range(3)])
        torch.testing.assert_close(glob.dense, whole[step].dense, rtol=0, atol=0)
        torch.testing.assert_close(glob.labels, whole[step].labels, rtol=0, atol=0)
        assert torch.equal(glob.sparse.values(), whole[step].sparse.values())
        assert torch.equal(glob.sparse.lengths(), whole[step].sparse.lengths())


def test_missing_and_negative_values(tmp_path: Path) -> None:
    fields = ["1", "-5", ""] + ["7"] * 11 + ["", "0000000F"] + ["ffffffff"] * 24
    path = tmp_path / "one.tsv"
    path.write_text("\t".join(fields) + "\n")
    (batch,) = read_criteo_tsv(path, [10] * 26, batch_size=1)
    assert batch.dense[0, :2].tolist() == [0.0, 0.0]
    assert batch.dense[0, 2].item() == pytest.approx(math.log1p(7))
    assert batch.sparse["f_cat_0"].values().tolist() == [0]
    assert batch.sparse["f_cat_1"].values().tolist() == [15 % 10]
    assert batch.sparse["f_cat_2"].values().tolist() == [0xFFFFFFFF % 10]
    assert batch.labels.tolist() == [1.0]


def good_fields() -> list[str]:
    return ["0"] + ["1"] * 13 + ["0123abcd"] * 26


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda f: f[:-1], r"expected 40 tab-separated fields .* got 39"),
        (lambda f: f + ["x"], r"expected 40 tab-separated fields .* got 41"),
        (lambda f: ["2"] + f[1:], r"label must be 0 or 1, got '2'"),
        (lambda f: [""] + f[1:], r"label must be 0 or 1, got ''"),
        (
            lambda f: f[:3] + ["1.5"] + f[4:],
            r"dense feature 2 \(field 4\) must be an integer or empty, got '1.5'",
        ),
        (lambda f: f[:1] + ["abc"] + f[2:], r"dense feature 0 \(field 2\) must be an integer"),
        (
            lambda f: f[:14] + ["0123abcg"] + f[15:],
            r"categorical feature 0 \(field 15\) must be 8 hex digits or empty, got '0123abcg'",
        ),
        (lambda f: f[:39] + ["123abcd"], r"categorical feature 25 \(field 40\) must be 8 hex"),
    ],
)
@pytest.mark.parametrize("rank", [0, 1])
def test_malformed_line_names_file_and_line(tmp_path: Path, edit, message: str, rank: int) -> None:
    path = tmp_path / "bad.tsv"
    lines = ["\t".join(good_fields())] * 6
    lines[4] = "\t".join(edit(good_fields()))
    path.write_text("".join(line + "\n" for line in lines))
    # Line 5 is in rank 0's stripe; rank 1 must fail on it too, at the same step.
    batches = read_criteo_tsv(path, [100] * 26, batch_size=2, rank=rank, world_size=2)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}, line 5: {message}"):
        list(batches)


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="26 categorical features, but .* has 3 entries"):
        read_criteo_tsv(SAMPLE, [10] * 3, batch_size=4)
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got 2"):
        read_criteo_tsv(SAMPLE, ROWS, batch_size=4, rank=2, world_size=2)
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        read_criteo_tsv(tmp_path / "nope.tsv", ROWS, batch_size=4)
