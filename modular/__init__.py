"""Composable sharded modules for recommender models.

    import modular
    model = modular.shard(model, plan)          # EmbeddingBagCollections, in place
    opt = torch.optim.Adagrad(modular.local_parameters(model), lr=0.1)
"""

from modular._checks import InputError
from modular.embedding_bag import ShardedEmbeddingBagCollection, ShardingError
from modular.optim import CombinedOptimizer, FusedOptimizer, fuse_optimizer
from modular._prefetch import prefetch
from modular.shard import ignored_params, local_parameters, shard, sharded_modules

__all__ = [
    "CombinedOptimizer",
    "FusedOptimizer",
    "fuse_optimizer",
    "InputError",
    "ShardedEmbeddingBagCollection",
    "ShardingError",
    "ignored_params",
    "local_parameters",
    "prefetch",
    "shard",
    "sharded_modules",
]

# Composition with FSDP2 / DDP for the dense part (docs/composition.md).
from modular.clip import clip_grad_norm_
from modular.fsdp import apply_ddp, apply_fully_shard

__all__ += ["apply_ddp", "apply_fully_shard", "clip_grad_norm_"]

# torch.compile around the sharded EBCs (Note [compiling a sharded model]).
from modular.compile import apply_compile  # noqa: E402

__all__ += ["apply_compile"]
import modular.checkpoint  # noqa: E402,F401  (modular.checkpoint.save/load/export/load_unsharded)
