"""A shard's merge of its recent entries into its main part (Note [a shard's recent entries] in
modular/mc/slot_shard.py): where each merged position's entry comes from, and the columns
rebuilt from that."""

from __future__ import annotations

import torch

__all__ = ["RUN", "merge_order", "merged_column"]

RUN = 32_768  # merged positions under one shift that a merge copies as a slice, not a gather


def merge_order(raw: torch.Tensor, gone: torch.Tensor, new_raw: torch.Tensor) -> tuple[list, torch.Tensor]:
    """For a shard's sorted raw ids `raw` with the entries at sorted positions `gone` replaced
    by as many sorted new raw ids (held by no entry): where each merged position's entry was,
    as pieces (start, stop, src) in order, src the old positions of [start, stop) (any where a
    new id goes) or, for a run of at least RUN positions under one shift (e.g. the empty slots
    past the new ids while the table fills), that shift; and the new ids' merged positions.
    O(new ids log), and O(merged positions) outside the runs."""
    n, m = raw.numel(), gone.numel()
    before = torch.searchsorted(raw, new_raw)  # entries below each new id
    at_new = before - torch.searchsorted(gone, before) + torch.arange(m)
    # A kept entry's old position is its merged position, plus the evicted entries before
    # it, less the new ids before it: a step function, +1 at the first kept entry past each
    # evicted one, -1 past each new id.
    kept_after = gone - torch.arange(m)  # the kept index of the first kept entry past each
    at_kept = kept_after + torch.searchsorted(at_new - torch.arange(m), kept_after, right=True)
    runs = []
    ends = torch.cat([torch.tensor([0]), at_new, torch.tensor([n])])
    if int((ends[1:] - ends[:-1]).max()) > RUN:  # a run needs a gap between new ids at least
        events = torch.sort(torch.cat([torch.tensor([0, n]), at_new, at_new + 1, at_kept]).clamp(max=n)).values
        long = ((events[1:] - events[:-1]) >= RUN).nonzero().view(-1).tolist()
        runs = [(int(events[i]), int(events[i + 1])) for i in long]
    pieces, start = [], 0
    for a, b in runs + [(n, n)]:
        if start < a:
            pieces.append((start, a, _sources(start, a, at_new, at_kept)))
        if a < b:  # no event inside: the shift is the step function's value at a
            shift = int(torch.searchsorted(at_kept, a, right=True)) - int(torch.searchsorted(at_new, a, right=True))
            pieces.append((a, b, shift))
        start = b
    return pieces, at_new


def _sources(a: int, b: int, at_new: torch.Tensor, at_kept: torch.Tensor) -> torch.Tensor:
    """The old positions of merged positions [a, b) (0 where a new id goes)."""
    kept = at_kept[(at_kept > a) & (at_kept < b)] - a
    fresh = at_new[(at_new >= a) & (at_new < b)] - a
    steps = torch.zeros(b - a, dtype=torch.int64)
    steps.index_add_(0, kept, torch.ones_like(kept))
    steps.index_add_(0, fresh, torch.full_like(fresh, -1))
    steps[0] += int((at_kept <= a).sum()) - int((at_new < a).sum())
    src = torch.arange(a, b) + steps.cumsum(0)
    src[fresh] = 0
    return src


def merged_column(old: torch.Tensor, pieces: list, at_new: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """One column of the main part after the merge: `old`'s entries moved as `pieces` say
    (`merge_order`), the recent entries' values `new` at `at_new`."""
    if len(pieces) == 1 and isinstance(pieces[0][2], torch.Tensor):
        merged = torch.gather(old, 0, pieces[0][2])
    else:
        merged = torch.empty_like(old)
        for a, b, src in pieces:
            if isinstance(src, int):  # one shift: a copy
                merged[a:b] = old[a + src : b + src]
            else:
                torch.gather(old, 0, src, out=merged[a:b])
    merged[at_new] = new.to(old.dtype)
    return merged
