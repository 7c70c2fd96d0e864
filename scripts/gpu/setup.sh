#!/usr/bin/env bash
# Sourced on the GPU machine from the repo root: unpacks .gpu/pkg.tar.xz (scripts/gpu/pack.sh)
# into /tmp/site, puts it on PYTHONPATH and checks that fbgemm's CUDA TBE and modular import.
set -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
mkdir -p /tmp/site && xz -dc .gpu/pkg.tar.xz | tar -C /tmp/site -xf - || return 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  /tmp/site/*.whl || return 1
# fbgemm's meta registrations name ops of the libraries left out: skip those ops, not the rest.
python3 - <<'PY' || return 1
p = "/tmp/site/fbgemm_gpu/sparse_ops.py"
s = open(p).read()
guard = ("\n        try:\n            torch._C._dispatch_find_schema_or_throw(op_name, '')\n"
         "        except RuntimeError:\n            return  # its library was not packed\n")
for head in ("    def impl_abstract(op_name, fn) -> None:\n",
             "    def impl_autograd(op_name, fn, setup_context: Optional[Callable] = None) -> None:\n"):
    assert head in s, head
    s = s.replace(head, head + guard, 1)
open(p, "w").write(s)
PY
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 - <<'PY' 2>&1 | grep -v -E "compat_table|cannot determine|^ *$|\[0m|\[33m|WARNING:root"
import torch, fbgemm_gpu, torchrec, modular
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen)
tbe = SplitTableBatchedEmbeddingBagsCodegen(
    [(100, 16, EmbeddingLocation.DEVICE, ComputeDevice.CUDA)],
    optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.1)
out = tbe(torch.tensor([1, 2, 3, 5], device="cuda"), torch.tensor([0, 2, 4], device="cuda"))
out.sum().backward()
torch.cuda.synchronize()
print("fbgemm", fbgemm_gpu.__version__, "CUDA TBE forward + fused backward ran")
PY
