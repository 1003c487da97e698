"""Whale's annotations in model code: scopes opened while a model is built, read by :func:`parallelize`.

The strategy of :mod:`moetrain.parallelize` is a table of module-name patterns kept apart from the
model. Whale (later EPL, the framework M6 was trained with) writes it where the model is written
instead: a default scope, ``split`` around the layers to shard, stages for the pipeline, ``auto`` to
let the system choose. These context managers do the same::

    from moetrain import scope

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            with scope.split():  # column-parallel: whole heads per rank
                self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
            with scope.split("row"):
                self.proj = nn.Linear(D, D)
            self.ffn = MoELayer(moe)  # MoE layers are ``expert`` by default

    with scope.set_default("replica"):
        model = Model()
    trained = parallelize(model, mesh)  # no strategy: the marks give it

What a scope marks: every module *registered* as a submodule while it is open (``self.x = ...``,
``add_module``, an ``nn.ModuleList`` built or appended), which in ordinary model code is where the
module is created. The mark is the stack of open scopes, kept on the module itself (a private
attribute: it survives ``copy.deepcopy`` and ``pickle``; nothing else about the module changes, and
a model built under no scope has no marks). The stack lives in a :class:`contextvars.ContextVar`:
threads and asyncio tasks each see their own, so two models built at once never mark each other.
Marking uses torch's public global hook ``torch.nn.modules.module.register_module_module_registration_hook``,
installed while at least one scope (or a default) is open and removed after.

Kinds, innermost scope wins (one dimension each: a module can be ``replica`` and in ``stage(1)``):

- ``replica()``: data parallel; every module registered inside is ``replica`` (under ``parallel.replica:
  fsdp`` each outermost one is an FSDP2 unit); layer containers (``nn.ModuleList`` / ``nn.ModuleDict``,
  which have no forward) are left out.
- ``split()``: ``nn.Linear`` by columns, ``nn.Embedding`` by vocabulary rows, ``DenseFFN`` as Megatron's
  MLP; an ``MoELayer`` under ``split`` is expert-parallel (Whale splits the experts' einsums over the
  expert dimension). ``split("row")``: ``nn.Linear`` by rows; ``split("head")``: an output ``nn.Linear``
  by columns with the parallel cross-entropy. With ``tp_size`` 1 a split scope is transparent (but
  for MoE layers): the modules inside take the kind of the scope around it.
- ``expert()``: an ``MoELayer`` expert-parallel (what MoE layers are by default).
- ``auto()``: the planner decides, at :func:`parallelize` time from the mesh and a cluster description,
  replica or split for each splittable unit inside (attention, dense FFN, embedding, head), as
  ``moetrain plan --recommend`` does (``moetrain.planner.auto.AutoSplit``); the rest is ``replica``.
- ``pipeline()``: the layer stack (``nn.ModuleList``) registered inside is cut into pipeline stages
  when ``pp_size > 1``; ``stage(i)``: the layers registered inside are stage ``i``: the cut points
  (``parallel.pp_layers``, when set, overrides them); stage marks alone also name the stack.
- ``set_default(kind)``: the kind of modules registered outside every scope (``"replica"`` or
  ``"auto"``); as a plain call it lasts in this thread (context) until ``set_default(None)``, as a
  context manager until the block ends.

MoE layers are ``expert`` by default: a scope written around an enclosing module (a block built
under ``replica()``) or the default does not change them; a scope opened around the layer itself
does (``with scope.replica(): self.ffn = MoELayer(...)`` replicates its experts, and so does the
same scope around ``nn.Sequential(MoELayer(...), nn.Dropout())``). Precisely: only the scopes the
enclosing module was not itself registered under count for the layer; the enclosing module is the
nearest one holding parameters besides the layer's (parameter-free wrappers and layer containers
are passed over); the root, registered nowhere, takes the scopes all its children share (none when
it has one child). Inside an MoE layer only ``replica`` marks count: the layer is parallelized as
a whole.

A scope around a module it cannot apply to (``split`` around a ``LayerNorm``, around a module with no
weight to shard, ``expert`` around a plain ``Linear``) is a ``ValueError`` naming the module and the
scope, raised by :func:`strategy_from_scopes`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook

from moetrain.layers.experts import DenseFFN
from moetrain.layers.moe_layer import MoELayer
from moetrain.validation import require_int

log = logging.getLogger(__name__)

MARK_ATTRIBUTE = "_moetrain_scopes"
SPLIT_PARTS = {None: "split", "row": "split.row", "head": "split.head"}
SPLIT_KINDS = tuple(SPLIT_PARTS.values())
DEFAULT_KINDS = ("replica", "auto")
CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # no forward of their own: never a replica unit
APPLIES = {
    "split": (nn.Linear, nn.Embedding, DenseFFN, MoELayer),
    "split.row": (nn.Linear,),
    "split.head": (nn.Linear,),
    "expert": (MoELayer,),
}
APPLIES_TEXT = {
    "split": "nn.Linear / nn.Embedding / DenseFFN (an MoELayer: expert parallel)",
    "split.row": "nn.Linear",
    "split.head": "nn.Linear",
    "expert": "MoELayer",
}


@dataclass(frozen=True, eq=False)
class Frame:
    """One open scope: ``dimension`` ``"kind"`` (``value`` a kind), ``"pipeline"`` or ``"stage"``
    (``value`` the stage index); ``default``: set by :func:`set_default`. Compared by identity:
    two ``with scope.split():`` blocks are two frames."""

    dimension: str
    value: object = None
    default: bool = False

    def describe(self) -> str:
        if self.default:
            return f"scope.set_default({self.value!r})"
        if self.dimension == "kind":
            if self.value in SPLIT_KINDS:
                part = next(p for p, k in SPLIT_PARTS.items() if k == self.value)
                return "scope.split()" if part is None else f"scope.split({part!r})"
            return f"scope.{self.value}()"
        if self.dimension == "stage":
            return f"scope.stage({self.value})"
        return "scope.pipeline()"


_STACK: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar("moetrain_scopes", default=())
_DEFAULT: contextvars.ContextVar[Frame | None] = contextvars.ContextVar(
    "moetrain_scope_default", default=None
)
_HOOK_LOCK = threading.Lock()
_HOOK = {"handle": None, "users": 0}


def _mark(parent: nn.Module, name: str, child: nn.Module) -> None:
    """The global registration hook: ``child`` takes the open scopes of this context, unless it
    was marked when first registered."""
    default = _DEFAULT.get()
    frames = _STACK.get()
    if default is not None:
        frames = (default, *frames)
    if frames and MARK_ATTRIBUTE not in vars(child):
        object.__setattr__(child, MARK_ATTRIBUTE, frames)


def _acquire() -> None:
    with _HOOK_LOCK:
        if _HOOK["users"] == 0:
            _HOOK["handle"] = register_module_module_registration_hook(_mark)
        _HOOK["users"] += 1


def _release() -> None:
    with _HOOK_LOCK:
        _HOOK["users"] -= 1
        if _HOOK["users"] == 0:
            _HOOK["handle"].remove()
            _HOOK["handle"] = None


@contextlib.contextmanager
def _open(frame: Frame) -> Iterator[None]:
    _acquire()
    token = _STACK.set((*_STACK.get(), frame))
    try:
        yield
    finally:
        _STACK.reset(token)
        _release()


def replica():
    """Modules registered inside are data parallel (``replica``)."""
    return _open(Frame("kind", "replica"))


def split(part: str | None = None):
    """Modules registered inside are tensor parallel over the mesh's ``tp`` ranks: ``split()``
    (Linear by columns, Embedding by vocabulary rows, DenseFFN whole, MoELayer expert parallel),
    ``split("row")`` (Linear by rows) or ``split("head")`` (output Linear, vocabulary-sharded logits)."""
    if part not in SPLIT_PARTS:
        raise ValueError(f"scope.split takes None, 'row' or 'head', got {part!r}")
    return _open(Frame("kind", SPLIT_PARTS[part]))


def expert():
    """MoE layers registered inside are expert parallel (their default)."""
    return _open(Frame("kind", "expert"))


def auto():
    """Splittable units registered inside are split or replicated as the planner recommends, decided
    when the model is parallelized (``parallelize(..., auto=AutoSplit(cluster, model))``)."""
    return _open(Frame("kind", "auto"))


def pipeline():
    """The layer stack (``nn.ModuleList``) registered inside is cut into pipeline stages (``pp_size > 1``)."""
    return _open(Frame("pipeline"))


def stage(index: int):
    """Layers registered inside (appended to the layer stack) belong to pipeline stage ``index``."""
    require_int("scope.stage index", index, 0)
    return _open(Frame("stage", index))


class _Default:
    """What :func:`set_default` returns: the default is already set; as a context manager it is
    restored to the previous one when the block ends."""

    def __init__(self, previous: Frame | None, token: contextvars.Token):
        self._previous, self._token = previous, token

    def __enter__(self) -> _Default:
        return self

    def __exit__(self, *exc) -> None:
        current = _DEFAULT.get()
        _DEFAULT.reset(self._token)
        if current is not None and self._previous is None:
            _release()
        elif current is None and self._previous is not None:
            _acquire()


def set_default(kind: str | None) -> _Default:
    """Whale's ``set_default_scope``: modules registered outside every scope take ``kind``
    (``"replica"`` or ``"auto"``; None: no default). A plain call lasts in this thread (context) until
    changed; ``with scope.set_default("replica"):`` until the block ends."""
    if kind is not None and kind not in DEFAULT_KINDS:
        raise ValueError(
            f"scope.set_default takes one of {', '.join(map(repr, DEFAULT_KINDS))} or None, got {kind!r}"
        )
    previous = _DEFAULT.get()
    if kind is not None and previous is None:
        _acquire()
    elif kind is None and previous is not None:
        _release()
    token = _DEFAULT.set(None if kind is None else Frame("kind", kind, default=True))
    return _Default(previous, token)


def marks(module: nn.Module) -> tuple[Frame, ...]:
    """The scopes ``module`` was registered under, outermost first (empty: none)."""
    return vars(module).get(MARK_ATTRIBUTE, ())


def has_marks(model: nn.Module) -> bool:
    """Whether any module of ``model`` was registered under a scope."""
    return any(MARK_ATTRIBUTE in vars(m) for m in model.modules())


def _innermost(frames: Sequence[Frame], dimension: str, skip: Callable[[Frame], bool]) -> Frame | None:
    for frame in reversed(frames):
        if frame.dimension == dimension and not skip(frame):
            return frame
    return None


def _error(name: str, module: nn.Module, frame: Frame, why: str) -> ValueError:
    return ValueError(
        f"{frame.describe()} around {name!r} (a {type(module).__name__}): {why}; open the scope around the "
        "layers it applies to only, or put this module under scope.replica()"
    )


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _enclosing_marks(model: nn.Module, modules: dict[str, nn.Module], name: str) -> tuple[Frame, ...]:
    """The scopes of the module that encloses MoE layer ``name``: its nearest ancestor, not a layer
    container (``nn.ModuleList`` / ``nn.ModuleDict``), holding parameters besides the layer's,
    passing over parameter-free wrappers (``nn.Sequential(layer, nn.Dropout())``). The root is
    registered nowhere: its own marks if it was, else the scopes all its children share when it has
    two or more (the root built under them); a root's only child tells no scope around the root
    from one around the child: none is taken for the root's."""
    own = {id(p) for p in modules[name].parameters()}
    enclosing = name
    while "." in enclosing:
        enclosing = _parent(enclosing)
        module = modules[enclosing]
        if not isinstance(module, CONTAINERS) and any(id(p) not in own for p in module.parameters()):
            return marks(module)
    if MARK_ATTRIBUTE in vars(model):
        return marks(model)
    children = [marks(child) for child in model.children()]
    if len(children) < 2:
        return ()
    shared = set.intersection(*(set(map(id, frames)) for frames in children))
    return tuple(f for f in children[0] if id(f) in shared)


