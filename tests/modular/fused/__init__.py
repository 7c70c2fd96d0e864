"""Tests of modular/fused/ (and `fuse_optimizer`, modular/optim.py): fused optimizers and the kernel choice."""
