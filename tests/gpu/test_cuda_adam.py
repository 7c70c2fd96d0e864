"""CUDA: the torch emulation of the Adam family equals fbgemm's CUDA kernels (Note [fused Adam and
LAMB] in modular/fused/adam.py).

Skipped where torch sees no CUDA device: fbgemm-gpu-cpu has none of these kernels, so this is
the only place they run. Not yet run on a GPU: written in a session without one (issue 35); run
it with `python -m pytest tests/gpu`.

One process, no process group: two one-process fused EBCs on the GPU from the same weights, one
on fbgemm's kernels (widths 8, 16, 32: whole tables take them on CUDA) and one forced onto the
emulation (`choose_kernel` patched to choose it), plus the written-out reference
(tests/modular/adam_reference.py), trained on the same batches for 5 steps with weight decay,
per kind: weights, both moments and the step count must agree (1e-5, the GPU's atomic sums
reorder additions). FP16 tables with stochastic_rounding=False: fbgemm rounds each new row to
nearest, as the emulation does, so the two stay within one FP16 ulp.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import modular
from modular import local_shards
from modular.fused.choice import KernelChoice, KernelKind
from modular.optim import fuse_now
from modular.fused.adam import AdamFusedKernel
from modular.fused.fbgemm import FusedKernel
from tests.modular.adam_reference import (
    ADAM_BETAS, ADAM_EPS, ADAM_FAMILY, ADAM_LR, MomentsReference, touched_rows,
)
from tests.modular.ebc_cases import make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS, DECAY, ATOL = 5, 0.01, 1e-5
CUDA = torch.device("cuda")


def _ebc(data_type: DataType = DataType.FP32) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=16, feature_names=["f_a", "f_b"], data_type=data_type),
        EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=8, feature_names=["f_c"], pooling=PoolingType.MEAN, data_type=data_type),
        EmbeddingBagConfig(name="c", num_embeddings=50, embedding_dim=32, feature_names=["f_d"], data_type=data_type),
    ]
    return EmbeddingBagCollection(tables=tables, device=CUDA)


def _fused(source: EmbeddingBagCollection, kind: str, emulate: bool, monkeypatch) -> tuple:
    ebc = copy.deepcopy(source)
    with monkeypatch.context() as m:
        if emulate:  # every kernel group takes the emulation (Note [fused tables])
            forced = KernelChoice(KernelKind.ADAM, "forced by the test")
            m.setattr(local_shards, "choose_kernel", lambda facts: forced)
        opt = modular.fuse_optimizer(
            ebc, kind, lr=ADAM_LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=DECAY,
            stochastic_rounding=False,
        )  # fmt: skip
        fuse_now(ebc, "")  # built here, under the patch (Note [fusing at shard])
    kernels = {type(k) for k in ebc._local_kernels}  # one process: every table is local
    assert kernels == ({AdamFusedKernel} if emulate else {FusedKernel}), (kind, emulate, kernels)
    return ebc, opt


@pytest.mark.parametrize("kind", ADAM_FAMILY)
def test_the_emulation_equals_fbgemms_cuda_kernel(kind: str, monkeypatch) -> None:
    source = _ebc()
    fbgemm, fbgemm_opt = _fused(source, kind, False, monkeypatch)
    emulated, emulated_opt = _fused(source, kind, True, monkeypatch)
    ref = MomentsReference(copy.deepcopy(source), kind, weight_decay=DECAY)
    for step in range(STEPS):
        batch = make_batch(source, seed=step, batch_size=8).to(CUDA)
        for model in (fbgemm, emulated, ref.module):
            out = model(batch).values()
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            (out * target.to(CUDA)).sum().backward()
        ref.step(touched_rows(ref.module, [batch]))
    got = {"fbgemm": fbgemm_opt.state_dict()["state"], "emulated": emulated_opt.state_dict()["state"]}
    params = {
        "fbgemm": dict(fbgemm.named_parameters()),
        "emulated": dict(emulated.named_parameters()),
        "reference": dict(ref.module.named_parameters()),
    }
    for name, want in params["reference"].items():
        for which in ("fbgemm", "emulated"):
            label = f"{kind}: {which} {name}"
            torch.testing.assert_close(params[which][name].detach(), want.detach(), atol=ATOL, rtol=0, msg=lambda m: f"{label}: {m}")
            for key, value in ref.state(name).items():
                torch.testing.assert_close(got[which][name][key], value, atol=ATOL, rtol=1e-5, msg=lambda m: f"{label} {key}: {m}")
            assert int(got[which][name]["step"]) == STEPS, label


@pytest.mark.parametrize("kind", ADAM_FAMILY)
def test_fp16_tables_round_like_fbgemm_without_stochastic_rounding(kind: str, monkeypatch) -> None:
    source = _ebc(DataType.FP16)
    fbgemm, _ = _fused(source, kind, False, monkeypatch)
    emulated, _ = _fused(source, kind, True, monkeypatch)
    for step in range(STEPS):
        batch = make_batch(source, seed=step, batch_size=8).to(CUDA)
        for model in (fbgemm, emulated):
            out = model(batch).values()
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(step))
            (out * target.to(CUDA)).sum().backward()
    for (name, a), (_, b) in zip(fbgemm.named_parameters(), emulated.named_parameters()):
        assert a.dtype == torch.float16
        ulp = 2.0**-10 * a.detach().float().abs().clamp(min=2.0**-14)
        assert ((a.detach().float() - b.detach().float()).abs() <= ulp).all(), (kind, name)