def _kinds(model: nn.Module, tp_size: int | None) -> tuple[dict[str, str], list[str]]:
    """``{name: kind}`` of the marked modules and the names left to ``auto`` (module docstring)."""
    modules = {name: m for name, m in model.named_modules() if name}

    def ancestors(name: str) -> Iterator[str]:
        while "." in name:
            name = _parent(name)
            yield name

    def inside_moe(name: str) -> bool:
        return any(isinstance(modules.get(a), MoELayer) for a in ancestors(name))

    def opaque(frame: Frame) -> bool:
        return False

    # tp_size 1: split scopes are transparent, except on MoE layers (their split is expert parallel)
    transparent = (lambda f: f.value in SPLIT_KINDS) if tp_size == 1 else opaque
    effective = {
        name: _innermost(
            marks(m), "kind", opaque if isinstance(m, MoELayer) or inside_moe(name) else transparent
        )
        for name, m in modules.items()
    }

    kinds: dict[str, str] = {}
    covered: dict[str, Frame] = {}  # modules given a non-replica kind, by the frame that gave it
    auto: list[str] = []
    for name, module in modules.items():
        frame = effective[name]
        if isinstance(module, MoELayer):
            enclosing = set(map(id, _enclosing_marks(model, modules, name)))
            direct = [f for f in marks(module) if id(f) not in enclosing and not f.default]
            own = _innermost(direct, "kind", opaque)
            if own is not None and own.value in ("split.row", "split.head"):
                raise _error(name, module, own, f"{own.value!r} applies to {APPLIES_TEXT[own.value]}")
            kinds[name] = "replica" if own is not None and own.value == "replica" else "expert"
            if kinds[name] == "expert" and frame is not None:
                covered[name] = frame
            continue
        if frame is None:
            continue
        if frame.value == "replica":
            if not isinstance(module, CONTAINERS):
                kinds[name] = "replica"
            continue
        if inside_moe(name) or any(covered.get(a) is frame for a in ancestors(name)):
            continue  # parallelized with the layer that holds it
        if frame.value == "auto":
            if not isinstance(module, CONTAINERS):
                auto.append(name)
            continue
        if isinstance(module, APPLIES[frame.value]):
            kinds[name] = frame.value
            covered[name] = frame
            continue
        why = f"{frame.value!r} applies to {APPLIES_TEXT[frame.value]}"
        if any(True for _ in module.parameters(recurse=False)):
            raise _error(name, module, frame, why)
        outermost = "." not in name or effective.get(_parent(name)) is not frame
        inside = [n for n in modules if n.startswith(name + ".") and effective[n] is frame]
        applicable = [n for n in inside if isinstance(modules[n], APPLIES[frame.value])]
        if outermost and not applicable:
            weights = any(True for _ in module.parameters())
            raise _error(name, module, frame, why + ("" if weights else ", and it has no weight to shard"))
    return kinds, auto


