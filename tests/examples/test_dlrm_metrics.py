import pytest
import torch

from examples.dlrm.metrics import auc


def brute_force_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    pos = scores[labels == 1].tolist()
    neg = scores[labels == 0].tolist()
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("distinct_scores", [None, 2, 5])
def test_matches_brute_force_with_and_without_ties(seed: int, distinct_scores: int | None) -> None:
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(301, generator=g) < 0.3).to(torch.float32)
    scores = torch.randn(301, generator=g) + labels
    if distinct_scores is not None:
        scores = torch.randint(0, distinct_scores, (301,), generator=g).to(torch.float32)
        scores = scores + labels * (seed % 2)
        assert scores.unique().numel() < 301
    assert auc(scores, labels) == pytest.approx(brute_force_auc(scores, labels), abs=1e-12)


def test_known_values() -> None:
    labels = torch.tensor([0, 0, 1, 1])
    assert auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), labels) == 0.75
    assert auc(torch.tensor([0.0, 0.1, 0.2, 0.3]), labels) == 1.0
    assert auc(torch.tensor([0.3, 0.2, 0.1, 0.0]), labels) == 0.0
    assert auc(torch.tensor([1.0, 1.0, 1.0, 1.0]), labels) == 0.5
    # One positive tied with one negative, above the other negative: (1 + 0.5) / 2.
    assert auc(torch.tensor([0.0, 0.5, 0.5]), torch.tensor([0, 0, 1])) == 0.75


def test_invariant_to_monotone_transforms() -> None:
    g = torch.Generator().manual_seed(0)
    labels = (torch.rand(100, generator=g) < 0.5).to(torch.float32)
    logits = torch.randn(100, generator=g) + labels
    assert auc(logits, labels) == pytest.approx(auc(torch.sigmoid(logits), labels), abs=1e-12)


@pytest.mark.parametrize(
    "scores, labels, message",
    [
        (torch.tensor([0.1, 0.2]), torch.tensor([1, 1]), "got 2 positives and 0 negatives"),
        (torch.tensor([0.1, 0.2]), torch.tensor([0, 2]), r"must be 0 or 1, got values \[0, 2\]"),
        (torch.tensor([0.1, 0.2]), torch.tensor([0, 1, 1]), r"got shapes \(2,\) and \(3,\)"),
        (torch.tensor([float("nan"), 0.2]), torch.tensor([0, 1]), "1 NaN values"),
    ],
)
def test_bad_input_is_rejected(scores: torch.Tensor, labels: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        auc(scores, labels)
