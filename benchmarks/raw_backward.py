"""fbgemm's raw CPU backward ops with no per-id weights against a tensor of ones.

    python benchmarks/raw_backward.py                       # column-wise pieces: 8 x 32 columns
    python benchmarks/raw_backward.py --tables 4 --dim 64   # one rank's table-wise share

One process, one thread. The deferred fused kernels (modular/fused/deferred.py: column-wise row
statistics, data-parallel copies) and the dense kernels' gradient (modular/kernels/dense.py) call
fbgemm's `split_embedding_backward_codegen_<optimizer>_cpu` themselves. They used to pass a
tensor of ones as the per-id weights of an unweighted lookup; passing None takes fbgemm's
unweighted path. For each optimizer this times both, alternately, on the same ids and output
gradient, and checks that the two updates are bit for bit the same.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

OPTIMIZERS = ("exact_sgd", "exact_adagrad", "exact_rowwise_adagrad")


def _tbe(optimizer: str, tables: int, rows: int, dim: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
        optimizer=EmbOptimType[optimizer.upper()],
        learning_rate=0.01,
        eps=1e-8,
    )
    with torch.no_grad():
        tbe.weights_host.normal_()
    return tbe


def _backward(tbe, optimizer: str, grad, ids, offsets, weights) -> None:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode

    lr = tbe.learning_rate_tensor
    common = (
        grad, tbe.weights_host, tbe.weights_placements, tbe.weights_offsets, tbe.D_offsets,
        tbe.max_D, tbe.hash_size_cumsum, tbe.total_hash_size_bits, ids, offsets,
        int(PoolingMode.SUM), weights, False,
    )  # fmt: skip
    if optimizer == "exact_sgd":
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(*common, lr, 0)
        return
    state = (tbe.momentum1_host, tbe.momentum1_placements, tbe.momentum1_offsets)
    if optimizer == "exact_adagrad":
        torch.ops.fbgemm.split_embedding_backward_codegen_adagrad_cpu(*common, *state, lr, 1e-8, 0)
    else:
        torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            *common, *state, lr, 1e-8, 0.0, 0, 0.0, 0
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=2048, help="bags per table")
    p.add_argument("--pooling", type=int, default=20, help="ids per bag")
    p.add_argument("--steps", type=int, default=20, help="timed calls of each variant")
    a = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = a.tables * a.batch * a.pooling
    ids = torch.randint(0, a.rows, (n,), dtype=torch.int32)
    offsets = torch.arange(0, n + 1, a.pooling, dtype=torch.int32)
    grad = torch.randn(a.batch, a.tables * a.dim)
    ones = torch.ones(n)
    print(
        f"## {a.tables} tables x {a.rows:,} rows x {a.dim} dims, {a.batch:,} bags x {a.pooling} "
        f"ids each ({n:,} ids), 1 thread, {a.steps} calls each, alternating, "
        f"{datetime.date.today()}\n"
    )
    print("| optimizer | ones ms | None ms | None / ones | same update |")
    print("|---|---:|---:|---:|---|")
    for optimizer in OPTIMIZERS:
        tbe = _tbe(optimizer, a.tables, a.rows, a.dim)
        start = [t.detach().clone() for t in (tbe.weights_host, tbe.momentum1_host)]
        after = {}
        for name, w in (("ones", ones), ("None", None)):
            for t, s in zip((tbe.weights_host, tbe.momentum1_host), start):
                t.detach().copy_(s)
            _backward(tbe, optimizer, grad, ids, offsets, w)
            after[name] = [t.detach().clone() for t in (tbe.weights_host, tbe.momentum1_host)]
        same = all(torch.equal(x, y) for x, y in zip(after["ones"], after["None"]))
        times: dict[str, list[float]] = {"ones": [], "None": []}
        for step in range(a.steps + 1):
            for name, w in (("ones", ones), ("None", None)):
                t0 = time.perf_counter()
                _backward(tbe, optimizer, grad, ids, offsets, w)
                if step:  # the first round warms up
                    times[name].append((time.perf_counter() - t0) * 1e3)
        with_ones, without = (statistics.median(times[k]) for k in ("ones", "None"))
        print(
            f"| {optimizer} | {with_ones:.2f} | {without:.2f} | {without / with_ones:.2f} | "
            f"{'yes' if same else 'NO'} |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
