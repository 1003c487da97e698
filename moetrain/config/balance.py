"""Hardware-aware batch balancing between ranks of unequal speed (:class:`BalanceConfig`) and its
validation."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.options import option
from moetrain.validation import require_bool, require_int, require_positive_float


@dataclass(frozen=True)
class BalanceConfig:
    """Hardware-aware batch balancing (Whale): the global micro-batch ``data.micro_batch_size *
    world`` is split between the ranks in proportion to ``speeds`` (one per rank, any unit),
    within ``memory_limits`` (most sequences per rank), and each rank weights its loss so the
    gradient equals that of the uniform split. ``calibrate``: measure the speeds at start-up (a few
    timed forward+backward passes) instead of giving them. Off when neither is set
    (``memory_limits`` alone is an error)."""

    speeds: tuple[float, ...] | None = option(
        None,
        (
            "hardware-aware batch balancing: one relative speed per rank; the "
            "global micro-batch is split in proportion"
        ),
    )
    memory_limits: tuple[int, ...] | None = option(
        None, "most sequences each rank can hold, one per rank (with speeds or calibrate)"
    )
    calibrate: bool = option(False, "measure the ranks' speeds at start-up instead of giving them")

    def __post_init__(self) -> None:
        for name in ("speeds", "memory_limits"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (list, tuple)) or not value:
                    raise ValueError(f"balance.{name} must be a list with one entry per rank, got {value!r}")
                object.__setattr__(self, name, tuple(value))
        for index, speed in enumerate(self.speeds or ()):
            require_positive_float(f"balance.speeds[{index}]", speed)
        for index, limit in enumerate(self.memory_limits or ()):
            require_int(f"balance.memory_limits[{index}]", limit, 1)
        require_bool("balance.calibrate", self.calibrate)
        if self.calibrate and self.speeds is not None:
            raise ValueError("balance: give either speeds or calibrate: true, not both")
        if self.memory_limits is not None and not self.enabled:
            raise ValueError(
                "balance.memory_limits needs balance.speeds or balance.calibrate: true (without either, "
                "balancing is off and the limits would be ignored)"
            )

    @property
    def enabled(self) -> bool:
        return self.calibrate or self.speeds is not None
