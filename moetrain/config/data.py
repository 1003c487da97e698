"""The input-data section of a run (:class:`DataConfig`: source, batch shape, loader workers) and its
validation."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.options import option
from moetrain.validation import require_int


@dataclass(frozen=True)
class DataConfig:
    """Model-agnostic: what ``source`` and ``seq_len`` mean for a model is its data hook's to say
    and check (``models/moe_lm``: ``embedded`` or one UTF-8 text file; ``models/m6_moe``: also
    JSON-lines image-text manifests and lists of them, ``seq_len`` bounding prefix and target each).

    - ``source``: ``"embedded"`` (the model's built-in data), a path, or a non-empty list of paths /
      glob patterns (kept as a tuple) for models that read several.
    - ``micro_batch_size`` sequences of up to ``seq_len`` tokens per rank and micro-step.
    - ``num_workers``: data-loader worker processes per rank for models that load in workers, an
      integer >= 0 (0: load in the training process) or ``"auto"`` (from the CPUs each rank may
      use, see :mod:`moetrain.cpus`)."""

    source: str | tuple[str, ...] = option(
        "embedded",
        (
            "'embedded' (the model's built-in data), a path, or a list of paths / glob patterns "
            "(the model's data hook checks which it takes)"
        ),
    )
    micro_batch_size: int = option(8, "sequences per rank and micro-step")
    seq_len: int = option(64, "tokens per sequence, as the model's data hook counts them")
    num_workers: int | str = option(
        "auto",
        (
            "data-loader worker processes per rank (models that load in workers): an integer >= 0 or "
            "'auto' (from the rank's CPUs)"
        ),
    )

    def __post_init__(self) -> None:
        source = self.source
        allowed = "'embedded', a file path or a non-empty list of file paths / glob patterns"
        if isinstance(source, (list, tuple)):
            if not source or not all(isinstance(s, str) and s and s != "embedded" for s in source):
                raise ValueError(f"data.source must be {allowed}, got {source!r}")
            object.__setattr__(self, "source", tuple(source))
        elif not isinstance(source, str) or not source:
            raise ValueError(f"data.source must be {allowed}, got {source!r}")
        require_int("data.micro_batch_size", self.micro_batch_size, 1)
        require_int("data.seq_len", self.seq_len, 1)
        if self.num_workers != "auto":
            try:
                require_int("data.num_workers", self.num_workers, 0)
            except ValueError:
                raise ValueError(
                    f"data.num_workers must be 'auto' or an integer >= 0, got {self.num_workers!r}"
                ) from None
