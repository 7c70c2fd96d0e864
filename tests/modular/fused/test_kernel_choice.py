"""Which kernel a kernel group gets, and the reason: `choose_kernel` (modular/fused/choice.py),
branch by branch. Pure and single-process: the choice reads plain facts, no model or process
group. Which kernel class each choice builds, and that it trains like the unsharded table, is held
by the multi-process parity tests (test_fused.py, test_fused_adam.py, test_2d.py)."""

from __future__ import annotations

import pytest

from modular.fused.choice import KernelFacts, KernelKind, choose_kernel
from modular.fused.config import FusedOptimizerKind as Kind

SGD, ROWWISE, ADAM = Kind.EXACT_SGD, Kind.EXACT_ROWWISE_ADAGRAD, Kind.ADAM


@pytest.mark.parametrize(
    "facts, kernel, across, because",
    [
        (KernelFacts("cpu", None), KernelKind.DENSE, False, "unfused"),
        (KernelFacts("cpu", None, exact_replicas=True), KernelKind.DENSE, True, "unfused"),
        (KernelFacts("cpu", SGD, widths=(8, 16)), KernelKind.FBGEMM, False, "fbgemm's fused kernel"),
        (KernelFacts("cuda", ADAM, widths=(8,)), KernelKind.FBGEMM, False, "adam: fbgemm"),
        (KernelFacts("cpu", ADAM, widths=(8,)), KernelKind.ADAM, False, "no Adam family"),
        (KernelFacts("cpu", Kind.LAMB, column_rows=True), KernelKind.ADAM, False, "no Adam family"),
        (KernelFacts("cpu", SGD, weight_decay=0.1), KernelKind.EMULATED, False, "weight decay 0.1 on CPU"),
        (KernelFacts("cuda", SGD, weight_decay=0.1), KernelKind.FBGEMM, False, "fbgemm"),
        (KernelFacts("cpu", ROWWISE, widths=(8, 6)), KernelKind.EMULATED, False, "width 6 is not a multiple of 4"),
        (KernelFacts("cpu", ROWWISE, data_parallel=True), KernelKind.REPLAYED, False, "data-parallel copies"),
        (KernelFacts("cuda", ROWWISE, data_parallel=True), KernelKind.EMULATED, False, "data-parallel copies on cuda"),
        (KernelFacts("cpu", ROWWISE, column_rows=True), KernelKind.ROW_STATISTICS, False, "two passes"),
        (KernelFacts("cuda", ROWWISE, column_rows=True), KernelKind.EMULATED, False, "whole rows' statistic on cuda"),
        (KernelFacts("cpu", ROWWISE, exact_replicas=True), KernelKind.REPLAYED, True, "replica groups"),
        (KernelFacts("cuda", ROWWISE, exact_replicas=True), KernelKind.EMULATED, True, "replica groups on cuda"),
        (KernelFacts("cpu", ADAM, exact_replicas=True), KernelKind.ADAM, True, "no Adam family"),
        (KernelFacts("cpu", ROWWISE, data_parallel=True, exact_replicas=True), KernelKind.REPLAYED, True, "data-parallel"),
        (KernelFacts("cpu", ROWWISE, data_parallel=True, column_rows=True), KernelKind.REPLAYED, False, "data-parallel"),
    ],
)  # fmt: skip
def test_each_branch_names_its_kernel_and_why(facts, kernel, across, because) -> None:
    choice = choose_kernel(facts)
    assert (choice.kernel, choice.across_replicas) == (kernel, across), choice
    assert because in choice.because, choice.because
    assert choice.describe().startswith(kernel.value)


def test_the_first_reason_to_emulate_is_the_one_given() -> None:
    """Adam on CPU with weight decay and an odd width: the missing kernel is the reason, as it is
    the one no other setting could remove."""
    choice = choose_kernel(KernelFacts("cpu", ADAM, weight_decay=0.1, widths=(6,)))
    assert choice.kernel is KernelKind.ADAM
    assert "no Adam family" in choice.because and "weight decay" not in choice.because
