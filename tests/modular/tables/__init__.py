"""Tests of modular/tables/: kernel groups, DTensor and ShardedTensor table forms."""
