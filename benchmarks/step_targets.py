"""Issue 29's CPU targets, each ratio the median over separate runs of step_time.py.

    python benchmarks/step_targets.py                    # 3 rounds, 20 steps per contender
    python benchmarks/step_targets.py --runs 3 --steps 40 --out out/targets

A round is two fresh runs of `benchmarks/step_time.py` (each its own processes, every contender
side by side in alternating blocks): every plan with `--cw-statistic per_shard` (TorchRec's
approximation, so column-wise compares like with like), then the column-wise fused plan with the
default exact statistic. The targets (issue 29):

  overhead   (ours - base) / (TorchRec - base) <= 0.5, base = floor + dense part: the framework's
             own cost per step against TorchRec's, for tw / rw / cw (per_shard) / dp, fused and
             dense. Below zero when ours is under the floor (the dense floor, fbgemm's dense TBE +
             SGD, updates every row; ours and TorchRec's step do not).
  cw         ours (per_shard) / TorchRec <= 0.8 for column-wise fused tables, and
             ours (exact) / ours (per_shard) <= 1.25.

Each ratio is computed within one run (both sides measured side by side), and the median of those
per-run ratios is what counts. Also printed, not targets: ours / TorchRec everywhere, the same
overhead ratio for ours + prefetch against TorchRec's pipeline, each side's ms above the base,
and "comm": ours' collectives replayed alone (what moving the step's bytes costs here).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from typing import Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._tables import overhead_ratio, parse_step_table, run_step_time  # noqa: E402

OVERHEAD_TARGET, CW_TARGET, EXACT_TARGET = 0.5, 0.8, 1.25
CASES = [(p, o) for p in ("tw", "rw", "cw", "dp") for o in ("dense", "fused")]


def _median(values: list[Optional[float]]) -> Optional[float]:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _fmt(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="rounds; each ratio is their median")
    p.add_argument("--steps", type=int, default=20, help="timed steps per contender per run")
    p.add_argument("--out", default=None, help="folder for each run's whole output")
    p.add_argument("extra", nargs="*", help="more step_time.py flags, after --")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    common = ["--steps", str(args.steps), *args.extra]
    rounds = []
    for r in range(args.runs):
        logs = [None, None]
        if args.out:
            logs = [os.path.join(args.out, f"run{r + 1}_{k}.txt") for k in ("per_shard", "cw_exact")]
        print(f"[round {r + 1}/{args.runs}] all plans, per_shard column statistic ...", flush=True)
        approx = parse_step_table(run_step_time([*common, "--cw-statistic", "per_shard"], log=logs[0]))
        print(f"[round {r + 1}/{args.runs}] column-wise fused, exact statistic ...", flush=True)
        exact = parse_step_table(
            run_step_time([*common, "--plans", "cw", "--optimizers", "fused"], log=logs[1])
        )
        rounds.append((approx, exact))
        _print_round(r + 1, approx, exact)

    def per_round(f: Callable) -> list[Optional[float]]:
        return [f(a, e) for a, e in rounds]

    print(
        f"\n## Medians over {args.runs} rounds ({datetime.date.today().isoformat()}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"step_time.py {' '.join(common)})\n"
    )
    print("| plan | optimizer | ours / TorchRec | overhead: ours vs TorchRec (<= 0.5) | "
          "overhead: ours + prefetch vs TorchRec pipeline | ours - base ms | TorchRec - base ms | "
          "comm ms |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    verdicts = []
    for case in CASES:
        ratio = _median(per_round(lambda a, e: _ratio(a.get(case), "ours", "torchrec")))
        over = _median(per_round(lambda a, e: overhead_ratio(a[case]) if case in a else None))
        piped = _median(per_round(
            lambda a, e: overhead_ratio(a[case], "prefetch", "pipeline") if case in a else None
        ))  # fmt: skip
        ours_over = _median(per_round(lambda a, e: _above(a.get(case), "ours")))
        theirs_over = _median(per_round(lambda a, e: _above(a.get(case), "torchrec")))
        comm = _median(per_round(lambda a, e: (a.get(case) or {}).get("comm")))
        name = f"{case[0]}{' (per_shard)' if case[0] == 'cw' else ''}"
        print(f"| {name} | {case[1]} | {_fmt(ratio)} | {_fmt(over)} | {_fmt(piped)} | "
              f"{_fmt(ours_over)} | {_fmt(theirs_over)} | {_fmt(comm)} |")
        verdicts.append((f"overhead {name}/{case[1]}", over, OVERHEAD_TARGET))
    cw = ("cw", "fused")
    cw_ratio = _median(per_round(lambda a, e: _ratio(a.get(cw), "ours", "torchrec")))
    exact_cost = _median(per_round(
        lambda a, e: None if cw not in a or cw not in e or not a[cw].get("ours")
        else e[cw]["ours"] / a[cw]["ours"]
    ))  # fmt: skip
    verdicts.append(("cw/fused per_shard: ours / TorchRec", cw_ratio, CW_TARGET))
    verdicts.append(("cw/fused: exact / per_shard", exact_cost, EXACT_TARGET))
    print()
    for what, value, target in verdicts:
        state = "n/a" if value is None else ("met" if value <= target else "NOT met")
        print(f"target {what} <= {target}: {_fmt(value)} ({state})")


def _above(row, who: str) -> Optional[float]:
    """`who`'s ms above the floor + dense part in one run (its own cost per step)."""
    if row is None or None in (row.get(who), row.get("floor"), row.get("dense")):
        return None
    return row[who] - row["floor"] - row["dense"]


def _ratio(row, a: str, b: str) -> Optional[float]:
    if row is None or row.get(a) is None or not row.get(b):
        return None
    return row[a] / row[b]


def _print_round(r: int, approx: dict, exact: dict) -> None:
    print(f"\nround {r}: ms (ours, ours + prefetch, TorchRec, pipeline, floor + dense part)")
    for case, row in list(approx.items()) + [(("cw exact",) + k[1:], v) for k, v in exact.items()]:
        base = None if row.get("floor") is None else row["floor"] + (row.get("dense") or 0.0)
        cells = [row.get(k) for k in ("ours", "prefetch", "torchrec", "pipeline")] + [base]
        print(f"  {case[0]:>9}/{case[1]:<5} " + " ".join(f"{_fmt(c):>7}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
