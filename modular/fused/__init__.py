"""The fused optimizer: the tables' update inside backward, no dense gradient (docs/design.md).

Everything it is lives here: `config` (which optimizer, its live hyperparameters), `choice` (which
kernel each kernel group gets, and why: one function, Note [fused tables]), its kernels (`fbgemm`,
fbgemm's own; `deferred`, fbgemm's backward ops run at the end of backward; `emulated` and `adam`,
the same updates in torch; `row_grads`, `row_sums` their batches' rows and statistics), `tables`
(`FusedTables`, which a fused module owns), `backward` (`EndOfBackward`, the one driver of the
updates that wait for the end of backward), `moments` (the Adam family's phased update),
`row_means` (column pieces' whole-row statistics) and `state` (the optimizer state in and out).
The public calls (`fuse_optimizer`, `FusedOptimizer`) are model-level, in modular/optim.py.
"""
