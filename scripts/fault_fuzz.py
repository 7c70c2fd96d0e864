"""A longer sweep of tests/faults/test_fuzz.py's seeded faults (issue 48), at world 2.

    PYTHONPATH=$PWD python scripts/fault_fuzz.py --cases 200 --seed 1

Each case must raise the same error class on every rank within seconds, the state unchanged
bit for bit; prints each failing case (reproduce it with its seed) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.dist import shutdown_pools
from tests.faults.test_fuzz import check_case, make_cases, run_case


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    failures = 0
    start = time.monotonic()
    try:
        for i, case in enumerate(make_cases(a.seed, a.cases)):
            try:
                check_case(case, run_case(case))
            except Exception as e:  # report every failing case, then go on
                failures += 1
                print(f"case {i} (seed {a.seed}) {case}: {type(e).__name__}: {e}", flush=True)
    finally:
        shutdown_pools()
    print(f"{a.cases - failures} of {a.cases} cases failed together as they should "
          f"({time.monotonic() - start:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
