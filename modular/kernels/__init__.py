"""Lookup: fbgemm's table-batched kernels over this rank's shards (docs/design.md's step 2).

One `Kernel` interface (`base`), implemented by the dense kernel (`dense`, gradients for any torch
optimizer, with per-shard `views`) and by the fused optimizer's kernels (modular/fused/);
`lookups` holds the batches kernels share, `table_dtypes` which table dtypes fbgemm takes, and
`exact_replicas` how a kernel's batch crosses 2D replica groups (Note [exact replicas]).
"""