def _stacks(model: nn.Module) -> list[str]:
    """The layer stacks the ``pipeline`` / ``stage`` marks name: the outermost ``nn.ModuleList`` of
    each ``pipeline()`` scope, and every ModuleList whose layers carry ``stage`` marks."""
    modules = {name: m for name, m in model.named_modules() if name}
    found = []
    for name, module in modules.items():
        frame = _innermost(marks(module), "pipeline", lambda f: False)
        if frame is not None:
            parent = modules.get(_parent(name)) if "." in name else None
            outer = parent is not None and _innermost(marks(parent), "pipeline", lambda f: False) is frame
            if not outer:
                if not isinstance(module, nn.ModuleList):
                    raise _error(name, module, frame, "'pipeline' applies to a layer stack (nn.ModuleList)")
                found.append(name)
        if isinstance(module, nn.ModuleList) and name not in found:
            own = _innermost(marks(module), "stage", lambda f: False)
            layers = [_innermost(marks(layer), "stage", lambda f: False) for layer in module]
            if any(f is not None and f is not own for f in layers):  # stage scopes around its layers
                found.append(name)
    return found


def stage_boundaries(stack: nn.ModuleList) -> list[int] | None:
    """The first layer of each stage but the first, from the layers' ``stage`` marks (None when no
    layer has one); ValueError unless every layer is marked and the stages run 0, 1, 2, ... in
    order over consecutive layers."""
    stages = [_innermost(marks(layer), "stage", lambda f: False) for layer in stack]
    if all(s is None for s in stages):
        return None
    unmarked = [i for i, s in enumerate(stages) if s is None]
    if unmarked:
        raise ValueError(
            f"scope.stage marks some layers of the stack but not layers {unmarked}: open a scope.stage(i) "
            "around every layer"
        )
    values = [s.value for s in stages]
    if values[0] != 0 or any(b not in (a, a + 1) for a, b in zip(values, values[1:], strict=False)):
        raise ValueError(
            f"the layers' scope.stage indices {values} must start at 0 and go up by at most 1 from one "
            "layer to the next (stages are runs of consecutive layers)"
        )
    return [i for i in range(1, len(values)) if values[i] != values[i - 1]]


