"""Tests of modular/pooled/, the sharded EBC's pooled output: arrival blocks and variable batch (VBE)."""
