"""What dtype a sharded EBC's output dist sends and returns: `modular.shard`'s `output_dtype` and
`comm_dtype` options, for every module of the plan or per module (Note [low-precision comms] in
modular/comm.py, Note [low-precision tables] in modular/kernels/table_dtypes.py)."""

from __future__ import annotations

from typing import Optional, Union

import torch

from modular.errors import ShardingError

__all__ = ["DtypeOption", "LOW_PRECISION", "per_module"]

LOW_PRECISION = (torch.float16, torch.bfloat16)

# One dtype for every planned module, or a dtype per module FQN (modules left out: the default).
DtypeOption = Union[None, torch.dtype, dict[str, Optional[torch.dtype]]]


def per_module(
    option: DtypeOption, modules: list[str], what: str, default: Optional[torch.dtype]
) -> dict[str, Optional[torch.dtype]]:
    """Each planned module's dtype for `option` (`what` names it in errors), checked: FP32,
    FP16 or BF16, and only modules of the plan named."""
    if isinstance(option, dict):
        unknown = sorted(set(option) - set(modules))
        if unknown:
            raise ShardingError(
                f"{what} names modules {unknown}, which the plan does not shard; the plan's "
                f"modules are {sorted(modules)}"
            )
        chosen = {m: option.get(m, default) for m in modules}
    else:
        chosen = {m: default if option is None else option for m in modules}
    for m, dtype in chosen.items():
        if dtype is not None and dtype not in (torch.float32, *LOW_PRECISION):
            raise ShardingError(
                f"{what} for module {m!r} is {dtype}; it takes torch.float32, torch.float16 or "
                "torch.bfloat16"
            )
    return chosen
