"""torchrec's example models, copied unmodified (README.md in this folder says from where).

Importable as `tests.third_party.torchrec_examples.retrieval.modules.two_tower` and
`tests.third_party.torchrec_examples.bert4rec.models.bert4rec`. The retrieval example imports faiss
at module level; importing this package first registers a stand-in for it when faiss is not
installed (`_faiss_stand_in.py`), so the copied files need no edit.
"""

from tests.third_party.torchrec_examples._faiss_stand_in import install_if_missing

install_if_missing()
