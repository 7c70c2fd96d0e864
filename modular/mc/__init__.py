"""Managed collisions, sharded: torchrec's MCH collision state split across ranks by slot.

The step before input dist for a managed-collision table: raw ids are remapped to slots (and
the table's eviction runs) here, and the slots then flow through the ordinary input dist ->
lookup -> output dist of the table's sharded collection. The design and its exactness contract
are Note [sharded managed collisions] in modular/mc/sharded_mch.py.
"""
