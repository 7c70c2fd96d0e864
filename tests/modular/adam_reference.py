"""The Adam family's reference: what `modular.fuse_optimizer(model, "adam" | "lamb" | ...)` must
equal, written once in plain torch on the unsharded tables.

`adam_family_step` is one step of fbgemm's kernels as Note [fused Adam and LAMB]
(modular/fused/adam.py) reads them, applied to the rows a step's ids touched; tests/gpu holds it
to fbgemm's CUDA kernels. `MomentsReference` steps every table of a module with it, as
`FusedReference` (tests/modular/fused_reference.py) does for the Adagrads.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

ADAM_FAMILY = ("adam", "partial_rowwise_adam", "lamb", "partial_rowwise_lamb")
ADAM_LR, ADAM_BETAS, ADAM_EPS = 0.02, (0.8, 0.95), 1e-3


@torch.no_grad()
def adam_family_step(
    kind: str,
    weight: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One step of `kind` on the rows `rows` (unique) of one table, in place: `grad` is the
    table's gradient (rows x dim), `exp_avg` like the table, `exp_avg_sq` like it too or, for the
    partial_rowwise kinds, one value per row; `step` counts from 1. A low-precision table's new
    rows are computed in FP32 and rounded once."""
    b1, b2 = betas
    w = weight[rows].float()
    g = grad[rows].float()
    m = b1 * exp_avg[rows] + (1 - b1) * g
    if kind.startswith("partial_rowwise"):
        v = b2 * exp_avg_sq[rows] + (1 - b2) * (g * g).mean(1)
        v_hat = (v / (1 - b2**step))[:, None]
    else:
        v = b2 * exp_avg_sq[rows] + (1 - b2) * g * g
        v_hat = v / (1 - b2**step)
    r = (m / (1 - b1**step)) / (v_hat.sqrt() + eps)
    if kind.endswith("lamb"):
        r = r + weight_decay * w
        trust = w.norm(dim=1) / r.norm(dim=1)  # the whole row's norms
        new = w - lr * trust[:, None] * r
    else:
        new = w - lr * (r + weight_decay * w)
    exp_avg[rows] = m
    exp_avg_sq[rows] = v
    weight[rows] = new.to(weight.dtype)


def touched_rows(module: nn.Module, batches: list[KeyedJaggedTensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """Per weight FQN of the EBC or EC `module` (under `prefix`), the rows `batches` look up."""
    if hasattr(module, "embedding_bag_configs"):
        configs, attr = module.embedding_bag_configs(), "embedding_bags"
    else:
        configs, attr = module.embedding_configs(), "embeddings"
    out = {}
    for c in configs:
        ids = [kjt[f].values() for kjt in batches for f in c.feature_names if f in kjt.keys()]
        out[f"{prefix}{attr}.{c.name}.weight"] = torch.cat(ids).long().unique()
    return out


class MomentsReference:
    """Every table of `module` trained with `adam_family_step` (`step` after backward, given the
    step's touched rows, `touched_rows`); the step count advances once per step."""

    def __init__(
        self,
        module: nn.Module,
        kind: str,
        *,
        lr: float = ADAM_LR,
        betas: tuple[float, float] = ADAM_BETAS,
        eps: float = ADAM_EPS,
        weight_decay: float = 0.0,
    ) -> None:
        self.module, self.kind = module, kind
        self.hyper = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        self.steps = 0
        params = dict(module.named_parameters())
        self.exp_avg = {n: torch.zeros(p.shape, device=p.device) for n, p in params.items()}
        partial = kind.startswith("partial_rowwise")
        self.exp_avg_sq = {
            n: torch.zeros(p.shape[0] if partial else p.shape, device=p.device) for n, p in params.items()
        }

    def step(self, touched: dict[str, torch.Tensor]) -> None:
        self.steps += 1
        for name, p in self.module.named_parameters():
            rows = touched.get(name)
            if rows is not None and rows.numel():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                adam_family_step(
                    self.kind, p.data, grad, self.exp_avg[name], self.exp_avg_sq[name], rows,
                    step=self.steps, **self.hyper,
                )  # fmt: skip
            p.grad = None

    def state(self, name: str) -> dict[str, torch.Tensor]:
        return {"exp_avg": self.exp_avg[name], "exp_avg_sq": self.exp_avg_sq[name]}
