"""Tests of modular/sequence/, the sharded EmbeddingCollection's parts."""
