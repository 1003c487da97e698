"""`moetrain` with a fault injected, for the fault tests: python inject.py FAULT ARGS...

FAULT: ``none``; ``inf-loss@S`` (the loss of optimizer step S is inf); ``nan-loss-from@S`` (every
loss from step S on is NaN); ``overflow-grad@S`` (the loss of step S is finite, its gradient
inf: an fp16 overflow in the backward); ``stop-in-moe@S`` (the first MoE layer's forward of step S, before
its all-to-all, waits 2 s, long enough for the watchdog to publish where the rank is, then stops
the process with SIGSTOP); ``kill9-rank@R:S`` (the process of RANK R kills itself with SIGKILL at the
loss of step S: for launches where every rank runs the same command); ``kill9-setup@R`` (the
process of RANK R kills itself with SIGKILL in the model builder: set-up, after the watchdog
started); ``slow-build@N`` (the model builder writes ``slow-build.started`` beside ``out_dir``,
then sleeps N seconds: set-up in progress, the out_dir lock held). Otherwise only this process is
affected (the tests pass the fault to one rank).

Ranks forked from the tests' fork server (``launch.start_ranks``) call :func:`install` and then
moetrain's ``main`` themselves."""

import math
import os
import signal
import sys
import time

if __name__ == "__main__":
    from inf_gradient import InfGradient  # beside this script
else:
    from tests.faults.inf_gradient import InfGradient

from moetrain.registry import get_model, register_model


def install(fault: str) -> None:
    """Registers ``moe_lm`` again, its builder injecting ``fault`` (``none``: changes nothing)."""
    if fault == "none":
        return
    kind, _, step_text = fault.partition("@")
    if kind in ("kill9-rank", "kill9-setup"):
        victim, _, step_text = step_text.partition(":")
        if int(os.environ.get("RANK", "0")) != int(victim):
            kind = "none"
        step_text = step_text or "0"
    start = int(step_text)
    spec = get_model("moe_lm")
    original_builder = spec.builder

    def stop_in_moe(model, config) -> None:
        from moetrain.layers import MoELayer

        layer = next(module for module in model.modules() if isinstance(module, MoELayer))
        original_forward, calls = layer.forward, {"n": 0}

        def forward(*args, **kwargs):
            calls["n"] += 1
            if (calls["n"] - 1) // config.grad_accum + 1 == start:
                time.sleep(2)
                os.kill(os.getpid(), signal.SIGSTOP)
            return original_forward(*args, **kwargs)

        layer.forward = forward

    def faulty_builder(config, shard):
        if kind == "kill9-setup":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "slow-build":
            cue = os.path.join(os.path.dirname(os.path.abspath(config.out_dir)), "slow-build.started")
            with open(cue, "w"):
                pass  # the test's cue: this rank is in the builder, past every earlier set-up stage
            time.sleep(start)
        model, batches, loss_fn = original_builder(config, shard)
        if kind in ("slow-build", "none"):
            return model, batches, loss_fn
        if kind == "stop-in-moe":
            stop_in_moe(model, config)
            return model, batches, loss_fn
        calls = {"n": 0}

        def faulty_loss(logits, targets):
            calls["n"] += 1
            step = (calls["n"] - 1) // config.grad_accum + 1
            loss = loss_fn(logits, targets)
            hit = step >= start if kind == "nan-loss-from" else step == start
            if hit and kind == "kill9-rank":
                os.kill(os.getpid(), signal.SIGKILL)
            if hit and kind == "overflow-grad":
                return InfGradient.apply(loss)
            return loss * (math.inf if kind == "inf-loss" else math.nan) if hit else loss

        return model, batches, faulty_loss

    register_model(
        "moe_lm", spec.config_class, faulty_builder, describe=spec.describe, strategy=spec.strategy
    )


if __name__ == "__main__":
    install(sys.argv[1])

    from moetrain.cli import main

    sys.exit(main(sys.argv[2:]))
