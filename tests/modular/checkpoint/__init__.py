"""Tests of modular/checkpoint/: save and load across plans and world sizes, export, `load_state_dict`."""
