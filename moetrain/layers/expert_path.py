"""Which implementation runs an eager call's expert GEMMs where more than one can: chosen by
measuring both on the device, once per shape class, not by a fixed rule.

The candidates compute the same ``y_ND = act(x_ND @ w1[e]) @ w2[e]`` over each expert's rows (values
within rounding of each other):

- ``"grouped"``: torch's grouped GEMM, one kernel for all experts (:mod:`moetrain.kernels.grouped_mm`;
  CUDA, bf16, compute capability >= 8.0);
- ``"per_expert"``: one cuBLAS GEMM per expert over its rows, with the row-stable phases and reused
  buffers of :mod:`moetrain.layers.expert_math`.

Which is faster depends on the GPU and the shapes (few large experts favour one, many small ones
the other; measured on an H100 both ways), so :class:`ExpertPathChooser` times forward + backward
of each candidate on the call's own shapes (detached copies: nothing reaches the model's gradients),
``warmup`` untimed then ``repeats`` timed runs alternating between candidates, keeps the one with
the smaller median, logs the choice with both times, and reuses it for every call of the same shape
class: device, dtype, d_model, the inner and output widths, experts, activation, biases, and the
row count rounded up to a power of two.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch

logger = logging.getLogger("moetrain.layers.expert_path")

Candidate = Callable[[], None]  # runs one forward + backward of a path on the call's shapes


def shape_class(x_ND: torch.Tensor, w1_EDF: torch.Tensor, w2_EFD: torch.Tensor, activation: str, bias: bool):
    """The key a choice is cached under: what the relative speed of the paths depends on."""
    rows = x_ND.shape[0]
    bucket = 1 << max(rows - 1, 0).bit_length()
    experts, d_model, inner = w1_EDF.shape
    return (str(x_ND.device), x_ND.dtype, d_model, inner, w2_EFD.shape[1], experts, activation, bias, bucket)


def device_timer(device: torch.device) -> Callable[[Candidate], float]:
    """Seconds one run of a candidate takes: CUDA events on a GPU, the wall clock elsewhere."""

    def timed(run: Candidate) -> float:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        run()
        return time.perf_counter() - begin

    return timed


class ExpertPathChooser:
    """Measures the candidates of a shape class once and remembers the faster (see module doc).
    ``timer`` is injectable (tests); ``choices`` maps shape classes to the chosen name."""

    def __init__(self, warmup: int = 1, repeats: int = 3, timer: Callable | None = None):
        self.warmup, self.repeats, self.timer = warmup, repeats, timer
        self.choices: dict[tuple, str] = {}

    def choose(self, key: tuple, device: torch.device, candidates: dict[str, Candidate]) -> str:
        if key not in self.choices:
            self.choices[key] = self._measure(key, device, candidates)
        return self.choices[key]

    def _measure(self, key: tuple, device: torch.device, candidates: dict[str, Candidate]) -> str:
        timed = self.timer or device_timer(device)
        for _ in range(self.warmup):
            for run in candidates.values():
                run()
        seconds: dict[str, list[float]] = {name: [] for name in candidates}
        for _ in range(self.repeats):
            for name, run in candidates.items():
                seconds[name].append(timed(run))
        medians = {name: statistics.median(values) for name, values in seconds.items()}
        chosen = min(medians, key=medians.get)
        logger.info(
            "experts on %s, shape class %s: %s (fwd+bwd %s)",
            device,
            key[2:],
            chosen,
            ", ".join(f"{name} {1e3 * value:.3f} ms" for name, value in medians.items()),
        )
        return chosen


CHOOSER = ExpertPathChooser()
