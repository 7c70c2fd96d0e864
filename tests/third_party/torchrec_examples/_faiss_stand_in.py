"""An import-time stand-in for faiss, which torchrec's retrieval example imports at module level.

`retrieval/modules/two_tower.py` runs `import faiss` and `import faiss.contrib.torch_utils` and names
`faiss.GpuIndexIVFPQ` and `faiss.IndexIVFPQ` in a signature, but touches faiss nowhere else:
`TwoTowerRetrieval` stores the index it is given and calls its `search(x, k, D, I)`. Without faiss
installed (it is not in this project's pinned stack), `install_if_missing` registers empty modules
of those names so the unmodified file imports; a test passes its own index (`ExactIndex` in
tests/modular/test_torchrec_examples.py). The index classes named here refuse to be built, so code
that really needs faiss fails saying so. Nothing is registered when faiss can be imported.
"""

from __future__ import annotations

import importlib.util
import sys
import types


class _NeedsFaiss:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"faiss.{type(self).__name__} is a stand-in (tests/third_party/torchrec_examples/"
            "_faiss_stand_in.py): faiss is not installed; install faiss-cpu to build a real index"
        )


class GpuIndexIVFPQ(_NeedsFaiss):
    pass


class IndexIVFPQ(_NeedsFaiss):
    pass


def install_if_missing() -> None:
    """Registers the stand-in modules `faiss`, `faiss.contrib` and `faiss.contrib.torch_utils`
    unless faiss is importable (or already registered)."""
    if "faiss" in sys.modules or importlib.util.find_spec("faiss") is not None:
        return
    faiss = types.ModuleType("faiss", "stand-in: faiss is not installed (" + __name__ + ")")
    faiss.GpuIndexIVFPQ = GpuIndexIVFPQ
    faiss.IndexIVFPQ = IndexIVFPQ
    contrib = types.ModuleType("faiss.contrib")
    torch_utils = types.ModuleType("faiss.contrib.torch_utils")
    faiss.contrib = contrib
    contrib.torch_utils = torch_utils
    sys.modules.update({"faiss": faiss, "faiss.contrib": contrib, "faiss.contrib.torch_utils": torch_utils})
