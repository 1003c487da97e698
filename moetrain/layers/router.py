"""Top-k router: token features -> routing probabilities, chosen experts and their gates.

Legend: T tokens, D model dim, E experts, K choices per token, G prototype groups; node-limited
routing: N nodes the experts are spread over, e = E/N experts per node, M = ``max_nodes_per_token``.
Router math runs in fp32 (fp64 for fp64 inputs), also under autocast, so every rank routes a
token identically whatever the training precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.config import MoEConfig
from moetrain.layers.precision import autocast_off
from moetrain.validation import require_int


@dataclass
class RouterOutput:
    logits_TE: torch.Tensor
    probs_TE: torch.Tensor
    expert_ids_TK: torch.Tensor
    gates_TK: torch.Tensor


def node_limit_binds(top_k: int, nodes: int, max_nodes: int | None) -> bool:
    """Whether ``max_nodes`` can change a token's choice: only when ``max_nodes < min(top_k, nodes)``
    (K experts never span more than K nodes, and there are only ``nodes`` of them)."""
    return max_nodes is not None and max_nodes < min(top_k, nodes)


def check_expert_nodes(num_experts: int, top_k: int, nodes: int, max_nodes: int | None) -> None:
    """ValueError unless ``nodes`` divides ``num_experts`` and, where the limit binds, the
    ``max_nodes`` kept nodes hold at least ``top_k`` experts."""
    require_int("expert nodes", nodes, 1, note=f"dividing num_experts = {num_experts}")
    if num_experts % nodes:
        raise ValueError(
            f"expert nodes must be an integer >= 1 dividing num_experts = {num_experts}, got {nodes!r}"
        )
    if node_limit_binds(top_k, nodes, max_nodes) and max_nodes * (num_experts // nodes) < top_k:
        raise ValueError(
            f"max_nodes_per_token = {max_nodes}: {max_nodes} of the {nodes} nodes hold "
            f"{max_nodes * (num_experts // nodes)} experts, fewer than top_k = {top_k}"
        )


def top_k_lowest_index_ties(scores_TE: torch.Tensor, top_k: int) -> torch.Tensor:
    """Indices of the ``top_k`` largest ``scores`` along the last dim, in descending order of score;
    equal scores in ascending order of index (a stable sort: the same on every device, where
    ``torch.topk`` leaves the order of ties unspecified). Without ties, ``torch.topk``'s indices."""
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[..., :top_k]


def node_limited_top_k(choice_TE: torch.Tensor, top_k: int, nodes: int, max_nodes: int) -> torch.Tensor:
    """``expert_ids_TK`` of node-limited routing (DeepSeek-V3, section 2.1.2: "each token will be
    sent to at most M nodes, which are selected according to the sum of the highest K_r/M affinity
    scores of the experts distributed on each node").

    Node m holds the ``E/N`` consecutive experts ``[m*E/N, (m+1)*E/N)``. With ``n = ceil(K/M)``:

    1. ``node_score[t, m] = sum of the n largest choice[t, e] over the experts e of node m``
       (n = K/M when M divides K, as in the paper; rounded up otherwise, where Megatron's
       group-limited routing rounds down);
    2. the token keeps the M nodes of highest ``node_score`` (ties: the lower node index);
    3. its K experts are those of highest ``choice`` among the kept nodes' ``M*E/N`` experts (ties:
       the lower expert index), in descending order of ``choice``.

    Both selections are :func:`top_k_lowest_index_ties`, so ties are broken the same way on every
    device.

    ``choice_TE``: the scores the choice is made on (with aux-free biases when enabled). Needs
    ``M * E/N >= K`` (:func:`check_expert_nodes`)."""
    num_tokens, num_experts = choice_TE.shape
    per_node = num_experts // nodes
    choice_TNe = choice_TE.view(num_tokens, nodes, per_node)
    node_score_TN = choice_TNe.topk(math.ceil(top_k / max_nodes), dim=-1).values.sum(dim=-1)
    kept_TM = top_k_lowest_index_ties(node_score_TN, max_nodes)
    keep_TN = torch.zeros_like(node_score_TN, dtype=torch.bool).scatter_(1, kept_TM, True)
    masked_TE = choice_TNe.masked_fill(~keep_TN.unsqueeze(-1), float("-inf")).view(num_tokens, num_experts)
    return top_k_lowest_index_ties(masked_TE, top_k)


