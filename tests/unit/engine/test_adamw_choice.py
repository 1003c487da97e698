"""Which ``torch.optim.AdamW`` implementation the engine builds (:func:`adamw_implementation`): the
fused one for plain CPU tensors (6x faster than ``foreach`` there), ``foreach`` for one kind of
tensor otherwise, neither for DTensors mixed with plain tensors. The engine's own tests (resume,
precisions, distributed runs against one process) run with the choice made here."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from moetrain.config import TrainConfig, config_from_dict
from moetrain.engine import Trainer
from moetrain.engine.setup import adamw_implementation
from tests.unit.engine.test_engine import tiny


class _Pretend(torch.nn.Module):
    """Parameters whose class names say DTensor without a process group (the choice looks at kinds)."""

    def __init__(self, kinds: list[bool]):
        super().__init__()
        for index, is_dtensor in enumerate(kinds):
            param = torch.nn.Parameter(torch.zeros(2))
            if is_dtensor:
                param.__class__ = type("DTensor", (torch.nn.Parameter,), {})
            self.register_parameter(f"p{index}", param)


def test_plain_cpu_parameters_get_the_fused_adamw():
    assert adamw_implementation(torch.nn.Linear(4, 4)) == {"fused": True}


def test_dtensors_get_foreach_alone_and_neither_when_mixed_with_plain_tensors():
    assert adamw_implementation(_Pretend([True, True])) == {"foreach": True}
    assert adamw_implementation(_Pretend([True, False])) == {"foreach": False}
    assert DTensor.__name__ == "DTensor"  # the name the choice looks for


def test_integer_parameters_keep_foreach():
    module = torch.nn.Module()
    module.register_parameter(
        "count", torch.nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    )
    assert adamw_implementation(module) == {"foreach": True}


def test_the_engine_builds_the_fused_adamw_on_the_cpu(tmp_path):
    trainer = Trainer(config_from_dict(TrainConfig, tiny(tmp_path / "run", steps=1)))
    try:
        assert trainer.optimizer.defaults["fused"] is True
        trainer.train()
    finally:
        trainer.close()
