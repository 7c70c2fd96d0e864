"""Pooled bags: the sharded EmbeddingBagCollection's own parts (modular/embedding_bag.py), the
mirror of modular/sequence/.

An EmbeddingBagCollection pools each bag, so its step is the shared input dist (modular/routing/),
a lookup through the kernels that pool (modular/kernels/, modular/fused/) and an output dist that
sends every rank its samples' pooled columns and lays them out as the unsharded module's
KeyedTensor. Two parts do it, and the input dist picks one per step (`Received.part`, Note
[collection kinds]): `PooledPart` (`pooled_part.py`) for a batch with one bag per sample, whose
arrivals go to their output columns by one gather of blocks (`arrival.py`, Note [arrival blocks]),
and `VariableBags` (`variable_bags.py`) for a batch whose features have their own bag counts
(torchrec's VBE KJTs, Note [variable batch per feature]).
"""
