"""`moetrain` with a fault injected, for the fault tests: python inject.py FAULT ARGS...

FAULT: ``none``; ``inf-loss@S`` (the loss of optimizer step S is inf); ``nan-loss-from@S`` (every
loss from step S on is NaN). Only this process is affected (the tests pass it to one rank)."""

import math
import sys

from moetrain.registry import get_model, register_model

fault, args = sys.argv[1], sys.argv[2:]
if fault != "none":
    kind, _, step_text = fault.partition("@")
    start = int(step_text)
    spec = get_model("moe_lm")
    original_builder = spec.builder

    def faulty_builder(config, shard):
        model, batches, loss_fn = original_builder(config, shard)
        calls = {"n": 0}

        def faulty_loss(logits, targets):
            calls["n"] += 1
            step = (calls["n"] - 1) // config.grad_accum + 1
            loss = loss_fn(logits, targets)
            hit = step == start if kind == "inf-loss" else step >= start
            return loss * (math.inf if kind == "inf-loss" else math.nan) if hit else loss

        return model, batches, faulty_loss

    register_model(
        "moe_lm", spec.config_class, faulty_builder, describe=spec.describe, strategy=spec.strategy
    )

from moetrain.cli import main  # noqa: E402

sys.exit(main(args))
