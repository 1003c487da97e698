"""One process doing what a pipeline step does, for the pipeline tests: every data stream's
micro-batches accumulated (``1 / (m * streams)`` each, aux losses scaled alike), and the relative
error of each stage's gradients against it."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from moetrain import parallelize, set_aux_loss_scale
from moetrain.layers import MoELayer


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|b|``."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def reference_step(reference, parallel, micro: int, example: Callable, loss_of: Callable):
    """Runs ``micro`` micro-batches of every data stream ``example(stream * 100 + i) -> (inputs,
    target)`` through ``reference`` (``loss_of(reference, inputs, target) -> loss``) with gradient
    accumulation. Returns (this rank's stream's losses, its summed aux losses, the global norm)."""
    count = parallel.data_count
    set_aux_loss_scale(reference, 1.0 / (micro * count))
    losses, aux = [], torch.zeros(())
    for index in range(count):
        for i in range(micro):
            inputs, target = example(index * 100 + i)
            loss = loss_of(reference, inputs, target)
            (loss / (micro * count)).backward()
            if index == parallel.data_index:
                losses.append(loss.detach())
                aux = aux + sum(m.last_stats.aux_loss for m in reference.modules() if isinstance(m, MoELayer))
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in reference.parameters()))
    return losses, aux, norm


def gradient_errors(model, reference, parallel) -> dict[str, float]:
    """Per parameter of this stage, the relative error of its gradient against the reference's
    (an expert tensor compared with this rank's slice of the full one)."""
    ref_params = dict(reference.named_parameters())
    errors = {}
    for name, param in model.named_parameters():
        want = ref_params[name].grad
        if ".experts." in name and param.shape != want.shape:
            local = parallel.local_experts(want.shape[0])
            want = want[local.start : local.stop]
        errors[name] = rel_error(param.grad, want)
    return errors


def pipeline_step_report(
    model, parallel, strategy, micro: int, example: Callable, loss_fn: Callable, loss_of: Callable
) -> dict:
    """One pipeline step of ``model`` (parallelized by ``strategy``: this rank keeps its stages)
    over ``micro`` micro-batches ``example(stream * 100 + i)`` of this rank's data stream, each
    loss ``loss_fn(output, target) / micro``, and the same step by a copy of the whole ``model``
    in one process (:func:`reference_step`, ``loss_of(net, inputs, target)``). Returns this
    rank's ``stage``, data ``stream``, its parameter names (``params``), the pipeline's and the
    reference's ``losses`` / ``ref_losses`` and summed ``aux`` / ``ref_aux`` losses, the global
    ``norm`` of both, and each parameter's relative gradient error (``grads``)."""
    reference = copy.deepcopy(model)
    trained = parallelize(model, parallel, strategy)
    set_aux_loss_scale(model, 1.0 / micro)
    batches = [example(parallel.data_index * 100 + i) for i in range(micro)]
    losses, aux = trained.pipeline.step(batches, loss_fn, 1.0 / micro)
    trained.reduce_gradients()
    norm = trained.grad_norm()
    ref_losses, ref_aux, ref_norm = reference_step(reference, parallel, micro, example, loss_of)
    return {
        "stage": parallel.pp_rank,
        "stream": parallel.data_index,
        "params": sorted(name for name, _ in model.named_parameters()),
        "losses": [float(x) for x in losses],
        "ref_losses": [float(x) for x in ref_losses],
        "aux": float(aux),
        "ref_aux": float(ref_aux),
        "grads": gradient_errors(model, reference, parallel),
        "norm": (float(norm), float(ref_norm)),
    }
