"""The command line's flags: the parser of `python -m planners`, its help texts and flag types.

`build_parser` declares the four subcommands (plan, show, compare, replan) and their flags;
what each command does with them is in planners/cli_commands.py.
"""

from __future__ import annotations

import argparse
import re

from planners.inputs import ColumnWiseStatistic, DataType, Optimizer, parse_bytes
from planners.replicas import ReplicaSync
from planners.report import SORT_KEYS
from planners.types import PlanError

_EPILOG = """\
examples:
  python -m planners plan examples/tables_criteo_1tb.yaml --world-size 64 --ranks-per-host 8 \\
      --device-memory 80GiB --batch-size 512 -o plan.json
  python -m planners show plan.json --table t_cat_9 --plot ranks.png
  python -m planners show plan.json --sort cost --top 10
  python -m planners show plan.json --format csv > shards.csv
  python -m planners compare plan.json other.json --plot both.png

TABLES is a YAML or JSON list of records, or a CSV file with a header, with the fields
name, num_embeddings, embedding_dim, features, pooling_factor, dtype, weighted, sequence,
batch_fraction (only the first three are required; sequence: true for an EmbeddingCollection's
table, whose pooling_factor is then the average sequence length; batch_fraction, in (0, 1], a
deduplicated feature's bags per sample, e.g. 0.125 for a request-level feature of 8 candidates:
its lookups and comms are priced at that batch, and 'show --table' says so). A plan file written by 'plan -o' records
the tables, constraints, cluster and workload it was planned from, so 'show' and 'compare' need
no more flags; a flag given again overrides the record, and the output says so. Sizes need a
unit (80GiB, 512MiB, 80GB). The cost model is described in docs/planner.md.
Exit codes: 0 ok, 1 no plan fits (the message names the tables and the ways out),
2 bad input (a one-line error naming the file, line or field).
"""


def _bandwidth(text: str) -> float:
    try:
        return float(parse_bytes(text, "bandwidth"))
    except PlanError as e:  # argparse shows an ArgumentTypeError's own text, not the type's name
        raise argparse.ArgumentTypeError(str(e)) from None


