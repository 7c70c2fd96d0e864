"""Tests of modular/mc/, managed collisions with their state split across ranks."""
