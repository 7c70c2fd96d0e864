"""The block map of output dist (Note [arrival blocks]) against the column-by-column reference:
forward and backward, for permutations (each output column arrives once) and sums (row-wise
partial sums), with the widths the common plans give. One process, no collectives."""

from __future__ import annotations

import random

import pytest
import torch

from modular.pooled.arrival import Arrival


def _reference(flat: torch.Tensor, widths: list[int], columns: list[int], output_dim: int, batch: int):
    """Each source's (batch, width) block side by side, then each column added at its output."""
    blocks = [c.view(batch, w) for c, w in zip(flat.split([batch * w for w in widths]), widths) if w]
    arrived = torch.cat(blocks, dim=1)
    return arrived.new_zeros(batch, output_dim).index_add(1, torch.tensor(columns), arrived)


def _check(widths: list[int], columns: list[int], output_dim: int, batch: int, width: int | None = None) -> Arrival:
    arrival = Arrival(widths, columns, output_dim, torch.device("cpu"))
    if width is not None:
        assert arrival.width == width
    flat = torch.randn(batch * sum(widths), dtype=torch.float64, requires_grad=True)
    ref_flat = flat.detach().clone().requires_grad_()
    out = arrival.arrange(flat, batch)
    ref = _reference(ref_flat, widths, columns, output_dim, batch)
    assert torch.equal(out, ref)
    probe = torch.randn(batch, output_dim, dtype=torch.float64)
    (out * probe).sum().backward()
    (ref * probe).sum().backward()
    assert torch.equal(flat.grad, ref_flat.grad)
    return arrival


def _tw_columns(features_per_rank: list[list[int]], dim: int) -> list[int]:
    return [c for feats in features_per_rank for f in feats for c in range(f * dim, (f + 1) * dim)]


@pytest.mark.parametrize("batch", [1, 5])
def test_table_wise_interleaved_ranks_move_whole_outputs(batch: int) -> None:
    cols = _tw_columns([[0, 2, 4, 6], [1, 3, 5, 7]], 64)
    a = _check([256, 256, 0], cols, 512, batch, width=64)
    assert a.is_permutation


def test_column_wise_halves_are_blocks_of_the_shard_width() -> None:
    # Each rank sends the same half of every output: rank 0 columns 0-31 of each 64-wide output.
    cols = [f * 64 + h * 32 + c for h in range(2) for f in range(8) for c in range(32)]
    _check([256, 256, 0], cols, 512, 3, width=32)


def test_row_wise_partial_sums_add_whole_rows_of_outputs() -> None:
    cols = list(range(512)) * 2
    a = _check([512, 512, 0], cols, 512, 4, width=512)
    assert not a.is_permutation


def test_a_partial_sum_into_the_middle_of_an_output_sets_the_block_width() -> None:
    # Source 1 adds into output columns 2-5 only: blocks must be 2 wide, though every width and
    # arrival position is a multiple of 4.
    _check([8, 4], [*range(8), *range(2, 6)], 8, 3, width=2)


def test_columns_in_order_from_one_source_need_no_copy() -> None:
    arrival = Arrival([0, 24], list(range(24)), 24, torch.device("cpu"))
    flat = torch.randn(3 * 24)
    assert arrival.arrange(flat, 3).data_ptr() == flat.data_ptr()


@pytest.mark.parametrize("seed", range(12))
def test_random_layouts_match_the_column_reference(seed: int) -> None:
    # Outputs of odd dims split into uneven column shards over 3 sources (2 ranks + local), some
    # outputs split by rows (both halves arrive whole and add up): widths fall to gcds like 1.
    rng = random.Random(seed)
    dims = [rng.choice([4, 5, 6, 8, 12]) for _ in range(rng.randint(1, 5))]
    starts = [sum(dims[:i]) for i in range(len(dims))]
    per_source: list[list[int]] = [[], [], []]
    for start, d in zip(starts, dims):
        kind = rng.choice(["whole", "cols", "rows"])
        if kind == "whole":
            per_source[rng.randrange(3)].extend(range(start, start + d))
        elif kind == "cols":
            cut = rng.randint(1, d - 1)
            per_source[0].extend(range(start, start + cut))
            per_source[1].extend(range(start + cut, start + d))
        else:
            per_source[0].extend(range(start, start + d))
            per_source[1].extend(range(start, start + d))
    order = [rng.sample(s, len(s)) if rng.random() < 0.3 else s for s in per_source]  # some shuffled
    widths = [len(s) for s in order]
    columns = [c for s in order for c in s]
    _check(widths, columns, sum(dims), rng.randint(1, 4))


def test_widths_that_do_not_cover_the_columns_are_refused() -> None:
    with pytest.raises(ValueError, match="columns for sources"):
        Arrival([2, 2], [0, 1, 2], 3, torch.device("cpu"))
