"""Lookup: fbgemm's table-batched kernels over this rank's shards (docs/design.md's step 2).

One `Kernel` interface (`base`), implemented by the dense kernel (`dense`, gradients for any torch
optimizer, with per-shard `views`), the fused kernel (`fused`) and the fused kernels that update
at the end of backward (`emulated`, `deferred`); `lookups` holds the batches they share.
"""
