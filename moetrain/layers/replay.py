"""Recompute replay: a MoE layer recomputed during backward (activation checkpointing) reuses the
routing decision, capacity cut and all-to-all results of its first forward instead of routing
and communicating again.

``MoELayer.set_recompute_replay(True)`` installs two wrappers, and ``False`` removes them; the
layer's forward and its dispatcher stay as they are:

- :class:`ReplayedRoute` wraps the layer's route step (:class:`~moetrain.layers.route.RouteStep`):
  a forward that builds a graph records the decision in a :class:`DispatchRecord`; a forward that
  runs inside a backward pass (a recompute) takes the recorded one instead.
- :class:`ReplayingExchanger` wraps the dispatcher's :class:`~moetrain.layers.exchange.Exchanger`:
  the record is the round the dispatcher opens, so the exchanger keeps in it the plans and the rows
  each exchange delivered, and in a recompute hands them back (rows through
  :func:`~moetrain.comm.all_to_all.replay_all_to_all`, so that the backward still communicates the
  gradients) without communicating.

In a compiled graph the decision passes through one operator, ``moetrain::replay_routing``, whose
kernel runs at call time: in a forward it records the decision (expert ids, and the priority order
for batch-prioritised routing) and returns it; in a recompute it returns the recorded decision.

Lifetime of a record. In eager mode the exchanger hangs the record on the autograd node of its
round's output when the round closes, so it lives exactly as long as that forward's graph: a
forward whose graph is dropped without backward leaves nothing behind. A compiled graph gives no
such handle; there the record is kept by :class:`RoutingReplay` (older records, whose backward never
came, are dropped when a newer one is taken). Every record keeps a digest of the layer's input, and
a recompute takes the oldest live record whose digest matches the recomputed input: a layer called
more than once in one forward, each call in its own checkpoint, is recomputed in reverse order.
``RoutingReplay.clear()`` (``MoELayer.set_recompute_replay``) drops every record. A record is
replayed once: the exchanger lets go of its rows as the recompute uses them (the rebuilt graph
keeps what its backward needs), so they do not wait for the end of the step. A graph with
recomputed MoE layers can therefore be backpropagated once: a second backward through it (after
``retain_graph=True``) raises, naming that cause.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from moetrain._torch_compat import in_backward_pass
from moetrain.comm.all_to_all import replay_all_to_all
from moetrain.layers.exchange import DispatchRound, Exchanger
from moetrain.layers.overlap import TripRows
from moetrain.layers.router import RouterOutput


@dataclass(eq=False)
class DispatchRecord(DispatchRound):
    """A recorded forward's dispatch round: the routing decision (``decision``: the expert ids
    ``[T, K]``, in compiled graphs then the priority order ``[S]`` when batch-prioritised), the
    dispatch plan (an eager replay reuses it), and what the round's exchanges delivered: the plans
    (``plans``) and rows (``exchanged``) by the name the dispatcher gave each exchange."""

    decision: list[torch.Tensor] = field(default_factory=list)
    digest: torch.Tensor | None = None  # of the layer's input (:func:`input_digest`)
    held: bool = False  # kept by the RoutingReplay (compiled graphs), not by its forward's graph
    plans: dict[str, object] = field(default_factory=dict)
    exchanged: dict[str, torch.Tensor] = field(default_factory=dict)
    replayed: bool = False

    def nbytes(self) -> int:
        """Bytes a replay record keeps beyond the autograd graph's own tensors: the decision and
        the all-to-all rows (the plans' index tensors are held by the graph with or without
        replay)."""
        tensors = [*self.decision, *self.exchanged.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(eq=False)
class _Entry:
    record: DispatchRecord | None = None  # held here only for records of compiled graphs
    ref: weakref.ref | None = field(default=None)

    def get(self) -> DispatchRecord | None:
        return self.record if self.record is not None else (self.ref() if self.ref is not None else None)


_REPLAYS: weakref.WeakValueDictionary[int, RoutingReplay] = weakref.WeakValueDictionary()
_NEXT_ID = itertools.count()


def input_digest(x_TD: torch.Tensor) -> torch.Tensor:
    """Two fp64 numbers that tell a recompute's input from other inputs: ``sum(x)`` and
    ``sum_t t * sum_d x[t, d]`` (the second sees a permutation of the tokens). A recompute of a
    deterministic forward reproduces ``x`` bit for bit, so its digest is equal."""
    row_sums_T = x_TD.detach().sum(dim=1, dtype=torch.float64)
    position_T = torch.arange(x_TD.shape[0], device=x_TD.device, dtype=torch.float64)
    return torch.stack([row_sums_T.sum(), (row_sums_T * position_T).sum()])


class RoutingReplay:
    """The records of one layer's forwards that may still be recomputed; ``current`` is the record
    of the layer's call in progress (recorded or replayed; None when it records nothing), which
    the :class:`ReplayingExchanger` hands to the dispatcher as the call's round."""

    def __init__(self):
        self.id = next(_NEXT_ID)
        _REPLAYS[self.id] = self
        self._entries: deque[_Entry] = deque()
        self._replayed: list[weakref.ref] = []  # records taken, while their graph lives (error message)
        self.current: DispatchRecord | None = None

    def __reduce__(self):
        """A copied or unpickled layer starts with no records and its own id (a copy sharing the
        id would send its records to the original)."""
        return (RoutingReplay, ())

    def clear(self) -> None:
        self._entries.clear()
        self._replayed.clear()
        self.current = None

    def records(self) -> list[DispatchRecord]:
        return [r for r in (e.get() for e in self._entries) if r is not None]

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.records())

    @staticmethod
    def in_recompute() -> bool:
        """Whether the layer runs inside a backward pass (a checkpoint's recompute)."""
        return in_backward_pass()

    def record(self, decision: list[torch.Tensor], digest: torch.Tensor, held: bool) -> DispatchRecord:
        """Keeps ``decision`` and the digest of the layer's input for a recompute: here when
        ``held`` (compiled graphs), else weakly (eager: the exchanger hands the record to its
        autograd graph)."""
        self.current = DispatchRecord(decision=[t.detach() for t in decision], digest=digest, held=held)
        entry = _Entry(record=self.current) if held else _Entry(ref=weakref.ref(self.current))
        self._entries.append(entry)
        return self.current

    def take(self, digest: torch.Tensor) -> DispatchRecord:
        """The record a recompute of input digest ``digest`` replays: the oldest live one whose
        digest is equal, so that a layer called more than once in a forward (each call its own
        checkpoint, recomputed in reverse order) replays each call's own record. The digests are
        compared only when more than one record is live (a comparison waits for the device).
        Records freed without backward are dropped, and so are held (compiled) records older than
        the one taken, whose backward never ran; older eager records stay (their backward may
        still come)."""
        live = [(entry, record) for entry in self._entries if (record := entry.get()) is not None]
        only = len(live) == 1
        self._replayed = [ref for ref in self._replayed if ref() is not None]
        for position, (_, record) in enumerate(live):
            if only or torch.equal(record.digest, digest):
                older = [e for e, _ in live[:position] if e.record is None]
                self._entries = deque(older + [e for e, _ in live[position + 1 :]])
                record.replayed = True
                self._replayed.append(weakref.ref(record))
                self.current = record
                return record
        if any(torch.equal(r.digest, digest) for r in (ref() for ref in self._replayed) if r is not None):
            raise RuntimeError(
                "MoELayer is recomputed a second time for one forward: a graph whose recomputed MoE "
                "layers replay their routing can be backpropagated once (its record is used up by "
                "the first backward; a second backward after retain_graph=True is not supported); "
                "run the forward again for each backward"
            )
        raise RuntimeError(
            "MoELayer is recomputed during backward but holds no recorded forward of this input to "
            "replay; set_recompute_replay(True) must be on before the forward that is recomputed, "
            "and the recomputed forward must see the same input"
        )

    def exchange(
        self, decision: list[torch.Tensor], digest: torch.Tensor, record: bool
    ) -> list[torch.Tensor]:
        """The kernel of ``replay_routing``: the decision to use, as copies (an operator's outputs
        never alias its inputs)."""
        if self.in_recompute():
            found = self.take(digest)
            shapes = [tuple(t.shape) for t in decision]
            if [tuple(t.shape) for t in found.decision] != shapes:
                raise RuntimeError(
                    f"MoELayer recompute replay: the recorded decision has shapes "
                    f"{[tuple(t.shape) for t in found.decision]} but the recompute routes {shapes}"
                )
            return [t.clone() for t in found.decision]
        if record:
            return [t.clone() for t in self.record([t.clone() for t in decision], digest, held=True).decision]
        self.current = None
        return [t.clone() for t in decision]


