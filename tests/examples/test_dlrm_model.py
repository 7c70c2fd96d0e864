import pytest
import torch
from torchrec import EmbeddingBagCollection

from examples.dlrm.data import SyntheticCriteo
from examples.dlrm.model import (
    CRITEO_TB,
    DLRM,
    criteo_table_configs,
    dot_interaction,
    feature_names,
)

DIM = 8


def small_model(device: str = "cpu", seed: int = 0) -> DLRM:
    torch.manual_seed(seed)
    return DLRM(
        criteo_table_configs(scale_rows_to=50, dim=DIM),
        bottom_mlp=[16, DIM],
        top_mlp=[32, 16],
        device=device,
    )


def small_batch(batch_size: int = 5):
    rows = [min(n, 50) for n in CRITEO_TB]
    return SyntheticCriteo(rows, batch_size=batch_size, seed=3).batch_at(0)


def test_criteo_table_configs_caps_rows_and_names_tables() -> None:
    capped = criteo_table_configs(scale_rows_to=20_000, dim=16)
    assert [t.name for t in capped] == [f"t_cat_{i}" for i in range(26)]
    assert [t.feature_names for t in capped] == [[f"f_cat_{i}"] for i in range(26)]
    assert [t.num_embeddings for t in capped] == [min(n, 20_000) for n in CRITEO_TB]
    assert {t.embedding_dim for t in capped} == {16}
    full = criteo_table_configs(scale_rows_to=None, dim=128)
    assert sum(t.num_embeddings for t in full) == 177_944_275


def test_forward_shape_and_ebc_location() -> None:
    model = small_model()
    assert isinstance(model.sparse.ebc, EmbeddingBagCollection)
    assert list(model.sparse.ebc.embedding_bags) == [f"t_cat_{i}" for i in range(26)]
    assert "sparse.ebc.embedding_bags.t_cat_0.weight" in model.state_dict()
    batch = small_batch(batch_size=5)
    logits = model(batch.dense, batch.sparse)
    assert logits.shape == (5,)
    assert torch.isfinite(logits).all()


def test_sparse_arch_stacks_pooled_features_in_feature_order() -> None:
    model = small_model()
    batch = small_batch(batch_size=4)
    pooled = model.sparse(batch.sparse)
    assert pooled.shape == (4, 26, DIM)
    per_feature = batch.sparse.to_dict()
    for i, name in enumerate(feature_names(26)):
        weight = model.sparse.ebc.embedding_bags[f"t_cat_{i}"].weight
        # Pooling factor 1: the pooled vector is the row of the one id.
        torch.testing.assert_close(pooled[:, i], weight[per_feature[name].values()])


def test_dot_interaction_matches_pairwise_loop_and_is_differentiable() -> None:
    torch.manual_seed(0)
    dense = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    sparse = torch.randn(3, 5, 4, dtype=torch.float64, requires_grad=True)
    out = dot_interaction(dense, sparse)
    assert out.shape == (3, 4 + 6 * 5 // 2)
    vectors = [dense] + [sparse[:, f] for f in range(5)]
    expected = torch.stack(
        [(vectors[i] * vectors[j]).sum(1) for i in range(6) for j in range(i + 1, 6)], dim=1
    )
    torch.testing.assert_close(out, torch.cat([dense, expected], dim=1))
    assert torch.autograd.gradcheck(dot_interaction, (dense, sparse))


def test_init_is_deterministic_given_seed() -> None:
    a, b, c = small_model(seed=0), small_model(seed=0), small_model(seed=1)
    for key, value in a.state_dict().items():
        torch.testing.assert_close(value, b.state_dict()[key], rtol=0, atol=0)
    assert not torch.equal(a.over[0].weight, c.over[0].weight)


def test_meta_construction_builds_dense_on_cpu_with_same_init() -> None:
    torch.manual_seed(0)
    big = DLRM(
        criteo_table_configs(scale_rows_to=None, dim=128),
        bottom_mlp=[64, 128],
        top_mlp=[64],
        device="meta",
    )
    assert big.sparse.ebc.embedding_bags["t_cat_0"].weight.shape == (45_833_188, 128)
    assert {p.device.type for p in big.sparse.parameters()} == {"meta"}
    dense = [p for n, p in big.named_parameters() if not n.startswith("sparse.")]
    dense_devices = {p.device.type for p in dense}
    assert dense_devices == {"cpu"}

    meta, cpu = small_model(device="meta"), small_model(device="cpu")
    assert list(meta.state_dict()) == list(cpu.state_dict())
    for name, param in cpu.named_parameters():
        if not name.startswith("sparse."):
            torch.testing.assert_close(meta.get_parameter(name), param, rtol=0, atol=0)


def test_mismatched_embedding_dim_is_rejected_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"bottom MLP's output size 16 .*'t_cat_0': 8"):
        DLRM(criteo_table_configs(scale_rows_to=10, dim=8), bottom_mlp=[16], top_mlp=[8])

