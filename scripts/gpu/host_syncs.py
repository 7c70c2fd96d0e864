"""Host syncs and host-side profile of one training step, ours against TorchRec, on one GPU.

    python3 scripts/gpu/host_syncs.py tw     # or rw, cw, dp; writes to $OUT (default /tmp)

Runs step_time.py's "ours" and "torchrec" contenders (fused row-wise Adagrad, world 1, NCCL)
and prints each host sync's call site, found with torch.cuda.set_sync_debug_mode("warn"): every
read of a device tensor on the host (Note [host syncs per step] in modular/routing/checks.py). It writes
a cProfile, a torch.profiler table and a Chrome trace of each into $OUT.
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import sys
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

import step_time as st  # noqa: E402
from benchmarks._common import time_block  # noqa: E402
from examples.ports import free_port  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def _sync_sites(step, kjts) -> collections.Counter:
    sites: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
        ours = [f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" for f in frames
                if "site-packages/torch/" not in f.filename][-3:]
        sites[" <- ".join(reversed(ours))] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            time_block(step, kjts, 4, 0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    return sites


def main() -> None:
    plan = sys.argv[1] if len(sys.argv) > 1 else "tw"
    out = os.environ.get("OUT", "/tmp")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    cfg = st.Config(tables=8, rows=100_000, dim=64, batch=1024, pooling=20, world_size=1,
                    plans=(plan,), optimizers=("fused",), steps=20, blocks=1, warmup=3,
                    profile=None, torchrec=True, device="cuda")  # fmt: skip
    ebc, kjts, probe = st.workload(cfg, 0)
    steps = {"ours": st.ours_step(cfg, ebc, plan, "fused", probe)[1],
             "torchrec": st.torchrec_step(cfg, ebc, plan, "fused", probe)}  # fmt: skip
    for name, step in steps.items():
        time_block(step, kjts, 5, 0)
        sites = _sync_sites(step, kjts)
        print(f"\n== {name} {plan}/fused: host syncs in 4 steps ==")
        for where, n in sites.most_common(20):
            print(f"{n:3d}  {where}")
        pr = cProfile.Profile()
        pr.enable()
        time_block(step, kjts, 20, 0)
        pr.disable()
        with open(f"{out}/cprof_{name}_{plan}.txt", "w") as f:
            for key in ("cumulative", "tottime"):
                pstats.Stats(pr, stream=f).sort_stats(key).print_stats(70)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            time_block(step, kjts, 10, 0)
        with open(f"{out}/tprof_{name}_{plan}.txt", "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
        prof.export_chrome_trace(f"{out}/trace_{name}_{plan}.json")
        times = sorted(time_block(step, kjts, 30, 0))
        print(f"{name} {plan}/fused: median step {times[15] * 1e3:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