@torch.library.custom_op("moetrain::replay_routing", mutates_args=())
def replay_routing(
    decision: list[torch.Tensor], digest: torch.Tensor, replay_id: int, record: bool
) -> list[torch.Tensor]:
    """Records (``record``: a forward whose graph may be recomputed) or replays (inside a backward
    pass) the routing decision of the layer whose :class:`RoutingReplay` has id ``replay_id``."""
    return _REPLAYS[replay_id].exchange(decision, digest, record)


@replay_routing.register_fake
def _(decision, digest, replay_id, record):
    return [torch.empty_like(t) for t in decision]


def attach_to_graph(output: torch.Tensor, record: DispatchRecord) -> None:
    """Makes ``output``'s autograd node own ``record`` (eager mode), so the record is freed with
    the graph of the forward that made it."""
    if output.grad_fn is not None:
        output.grad_fn.metadata["moetrain.dispatch_record"] = record


class ReplayedRoute:
    """The layer's route step with recompute replay (module docstring): ``(x_TD, capacity,
    training)`` -> (the router's output, the dispatch plan), as ``route`` (a
    :class:`~moetrain.layers.route.RouteStep`) gives them, but with the decision recorded in a
    forward that builds a graph and the recorded one used in a recompute. Eager: a recompute takes
    the recorded expert ids (the router recomputes their gates) and dispatch plan. Compiled: the
    decision passes through ``moetrain::replay_routing``, which decides when the graph runs."""

    def __init__(self, route, replay: RoutingReplay):
        self.inner, self.replay = route, replay

    def __call__(self, x_TD: torch.Tensor, capacity: int | None, training: bool):
        route, replay = self.inner, self.replay
        compiling = torch.compiler.is_compiling()
        if not compiling and replay.in_recompute():
            record = replay.take(input_digest(x_TD))
            return route.router(x_TD, record.decision[0]), record.plan
        routing, priority_S = route.decide(x_TD)
        if compiling:
            routing, priority_S = self._through_operator(x_TD, routing, priority_S)
            return routing, route.plan(routing, capacity, priority_S, training)
        record = None
        if torch.is_grad_enabled():
            record = replay.record([routing.expert_ids_TK], input_digest(x_TD), held=False)
        replay.current = record
        plan = route.plan(routing, capacity, priority_S, training)
        if record is not None:
            record.plan = plan
        return routing, plan

    def _through_operator(self, x_TD: torch.Tensor, routing: RouterOutput, priority_S):
        """In a compiled graph: the decision (expert ids ``[T, K]``, the priority order ``[S]`` or
        None) through ``moetrain::replay_routing``; the gates are taken again for the experts it
        returns."""
        decision = [routing.expert_ids_TK] if priority_S is None else [routing.expert_ids_TK, priority_S]
        decision = torch.ops.moetrain.replay_routing(
            decision, input_digest(x_TD), self.replay.id, torch.is_grad_enabled()
        )
        gates_TK = self.inner.router.gates(routing.probs_TE, decision[0])
        routing = RouterOutput(routing.logits_TE, routing.probs_TE, decision[0], gates_TK)
        return routing, (decision[1] if priority_S is not None else None)


