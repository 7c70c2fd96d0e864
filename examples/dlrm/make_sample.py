"""Writes a small synthetic file in the Criteo TSV format (no real Criteo data).

    python -m examples.dlrm.make_sample                    # examples/data/criteo_sample.tsv
    python -m examples.dlrm.make_sample --out /tmp/s.tsv --lines 1000 --seed 1

The output depends only on --lines and --seed. About 10% of the dense and 5% of the
categorical values are missing (empty), and some dense values are negative, as in Criteo.
"""

import argparse
from pathlib import Path

import numpy as np

from examples.dlrm.data import NUM_CRITEO_CATEGORICAL
from examples.dlrm.model import NUM_DENSE_FEATURES

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "data" / "criteo_sample.tsv"


def sample_lines(num_lines: int, seed: int) -> list[str]:
    """`num_lines` Criteo-format lines (without newline), a function of the seed only."""
    rng = np.random.default_rng(seed)
    labels = rng.random(num_lines) < 0.25
    dense = np.floor(np.exp(1.0 + 1.5 * rng.standard_normal((num_lines, NUM_DENSE_FEATURES))))
    dense = dense.astype(np.int64) - (rng.random((num_lines, NUM_DENSE_FEATURES)) < 0.03) * 3
    dense_missing = rng.random((num_lines, NUM_DENSE_FEATURES)) < 0.10
    # A few hundred distinct values per feature, so ids repeat as in real data.
    vocab = rng.integers(0, 2**32, size=(NUM_CRITEO_CATEGORICAL, 300), dtype=np.uint64)
    picks = np.minimum(rng.zipf(1.3, size=(num_lines, NUM_CRITEO_CATEGORICAL)) - 1, 299)
    cat_missing = rng.random((num_lines, NUM_CRITEO_CATEGORICAL)) < 0.05
    lines = []
    for i in range(num_lines):
        fields = [str(int(labels[i]))]
        fields += [
            "" if dense_missing[i, j] else str(dense[i, j]) for j in range(NUM_DENSE_FEATURES)
        ]
        fields += [
            "" if cat_missing[i, j] else f"{int(vocab[j, picks[i, j]]):08x}"
            for j in range(NUM_CRITEO_CATEGORICAL)
        ]
        lines.append("\t".join(fields))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--lines", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(line + "\n" for line in sample_lines(args.lines, args.seed)))
    print(f"wrote {args.lines} lines to {args.out}")


if __name__ == "__main__":
    main()
