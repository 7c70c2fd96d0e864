"""Time of checking + routing one rank's batch (Router.check_and_route), before and after.

    python benchmarks/router.py                      # default config, all plans
    python benchmarks/router.py --plans rw mixed --repeats 50

"before" is the per-id reference router kept in benchmarks/_router_reference.py (repeat_interleave
to each id's feature, searchsorted over (slot, row) keys, int16 stable argsort by route); "after"
is modular.routing.router.Router. Both run in this process on the same batches, alternating, one thread
(as each rank of benchmarks/step_time.py). Reported: the median ms per call over the repeats,
for check, route and check + route, and for "after" the fbgemm pieces it runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from planners.types import ShardingType, TablePlacement  # noqa: E402
from benchmarks._router_reference import assert_same_routes, routers  # noqa: E402

PLANS = ("tw", "rw", "cw", "dp", "twrw", "mixed")


def _placements(plan: str, tables: int, world: int) -> dict[str, TablePlacement]:
    everyone = tuple(range(world))
    kinds = {
        "tw": ShardingType.TABLE_WISE, "rw": ShardingType.ROW_WISE,
        "cw": ShardingType.COLUMN_WISE, "dp": ShardingType.DATA_PARALLEL,
        "twrw": ShardingType.TABLE_ROW_WISE,
    }  # fmt: skip
    out = {}
    for i in range(tables):
        if plan == "mixed":  # every type, round robin, ranks backwards for the row-split ones
            kind = [ShardingType.TABLE_WISE, ShardingType.ROW_WISE, ShardingType.COLUMN_WISE,
                    ShardingType.DATA_PARALLEL][i % 4]  # fmt: skip
            ranks = everyone[::-1]
        else:
            kind, ranks = kinds[plan], everyone
        if kind is ShardingType.TABLE_WISE:
            out[f"t{i}"] = TablePlacement(kind, ranks=(i % world,))
        elif kind is ShardingType.DATA_PARALLEL:
            out[f"t{i}"] = TablePlacement(kind)
        else:
            out[f"t{i}"] = TablePlacement(kind, ranks=ranks)
    return out


def _median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=100_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--pooling", type=int, default=20)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--weighted", action="store_true")
    p.add_argument("--uneven-rows", action="store_true",
                   help="table i has rows * (i + 1) / tables rows (per-feature id bounds differ)")
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    rows = [
        args.rows * (i + 1) // args.tables if args.uneven_rows else args.rows
        for i in range(args.tables)
    ]
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", num_embeddings=rows[i], embedding_dim=args.dim,
            feature_names=[f"f{i}"], pooling=PoolingType.SUM,
        )
        for i in range(args.tables)
    ]  # fmt: skip
    print(
        f"{args.tables} tables x {args.rows:_} rows{' (uneven)' if args.uneven_rows else ''} x "
        f"{args.dim}, batch {args.batch}, pooling {args.pooling} (fixed), world "
        f"{args.world_size}, {'weighted' if args.weighted else 'unweighted'}, "
        f"{torch.get_num_threads()} thread; median ms of {args.repeats}"
    )
    print(f"{'plan':6} {'':6} {'check':>7} {'route':>7} {'check+route':>12}   pieces (after)")
    for plan in args.plans:
        router, ref = routers(
            configs, _placements(plan, args.tables, args.world_size), args.world_size,
            args.weighted,
        )  # fmt: skip
        features = list(router.features)
        # Every bag holds exactly `pooling` ids, as in benchmarks/step_time.py.
        lengths = torch.full((args.tables * args.batch,), args.pooling, dtype=torch.int64)
        g = torch.Generator().manual_seed(1)
        values = torch.cat([
            torch.randint(0, r, (args.batch * args.pooling,), generator=g) for r in rows
        ])  # fmt: skip
        kjt = KeyedJaggedTensor(
            keys=features, values=values, lengths=lengths, stride=args.batch,
            weights=torch.rand(values.numel(), generator=g) if args.weighted else None,
        )  # fmt: skip
        rejection, routed = router.check_and_route(kjt)
        assert rejection is None and ref.check(kjt) is None
        assert_same_routes(routed, ref.route(kjt))

        results = {"before": [[], [], []], "after": [[], [], []]}
        for _ in range(3):  # alternate blocks, so that noise hits both alike
            for name, r in (("before", ref), ("after", router)):
                both = (lambda r=r: (r.check(kjt), r.route(kjt))) if name == "before" else (
                    lambda r=r: r.check_and_route(kjt))
                n = max(1, args.repeats // 3)
                results[name][0].append(_median_ms(lambda r=r: r.check(kjt), n))
                results[name][1].append(_median_ms(lambda r=r: r.route(kjt), n))
                results[name][2].append(_median_ms(both, n))
        pieces = _pieces(router, kjt, args.repeats)
        for name in ("before", "after"):
            check, route, both = (statistics.median(x) for x in results[name])
            extra = pieces if name == "after" else ""
            print(f"{plan:6} {name:6} {check:7.2f} {route:7.2f} {both:12.2f}   {extra}")


def _pieces(router, kjt, repeats: int) -> str:
    """The fbgemm ops `route` runs, timed alone on the same batch."""
    values, lengths, weights = kjt.values(), kjt.lengths(), kjt.weights_or_none()
    batch, nf = kjt.stride(), len(router.features)
    out = []
    out.append(f"aminmax {_median_ms(lambda: torch.aminmax(values), repeats):.2f}")
    if router.num_routes == 0:
        return ", ".join(out)
    if router._bucketize:
        s_lengths = lengths.view(nf, batch)
        s_values, s_weights = values, weights
        if router._slot_features is not None:
            s_lengths, s_values, s_weights = torch.ops.fbgemm.permute_2D_sparse_data(
                router._slot_features, s_lengths, values, weights, None
            )
        def bucketize():
            torch.ops.fbgemm.block_bucketize_sparse_features(
                s_lengths.reshape(-1), s_values, False, False, router._block_sizes,
                router._num_buckets, s_weights, None, -1, router._bucket_pos,
            )

        path = "explicit boundaries" if router._bucket_pos is not None else "block size"
        out.append(f"bucketize ({path}) {_median_ms(bucketize, repeats):.2f}")
    if router._route_source is not None:
        src_rows = router._source_rows
        fake_lengths = torch.full((src_rows, batch), int(lengths.sum()) // (src_rows * batch))
        fake_values = values[: int(fake_lengths.sum())]
        def permute():
            torch.ops.fbgemm.permute_2D_sparse_data(
                router._route_source, fake_lengths, fake_values, None, None
            )

        out.append(f"permute {_median_ms(permute, repeats):.2f}")
    return ", ".join(out)


if __name__ == "__main__":
    main()
