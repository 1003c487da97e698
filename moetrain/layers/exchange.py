"""The one seam between a dispatcher and the communication of its rounds.

A dispatcher (:mod:`moetrain.layers.dispatch`, :mod:`moetrain.layers.node_dispatch`) opens a
:class:`DispatchRound` per forward call, and every exchange it makes goes through its
:class:`Exchanger`: the plans that take a count exchange (``plans``), the row exchanges each way
(``all_to_all``, ``all_to_all_reverse``, ``all_to_all_with_ids``), the chunked exchange overlapped
with the experts (``chunked_trip``), and the end of the round (``close``, given the round's output).
Each call names what it delivers (``name``), unique within a round.

:class:`Exchanger` communicates. Recompute replay (:mod:`moetrain.layers.replay`) installs an
exchanger that wraps this one: it keeps what a recorded round's calls delivered and hands it back,
without communicating, when the round is recomputed. The dispatchers do not know which one they
hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from moetrain.comm.all_to_all import all_to_all, all_to_all_reverse, all_to_all_with_ids
from moetrain.layers.overlap import OverlapSettings, TripRows, chunked_experts

Made = TypeVar("Made")


@dataclass(eq=False)
class DispatchRound:
    """One forward call's dispatch round: the dispatch plan (``plan``, a
    :class:`~moetrain.layers.dispatch.DispatchPlan`) and under expert parallelism the exchange plan
    (``a2a_plan``) and the rows received per source rank and local expert (``recv_counts_PE``).
    The dispatcher's ``dispatch`` returns it and its ``combine`` takes it back."""

    plan: object = None
    recv_counts_PE: torch.Tensor | None = None
    a2a_plan: object = None


class Exchanger:
    """The communication of a dispatcher's rounds (module docstring): every call communicates."""

    def new_round(self, plan) -> DispatchRound:
        """The round of a forward call with dispatch plan ``plan``."""
        return DispatchRound(plan)

    def plans(self, rnd: DispatchRound, name: str, make: Callable[[], Made]) -> Made:
        """``make()``: plans of ``rnd`` that take a count exchange (or derive from exchanged rows)."""
        return make()

    def all_to_all(self, rnd: DispatchRound, name: str, x_ND: torch.Tensor, plan, comm_dtype) -> torch.Tensor:
        """:func:`moetrain.comm.all_to_all.all_to_all` of ``x_ND`` with the exchange plan ``plan``."""
        return all_to_all(x_ND, plan, comm_dtype)

    def all_to_all_reverse(
        self, rnd: DispatchRound, name: str, y_ND: torch.Tensor, plan, comm_dtype
    ) -> torch.Tensor:
        """:func:`moetrain.comm.all_to_all.all_to_all_reverse`: the return trip of ``plan``."""
        return all_to_all_reverse(y_ND, plan, comm_dtype)

    def all_to_all_with_ids(
        self, rnd: DispatchRound, name: str, x_CD: torch.Tensor, ids_CK: torch.Tensor, plan, comm_dtype
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(``x_RD``, ``ids_RK``): :func:`moetrain.comm.all_to_all.all_to_all_with_ids`. ``ids_RK`` is
        None where the rows are replayed (the round's plans then come from its record)."""
        return all_to_all_with_ids(x_CD, ids_CK, plan, comm_dtype)

    def chunked_trip(
        self,
        rnd: DispatchRound,
        x_ND: torch.Tensor,
        experts,
        settings: OverlapSettings,
        rows: TripRows | None = None,
    ) -> torch.Tensor:
        """The chunked exchange -> ``experts`` -> return exchange of ``x_ND`` (send order), overlapped
        (:func:`moetrain.layers.overlap.chunked_experts`); ``rows`` as there."""
        return chunked_experts(x_ND, experts, settings, rows)

    def close(self, rnd: DispatchRound, y_TD: torch.Tensor) -> torch.Tensor:
        """The end of ``rnd``, whose output is ``y_TD``; returns ``y_TD``."""
        return y_TD
