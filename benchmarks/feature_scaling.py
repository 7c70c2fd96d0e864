"""Does a step's host work grow per feature? Step time at several table counts of one total size.

    python benchmarks/feature_scaling.py                           # 50, 200, 800 tables, tw rw dp
    python benchmarks/feature_scaling.py --tables 50 200 800 --plans tw --runs 3

Every model has the same total rows (`--total-rows`, split evenly over its tables, one feature
each), the same width and batch, and the same ids per sample (`--ids-per-sample`, split evenly
over the features: pooling 16, 4 and 1 at 50, 200 and 800 tables by default), so the kernel reads
about as many rows at every size and what grows with the table count is the per-feature part of
a step: pooled outputs (batch x features x dim floats, sent and received by any sharded
framework), per-feature bookkeeping, and any Python looping over features. Each size is one fresh
run of `benchmarks/step_time.py` (all contenders side by side, fused row-wise Adagrad by
default). The script fits, by least squares over the sizes, the slope of each contender's step
time per table, and of its time above the kernel floor (step - floor - dense part), in
microseconds per feature: ours against TorchRec's is the issue's comparison (issue 29), and
tests/modular/test_step_python.py pins that no Python in `modular` runs per table.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._tables import parse_step_table, run_step_time  # noqa: E402

CONTENDERS = ("ours", "prefetch", "torchrec", "pipeline", "floor")


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, nargs="+", default=[50, 200, 800])
    p.add_argument("--total-rows", type=int, default=400_000)
    p.add_argument("--ids-per-sample", type=int, default=800)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--plans", nargs="+", default=["tw", "rw", "dp"])
    p.add_argument("--optimizer", choices=["fused", "dense"], default="fused")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--runs", type=int, default=1, help="runs per size; the median step time counts")
    p.add_argument("--out", default=None, help="folder for each run's whole output")
    args = p.parse_args()
    if len(args.tables) < 2:
        p.error("--tables needs at least two sizes to fit a slope")
    for t in args.tables:
        if args.total_rows % t or args.ids_per_sample % t:
            p.error(f"{t} tables must divide --total-rows {args.total_rows} and --ids-per-sample "
                    f"{args.ids_per_sample} so that every size holds the same rows and ids")  # fmt: skip
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    # (plan, contender) -> per size, the median over runs of its step time
    times: dict[tuple[str, str], list[Optional[float]]] = {}
    bases: dict[str, list[Optional[float]]] = {}
    for i, t in enumerate(args.tables):
        runs = []
        for r in range(args.runs):
            print(f"[{t} tables, run {r + 1}/{args.runs}] ...", flush=True)
            log = os.path.join(args.out, f"tables{t}_run{r + 1}.txt") if args.out else None
            flags = [
                "--tables", str(t), "--rows", str(args.total_rows // t), "--dim", str(args.dim),
                "--batch", str(args.batch), "--pooling", str(args.ids_per_sample // t),
                "--plans", *args.plans, "--optimizers", args.optimizer, "--steps", str(args.steps),
            ]  # fmt: skip
            runs.append(parse_step_table(run_step_time(flags, log=log)))
        for plan in args.plans:
            key = (plan, args.optimizer)
            for c in CONTENDERS:
                got = [run[key].get(c) for run in runs if key in run and run[key].get(c) is not None]
                times.setdefault((plan, c), [None] * len(args.tables))[i] = (
                    statistics.median(got) if got else None
                )
            got = [run[key]["floor"] + run[key]["dense"] for run in runs if key in run]
            bases.setdefault(plan, [None] * len(args.tables))[i] = statistics.median(got) if got else None

    sizes = " / ".join(str(t) for t in args.tables)
    print(
        f"\n## Step time per feature ({datetime.date.today().isoformat()}): {sizes} tables, "
        f"{args.total_rows:,} rows x {args.dim} dims in all, {args.ids_per_sample} ids per sample, "
        f"batch {args.batch} per rank, {args.optimizer}, {args.steps} steps, median of {args.runs} "
        f"run(s) per size\n"
    )
    print(f"| plan | contender | step ms at {sizes} tables | us per feature | "
          "above the floor, us per feature |")  # fmt: skip
    print("|---|---|---|---:|---:|")
    for plan in args.plans:
        for c in CONTENDERS:
            ys = times.get((plan, c), [])
            if not ys or None in ys:
                print(f"| {plan} | {c} | n/a | n/a | n/a |")
                continue
            above = "" if c == "floor" or None in bases[plan] else (
                f"{slope(args.tables, [y - b for y, b in zip(ys, bases[plan])]) * 1e3:.1f}"
            )  # fmt: skip
            cells = " / ".join(f"{y:.1f}" for y in ys)
            print(f"| {plan} | {c} | {cells} | {slope(args.tables, ys) * 1e3:.1f} | {above} |")


if __name__ == "__main__":
    main()
