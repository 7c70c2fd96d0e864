"""What one table of a width fbgemm's fused kernels cannot take costs a fused EBC.

    python benchmarks/odd_width.py                 # 8 tables x 100,000 rows, one of them 62 wide
    python benchmarks/odd_width.py --odd-dim 60    # every width a multiple of 4: ratio ~1

One process, one thread. Two fused (exact row-wise Adagrad) EBCs, identical but for the last
table's width (64 against --odd-dim), are timed alternately on the same batches, forward +
backward (the update happens in backward). A width that is not a multiple of 4 takes the torch
emulation of the fused update (modular/optim.py); its shards form kernel groups of their own
(`kernel_groups` in modular/tables/layout.py), so only that table pays for it. Before that split the
whole pooling group went to the emulation: 90 ms against 28 ms per step at the defaults.
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
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def _model(dims: list[int], rows: int):
    import modular
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=rows, feature_names=[f"f{i}"])
        for i, d in enumerate(dims)
    ])  # fmt: skip
    modular.fuse_optimizer(ebc, "exact_rowwise_adagrad", lr=0.01)
    return ebc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--odd-dim", type=int, default=62)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    even = [args.dim] * args.tables
    models = {
        "all even": _model(even, args.rows),
        f"last {args.odd_dim} wide": _model(even[:-1] + [args.odd_dim], args.rows),
    }
    g = torch.Generator().manual_seed(1)
    n, b = args.tables, args.batch
    kjts = [
        KeyedJaggedTensor(
            keys=[f"f{i}" for i in range(n)], values=torch.randint(0, args.rows, (n * b * args.pooling,), generator=g),
            lengths=torch.full((n * b,), args.pooling), stride=b,
        )
        for _ in range(4)
    ]  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in models}
    for step in range(args.steps + 3):
        for name, model in models.items():
            t0 = time.perf_counter()
            model(kjts[step % len(kjts)]).values().sum().backward()
            if step >= 3:  # warm-up
                times[name].append(time.perf_counter() - t0)
    print(f"{n} tables x {args.rows:,} rows, batch {b:,}, pooling {args.pooling}, fused exact row-wise "
          f"Adagrad, 1 thread, {args.steps} steps each, {datetime.date.today().isoformat()}")  # fmt: skip
    for name, model in models.items():
        kinds = [type(k).__name__ for k in (*model._kernels, *model._local_kernels)]
        print(f"  {name:16} median {statistics.median(times[name]) * 1e3:7.1f} ms   kernels {kinds}")
    base, odd = (statistics.median(t) for t in times.values())
    print(f"  ratio {odd / base:.2f}")


if __name__ == "__main__":
    main()
