"""Tests of modular/compose/: DDP, FSDP2, gradient clipping and `torch.compile` over sharded models."""
