"""Tests of modular/resharding/ (`modular.reshard`), in 1D and 2D."""
