from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from examples.dlrm.data import SyntheticCriteo, concat_batches
from examples.dlrm.metrics import auc
from examples.dlrm.model import DLRM, criteo_table_configs


@pytest.fixture
def one_thread() -> Iterator[None]:
    # These ops are too small to gain from threads; with the CPUs busy (other tests, other
    # ranks) two spinning OpenMP threads made this test 10x slower (1 s -> 12 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_dlrm_learns_the_synthetic_rule_in_150_steps(one_thread: None) -> None:
    torch.manual_seed(0)
    dim = 16
    tables = criteo_table_configs(scale_rows_to=1000, dim=dim)
    model = DLRM(tables, bottom_mlp=[32, dim], top_mlp=[64, 32])
    data = SyntheticCriteo([t.num_embeddings for t in tables], batch_size=256, seed=0)
    # Held out: steps the training loop never reaches, same hidden rule.
    held_out = concat_batches([data.batch_at(100_000 + i) for i in range(8)])

    sparse_opt = torch.optim.Adagrad(model.sparse.parameters(), lr=0.1)
    dense_params = [p for n, p in model.named_parameters() if not n.startswith("sparse.")]
    dense_opt = torch.optim.Adam(dense_params, lr=1e-3)

    def held_out_loss_and_auc() -> tuple[float, float]:
        with torch.no_grad():
            logits = model(held_out.dense, held_out.sparse)
        loss = F.binary_cross_entropy_with_logits(logits, held_out.labels).item()
        return loss, auc(logits, held_out.labels)

    loss_before, auc_before = held_out_loss_and_auc()
    for step in range(150):
        batch = data.batch_at(step)
        loss = F.binary_cross_entropy_with_logits(model(batch.dense, batch.sparse), batch.labels)
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
    loss_after, auc_after = held_out_loss_and_auc()

    ideal_auc = auc(data.ideal_logits(held_out), held_out.labels)
    # Measured: 0.85 (ideal 0.88). With the tables frozen at init the same loop reaches 0.79
    # (the rule's dense term alone scores 0.74), so passing 0.82 needs the tables to learn.
    assert auc_before < 0.6
    assert auc_after > 0.82, (auc_before, auc_after, ideal_auc)
    assert auc_after < ideal_auc + 0.02
    assert loss_after < loss_before - 0.15, (loss_before, loss_after)
