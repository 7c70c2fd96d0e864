"""The floor's achieved bandwidth in benchmarks/step_time.py: the bytes fbgemm's fused row-wise
Adagrad kernel must read and write in a step, counted from that step's ids, and the peak memory
bandwidth of the devices we know, so that a run prints how far the floor is from the physical
limit. All but `ids_per_table` (which counts a batch's distinct ids with torch) are pure
functions of counts and names; tests/test_benchmark_targets.py checks them on CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "PEAK_BANDWIDTH", "bandwidth_line", "floor_bytes_per_step", "fused_floor_bytes",
    "ids_per_table", "peak_bandwidth",
]  # fmt: skip


def fused_floor_bytes(
    *, ids: list[int], unique: list[int], dims: list[int], bags: int, weight_bytes: int = 4,
    output_bytes: int = 4, momentum_bytes: int = 4, index_bytes: int = 4,
) -> int:  # fmt: skip
    """The bytes a fused row-wise Adagrad TBE must read and write in one step (forward, then
    backward with the update), a lower bound counted from that step's own ids.

    For each table t, `dims[t]` wide (D), looked up by `ids[t]` ids (n) of which `unique[t]`
    are distinct rows (u), over `bags` bags (B) per table, with w bytes per weight, o per output
    element, m per row's momentum (row-wise Adagrad keeps one) and i per index:

        forward    n*D*w          read every looked-up row
                 + B*D*o          write the pooled output
        backward   B*D*o          read the output's gradient
                 + 2*u*D*w        read and write each distinct row (the update)
                 + 2*u*m          read and write each distinct row's momentum
        indices    2*(n + B)*i    ids and offsets, read in forward and again in backward

    and the step moves the sum over tables. A kernel that reads a row once per id in backward too,
    or sorts the ids through memory, moves more: achieved bandwidth is these bytes over the step's
    time, so it is at most what the kernel really moved per second.
    """
    if not len(ids) == len(unique) == len(dims):
        raise ValueError(
            f"one count per table: {len(ids)} id counts, {len(unique)} distinct-row counts, "
            f"{len(dims)} widths"
        )
    total = 0
    for n, u, d in zip(ids, unique, dims):
        if u > n:
            raise ValueError(f"a table has {u} distinct rows among only {n} ids")
        total += n * d * weight_bytes + bags * d * output_bytes  # forward
        total += bags * d * output_bytes + 2 * u * d * weight_bytes + 2 * u * momentum_bytes
        total += 2 * (n + bags) * index_bytes
    return total


def ids_per_table(values: torch.Tensor, offsets: torch.Tensor, tables: int) -> tuple[list[int], list[int]]:
    """(ids, distinct ids) of each table of a TBE batch: `values` and `offsets` over `tables`
    tables of equally many bags each, table-major, as fbgemm's TBE takes them."""
    bags = (offsets.numel() - 1) // tables
    bounds = offsets[:: bags].tolist() if bags else [0] * (tables + 1)
    ids, unique = [], []
    for t in range(tables):
        chunk = values[bounds[t]:bounds[t + 1]]
        ids.append(chunk.numel())
        unique.append(int(torch.unique(chunk).numel()))
    return ids, unique


def floor_bytes_per_step(received: list, sizes: list[tuple[int, int]]) -> float:
    """`fused_floor_bytes` of the floor's batches ((ids, offsets, weights) per batch, as
    step_time.py's `_floor_inputs` makes them, over tables of `sizes` (rows, cols)), averaged over
    them (FP32 weights, output and momentum, int32 indices, as the floor runs)."""
    dims = [c for _, c in sizes]
    per_batch = []
    for values, offsets, _ in received:
        ids, unique = ids_per_table(values, offsets, len(sizes))
        bags = (offsets.numel() - 1) // len(sizes)
        per_batch.append(fused_floor_bytes(ids=ids, unique=unique, dims=dims, bags=bags))
    return sum(per_batch) / len(per_batch)


# Peak memory bandwidth in bytes/s of the devices we know, by what torch.cuda.get_device_name()
# contains (first match): the vendors' figures.
PEAK_BANDWIDTH = (
    (("H100", "PCIe"), 2.0e12),
    (("H100", "HBM3"), 3.35e12),  # the SXM part calls itself "NVIDIA H100 80GB HBM3"
    (("H100", "SXM"), 3.35e12),
    (("H200",), 4.8e12),
    (("A100", "80GB"), 2.0e12),
)


def peak_bandwidth(device_name: str) -> Optional[float]:
    """The device's peak memory bandwidth in bytes/s from `PEAK_BANDWIDTH`, or None if unknown."""
    for parts, peak in PEAK_BANDWIDTH:
        if all(part in device_name for part in parts):
            return peak
    return None


def bandwidth_line(case: str, moved: float, seconds: float, device_name: Optional[str]) -> str:
    """The floor's achieved bandwidth of one case next to the device's peak, as printed."""
    achieved = moved / seconds
    line = (
        f"{case}: floor moved at least {moved / 1e9:.4g} GB per step (per rank) in "
        f"{seconds * 1e3:.2f} ms: {achieved / 1e12:.4g} TB/s"
    )
    peak = peak_bandwidth(device_name) if device_name else None
    if peak is None:
        return line + f"; peak of {device_name or 'this CPU'}: unknown"
    return line + f"; peak of {device_name}: {peak / 1e12:.2f} TB/s ({achieved / peak:.0%} of it)"
