"""The fused update: a sharded module's tables updated inside backward (docs/design.md).

`config` (which optimizer, its live hyperparameters), `tables` (`FusedTables`, which a fused
module owns: it picks every fused kernel), `backward` (`EndOfBackward`, the one driver of the
updates that wait for the end of backward) and `state` (the optimizer state in and out). The
public calls (`fuse_optimizer`, `FusedOptimizer`) are in modular/optim.py.
"""