class ReplayingExchanger(Exchanger):
    """A dispatcher's exchanger with recompute replay (module docstring): the round of a call that
    records or replays is its :class:`DispatchRecord` (``RoutingReplay.current``); a recorded round
    keeps what ``inner``'s exchanges delivered, a replayed one gets it back without communicating.
    Other rounds (compiled graphs, forwards without a graph) go to ``inner`` untouched."""

    def __init__(self, inner: Exchanger, replay: RoutingReplay):
        self.inner, self.replay = inner, replay

    def new_round(self, plan) -> DispatchRound:
        record = None if torch.compiler.is_compiling() else self.replay.current
        if record is None:
            return self.inner.new_round(plan)
        record.plan = plan
        return record

    def plans(self, rnd, name, make):
        if not isinstance(rnd, DispatchRecord):
            return self.inner.plans(rnd, name, make)
        if rnd.replayed:
            return rnd.plans[name]
        rnd.plans[name] = made = self.inner.plans(rnd, name, make)
        return made

    def all_to_all(self, rnd, name, x_ND, plan, comm_dtype):
        return self._rows(self.inner.all_to_all, rnd, name, x_ND, plan, comm_dtype, True)

    def all_to_all_reverse(self, rnd, name, y_ND, plan, comm_dtype):
        return self._rows(self.inner.all_to_all_reverse, rnd, name, y_ND, plan, comm_dtype, False)

    def all_to_all_with_ids(self, rnd, name, x_CD, ids_CK, plan, comm_dtype):
        if isinstance(rnd, DispatchRecord) and rnd.replayed:
            return _replayed(rnd, name, x_CD, plan, comm_dtype, True), None
        x_RD, ids_RK = self.inner.all_to_all_with_ids(rnd, name, x_CD, ids_CK, plan, comm_dtype)
        if isinstance(rnd, DispatchRecord):
            rnd.exchanged[name] = x_RD.detach()
        return x_RD, ids_RK

    def chunked_trip(self, rnd, x_ND, experts, settings, rows=None):
        if not isinstance(rnd, DispatchRecord):
            return self.inner.chunked_trip(rnd, x_ND, experts, settings, rows)
        if rnd.replayed:
            rows = TripRows(rnd.exchanged.pop("received"), rnd.exchanged.pop("returned"))
            return self.inner.chunked_trip(rnd, x_ND, experts, settings, rows)
        rows = TripRows()
        y_ND = self.inner.chunked_trip(rnd, x_ND, experts, settings, rows)
        rnd.exchanged.update(received=rows.received_ND, returned=rows.returned_ND)
        return y_ND

    def close(self, rnd, y_TD):
        if isinstance(rnd, DispatchRecord) and not rnd.replayed and not rnd.held:
            attach_to_graph(y_TD, rnd)  # compiled graphs' records stay in the replay
        self.replay.current = None
        return self.inner.close(rnd, y_TD)

    @staticmethod
    def _rows(send, rnd, name, x, plan, comm_dtype, forward_direction: bool) -> torch.Tensor:
        """The rows ``send`` (an exchange of ``inner``) delivers, kept in a recorded round; in a
        replayed round the kept rows instead."""
        if not isinstance(rnd, DispatchRecord):
            return send(rnd, name, x, plan, comm_dtype)
        if rnd.replayed:
            return _replayed(rnd, name, x, plan, comm_dtype, forward_direction)
        rows = send(rnd, name, x, plan, comm_dtype)
        rnd.exchanged[name] = rows.detach()
        return rows


def _replayed(
    record: DispatchRecord, name: str, x, plan, comm_dtype, forward_direction: bool
) -> torch.Tensor:
    """The rows ``record`` kept under ``name``, standing in for the exchange of ``x`` (its backward
    communicates the gradient); the record lets go of them."""
    return replay_all_to_all(x, record.exchanged.pop(name), plan, comm_dtype, forward_direction)


def with_replay(route, exchanger: Exchanger, replay: RoutingReplay, enabled: bool):
    """(route step, exchanger) with the replay wrappers installed (``enabled``) or removed."""
    route = route.inner if isinstance(route, ReplayedRoute) else route
    exchanger = exchanger.inner if isinstance(exchanger, ReplayingExchanger) else exchanger
    if enabled:
        return ReplayedRoute(route, replay), ReplayingExchanger(exchanger, replay)
    return route, exchanger
