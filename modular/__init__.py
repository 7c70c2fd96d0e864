"""Composable sharded modules for recommender models.

    import modular
    model = modular.shard(model, plan)          # EmbeddingBagCollections, in place
    opt = torch.optim.Adagrad(modular.local_parameters(model), lr=0.1)
"""

from modular._input import InputError
from modular.embedding_bag import ShardedEmbeddingBagCollection, ShardingError
from modular.optim import CombinedOptimizer, FusedOptimizer, fuse_optimizer
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
    "shard",
    "sharded_modules",
]
