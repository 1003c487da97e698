"""CPU shares per rank and the default thread / loader-worker counts derived from them."""

from __future__ import annotations

import logging

import torch

from moetrain.cpus import cpus_per_rank, default_num_workers, default_threads, share_of_cpus, usable_cpus
from tests.helpers.paths import ROOT


def test_a_rank_shares_its_cpus_with_the_ranks_of_its_host_whose_masks_overlap():
    node = set(range(16))
    unbound = [("a", node)] * 4 + [("b", node)] * 4  # plain torchrun on two nodes: 4 ranks share 16 CPUs
    assert share_of_cpus(("a", node), unbound) == 4
    bound = [("a", set(range(4 * r, 4 * r + 4))) for r in range(4)]  # bind_rank.py: 4 CPUs each
    assert share_of_cpus(bound[1], bound) == 4
    container = [("a", {0, 1})] * 8  # 8 ranks in a 2-CPU container: at least one each
    assert share_of_cpus(("a", {0, 1}), container) == 1
    assert cpus_per_rank(1) == len(usable_cpus()) >= 1


def test_default_workers_and_threads_do_not_oversubscribe_a_ranks_cpus():
    assert [default_num_workers(c) for c in (1, 2, 4, 8, 16, 64)] == [0, 1, 1, 2, 4, 8]
    assert [default_threads(c, default_num_workers(c)) for c in (1, 2, 4, 16, 64)] == [1, 1, 3, 12, 56]
    assert default_threads(2, 5) == 1


def test_threads_null_chooses_from_the_cpus_and_the_loader_workers_and_logs_it(tmp_path, caplog):
    from moetrain.cli import build_train_config
    from moetrain.engine import Trainer

    before = torch.get_num_threads()
    overrides = [f"out_dir={tmp_path}", "steps=1", "device=cpu", "data.micro_batch_size=2"]
    try:
        with caplog.at_level(logging.INFO, logger="moetrain.engine"):
            trainer = Trainer(
                build_train_config(str(ROOT / "models/m6_moe/tiny.yaml"), [*overrides, "data.num_workers=1"])
            )
            trainer.close()
        cpus = cpus_per_rank(1)
        assert trainer.batches.num_workers == 1 and torch.get_num_threads() == default_threads(cpus, 1)
        lines = [r.getMessage() for r in caplog.records if "torch threads" in r.getMessage()]
        assert lines == [
            f"rank 0: torch threads {default_threads(cpus, 1)} (CPUs for this rank: {cpus}, data-loader "
            "workers: 1; set threads: N to override)"
        ]
        caplog.clear()
        trainer = Trainer(
            build_train_config(str(ROOT / "models/m6_moe/tiny.yaml"), [*overrides, "threads=3"])
        )
        trainer.close()
        assert torch.get_num_threads() == 3 and not any(
            "torch threads" in r.getMessage() for r in caplog.records
        )
    finally:
        torch.set_num_threads(before)
