"""`torch.compile` over a `modular`-sharded model: the dense modules compiled, the tables eager.

    model = modular.shard(model, plan)
    model = modular.apply_fully_shard(model, modules={MLP})     # or apply_ddp, or neither
    model = modular.apply_compile(model, modules={MLP})         # each dense tower's forward
    compiled = torch.compile(model)   # and the rest, one graph break per sharded collection call

# Note [compiling a sharded model]
A sharded collection's forward (an EBC's or an EC's, one path: modular/collection.py) is input
dist -> lookup -> output dist: it reads the batch on the host
(the input checks' `bool(tensor)`, lengths and split sizes for the all-to-alls), runs collectives
whose sizes depend on the data, and calls fbgemm lookup kernels that have no fake-tensor
implementation. Traced by dynamo, that was 46 graph breaks and 34 graphs for the tests' small
DLRM and a 60 s first step on CPU (one rank, 2 cores). Nothing is gained by compiling it: its
work is collectives and fbgemm kernels already. So every sharded collection's `forward` (and
`prefetch`) sit behind `torch.compiler.disable`, once for both kinds (`ShardedCollectionModule`
in modular/collection.py):

- The boundary is the module's call. Dynamo stops before it, runs it eagerly, and resumes after
  it: one graph break per sharded collection call, whatever the kind, the plan, the fused optimizer or prefetch.
  The KeyedJaggedTensor crosses the boundary untouched (the forward receives the caller's very
  object, so a prefetched batch is found by identity as in eager mode), and nothing in a
  compiled graph depends on its lengths or id counts: batches whose ids vary never recompile.
- The output's batch dimension is marked dynamic (`maybe_mark_dynamic`): the code after the EBC
  is compiled once for every batch size. Mark the model's other inputs likewise
  (`torch._dynamo.mark_dynamic(dense, 0)`) where batch sizes vary, e.g. a short last batch;
  otherwise dynamo compiles once more on the first new size, then stays dynamic.
- Autograd crosses the boundary as in eager mode: the EBC's backward (output dist, then the
  lookup's backward) is the eager autograd graph, so fused tables update once per step inside
  it, and data-parallel tables all-reduce their own gradients, exactly as without compile.
- The tables are `ShardedTensor`s (or data-parallel copies) that only the eager forward reads, so
  dynamo never sees them as graph inputs, and the fused kernels' weights and optimizer state
  change in place where no guard looks.
- The dense part is dynamo's and FSDP2's business as in any model, with one consequence: FSDP2
  keeps dynamo out of a fully sharded module's call (its hooks are skipped, the call runs
  eagerly), so `torch.compile(model)` over an FSDP2 model compiles only what lies between the
  fully sharded towers. `apply_compile` compiles each tower's `forward` on the instance: FSDP2's
  all-gather and reduce-scatter hooks run eagerly around the compiled code, which sees the
  unsharded parameters, as torchtitan compiles each block. Use both (as `examples/train_dlrm.py
  --compile` does): towers by `apply_compile`, the rest by `torch.compile(model)`. Under
  `apply_ddp` (PyTorch's composable DDP), `torch.compile(model)` compiles the towers too; DDP
  initialises itself in its first forward's hook, so the second step recompiles that hook once,
  then never again.

`fullgraph=True` cannot hold a graph break, so a compiled module that contains a sharded EBC
cannot use it: `apply_compile` refuses that up front, naming the module; `torch.compile(model,
fullgraph=True)` fails in dynamo with the reason given to `torch.compiler.disable`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modular.compose.fsdp import ModuleSelector, dense_modules
from modular.sharded_types import SHARDED_COLLECTIONS
from modular.errors import ShardingError

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, *, modules: ModuleSelector, **compile_kwargs: Any) -> nn.Module:
    """Compiles the `forward` of each dense module picked by `modules`; returns `model`.

    Call it after `modular.shard` and `apply_fully_shard` / `apply_ddp`, on every rank:

        model = modular.apply_compile(model, modules={MLP}, mode="max-autotune-no-cudagraphs")

    `modules` picks as for `apply_fully_shard` (a set of classes or a predicate; never the root,
    never inside a sharded EBC). Each picked module's `forward` is replaced by
    `torch.compile(forward, **compile_kwargs)` on the instance, so module hooks (FSDP2's
    all-gathers) run around the compiled code and parameter names never change (compiling the
    module itself would add `_orig_mod.` to them). A picked module that contains a sharded EBC
    compiles around it (Note [compiling a sharded model]), except under `fullgraph=True`, which
    raises a ShardingError naming it. To compile the whole model, use `torch.compile(model)`.
    """
    if isinstance(model, SHARDED_COLLECTIONS):
        raise ShardingError(
            f"apply_compile was given a {type(model).__name__}: its forward runs eagerly "
            "by design (Note [compiling a sharded model]); call it on the model that contains it"
        )
    picked = dense_modules(model, modules)
    if compile_kwargs.get("fullgraph"):
        names = {id(m): n for n, m in model.named_modules()}
        for module in picked:
            inner = [
                (n, m) for n, m in module.named_modules() if isinstance(m, SHARDED_COLLECTIONS)
            ]
            if inner:
                fqn, found = inner[0]
                raise ShardingError(
                    f"apply_compile(fullgraph=True): module {names[id(module)]!r} contains the "
                    f"sharded {found.kind.name} {fqn!r}, whose forward runs eagerly "
                    "behind a graph break (Note [compiling a sharded model]); pick only modules "
                    "without one, or drop fullgraph=True"
                )
    for module in picked:
        module.forward = torch.compile(module.forward, **compile_kwargs)
    return model
