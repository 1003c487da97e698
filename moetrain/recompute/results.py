"""The plain results of recompute planning: what profiling measured per block and per group
(:class:`BlockProfile`, :class:`RecomputeOption`, :class:`ActivationProfile`) and the plan chosen
(:class:`RecomputePlan`); no torch, no hooks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields


@dataclass(frozen=True)
class BlockProfile:
    """One candidate, measured over the profiled forward (all its calls summed).

    ``saved_bytes``: unique storages saved for backward inside it (sub-blocks included), not
    recomputed. ``input_bytes``: unique storages of its tensor inputs. ``replay_bytes``: MoE replay
    kept when it is recomputed. ``kept_bytes = input_bytes + replay_bytes`` (before de-duplication
    against the rest of its group). ``forward_ms``: its forward time, the cost of recomputing it.
    """

    name: str
    parent: str | None
    calls: int
    saved_bytes: int
    input_bytes: int
    replay_bytes: int
    forward_ms: float

    @property
    def kept_bytes(self) -> int:
        return self.input_bytes + self.replay_bytes


@dataclass(frozen=True)
class RecomputeOption:
    """One way to treat a group: the blocks recomputed, the group's activation bytes, the cost."""

    recomputed: tuple[str, ...]
    activation_bytes: int
    recompute_ms: float


@dataclass(frozen=True)
class ActivationProfile:
    """What :func:`profile_activations` measured.

    ``baseline_bytes``: saved bytes of the whole forward without recompute (exact union).
    ``outside_bytes``: saved outside every candidate. ``groups[i]``: the options of the i-th
    top-level candidate (option 0 recomputes nothing). ``blocks``: every candidate, by name.
    """

    baseline_bytes: int
    outside_bytes: int
    blocks: dict[str, BlockProfile]
    groups: tuple[tuple[RecomputeOption, ...], ...]

    @property
    def min_activation_bytes(self) -> int:
        """The least activation memory any choice reaches."""
        return self.outside_bytes + sum(min(o.activation_bytes for o in g) for g in self.groups)

    def cost_of(self, recomputed: Sequence[str]) -> tuple[int, float]:
        """``(activation_bytes, recompute_ms)`` of recomputing exactly ``recomputed``, by the model
        above. Raises ValueError if the set is not one option per group (e.g. a block and its
        sub-block together, or an unknown name)."""
        wanted = set(recomputed)
        total_bytes, total_ms = self.outside_bytes, 0.0
        for options in self.groups:
            names = {n for o in options for n in o.recomputed}
            match = [o for o in options if set(o.recomputed) == wanted & names]
            if not match:
                raise ValueError(
                    "recomputed must name at most one of a block and its sub-blocks, "
                    f"got {sorted(wanted & names)}"
                )
            total_bytes += match[0].activation_bytes
            total_ms += match[0].recompute_ms
        unknown = wanted - set(self.blocks)
        if unknown:
            raise ValueError(
                f"recomputed must name profiled candidates {sorted(self.blocks)}, got {sorted(unknown)}"
            )
        return total_bytes, total_ms


def merge_profiles(profiles: Sequence[ActivationProfile]) -> ActivationProfile:
    """The element-wise maximum of ``profiles`` of one model measured on different batches (e.g.
    one per rank: under expert parallelism ranks route different rows): every byte count and time,
    of each option, block, ``baseline_bytes`` and ``outside_bytes``, is the largest over the
    profiles. A plan of the merged profile fits its budget on each of them: for every set of
    recomputed blocks, each profile's ``cost_of`` is at most the merged one's. ValueError unless the
    profiles have the same candidates and options (the same model, profiled the same way)."""
    first = profiles[0]
    for index, other in enumerate(profiles[1:], start=1):
        if _layout(other) != _layout(first):
            raise ValueError(
                f"profiles must have the same candidates and options to be merged; profile {index} has "
                f"{sorted(other.blocks)}, profile 0 has {sorted(first.blocks)}"
            )
    groups = tuple(
        tuple(
            RecomputeOption(
                options[0].recomputed,
                max(o.activation_bytes for o in options),
                max(o.recompute_ms for o in options),
            )
            for options in zip(*same_group, strict=True)
        )
        for same_group in zip(*(p.groups for p in profiles), strict=True)
    )
    blocks = {}
    for name, block in first.blocks.items():
        merged = {
            f.name: max(getattr(p.blocks[name], f.name) for p in profiles)
            for f in fields(BlockProfile)
            if f.name not in ("name", "parent")
        }
        blocks[name] = BlockProfile(name=name, parent=block.parent, **merged)
    return ActivationProfile(
        baseline_bytes=max(p.baseline_bytes for p in profiles),
        outside_bytes=max(p.outside_bytes for p in profiles),
        blocks=blocks,
        groups=groups,
    )


def _layout(profile: ActivationProfile) -> tuple:
    """What must agree for profiles to be merged: the blocks and their parents, and each group's
    options (the blocks each one recomputes), in order."""
    blocks = tuple((name, block.parent) for name, block in profile.blocks.items())
    return blocks, tuple(tuple(o.recomputed for o in options) for options in profile.groups)


@dataclass(frozen=True)
class RecomputePlan:
    """The blocks to recompute and what that buys.

    ``activation_bytes``: estimated saved bytes with the plan (<= ``memory_budget_bytes``);
    ``saved_bytes = baseline_bytes - activation_bytes``; ``recompute_ms``: expected extra forward
    time per step; ``moe_replay``: MoELayers switched to routing replay.
    """

    recomputed: tuple[str, ...]
    memory_budget_bytes: int
    activation_bytes: int
    baseline_bytes: int
    min_activation_bytes: int
    recompute_ms: float
    moe_replay: tuple[str, ...]
    profile: ActivationProfile = field(repr=False)

    @property
    def saved_bytes(self) -> int:
        return self.baseline_bytes - self.activation_bytes

    def summary(self) -> str:
        """The plan as :func:`auto_checkpoint` logs it (INFO, logger ``moetrain.recompute``)."""
        lines = [
            f"auto_checkpoint: budget {format_bytes(self.memory_budget_bytes)}; activations "
            f"{format_bytes(self.baseline_bytes)} without recompute -> {format_bytes(self.activation_bytes)} "
            f"with this plan (saves {format_bytes(self.saved_bytes)}; minimum possible "
            f"{format_bytes(self.min_activation_bytes)})",
            f"  recompute {len(self.recomputed)} block(s), expected +{self.recompute_ms:.3f} ms per step",
        ]
        width = max((len(n) for n in self.recomputed), default=0)
        for name in self.recomputed:
            block = self.profile.blocks[name]
            replay = f" + {format_bytes(block.replay_bytes)} MoE replay" if block.replay_bytes else ""
            lines.append(
                f"    {name:<{width}}  keeps {format_bytes(block.input_bytes)} input{replay} "
                f"instead of {format_bytes(block.saved_bytes)}, recompute {block.forward_ms:.3f} ms"
            )
        return "\n".join(lines)


def format_bytes(num_bytes: float) -> str:
    """``1536 -> '1.50 KiB'`` (binary units)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
