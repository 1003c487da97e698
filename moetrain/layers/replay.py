"""Recompute replay: a MoE layer recomputed during backward (activation checkpointing) reuses the
routing decision, capacity cut and all-to-all results of its first forward instead of routing
and communicating again.

The decision passes through one operator, ``moetrain::replay_routing``, whose kernel runs at call
time, also inside a compiled graph: in a forward it records the decision (expert ids, and the
priority order for batch-prioritised routing) and returns it; in a forward that runs inside a
backward pass (a recompute) it returns the recorded decision instead. Under expert parallelism the
dispatcher adds the exchange plan and the rows each all-to-all delivered to the same
:class:`DispatchRecord` (the node-deduplicating dispatcher, whose round has four exchanges, keeps
its plans in ``a2a_plan`` and its rows in ``exchanged``).

Lifetime of a record. In eager mode the layer hangs the record on its output's autograd node, so
it lives exactly as long as that forward's graph: a forward whose graph is dropped without
backward leaves nothing behind. A compiled graph gives no such handle; there the record is kept
by this object with a digest of the layer's input, and a recompute takes the oldest record whose
digest matches the recomputed input (older records, whose backward never came, are dropped).
``RoutingReplay.clear()`` (``MoELayer.set_recompute_replay``) drops every record. A record is
replayed once: the dispatcher lets go of its all-to-all rows as the recompute uses them (the
rebuilt graph keeps what its backward needs), so they do not wait for the end of the step.
"""

from __future__ import annotations

import itertools
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from moetrain._torch_compat import in_backward_pass


@dataclass(eq=False)
class DispatchRecord:
    """One forward's dispatch round: the routing decision (``decision``: the expert ids ``[T, K]``,
    in compiled graphs then the priority order ``[S]`` when batch-prioritised; empty when nothing
    is recorded), the dispatch plan (an eager replay reuses it), and under expert parallelism the
    exchange plan and the rows each all-to-all delivered. The dispatcher's ``dispatch`` returns
    it and its ``combine`` takes it back."""

    decision: list[torch.Tensor] = field(default_factory=list)
    digest: torch.Tensor | None = None
    plan: object = None
    recv_counts_PE: torch.Tensor | None = None
    a2a_plan: object = None
    received_rows: torch.Tensor | None = None
    returned_rows: torch.Tensor | None = None
    exchanged: dict[str, torch.Tensor] = field(default_factory=dict)  # other dispatchers' recorded rows
    replayed: bool = False
    chunks: int = 1  # of a chunked exchange (moetrain.layers.overlap): its replay uses the same

    def nbytes(self) -> int:
        """Bytes a replay record keeps beyond the autograd graph's own tensors: the decision and
        the all-to-all rows (the plan's index tensors are held by the graph with or without
        replay)."""
        tensors = [*self.decision, self.received_rows, self.returned_rows, *self.exchanged.values()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


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
    of the layer's latest call (recorded or replayed), for the dispatcher of that call."""

    def __init__(self):
        self.id = next(_NEXT_ID)
        _REPLAYS[self.id] = self
        self._entries: deque[_Entry] = deque()
        self.current: DispatchRecord | None = None

    def __reduce__(self):
        """A copied or unpickled layer starts with no records and its own id (a copy sharing the
        id would send its records to the original)."""
        return (RoutingReplay, ())

    def clear(self) -> None:
        self._entries.clear()
        self.current = None

    def records(self) -> list[DispatchRecord]:
        return [r for r in (e.get() for e in self._entries) if r is not None]

    def nbytes(self) -> int:
        return sum(r.nbytes() for r in self.records())

    @staticmethod
    def in_recompute() -> bool:
        """Whether the layer runs inside a backward pass (a checkpoint's recompute)."""
        return in_backward_pass()

    def record(self, decision: list[torch.Tensor], digest: torch.Tensor | None) -> DispatchRecord:
        """Keeps ``decision`` for a recompute: weakly when ``digest`` is None (eager: the layer
        hands the record to its autograd graph), else here, matched by ``digest`` later."""
        self.current = DispatchRecord([t.detach() for t in decision], digest)
        if digest is None:
            self._entries.append(_Entry(ref=weakref.ref(self.current)))
        else:
            self._entries.append(_Entry(record=self.current))
        return self.current

    def take(self, digest: torch.Tensor | None = None) -> DispatchRecord:
        """The record a recompute replays: the oldest live one (with ``digest``: whose digest is
        equal; older records whose backward never came are dropped)."""
        while self._entries:
            found = self._entries.popleft().get()
            if found is None:
                continue  # its graph was freed without backward
            if found.digest is not None and (digest is None or not torch.equal(found.digest, digest)):
                continue  # a compiled forward whose backward never ran
            found.replayed = True
            self.current = found
            return found
        raise RuntimeError(
            "MoELayer is recomputed during backward but holds no recorded forward to replay; "
            "set_recompute_replay(True) must be on before the forward that is recomputed"
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
            return [t.clone() for t in self.record([t.clone() for t in decision], digest).decision]
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
