"""The README's "Shard your model" snippet runs as written, on 2 gloo ranks, and is correct.

The block after `<!-- snippet: shard-your-model -->` is executed on every rank; then its sharded
model's logits are compared with the unsharded model the snippet's state exports to, on the
global batch (every rank's batch, concatenated in rank order).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

import modular
from tests.dist import run_on_ranks

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- snippet: shard-your-model -->"


def snippet(name_marker: str = MARKER) -> str:
    text = README.read_text()
    if name_marker not in text:
        raise AssertionError(f"README.md has no {name_marker!r}; the test needs it before the snippet")
    found = re.search(r"```python\n(.*?)```", text[text.index(name_marker) :], re.DOTALL)
    if found is None:
        raise AssertionError(f"README.md has no ```python block after {name_marker!r}")
    return found.group(1)


def _run_snippet(code: str) -> tuple[list[float], float]:
    from examples.dlrm import DLRM, concat_batches

    scope: dict = {"__name__": "readme_snippet"}
    exec(compile(code, "README.md:shard-your-model", "exec"), scope)
    model, data, tables, losses = scope["model"], scope["data"], scope["tables"], scope["losses"]
    world = dist.get_world_size()

    # The sharded model on this rank's batch, gathered in rank order...
    batch = data.batch_at(10_000)
    with torch.no_grad():
        local = model(batch.dense, batch.sparse)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    # ... against the unsharded model it exports to, on the global batch.
    state = modular.checkpoint.export(model)
    if state is None:
        return losses, 0.0
    reference = DLRM(tables, bottom_mlp=[32, 16], top_mlp=[32])
    reference.load_state_dict(state, strict=True)
    streams = [type(data)(data.num_embeddings_per_feature, batch_size=data.batch_size, seed=data.seed,
                          rank=r, world_size=world) for r in range(world)]  # fmt: skip
    global_batch = concat_batches([s.batch_at(10_000) for s in streams])
    with torch.no_grad():
        expected = reference(global_batch.dense, global_batch.sparse)
    torch.testing.assert_close(torch.cat(gathered), expected, atol=1e-5, rtol=1e-5)
    return losses, (expected - torch.cat(gathered)).abs().max().item()


def test_readme_snippet_trains_and_matches_the_unsharded_model() -> None:
    results = run_on_ranks(2, _run_snippet, snippet(), timeout=90)
    losses, max_diff = results[0]
    assert len(losses) == 30
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.02, f"the snippet's loss did not fall: first 5 steps {first:.4f}, last 5 {last:.4f}"
    assert max_diff <= 1e-5
