"""Tests of modular/routing/, the input dist: router, ids exchange, ids on the wire, prefetch."""
