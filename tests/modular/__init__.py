"""Runtime tests of `modular`, and their helpers.

The tests follow modular's packages: the tests of modular/fused/ are in tests/modular/fused/, of
modular/routing/ in tests/modular/routing/, and so on for checkpoint/, compose/, kernels/,
pooled/, resharding/, sequence/ and tables/; 2D sharding (modular/mesh.py,
tables/replicas.py, kernels/exact_replicas.py, replica_sync.py) is tested in replicas/, its
reshards in resharding/. The tests of modular's top-level modules (`shard`, the shared step,
comm.py, exit.py, `unshard`, lifecycle.py, `import modular`, torchrec's examples) are here.

The helpers, shared by the test folders, are here too:

- ebc_cases.py: the EBC cases (tables, `CASES` plans, per-rank and global batches) that most tests
  of `modular.shard` run;
- sequence_cases.py: two EmbeddingCollections beside an EBC (sequence/test_sequence_*.py);
- dlrm_cases.py: a small DLRM for the composition tests (DDP, FSDP2, clipping);
- checkpoint_cases.py: the checkpoint model, its three plan kinds and its snapshots;
- fused_reference.py: the torch equivalent of each fused optimizer (`FusedReference`, and the
  one written-out row-wise Adagrad step); adam_reference.py: the Adam family's;
- compare.py: comparisons with the unsharded reference; collectives.py: `no_collectives`;
- exit_job.py: the 2-rank job that test_exit.py and scripts/exit_stress.py start.

The router's specification (`ReferenceRouter`) is benchmarks/_router_reference.py, which the
router benchmark times too.
"""
