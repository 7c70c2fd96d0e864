"""Low-precision tables: which weights precisions fbgemm's kernels take on a device, and fbgemm's
name for each (Note [low-precision tables]).

# Note [low-precision tables]
A table keeps the dtype of its torchrec config (`EmbeddingBagConfig(data_type=DataType.FP16)`):
the kernel's fbgemm TBE is built with that weights precision, the table's `ShardedTensor` (or
data-parallel copy) holds shards of that dtype under the unsharded name, and a kernel group
holds tables of one dtype only (`kernel_groups`). What is done in FP32 regardless:
- pooling: fbgemm reads each row, widens it to FP32 and sums in FP32, so the pooled outputs are
  FP32 (and so are the output dist's all-to-alls, unless `comm_dtype` says otherwise, Note
  [low-precision comms] in modular/comm.py); `output_dtype` casts the module's output;
- the pooled gradients, and each touched row's gradient, which fbgemm sums in FP32; a fused
  update is computed in FP32 and the optimizer state (Adagrad's sums) stays FP32 (fbgemm's
  layout). The new row is rounded into the table's dtype: for row-wise Adagrad w + step is
  rounded once; fbgemm's CPU exact-SGD and Adagrad kernels round the step itself to FP16 first
  and then w + step (measured on fbgemm-gpu-cpu 1.8.0: bit for bit on 1,024 values each,
  tests/modular/fused/test_low_precision_fused.py), and the emulation does the same per optimizer;
- an unfused table's `.grad` has the table's dtype (a torch optimizer needs it to), holding each
  step's row gradients summed in FP32 and rounded once as they are added (Note [dense gradient
  buffer]).
Rounding: fbgemm's CPU kernels round to nearest (they ignore `stochastic_rounding`, fbgemm-gpu-cpu
1.8.0); its CUDA kernels round stochastically by default (`stochastic_rounding=True`), which
`fuse_optimizer(..., stochastic_rounding=...)` passes on. The torch emulation of the fused
kernels (Note [emulated fused kernels]) rounds to nearest on every device, from the same values
on every rank, so data-parallel copies stay bit-identical; copies on fbgemm's CPU kernels run
the same batch through the same deterministic kernel on every rank (Note [fused data-parallel
copies]). Unfused FP16 copies on CPU always replay the global batch (one rounding of an FP32
sum, Note [dense data-parallel copies]); off CPU they all-reduce their FP16 gradient, which
rounds once per partial sum (not yet measured on a GPU).
BF16 tables need kernels fbgemm's CPU build lacks ("not implemented for 'BFloat16'"): `shard`
refuses them on CPU before allocating anything (`check_table_dtypes`).
"""

from __future__ import annotations

import functools

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
)

from modular.errors import ShardingError
from modular.tables.layout import TableInfo

__all__ = ["check_table_dtypes", "sparse_type", "supported_on"]

_SPARSE_TYPES = {
    torch.float32: SparseType.FP32,
    torch.float16: SparseType.FP16,
    torch.bfloat16: SparseType.BF16,
}


def sparse_type(dtype: torch.dtype) -> SparseType:
    """fbgemm's name for a table or output dtype."""
    return _SPARSE_TYPES[dtype]


@functools.lru_cache(maxsize=None)
def supported_on(dtype: torch.dtype, device_type: str) -> bool:
    """Whether fbgemm's TBE kernels take `dtype` weights on `device_type`. On CPU this looks up
    one id in a 1 x 4 table once (the CPU build's kernels are compiled per dtype: FP32 and FP16
    in fbgemm-gpu-cpu 1.8.0); fbgemm's CUDA kernels take all three."""
    if dtype is torch.float32 or device_type != "cpu":
        return dtype in _SPARSE_TYPES
    try:
        tbe = DenseTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(1, 4)], pooling_mode=PoolingMode.SUM, use_cpu=True,
            weights_precision=sparse_type(dtype),
        )  # fmt: skip
        with torch.no_grad():
            tbe(torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1]))
    except RuntimeError:
        return False
    return True


def check_table_dtypes(tables: tuple[TableInfo, ...], module: str, device: torch.device) -> None:
    """Refuses, naming the table, its dtype and the device, a table whose dtype fbgemm's kernels
    cannot take on `device` (before anything is allocated: `modular.shard` checks it with the
    plan, on every rank alike)."""
    for t in tables:
        if not supported_on(t.dtype, device.type):
            name = str(t.dtype).removeprefix("torch.")
            raise ShardingError(
                f"table {t.name!r} of module {module!r} has data type {name}, which fbgemm's "
                f"kernels on {device.type} do not support (its {device.type} build has no "
                f"{name} kernels); use DataType.FP16 or DataType.FP32 for this table on "
                f"{device.type}, or shard on a GPU"
            )