class TopKRouter(nn.Module):
    """``logits_TE = x_TD @ weight_ED^T``; scores by softmax (per prototype group) or sigmoid; each
    of the G groups of E/G consecutive experts picks its top K/G experts (G = 1: plain top-k;
    K = G: M6-T expert prototyping, "k top-1"), in descending order of score, equal scores by the
    lower expert index (:func:`top_k_lowest_index_ties`). Gates are the chosen scores, divided by
    their sum over the K choices when ``normalize_gates`` (auto: when K > 1).

    Training-time jitter multiplies the router input by ``U(1 - eps, 1 + eps)`` (Switch).

    Aux-loss-free balancing (``score_bias_rate > 0``, DeepSeek-V3): the choice is made on
    ``probs_TE + score_bias_E`` while the gates stay the unbiased scores; ``load_E`` counts the
    slots routed to each expert since the last :meth:`update_score_bias`, which moves each bias by
    ``rate * sign(mean load - load_e)`` (see :func:`moetrain.layers.update_score_biases`, called
    once per optimizer step with the counts summed over every rank that shares the router). The
    bias is a buffer: it is saved with the model and identical on every replica.

    Node-limited routing (``max_nodes_per_token = M``): once :meth:`set_expert_nodes` has said over
    how many nodes N the experts are spread, each token's K experts are chosen among those of its M
    best nodes (:func:`node_limited_top_k`, on the same scores as the plain choice, biases
    included; the gates stay the unbiased scores). When ``M >= min(K, N)`` the limit cannot bind
    and routing is the plain top-k, bit for bit. Refused with ``num_prototypes > 1``
    (:class:`~moetrain.config.MoEConfig`). A recompute that replays a recorded choice reuses its
    expert ids, so it needs nothing here.
    """

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model))
        if config.score_bias_rate > 0:
            self.register_buffer("score_bias_E", torch.zeros(config.num_experts, dtype=torch.float32))
            # integer counts: a model cast to bf16 / fp16 weights leaves them exact
            self.register_buffer(
                "load_E", torch.zeros(config.num_experts, dtype=torch.int64), persistent=False
            )
        else:
            self.score_bias_E = self.load_E = None
        self.expert_nodes: int | None = 1
        self.limits_nodes = False
        self.reset_parameters()

    def set_expert_nodes(self, nodes: int | None) -> None:
        """The number of nodes N the experts are spread over, node m holding experts
        ``[m*E/N, (m+1)*E/N)`` (how expert parallelism lays them out: see
        :attr:`moetrain.ParallelContext.ep_nodes`); 1 (the default) is a single node. ``None``: the
        layout has no regular node grid, which node-limited routing cannot use (ValueError when its
        limit could bind). Not saved: it belongs to the run's layout, not to the model."""
        cfg = self.config
        if nodes is None:
            if cfg.max_nodes_per_token is not None and cfg.max_nodes_per_token < cfg.top_k:
                raise ValueError(
                    "max_nodes_per_token needs every node to hold the same number of the expert-parallel "
                    "group's ranks (ParallelContext.ep_node_grid); this layout does not: set "
                    "max_nodes_per_token to None (or >= top_k) or use a regular layout"
                )
            self.expert_nodes, self.limits_nodes = None, False
            return
        check_expert_nodes(cfg.num_experts, cfg.top_k, nodes, cfg.max_nodes_per_token)
        self.expert_nodes = nodes
        self.limits_nodes = node_limit_binds(cfg.top_k, nodes, cfg.max_nodes_per_token)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Weights ``N(0, 0.02)`` (small logits: near-uniform routing at the start); biases and
        loads zero (also after a model built on ``meta`` is materialised)."""
        nn.init.normal_(self.weight, std=0.02)
        for buffer in (self.score_bias_E, self.load_E):
            if buffer is not None and buffer.device.type != "meta":
                buffer.zero_()

    def _apply(self, fn, recurse=True):
        """As :meth:`nn.Module._apply`, but ``score_bias_E`` stays fp32 when the module is cast
        (bf16 / fp16 weights): steps of ``score_bias_rate`` are lost next to a bias in bf16."""
        bias = self.score_bias_E
        super()._apply(fn, recurse)
        if bias is not None and self.score_bias_E.dtype != torch.float32:
            self.score_bias_E = bias.to(self.score_bias_E.device, torch.float32)
        return self

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
                    if self.limits_nodes:
                        expert_ids_TK = node_limited_top_k(
                            choice_TE, cfg.top_k, self.expert_nodes, cfg.max_nodes_per_token
                        )
                    else:
                        top_index_TGk = top_k_lowest_index_ties(
                            choice_TE.view(num_tokens, groups, per_group), cfg.top_k_per_prototype
                        )
                        group_offset_G1 = (
                            torch.arange(groups, device=x_TD.device).mul_(per_group).view(groups, 1)
                        )
                        expert_ids_TK = (top_index_TGk + group_offset_G1).reshape(num_tokens, cfg.top_k)
            gates_TK = self.gates(probs_TE, expert_ids_TK)
        return RouterOutput(logits_TE, probs_TE, expert_ids_TK, gates_TK)

    def observe(self, routed_per_expert_E: torch.Tensor) -> None:
        """Adds a forward's routed slots per expert to ``load_E`` (aux-free balancing only)."""
        if self.load_E is not None:
            self.load_E += routed_per_expert_E.to(self.load_E.device, torch.int64)

    @torch.no_grad()
    def update_score_bias(self, load_E: torch.Tensor) -> None:
        """``score_bias_E += rate * sign(mean(load_E) - load_E)``; clears ``load_E``."""
        load_E = load_E.double()
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
