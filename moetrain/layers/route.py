"""The route step of a MoELayer: the router's decision for the tokens and its dispatch plan.

Legend: T tokens, D model dim, E experts, K choices, S = T*K routing slots.

``RouteStep(x_TD, capacity, training)`` = :meth:`~RouteStep.decide` (the router's
:class:`~moetrain.layers.router.RouterOutput` and, for batch-prioritised routing, the order ``[S]``
in which slots claim capacity) then :meth:`~RouteStep.plan` (the dispatch plan of the chosen
experts). Recompute replay wraps this step (:class:`moetrain.layers.replay.ReplayedRoute`) to record
the decision or reuse a recorded one.
"""

from __future__ import annotations

import torch

from moetrain.config import MoEConfig
from moetrain.layers.dispatch import DispatchPlan, build_dispatch_plan, token_priority_order
from moetrain.layers.router import RouterOutput, TopKRouter


class RouteStep:
    """``x_TD [T, D]`` -> (the router's output, the dispatch plan) with ``router`` and ``config``."""

    def __init__(self, router: TopKRouter, config: MoEConfig):
        self.router, self.config = router, config

    def __call__(
        self, x_TD: torch.Tensor, capacity: int | None, training: bool
    ) -> tuple[RouterOutput, DispatchPlan]:
        routing, priority_S = self.decide(x_TD)
        return routing, self.plan(routing, capacity, priority_S, training)

    def decide(self, x_TD: torch.Tensor) -> tuple[RouterOutput, torch.Tensor | None]:
        """The router's output for ``x_TD`` and the slot order ``[S]`` of batch-prioritised routing
        (tokens by descending top probability; None without it)."""
        routing = self.router(x_TD)
        if not self.config.batch_prioritized_routing:
            return routing, None
        with torch.no_grad():
            token_score_T = routing.probs_TE.max(dim=-1).values
            return routing, token_priority_order(token_score_T.shape[0], self.config.top_k, token_score_T)

    def plan(
        self, routing: RouterOutput, capacity: int | None, priority_S: torch.Tensor | None, training: bool
    ) -> DispatchPlan:
        """The dispatch plan of ``routing.expert_ids_TK`` (padded to a routing-independent row count
        in compiled graphs and on ``meta``); in training, the routed counts feed the score biases."""
        cfg = self.config
        expert_ids_TK = routing.expert_ids_TK
        padded = torch.compiler.is_compiling() or expert_ids_TK.device.type == "meta"
        plan = build_dispatch_plan(
            expert_ids_TK, cfg.num_experts, capacity, priority_S, cfg.kernels, padded, ids_in_range=True
        )
        if training and cfg.score_bias_rate > 0:
            self.router.observe(plan.routed_per_expert_E)
        return plan
