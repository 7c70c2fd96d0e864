"""examples/train_dlrm.py --optimizer: every fused optimizer, the Adam family included, reaches
both the planner (which prices its state) and `modular.fuse_optimizer`."""

from __future__ import annotations

import planners
from tests.dist import run_on_ranks
from tests.examples.test_train_dlrm import _losses


def test_the_optimizer_flag_reaches_the_planner_and_the_fused_optimizer() -> None:
    from examples import train_dlrm

    config, _ = train_dlrm.parse_args(["--optimizer", "partial_rowwise_lamb", "--lr", "0.01"])
    assert (config.optimizer, config.lr) == ("partial_rowwise_lamb", 0.01)
    meta = train_dlrm.build_model("meta")
    priced = {
        name: train_dlrm.make_plan(meta, world_size=2, batch_size=64, device_memory="80GiB", optimizer=name)[1]
        for name in ("exact_rowwise_adagrad", "adam")
    }
    assert priced["adam"].optimizer is planners.Optimizer.ADAM
    assert max(r.memory for r in priced["adam"].ranks) > max(r.memory for r in priced["exact_rowwise_adagrad"].ranks)
    # The first loss comes before any update: the same; Adam's updates then differ from Adagrad's.
    adagrad = run_on_ranks(2, _losses, dict(steps=3, lr=0.01), timeout=90)[0][2]
    adam = run_on_ranks(2, _losses, dict(steps=3, lr=0.01, optimizer="adam"), timeout=90)[0][2]
    assert adam[0] == adagrad[0] and adam[1:] != adagrad[1:], (adam, adagrad)
