"""fbgemm's sequence kernel (PoolingMode.NONE) against bags of one in a SUM kernel, on CPU.

    python benchmarks/sequence_kernels.py                         # row-wise Adagrad
    python benchmarks/sequence_kernels.py --optimizer EXACT_SGD --lengths 5 35

The two forms of Note [sequence lookups] (modular/sequence/lookup.py), with the fused optimizer:
one split TBE of `--tables` tables looks up every table's ids (route t holds lengths[t % k] x
`--batch` ids), forward then backward (the update), on one thread. NONE takes one bag per route
and returns (ids, dim); the SUM kernel takes the longest route's count of bags per route, each
of one id or empty, and returns (bags, tables x dim). Prints the median of `--steps` of each,
alternating.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tables", type=int, default=4)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=256, help="sequences per route")
    p.add_argument("--lengths", type=int, nargs="+", default=[20])
    p.add_argument("--optimizer", default="EXACT_ROWWISE_ADAGRAD")
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(1)
    counts = [a.batch * a.lengths[t % len(a.lengths)] for t in range(a.tables)]
    ids = torch.cat([torch.randint(0, a.rows, (n,)) for n in counts])
    longest = max(counts)
    kernels, offsets = {}, {}
    for name, mode in (("none", PoolingMode.NONE), ("bags of one", PoolingMode.SUM)):
        kernels[name] = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(a.rows, a.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * a.tables,
            optimizer=getattr(EmbOptimType, a.optimizer), learning_rate=0.01, eps=1e-8,
            pooling_mode=mode, device=torch.device("cpu"), bounds_check_mode=BoundsCheckMode.NONE,
        )  # fmt: skip
    offsets["none"] = torch.ops.fbgemm.asynchronous_complete_cumsum(torch.tensor(counts))
    lengths = torch.arange(longest).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)
    offsets["bags of one"] = torch.ops.fbgemm.asynchronous_complete_cumsum(lengths.reshape(-1).long())
    times: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in kernels}
    for step in range(a.steps + 3):
        for name, tbe in kernels.items():
            t0 = time.perf_counter()
            out = tbe(ids, offsets[name])
            t1 = time.perf_counter()
            out.backward(torch.ones_like(out))
            t2 = time.perf_counter()
            if step >= 3:  # warm-up
                times[name][0].append(t1 - t0)
                times[name][1].append(t2 - t1)
    print(f"{a.tables} tables x {a.rows} x {a.dim}, {sum(counts)} ids ({'/'.join(map(str, a.lengths))} "
          f"per sequence, {a.batch} sequences per table), {a.optimizer}, 1 thread")  # fmt: skip
    for name, (fwd, bwd) in times.items():
        print(f"{name:<12} forward {1e3 * statistics.median(fwd):7.2f} ms   "
              f"backward {1e3 * statistics.median(bwd):7.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
