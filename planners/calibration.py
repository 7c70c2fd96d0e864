"""What `python -m planners calibrate` measured on a machine, and its file (pure Python).

    topology = planners.Topology.from_file("h.json")   # the measured constants, priced with
    python -m planners plan tables.json --topology h.json ...

Note [calibrated prices]
Without a file the planner prices a step with the H100 constants of `Topology` (bandwidths of
HBM, NVLink and the NIC): a bound that no kernel reaches. `calibrate` measures the machine as
the job's ranks run it (one process per rank over the job's backend, its threads per rank) and
the cost model then prices each part of a step with what was measured:
- lookup: modular's own kernels, timed apart from the wire (every rank a one-rank model of its
  own, all ranks at once as they share the machine in a step) on shapes that span what a shard
  meets (modular/measure_kernels.py), fitted per kernel family as
      t = per_id * n + per_id_byte * n*d*e + per_bag_column * b*d + per_table_byte * R*d*e
          + per_touched_byte * u*d*e + per_shard
  for n ids, b bags and d columns of e bytes in a shard of R rows, u of them touched
  (`KernelRate`): random row reads and updates cost more than a streaming copy, which is what
  the H100 constants assume, an update costs per distinct row, and the Adam family's emulation
  pays per shard. Inside a step the same kernels run slower or faster than alone (caches shared
  with the routing, the wire's buffers): one factor per family (and per family's data-parallel
  copies, `DATA_PARALLEL`) is fitted on the probe steps below;
- the all-to-alls (input and output dist) and the all-reduce of data-parallel gradients:
  `seconds = latency + bytes / bandwidth`, per peer for all_to_all_single;
- a data-parallel copy is priced as modular runs it, where the H100 model prices an all-reduce
  of the whole table: a fused copy gathers the touched rows' gradients (Note [fused
  data-parallel copies] in modular/fused/deferred.py), an unfused one the peers' ids and bag
  gradients when its global batch has at most as many ids as it has rows (Note [dense
  data-parallel copies] in modular/kernels/dense.py; else it all-reduces), and both run their
  backward and update on the global batch, at the family's rates times a factor of their own
  (`DATA_PARALLEL`);
- what a step costs beyond the kernels and the wire: a fixed part (Python, checks, the
  collectives' latencies, a kernel call), `kernel_fixed` for each further kind of shard a rank
  holds (each runs its own kernels), one all-reduce's latency for data-parallel tables, and
  the rank's own batch: routing per id it sends.
  These, with the factors above, are fitted on probe steps of modular at the job's world size,
  as what the parts above leave unexplained: hand-picked corners (some with several kinds of
  shard on a rank) and a seeded spread over kinds, families, widths, poolings and batches, by
  least squares on each probe's error relative to its step (a 5 ms step's error weighs as much
  as a 100 ms step's), every constant >= 0. They go into each rank's `fixed`
  (`RankStats.fixed`): the search places tables with the per-table parts, and the step's
  prediction adds them.
- the collectives' latency is the median of a small message alone, their bandwidth the slope
  above it through larger ones timed in turn (`interleaved` in modular/measure_device.py), so
  that a slow minute of the machine does not fall on one size.
On CUDA (`calibrate --device cuda`) every timed step ends with the GPU's work and the
collectives run over NCCL or gloo as the job's would (Note [calibrating a GPU machine] in
modular/measure_device.py); the file records the device, the backend and `notes` on what such a
run cannot measure as a job would (gloo for NCCL, world 1's collectives without a peer).
The file records the machine and the date; the CLI prints both with every priced plan, and
old files are not refused (a warning past `STALE_DAYS`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from planners.types import PlanError

__all__ = ["Calibration", "CalibrationError", "KernelRate", "DATA_PARALLEL", "FAMILIES", "SCHEMA",
           "STALE_DAYS"]

SCHEMA = "modular-topology/1"
STALE_DAYS = 30
# a gathered id (int64) and a gradient float (fp32): planners/cost.py's ROW_ID_BYTES and
# OUTPUT_BYTES, which this module cannot import (cost.py reads a Topology's calibration)
ID_BYTES, GRAD_BYTES = 8, 4
# Kernel families, as modular chooses them (modular/fused/choice.py): fbgemm's fused CPU/GPU
# kernels (SGD, Adagrad, row-wise Adagrad), the exact torch emulation (the Adam family, widths
# fbgemm cannot take), and the dense kernel that a torch optimizer steps (unfused).
FAMILIES = ("fused", "emulated", "dense")
# A data-parallel copy of each family runs differently (it gathers the peers' rows or batches and
# updates for the global batch), so calibrate fits its rates apart, under these names; a file
# without them prices data-parallel copies at the family's own rates.
DATA_PARALLEL = {f: f"{f}_dp" for f in FAMILIES}


def replays(world: int, ids: Any, rows: Any) -> Any:
    """Whether an unfused data-parallel copy replays the global batch (its ids x columns at most
    the table's rows x columns: modular's `replay_pays` at its default ratio of 1) instead of
    all-reducing its gradient."""
    return world * ids <= rows


class CalibrationError(PlanError):
    """A topology file that cannot be read: the message names the file and what is wrong."""


@dataclass(frozen=True)
class KernelRate:
    """Seconds of one kernel family's forward + backward (+ update) of one shard of R rows, for
    n ids of d columns of e bytes into b bags, u of its rows touched:
        per_id * n + per_id_byte * n*d*e + per_bag_column * b*d + per_table_byte * R*d*e
        + per_touched_byte * u*d*e + per_shard
    `per_table_byte` is the dense kernel's (its torch optimizer steps over the whole gradient
    buffer, Note [dense gradient buffer] in modular/kernels/dense.py); `per_touched_byte` the
    update of the distinct rows a step touches (a fused optimizer's rows and their state), u = R
    (1 - exp(-n / R)) for ids drawn uniformly; `per_shard` what each shard's kernel call costs
    whatever its size (the Adam family's emulation runs per table). Files written before the last
    two were measured price them at 0."""

    per_id: float
    per_id_byte: float
    per_bag_column: float
    per_table_byte: float = 0.0
    per_touched_byte: float = 0.0
    per_shard: float = 0.0

    PARTS = ("per_id", "per_id_byte", "per_bag_column", "per_table_byte", "per_touched_byte",
             "per_shard")  # its fields, in order (what calibrate fits)

    def seconds(self, ids: Any, row_bytes: Any, bag_columns: Any, table_bytes: Any,
                touched_bytes: Any = 0.0) -> Any:  # fmt: skip
        return (self.per_id * ids + self.per_id_byte * ids * row_bytes
                + self.per_bag_column * bag_columns + self.per_table_byte * table_bytes
                + self.per_touched_byte * touched_bytes + self.per_shard)  # fmt: skip


@dataclass(frozen=True, eq=False)  # its rates are a dict: compared and hashed by identity
class Calibration:
    """The constants one `calibrate` run measured (seconds, bytes/second)."""

    kernels: Mapping[str, KernelRate]  # by family (`FAMILIES`)
    all_to_all_latency: float  # one all_to_all_single
    all_to_all_bandwidth: float  # bytes/s from each peer
    all_reduce_latency: float
    all_reduce_bandwidth: float  # bytes/s of the reduced tensor (ring: 2 (W-1)/W of it moves)
    stream_bandwidth: float  # a streaming read + write (a data-parallel table's whole-table step)
    step_fixed: float  # a step of a tiny table on every rank
    kernel_fixed: float  # one more kernel call
    world_size: int
    threads_per_rank: int
    backend: str
    device: str
    # What a rank spends on its own batch beyond the kernels and the wire, fitted on probe steps
    # at the job's world size: routing (checks, bucketing, permutations) per id it sends (an id
    # sent to k column pieces counts k times).
    sent_id: float = 0.0
    host: str = ""
    measured_at: float = 0.0  # seconds since the epoch
    versions: Mapping[str, str] = field(default_factory=dict)
    # Not measured, written in by hand where known: each rank's tier for tiered tables (bytes;
    # "500GiB" too) and its bytes/s, which `Topology.from_file` takes unless given (Note
    # [pricing tiered tables] in planners/tier_cost.py). None: Topology's defaults.
    tier_memory: int | str | None = None
    tier_bandwidth: float | None = None
    # What the run could not measure as the job runs it (e.g. gloo standing in for NCCL); written
    # by `calibrate --device cuda` (Note [calibrating a GPU machine] in modular/measure_device.py)
    notes: tuple[str, ...] = ()
    path: str = ""  # where it was read from ("" if not from a file)

    def __post_init__(self) -> None:
        missing = [f for f in FAMILIES if f not in self.kernels]
        if missing:
            raise CalibrationError(f"{self._where}kernel rates for {missing} are missing")
        for name in ("all_to_all_bandwidth", "all_reduce_bandwidth", "stream_bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise CalibrationError(f"{self._where}{name} must be a positive number, got {value!r}")
        value = self.tier_bandwidth
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise CalibrationError(f"{self._where}tier_bandwidth must be a positive number, got {value!r}")
        for name in ("all_to_all_latency", "all_reduce_latency", "step_fixed", "kernel_fixed",
                     "sent_id"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise CalibrationError(f"{self._where}{name} must be a number >= 0, got {value!r}")

    def lookup_seconds(self, family: Any, data_parallel: bool, fused: bool, rows: Any,
                       row_bytes: Any, ids: Any, bag_columns: Any, work: Any, base: Any,
                       world: int = 1) -> Any:  # fmt: skip
        """A shard's lookup at the measured rate of its kernel family (`FAMILIES` index per
        entry, planners/cost.py's `CostModel.family`); what a kind adds beyond one pass (a column
        piece's second backward, the other replica groups' batches: `work` over `base` bytes)
        scales it as it scales the bytes. A data-parallel copy runs its backward and update on
        the global batch where modular gathers it (a fused copy's touched rows; an unfused copy
        that replays, `replays`), and an unfused copy's whole-table step (the bytes beyond the
        ids' rows) streams at the measured copy rate."""
        if data_parallel:
            whole = fused | replays(world, ids, rows)
            ids = np.where(whole, ids * (1 + world) / 2, ids)  # forward: its own ids
        seconds = 0.0 * rows * row_bytes
        touched = rows * -np.expm1(-ids / np.maximum(rows, 1))  # distinct rows of uniform ids
        for f, name in enumerate(FAMILIES):
            rate = self.kernels[name]
            if data_parallel:  # its own rates where the file has them
                rate = self.kernels.get(DATA_PARALLEL[name], rate)
            here = rate.seconds(ids, row_bytes, bag_columns, rows * row_bytes, touched * row_bytes)
            seconds = np.where(family == f, here, seconds)
        if data_parallel and fused:
            return seconds
        if data_parallel:
            return seconds + np.maximum(work - base, 0.0) / self.stream_bandwidth
        return seconds * np.where(base > 0, work / np.maximum(base, 1e-30), 1.0)

    def data_parallel_sync(self, fused: bool, world: int, rows: Any, cols: Any, elem: Any, ids: Any,
                           bags: Any) -> Any:  # fmt: skip
        """Seconds a data-parallel copy's gradient takes to agree across ranks, as modular does
        it: a fused copy gathers each rank's touched rows (int64 id + fp32 gradient row; Note
        [fused data-parallel copies] in modular/fused/deferred.py); an unfused one gathers the
        peers' ids and bag gradients when replaying them is cheaper than an all-reduce of its
        gradient (`replays`, Note [dense data-parallel copies] in modular/kernels/dense.py), and
        all-reduces the gradient otherwise."""
        if fused:
            touched = rows * -np.expm1(-ids / np.maximum(rows, 1))
            gathered = (world - 1) * touched * (ID_BYTES + cols * GRAD_BYTES)
            return self.all_to_all_latency + gathered / self.all_to_all_bandwidth
        gathered = (world - 1) * (ids * ID_BYTES + bags * cols * GRAD_BYTES)
        replay = self.all_to_all_latency + gathered / self.all_to_all_bandwidth
        reduce = self.all_reduce_latency + rows * cols * elem / self.all_reduce_bandwidth
        return np.where(replays(world, ids, rows), replay, reduce)

    @property
    def _where(self) -> str:
        return f"topology file {self.path}: " if self.path else ""

    @property
    def _on(self) -> str:
        return self.backend if self.device == "cpu" else f"{self.device} over {self.backend}"

    def age_days(self, now: float | None = None) -> float:
        return ((time.time() if now is None else now) - self.measured_at) / 86400

    def describe(self, now: float | None = None) -> str:
        """One line for the CLI: which constants a plan was priced with, and how old they are."""
        age = self.age_days(now)
        when = f"{age * 24:.1f} hours" if age < 2 else f"{age:.0f} days"
        line = (f"priced with calibrated constants from {self.path or 'a calibration'} "
                f"(measured on {self.host or 'an unnamed host'}, {self._on}, world "
                f"{self.world_size}, {self.threads_per_rank} thread(s) per rank, {when} ago)")  # fmt: skip
        if self.notes:
            line += "; its notes: " + "; ".join(self.notes)
        if age > STALE_DAYS:
            line += f"; it is over {STALE_DAYS} days old: run `python -m planners calibrate` again"
        return line

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("path")
        if not d["notes"]:
            d.pop("notes")  # a CPU file's fields, as before notes
        return {"schema": SCHEMA, **d}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, data: Any, path: str = "") -> "Calibration":
        where = f"topology file {path}: " if path else ""
        if not isinstance(data, dict):
            raise CalibrationError(f"{where}expected a JSON object written by `python -m planners calibrate`")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise CalibrationError(
                f"{where}schema {schema!r} is not {SCHEMA!r}: write it again with "
                "`python -m planners calibrate --out FILE`"
            )
        fields = {k: v for k, v in data.items() if k != "schema"}
        try:
            kernels = {name: KernelRate(**rate) for name, rate in fields.pop("kernels").items()}
            if "notes" in fields:
                fields["notes"] = tuple(str(n) for n in fields["notes"])
            return cls(kernels=kernels, path=path, **fields)
        except CalibrationError:
            raise
        except (KeyError, TypeError, AttributeError) as e:
            raise CalibrationError(f"{where}missing or unexpected field ({e})") from None

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise CalibrationError(f"topology file {p}: cannot read it ({e.strerror})") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"topology file {p}: not JSON (line {e.lineno}: {e.msg})") from None
        return cls.from_json(data, str(p))
