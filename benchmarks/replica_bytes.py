"""Bytes per rank per step that keep a shard's replicas exact across R replica groups (issue 36):
the replay of Note [exact replicas] (modular/kernels/exact_replicas.py: ids, bag lengths and pooled
gradients all-gathered) against all-reducing row-sparse gradients (the union of touched rows
gathered, then rows x dim floats all-reduced over it, ring-all-reduce bytes).

Counts what each scheme puts on the wire for one kernel of one table, from real batches (uniform
and power-law ids), single process:

    .venv/bin/python benchmarks/replica_bytes.py
"""

from __future__ import annotations

import argparse

import torch


def batch_ids(rows: int, bags: int, pooling: int, skew: float, g: torch.Generator) -> torch.Tensor:
    """`bags` bags of `pooling` ids each; skew 0 is uniform, else ids ~ rank^-skew."""
    n = bags * pooling
    if skew == 0:
        return torch.randint(0, rows, (n,), generator=g)
    weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-skew)
    return torch.multinomial(weights, n, replacement=True, generator=g)


def replay_bytes(bags: int, ids: int, dim: int, replicas: int) -> int:
    """Received per rank by the replay's all-gathers: counts, lengths (int32), ids (int32) and
    the pooled gradients (fp32) of the R - 1 other replicas."""
    return (replicas - 1) * (3 * 8 + 4 * bags + 4 * ids + 4 * bags * dim)


def sparse_bytes(touched: list[torch.Tensor], dim: int, replicas: int) -> int:
    """Received per rank by the row-sparse scheme: the other replicas' touched rows (int64,
    padded to the longest), then a ring all-reduce of the union's rows x dim floats."""
    longest = max(t.numel() for t in touched)
    union = torch.unique(torch.cat(touched)).numel()
    return (replicas - 1) * 8 * longest + int(2 * (replicas - 1) / replicas * 4 * union * dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--bags", type=int, default=2 * 512, help="bags per step per kernel: G x B")
    parser.add_argument("--replicas", type=int, default=2)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    print(f"table {args.rows} x {args.dim}, {args.bags} bags per replica, R={args.replicas}")
    print(f"{'ids/bag':>8} {'skew':>5} {'touched':>8} {'union':>8} {'replay KiB':>11} {'sparse KiB':>11}")
    for pooling in (1, 4, 20):
        for skew in (0.0, 1.05):
            ids = [batch_ids(args.rows, args.bags, pooling, skew, g) for _ in range(args.replicas)]
            touched = [torch.unique(i) for i in ids]
            union = torch.unique(torch.cat(touched)).numel()
            replay = replay_bytes(args.bags, ids[0].numel(), args.dim, args.replicas)
            sparse = sparse_bytes(touched, args.dim, args.replicas)
            print(
                f"{pooling:>8} {skew:>5} {touched[0].numel():>8} {union:>8} "
                f"{replay / 1024:>11.1f} {sparse / 1024:>11.1f}"
            )


if __name__ == "__main__":
    main()
