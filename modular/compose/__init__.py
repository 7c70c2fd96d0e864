"""Composing sharded tables with PyTorch's own parallelism for the dense part.

`fsdp` (`apply_fully_shard`), `ddp` (`apply_ddp`), `compile` (`apply_compile`: the dense towers
compiled, Note [compiling a sharded model]), `clip` (global `clip_grad_norm_` over tables
and dense parameters) and `params` (which tensors a torch optimizer, DDP and FSDP should see).
"""
