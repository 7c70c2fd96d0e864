"""Tests of modular/kernels/: dense kernels, packed gathers and low-precision (FP16) tables."""