def _bytes(text: str) -> int:
    # A bare number would be bytes: '--device-memory 80' meant 80 GiB, not 80 bytes.
    if re.fullmatch(r"\s*[0-9.eE+-]+\s*", text):
        try:
            number = float(text)
        except ValueError:
            number = None
        if number is not None and number > 0:
            raise argparse.ArgumentTypeError(
                f"memory size needs a unit: {text!r} would be {text.strip()} bytes; write e.g. "
                f"'{text.strip()}GiB' or '{text.strip()}MiB'"
            )
    try:
        return parse_bytes(text, "memory size")
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _optimizer(text: str) -> str:
    try:
        return Optimizer.parse(text).value
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_cluster_flags(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("cluster and workload" + ("" if required else
                                                       " (default: as recorded in the plan)"))  # fmt: skip
    if required:
        g.add_argument("--world-size", type=int, required=True, help="number of ranks (GPUs)")
        g.add_argument("--ranks-per-host", type=int, help="ranks per host (default: min(8, world size))")
        g.add_argument("--batch-size", type=int, required=True, help="samples per rank per step")
    else:
        g.add_argument("--batch-size", type=int, help="samples per rank per step")
    g.add_argument("--device-memory", type=_bytes,
                   help="memory per rank with its unit, e.g. 80GiB (default 80GiB, an H100)")  # fmt: skip
    g.add_argument("--reserved", type=float, dest="reserved_fraction",
                   help="fraction of device memory kept free (default 0.1)")  # fmt: skip
    g.add_argument("--memory-bandwidth", type=_bandwidth, dest="device_memory_bandwidth",
                   help="device memory bytes/s, e.g. 3.35e12 (default H100 HBM3)")  # fmt: skip
    g.add_argument("--intra-host-bandwidth", type=_bandwidth,
                   help="bytes/s per rank inside a host (default 450e9, NVLink)")
    g.add_argument("--cross-host-bandwidth", type=_bandwidth,
                   help="bytes/s per rank across hosts (default 50e9, 400 Gb/s NIC)")
    g.add_argument("--tier-memory", type=_bytes,
                   help="room per rank for tiered tables' stores (local disk under tier_dir on "
                        "CPU ranks, host memory on CUDA), e.g. 500GiB (default 1TiB)")  # fmt: skip
    g.add_argument("--tier-bandwidth", type=_bandwidth,
                   help="bytes/s a rank reads and writes its tier at (default 2e9, local disk "
                        "or page cache; ~25e9 for host memory over PCIe)")  # fmt: skip
    g.add_argument("--prefetch", action="store_true", default=None,
                   help="the loop calls modular.prefetch: tiered tables' reads and write-backs "
                        "run beside the step (default: not, or as recorded)")  # fmt: skip
    g.add_argument("--topology", metavar="FILE",
                   help="price with the constants `python -m planners calibrate --out FILE` "
                        "measured on the machine the job runs on (default: an H100 cluster's "
                        "bandwidths); recorded in the plan file")  # fmt: skip
    g.add_argument("--optimizer", type=_optimizer, metavar="OPT",
                   help="embedding optimizer: sgd, rowwise_adagrad (default), adagrad, adam, "
                        "partial_rowwise_adam, lamb, partial_rowwise_lamb, or "
                        "modular.fuse_optimizer's names exact_sgd, exact_rowwise_adagrad, "
                        "exact_adagrad; unfused_sgd, unfused_adagrad, unfused_adam for tables "
                        "not fused, stepped by that torch optimizer (a gradient buffer as large "
                        "as the weights, and torch's state)")  # fmt: skip
    g.add_argument("--column-wise-statistic", choices=[s.value for s in ColumnWiseStatistic],
                   help="row-wise Adagrad's row statistic on a table cut into column pieces, as "
                        "given to modular.fuse_optimizer: exact (default; each piece pays a second "
                        "backward pass and an exchange of statistics) or per_shard (TorchRec's "
                        "approximation: plain pieces, so cutting costs less); no effect under the "
                        "other optimizers")  # fmt: skip
    g.add_argument("--comm-dtype", choices=[d.value for d in DataType],
                   help="dtype the pooled embeddings and their gradients travel in, as given to "
                        "modular.shard(comm_dtype=...): fp32 (default), fp16 or bf16 (half the "
                        "output-dist bytes, plus the low-precision copies in memory)")  # fmt: skip
    g.add_argument("--module", help="FQN of the EBC the tables belong to (default: '')")
    g.add_argument("--replicas", type=int, metavar="R",
                   help="2D sparse parallelism: plan one shard group of world-size / R ranks, "
                        "replicated R times (modular.shard with a ('replicate', 'shard') mesh); "
                        "default 1")  # fmt: skip
    g.add_argument("--replica-sync", choices=[m.value for m in ReplicaSync],
                   help="how the R replica groups stay in step, as given to modular.shard: exact "
                        "(default; every group's ids and pooled gradients gathered each step, "
                        "priced) or periodic (nothing per step)")  # fmt: skip


def _add_view_flags(p: argparse.ArgumentParser, plot_help: str) -> None:
    g = p.add_argument_group("what to print")
    g.add_argument("--table", action="append", metavar="NAME", default=[],
                   help="show only this table, shard by shard (repeatable)")
    g.add_argument("--sort", choices=list(SORT_KEYS), default="order",
                   help="order of the per-table view: as planned (default), by name, by the "
                        "cost or memory of the largest shard, total cost, type or shard count")  # fmt: skip
    g.add_argument("--top", type=int, metavar="N", help="show at most N tables")
    g.add_argument("--rows", type=int, default=None, help="show at most this many ranks")
    g.add_argument("--format", choices=("table", "json", "csv"), default="table",
                   help="table (default, for people), json (everything), or csv (one row per shard)")
    g.add_argument("--plot", metavar="PNG", help=plot_help)
    g.add_argument("--plot-by", choices=("type", "table"), default="type",
                   help="colour the plot's table blocks by sharding type (default) or by table")


def _budget(text: str) -> int:
    """A byte count with its unit, or 0 (keep the old plan)."""
    if re.fullmatch(r"\s*0+\s*[A-Za-z]*\s*", text):
        return 0
    return _bytes(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m planners",
        description="Plan where embedding tables go on a GPU cluster, and explain the plan.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{plan,show,compare,replan,calibrate}")  # fmt: skip
    p = sub.add_parser("plan", help="plan TABLES and print where each table went and what it costs",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("tables", metavar="TABLES", help="table file (.yaml, .json or .csv)")
    p.add_argument("--constraints", metavar="C", help="per-table constraints (.yaml or .json)")
    p.add_argument("--torchrec-compatible", action="store_true",
                   help="plan only what TorchRec's DistributedModelParallel runs as planned: "
                        "to_torchrec converts it with no warning and no moved row (row-wise "
                        "tables over every rank, table-row-wise over a whole host, in TorchRec's "
                        "block split); recorded in the plan file")  # fmt: skip
    p.add_argument("--no-auto-tier", dest="auto_tier", action="store_false",
                   help="never put a table on a tier by itself (by default, when no plan fits "
                        "with every table resident, the largest tables go on a tier behind a "
                        "cache; docs/planner.md, 'Tiered tables')")  # fmt: skip
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan JSON here")
    _add_view_flags(p, "draw per-rank cost, memory and tables here (PNG)")
    _add_cluster_flags(p, required=True)
    s = sub.add_parser("show", help="print a plan again (per rank and per table), and --plot it",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    s.add_argument("plan", metavar="PLAN", help="plan JSON written by 'plan'")
    s.add_argument("--tables", metavar="TABLES", help="the table file (default: as recorded)")
    s.add_argument("--constraints", metavar="C", help="constraints (default: as recorded)")
    _add_view_flags(s, "draw per-rank cost, memory and tables here (PNG)")
    _add_cluster_flags(s, required=False)
    c = sub.add_parser("compare", help="compare two plans: settings, figures, tables that moved",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    c.add_argument("plans", metavar="PLAN", nargs=2, help="two plan JSON files")
    c.add_argument("--tables", metavar="TABLES", help="the table file (default: as recorded)")
    c.add_argument("--constraints", metavar="C", help="constraints (default: as recorded)")
    c.add_argument("--plot", metavar="PNG", help="draw the two plans side by side here (PNG)")
    c.add_argument("--plot-by", choices=("type", "table"), default="type",
                   help="colour the plot's table blocks by sharding type (default) or by table")
    c.add_argument("--format", choices=("table", "json"), default="table",
                   help="table (default) or json: both plans' statistics, the settings that "
                        "differ and every table that moved")  # fmt: skip
    _add_cluster_flags(c, required=False)
    r = sub.add_parser("replan", help="a plan for updated tables within a budget of moved bytes "
                                      "(modular.reshard moves them), and what moves and why")
    r.add_argument("plan", metavar="PLAN", help="the current plan JSON written by 'plan'")
    r.add_argument("--tables", metavar="TABLES", required=True,
                   help="the updated tables (new pooling factors, new rows)")
    r.add_argument("--max-moved", type=_budget, metavar="BYTES",
                   help="most bytes of weights and optimizer state that may change rank, e.g. "
                        "20GiB (default: no limit; 0B keeps the old plan)")  # fmt: skip
    r.add_argument("--constraints", metavar="C", help="constraints (default: as recorded)")
    r.add_argument("-o", "--output", metavar="PLAN", help="write the new plan JSON here")
    _add_cluster_flags(r, required=False)
    k = sub.add_parser("calibrate", help="measure this machine as a job's ranks run it and write "
                                         "a topology file for --topology (docs/planner.md)")
    k.add_argument("--out", required=True, metavar="FILE", help="the topology file to write (JSON)")
    k.add_argument("--world-size", type=int, default=2,
                   help="rank processes to measure with, as the job runs them (default 2)")
    k.add_argument("--threads-per-rank", type=int, default=1,
                   help="threads of each rank (default 1, as torchrun sets OMP_NUM_THREADS)")
    k.add_argument("--quick", action="store_true",
                   help="fewer sizes and steps (~10 s instead of ~40 s): rougher constants")
    k.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: each rank on GPU rank %% GPUs, steps timed to the GPU's end "
                        "(docs/planner.md, 'Calibrating a GPU machine')")
    k.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="the collectives' backend (default: gloo on CPU; on cuda nccl with a GPU "
                        "per rank, else gloo, the ranks sharing the GPUs)")  # fmt: skip
    return parser

