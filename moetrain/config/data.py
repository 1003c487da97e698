"""The input-data section of a run (:class:`DataConfig`: source, batch shape, loader workers) and its
validation."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.options import option
from moetrain.validation import require_int


@dataclass(frozen=True)
class DataConfig:
    """``source``: ``"embedded"`` (the model's built-in data: the text corpus in ``models/moe_lm``
    for ``moe_lm``, the generated image-caption dataset for ``m6_moe``), a path (a UTF-8 text file
    for ``moe_lm``, a JSON-lines image-text manifest for ``m6_moe``) or, for ``m6_moe``, a list of
    manifest paths and glob patterns (kept as a tuple); ``micro_batch_size`` sequences of up to
    ``seq_len`` tokens per rank and micro-step; ``num_workers``: data-loader worker processes per
    rank for models that load in workers (``m6_moe``), an integer >= 0 (0: load in the training
    process) or ``"auto"`` (from the CPUs each rank may use, see :mod:`moetrain.cpus`)."""

    source: str | tuple[str, ...] = option(
        "embedded",
        (
            "'embedded' (the model's built-in data), a file (text for moe_lm, a "
            "JSON-lines manifest for m6_moe) or, for m6_moe, a list of manifests / "
            "glob patterns"
        ),
    )
    micro_batch_size: int = option(8, "sequences per rank and micro-step")
    seq_len: int = option(64, ("tokens per sequence (m6_moe: the longest prefix and the longest target)"))
    num_workers: int | str = option(
        "auto",
        ("data-loader worker processes per rank (m6_moe): an integer >= 0 or 'auto' (from the rank's CPUs)"),
    )

    def __post_init__(self) -> None:
        source = self.source
        if isinstance(source, (list, tuple)):
            if not source or not all(isinstance(s, str) and s and s != "embedded" for s in source):
                raise ValueError(
                    f"data.source must be 'embedded', a file path or a non-empty list of file paths / glob "
                    f"patterns, got {source!r}"
                )
            object.__setattr__(self, "source", tuple(source))
        elif not isinstance(source, str) or not source:
            raise ValueError(f"data.source must be 'embedded' or a file path, got {source!r}")
        require_int("data.micro_batch_size", self.micro_batch_size, 1)
        require_int("data.seq_len", self.seq_len, 1)
        if self.num_workers != "auto":
            try:
                require_int("data.num_workers", self.num_workers, 0)
            except ValueError:
                raise ValueError(
                    f"data.num_workers must be 'auto' or an integer >= 0, got {self.num_workers!r}"
                ) from None
