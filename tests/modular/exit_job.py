"""A user's own rank script, ended the way PyTorch's docs end one: destroy_process_group, return.

Run by tests/modular/test_exit.py as a plain process per rank (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment, as torchrun sets them). It trains one step of a small DLRM whose
tables are sharded by `modular.shard` and whose towers are under FSDP2 (`apply_fully_shard`),
with the batch's input dist prefetched (`modular.prefetch`, which makes a second gloo group).

Its only instrumentation is an atexit probe registered before `import modular`, so it runs after
modular's hook (atexit runs hooks last-registered first) and just before the interpreter
finalizes: it prints which threads of torch's process groups are still alive then
(Note [exit after destroy_process_group] in modular/exit.py). `MODULAR_TEST_NO_EXIT_HOOK=1` takes
modular's hook out, to measure the run as it was without it.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

PROCESS_GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def _threads_left() -> None:
    names = [(Path("/proc/self/task") / t / "comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    left = sorted(n for n in names if n in PROCESS_GROUP_THREADS)
    print(f"process group threads at exit: {left}", flush=True)


atexit.register(_threads_left)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import modular  # noqa: E402
import planners  # noqa: E402
from examples.dlrm import DLRM, SyntheticCriteo, criteo_table_configs  # noqa: E402

if os.environ.get("MODULAR_TEST_NO_EXIT_HOOK") == "1":
    atexit.unregister(modular.exit.release_process_groups)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tables = criteo_table_configs(scale_rows_to=100, dim=8)
    torch.manual_seed(0)
    model = DLRM(tables, bottom_mlp=[16, 8], top_mlp=[16], device="meta")
    plan = planners.plan(model, planners.Topology(world), batch_size=16)
    tables_opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    model = modular.shard(model, plan)
    model = modular.apply_fully_shard(model, modules=lambda m: m is model.dense or m is model.over)
    dense_opt = torch.optim.Adam(modular.local_parameters(model), lr=1e-3)
    opt = modular.CombinedOptimizer({"tables": tables_opt, "dense": dense_opt})
    data = SyntheticCriteo([t.num_embeddings for t in tables], batch_size=16, seed=0, rank=rank, world_size=world)
    batch = data.batch_at(0)
    modular.prefetch(model, batch.sparse)  # its input dist runs on modular's background group
    loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"rank {rank} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
