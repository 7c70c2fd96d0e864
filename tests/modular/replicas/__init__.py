"""Tests of 2D sharding (mesh ("replicate", "shard")): modular/mesh.py, modular/tables/replicas.py,
modular/kernels/exact_replicas.py and modular/replica_sync.py. Its reshards: tests/modular/resharding/."""
