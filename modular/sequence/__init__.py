"""Sequence embeddings: the sharded EmbeddingCollection's own parts (modular/embedding.py).

An EmbeddingCollection looks every id up without pooling, so its step is the EBC's input dist
(modular/routing/), a lookup through the same kernels (modular/kernels/: fbgemm's sequence kernel
where it serves, each id a bag of its own elsewhere, Note [sequence lookups] in `lookup.py`) and an
output dist that sends every id's row, not a bag's sum, back to its sample's rank (`output.py`,
Note [sequence output dist]).
`table_infos.py` reads an EmbeddingCollection's tables into the layout's terms.
"""
