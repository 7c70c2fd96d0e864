"""Evaluation metrics for the DLRM example."""

import torch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC: the probability that a random positive outscores a random negative.

    Computed from ranks (Mann-Whitney U): tied scores get their average rank, so a tie
    between a positive and a negative counts one half. O(n log n); no sklearn.

        auc(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))  # 0.75

    Args:
        scores: [n] logits or probabilities (any monotone transform gives the same AUC).
        labels: [n] with values 0 and 1 only, both present.
    """
    if scores.dim() != 1 or scores.shape != labels.shape:
        raise ValueError(
            f"scores and labels must be 1-D of the same length, got shapes "
            f"{tuple(scores.shape)} and {tuple(labels.shape)}"
        )
    scores = scores.detach().to(torch.float64)
    labels = labels.detach()
    if torch.isnan(scores).any():
        raise ValueError(f"scores contain {int(torch.isnan(scores).sum())} NaN values")
    if not ((labels == 0) | (labels == 1)).all():
        raise ValueError(f"labels must be 0 or 1, got values {labels.unique().tolist()}")
    positive = labels == 1
    num_pos = int(positive.sum())
    num_neg = labels.numel() - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(
            f"AUC needs both classes, got {num_pos} positives and {num_neg} negatives"
        )
    _, inverse, counts = torch.unique(scores, sorted=True, return_inverse=True, return_counts=True)
    # 1-based rank of each distinct score, averaged over its ties.
    ends = torch.cumsum(counts, 0).to(torch.float64)
    average_rank = ends - (counts.to(torch.float64) - 1) / 2
    rank_sum = average_rank[inverse][positive].sum().item()
    return (rank_sum - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg)
