"""The public calls' one convention: in place, one order, no state left on users' modules.

Pure and single-process: none of these paths reaches a collective.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import modular
from modular import lifecycle


class _Model(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        tables = [EmbeddingBagConfig(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"])]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device(device))
        self.mlp = nn.Linear(4, 1, device=device)


@pytest.mark.parametrize("call", ["apply_fully_shard", "apply_ddp"])
def test_dense_towers_on_meta_are_named_before_fsdp_or_ddp_sees_them(call: str) -> None:
    model = _Model("meta")
    apply = getattr(modular, call)
    kwargs = {"modules": {nn.Linear}} if call == "apply_fully_shard" else {}
    with pytest.raises(modular.ShardingError) as e:
        apply(model, **kwargs)
    message = str(e.value)
    assert message.startswith(f"{call}: 3 dense parameters are on the meta device"), message
    assert "'mlp.weight'" in message and "Only the embedding tables may be on meta" in message


def test_fuse_optimizer_on_meta_leaves_no_attribute_on_the_torchrec_module() -> None:
    model = _Model("meta")
    before = set(vars(model.ebc))
    opt = modular.fuse_optimizer(model, "exact_rowwise_adagrad", lr=0.1)
    assert set(vars(model.ebc)) == before, "fuse_optimizer set attributes on torchrec's EBC"
    assert lifecycle.pending_fuse(model.ebc) is opt._config  # the registry holds the fact
    with pytest.raises(ValueError, match="already fused; fuse a model only once"):
        modular.fuse_optimizer(model, "exact_sgd", lr=0.1)


def test_fuse_optimizer_accepts_the_planners_spelling() -> None:
    opt = modular.fuse_optimizer(_Model("meta"), "rowwise_adagrad", lr=0.1)
    assert opt.kind.value == "exact_rowwise_adagrad"
    assert modular.fuse_optimizer(_Model("meta"), "adam", lr=0.1).kind.value == "adam"
    with pytest.raises(ValueError, match="'sgd_momentum' is not supported; fuse_optimizer takes 'exact_sgd'"):
        modular.fuse_optimizer(_Model("meta"), "sgd_momentum", lr=0.1)


def test_fusing_a_materialised_model_marks_it_and_its_first_use_fuses_it_in_place() -> None:
    """Note [fusing at shard]: `fuse_optimizer` copies nothing; the model's first use before
    any `shard` fuses its EBC in place (the same object), keeping names and weights."""
    torch.manual_seed(0)
    model = _Model("cpu")
    ebc = model.ebc
    weight = ebc.embedding_bags["t"].weight.detach().clone()
    names = [n for n, _ in model.named_parameters()]
    modular.fuse_optimizer(model, "exact_sgd", lr=0.1)
    assert type(model.ebc) is EmbeddingBagCollection and modular.local_parameters(model) == list(model.mlp.parameters())
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    model.ebc(kjt)
    assert model.ebc is ebc and isinstance(ebc, modular.ShardedEmbeddingBagCollection) and ebc.is_local
    assert [n for n, _ in model.named_parameters()] == names
    assert torch.equal(model.ebc.embedding_bags["t"].weight, weight)


def test_namespaces_show_their_public_names_only() -> None:
    assert callable(modular.shard)
    with pytest.raises(ModuleNotFoundError):  # no submodule hides behind the function's name
        importlib.import_module("modular.shard")
    assert dir(modular.checkpoint) == sorted(modular.checkpoint.__all__)
    assert dir(modular) == sorted(modular.__all__)
    for name in ("ShardingError", "InputError", "CollectiveError", "CheckpointError", "PlanError"):
        assert issubclass(getattr(modular, name), Exception), name
    assert modular.CheckpointError is modular.checkpoint.CheckpointError


def test_compiled_autograd_is_refused_naming_the_module() -> None:
    model = _Model("cpu")
    modular.fuse_optimizer(model, "exact_sgd", lr=0.1)  # a one-process sharded module
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    assert model.ebc(kjt).values().shape == (2, 4)
    with torch._dynamo.config.patch(compiled_autograd=True):
        with pytest.raises(modular.ShardingError, match="module 'ebc': compiled autograd"):
            model.ebc(kjt)


class _TwoCollections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = lambda name, feature: EmbeddingBagConfig(  # noqa: E731
            name=name, num_embeddings=10, embedding_dim=4, feature_names=[feature]
        )
        self.a = EmbeddingBagCollection(tables=[config("ta", "f")])
        self.b = EmbeddingBagCollection(tables=[config("tb", "g")])


def test_prefetch_goes_to_the_modules_named_and_the_forward_takes_it() -> None:
    torch.manual_seed(0)
    model = _TwoCollections()
    modular.fuse_optimizer(model, "exact_sgd", lr=0.1)  # two one-process sharded modules
    kjt = KeyedJaggedTensor(keys=["f"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1]))
    expected = model.a(kjt).values()
    assert modular.prefetch(model, kjt, modules=["a"]) is model
    assert model.b._prefetcher is None, "module 'b' takes another batch: nothing prefetched for it"
    assert torch.equal(model.a(kjt).values(), expected)
    assert not model.a._prefetcher._pending, "the forward took the prefetched batch"
    with pytest.raises(ValueError, match=r"modules \['c'\] are not sharded collections of the model; its sharded collections are \['a', 'b'\]"):
        modular.prefetch(model, kjt, modules=["c"])
