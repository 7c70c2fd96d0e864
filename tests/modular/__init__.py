"""Runtime tests of `modular`, and their helpers, one module per topic:

- ebc_cases.py: the EBC cases (tables, `CASES` plans, per-rank and global batches) that most tests
  of `modular.shard` run;
- sequence_cases.py: two EmbeddingCollections beside an EBC (test_sequence_*.py);
- dlrm_cases.py: a small DLRM for the composition tests (DDP, FSDP2, clipping);
- checkpoint_cases.py: the checkpoint model, its three plan kinds and its snapshots;
- fused_reference.py: the torch equivalent of each fused optimizer (`FusedReference`, and the
  one written-out row-wise Adagrad step);
- compare.py: comparisons with the unsharded reference; collectives.py: `no_collectives`.

The router's specification (`ReferenceRouter`) is benchmarks/_router_reference.py, which the
router benchmark times too.
"""
