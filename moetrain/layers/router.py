"""Top-k router: token features -> routing probabilities, chosen experts and their gates.

Legend: T tokens, D model dim, E experts, K choices per token, G prototype groups.
Router math runs in fp32 (fp64 for fp64 inputs), also under autocast, so every rank routes a
token identically whatever the training precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import MoEConfig
from moetrain.layers.precision import autocast_off


@dataclass
class RouterOutput:
    logits_TE: torch.Tensor
    probs_TE: torch.Tensor
    expert_ids_TK: torch.Tensor
    gates_TK: torch.Tensor


class TopKRouter(nn.Module):
    """``logits_TE = x_TD @ weight_ED^T``; scores by softmax (per prototype group) or sigmoid; each
    of the G groups of E/G consecutive experts picks its top K/G experts (G = 1: plain top-k;
    K = G: M6-T expert prototyping, "k top-1"). Gates are the chosen scores, divided by their sum
    over the K choices when ``normalize_gates`` (auto: when K > 1).

    Training-time jitter multiplies the router input by ``U(1 - eps, 1 + eps)`` (Switch).

    Aux-loss-free balancing (``score_bias_rate > 0``, DeepSeek-V3): the choice is made on
    ``probs_TE + score_bias_E`` while the gates stay the unbiased scores; ``load_E`` counts the
    slots routed to each expert since the last :meth:`update_score_bias`, which moves each bias by
    ``rate * sign(mean load - load_e)`` (see :func:`moetrain.layers.update_score_biases`, called
    once per optimizer step with the counts summed over every rank that shares the router). The
    bias is a buffer: it is saved with the model and identical on every replica.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model))
        if config.score_bias_rate > 0:
            self.register_buffer("score_bias_E", torch.zeros(config.num_experts, dtype=torch.float32))
            self.register_buffer(
                "load_E", torch.zeros(config.num_experts, dtype=torch.float64), persistent=False
            )
        else:
            self.score_bias_E = self.load_E = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weights ``N(0, 0.02)`` (small logits: near-uniform routing at the start); biases and
        loads zero (also after a model built on ``meta`` is materialised)."""
        nn.init.normal_(self.weight, std=0.02)
        for buffer in (self.score_bias_E, self.load_E):
            if buffer is not None and buffer.device.type != "meta":
                buffer.zero_()

    def router_dtype(self, x: torch.Tensor) -> torch.dtype:
        return torch.float64 if x.dtype == torch.float64 else torch.float32

    def forward(self, x_TD: torch.Tensor, expert_ids_TK: torch.Tensor | None = None) -> RouterOutput:
        """Routes ``x_TD``; with ``expert_ids_TK`` given (a recorded decision being replayed), the
        scores and gates are recomputed (differentiably) but the choice of experts is not."""
        cfg = self.config
        dtype = self.router_dtype(x_TD)
        num_tokens = x_TD.shape[0]
        with autocast_off(x_TD.device.type):
            x_TD = x_TD.to(dtype)
            if self.training and cfg.router_jitter > 0:
                noise_TD = torch.empty_like(x_TD).uniform_(1.0 - cfg.router_jitter, 1.0 + cfg.router_jitter)
                x_TD = x_TD * noise_TD
            logits_TE = F.linear(x_TD, self.weight.to(dtype))
            groups, per_group = cfg.num_prototypes, cfg.experts_per_prototype
            if cfg.score_function == "softmax":
                probs_TE = logits_TE.view(num_tokens, groups, per_group).softmax(dim=-1).view_as(logits_TE)
            else:
                probs_TE = logits_TE.sigmoid()
            if expert_ids_TK is None:  # the choice is not differentiable; the gates below are
                with torch.no_grad():
                    choice_TE = (
                        probs_TE if self.score_bias_E is None else probs_TE + self.score_bias_E.to(dtype)
                    )
                    top_index_TGk = (
                        choice_TE.view(num_tokens, groups, per_group)
                        .topk(cfg.top_k_per_prototype, dim=-1)
                        .indices
                    )
                    group_offset_G1 = torch.arange(groups, device=x_TD.device).mul_(per_group).view(groups, 1)
                    expert_ids_TK = (top_index_TGk + group_offset_G1).reshape(num_tokens, cfg.top_k)
            gates_TK = self.gates(probs_TE, expert_ids_TK)
        return RouterOutput(logits_TE, probs_TE, expert_ids_TK, gates_TK)

    def observe(self, routed_per_expert_E: torch.Tensor) -> None:
        """Adds a forward's routed slots per expert to ``load_E`` (aux-free balancing only)."""
        if self.load_E is not None:
            self.load_E += routed_per_expert_E.to(self.load_E.device, torch.float64)

    @torch.no_grad()
    def update_score_bias(self, load_E: torch.Tensor) -> None:
        """``score_bias_E += rate * sign(mean(load_E) - load_E)``; clears ``load_E``."""
        step = torch.sign(load_E.mean() - load_E) * self.config.score_bias_rate
        self.score_bias_E += step.to(self.score_bias_E)
        self.load_E.zero_()

    def gates(self, probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
        """The chosen experts' scores ``probs[t, expert_ids[t, j]]``, divided by their sum over the
        K choices when ``normalize_gates`` (differentiable in ``probs_TE``)."""
        gates_TK = probs_TE.gather(1, expert_ids_TK)
        if self.config.gates_normalized:
            tiny = torch.finfo(probs_TE.dtype).tiny
            gates_TK = gates_TK / gates_TK.sum(dim=-1, keepdim=True).clamp_min(tiny)
        return gates_TK