def strategy_from_scopes(model: nn.Module, parallel=None, *, auto=None) -> dict[str, str]:
    """The strategy (``{module name: kind}``, exact names) the marks of ``model`` give; empty when it
    has none. Exact names compose with patterns: ``compose(patterns, strategy_from_scopes(model))``
    puts the patterns first (they override marks: the first match wins), the marks where no pattern
    matches.

    ``parallel``: the :class:`~moetrain.parallel.ParallelContext` the model will be laid out over
    (None: the marks alone): with ``tp_size`` 1 split scopes are transparent, with ``pp_size`` 1
    pipeline and stage scopes give no entry. ``auto``: the decision for ``scope.auto()`` modules,
    ``auto(model, parallel, names) -> {name: kind}`` (``moetrain.planner.auto.AutoSplit``); with
    ``tp_size`` 1 they are replicated without one. A scope around a module it cannot apply to is a
    ValueError naming both."""
    tp = None if parallel is None else parallel.tp_size
    kinds, autos = _kinds(model, tp)
    if autos:
        if tp == 1:
            log.info("scope.auto(): tp_size 1, the %d auto-scoped module(s) are replicated", len(autos))
            kinds.update(dict.fromkeys(autos, "replica"))
        elif parallel is None or auto is None:
            shown = ", ".join(autos[:4]) + (", ..." if len(autos) > 4 else "")
            raise ValueError(
                f"scope.auto() marks {len(autos)} module(s) ({shown}) decided from the mesh and a cluster: "
                "pass both, as parallelize(model, mesh, auto=AutoSplit(cluster, description)) "
                "(moetrain.planner.auto) does; under `moetrain train`, set parallel.auto_gpu"
            )
        else:
            chosen = dict(auto(model, parallel, list(autos)))
            stray = sorted(set(chosen) - set(autos))
            if stray:
                raise ValueError(f"the auto decision named modules no scope.auto() marks: {stray[:4]}")
            kinds.update({name: chosen.get(name, "replica") for name in autos})
    stacks = _stacks(model)  # checked on every mesh; an entry only where there are stages
    if parallel is None or parallel.pp_size > 1:
        kinds.update(dict.fromkeys(stacks, "pipeline"))
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return {name: kinds[name] for name in sorted(kinds, key=order.__getitem__)}


def compose(patterns: dict[str, str] | None, marked: dict[str, str]) -> dict[str, str]:
    """``patterns`` first (they override marks: the first matching pattern wins), then the marked
    names no pattern matches."""
    patterns = dict(patterns or {})
    rest = {n: k for n, k in marked.items() if not any(fnmatchcase(n, p) for p in patterns)}
    return {**patterns, **rest}


__all__ = [
    "Frame",
    "auto",
    "compose",
    "expert",
    "has_marks",
    "marks",
    "pipeline",
    "replica",
    "set_default",
    "split",
    "stage",
    "stage_boundaries",
    "strategy_from_scopes",
]
