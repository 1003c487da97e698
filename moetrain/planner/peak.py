"""The peak of one micro-step's memory: activations, gradients and working memory over the backward.

Memory a step allocates and frees (saved activations, recomputed segments, gradients, working
tensors) does not all exist at once: the forward saves activations; the backward walks the layers
from the last to the first, rebuilding a recomputed layer's activations just before its own
backward, freeing each layer's activations after it and allocating each layer's parameter
gradients as it goes (the engine sets gradients to None between steps). The peak is the largest of
(``L`` layers, ``A_j`` the bytes layer ``j`` keeps, ``F_j`` all it saves without recompute, ``G_j``
its gradient bytes (autocast's weight copies count with ``A_j``, see :func:`step_peak`), ``O``
the activations saved outside the layers, ``G_o`` the gradients outside the layers allocated
first (head, final norm), ``G_in`` those of the parameters used before the first layer
(embeddings, positions, an image stem: ``ModelArch.input_modules``), allocated last, ``W_j`` layer
``j``'s backward working set, ``W_loss`` the loss's):

- the start of the backward: ``O + sum_j A_j + G_o + W_loss``;
- the backward of layer ``i`` (``i = L-1 .. 0``):
  ``O' + sum_{j<i} A_j + F_i + sum_{j>i} K_j + G_o + sum_{j>i} G_j + max(W_i, G_i)``
  (a recomputed layer's activations are rebuilt whole: ``F_i`` replaces ``A_i``; ``O'``: ``O``
  less what the final norm, the head and the loss saved, freed by then; the layer's own gradients
  appear as its working memory goes);
- the end, the backward of the inputs: ``O' + G_o + sum_j G_j + G_in + sum_j K_j`` (``O'`` is what
  the embeddings and the stem saved, held until their backward).

MoE routing replay (a recomputed MoE FFN): its record (``R_j`` in ``A_j``: the expert ids and,
under EP, the rows each all-to-all delivered) is kept until the layer is rebuilt; the rebuild
replays the rows once and lets them go (the rebuilt combine keeps its view of the returned rows,
counted in ``F_i``). What the record still holds lives with the forward's autograd graph, to the
end of the backward: ``K_j = T*k*8`` expert ids plus the dispatch index (0 without replay).

``W_i``: the gradient arriving at and leaving the layer (``2*T*D*b``) plus the largest of the
attention backward (``4*T*D*b``: the gradients of q, k, v and the output) and the FFN backward
(``rows * max(D + H, 2H) * b`` with the hidden width ``H``; rows: ``N_r`` for an MoE layer, ``T``
for a dense one). Checked against :class:`moetrain.planner.measure.PeakStorageBytes` by
``tests/unit/planner/test_planner_validation.py`` (table in ``docs/planner.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.planner.activations import ActivationModel, Workload

HEAD_TERMS = ("final_norm", "head_input", "loss")  # saved after the layers, freed before their backward


@dataclass(frozen=True)
class StepPeak:
    """The step's peak (bytes) and where it is (``"start of backward"``, ``"backward of layer 3"``,
    ``"end of backward"``), with the parts at that point: activations held (kept and rebuilt),
    gradients allocated before it, working memory (in a layer: the larger of its working memory
    and its own gradients)."""

    total: int
    where: str
    activations: int
    gradients: int
    working: int
    backward_total: int | None = None  # the backward's peak (the total unless the optimizer's is above)
    optimizer_total: int | None = None  # the optimizer step's (None: no such phase on the GPU)

    @property
    def backward(self) -> int:
        """The backward's peak: ``backward_total`` where it was kept, else the total."""
        return self.total if self.backward_total is None else self.backward_total


def _ffn_working(rows: int, d_model: int, d_ff: int, activation: str, b: int) -> int:
    """An FFN backward over ``rows`` rows: at most the gradients of two of its tensors at once, the
    hidden one's (width ``H``: ``F``, ``2F`` for SwiGLU's gate and up) before and after the
    activation, or it and the input's: ``rows * max(D + H, 2H) * b``."""
    hidden = 2 * d_ff if activation == "swiglu" else d_ff
    return rows * max(d_model + hidden, 2 * hidden) * b


def layer_working_bytes(arch, acts: ActivationModel, b: int) -> list[int]:
    """``W_i`` of every layer (see the module docstring)."""
    tokens, d = acts.tokens, arch.d_model
    working = []
    for layer in acts.layers:
        attention = 4 * tokens * d * b if not arch.generic else 0
        if layer.is_moe:
            ffn = _ffn_working(layer.rows.received, d, arch.moe.d_ff, arch.moe.activation, b)
        else:
            ffn = _ffn_working(tokens, d, arch.dense_d_ff or 0, arch.moe.activation, b)
        working.append(2 * tokens * d * b + max(attention, ffn))
    return working


def loss_working_bytes(arch, acts: ActivationModel, b: int) -> int:
    """The loss's backward: logits in the compute dtype and their fp32 gradient, ``T_loss*V*(b + 4)``."""
    loss_tokens = acts.outside.get("head_input", 0) // (arch.d_model * b)
    return loss_tokens * arch.vocab_size * (b + 4)


def replay_leftovers(arch, acts: ActivationModel, replayed) -> list[int]:
    """``K_j`` of every layer (see the module docstring): what a replayed MoE layer's record keeps
    after the layer's backward, ``T*k*8 + `` its dispatch index bytes."""
    return [
        layer.rows.tokens * arch.moe.top_k * 8 + layer.terms["dispatch_index"]
        if replays and layer.is_moe and layer.replay
        else 0
        for layer, replays in zip(acts.layers, replayed, strict=True)
    ]


def optimizer_step_peak(gradient_bytes: int, state_bytes: int, backward_total: int) -> StepPeak:
    """The optimizer step of a GPU-resident torch AdamW (``foreach``), after the backward: every
    gradient, plus the one temporary the multi-tensor step allocates (``sqrt(exp_avg_sq)`` of all
    the parameters it steps at once: one optimizer state's bytes, ``state_bytes``). Where it
    exceeds the backward's peak (little activation memory left, as with full recompute) it is the
    step's peak. The offloaded optimizer steps on the host and has no such phase on the GPU.
    ``backward_total``: the backward's peak, kept beside it."""
    return StepPeak(
        total=gradient_bytes + state_bytes,
        where="optimizer step",
        activations=0,
        gradients=gradient_bytes,
        working=state_bytes,
        backward_total=backward_total,
        optimizer_total=gradient_bytes + state_bytes,
    )


def step_peak(
    arch,
    acts: ActivationModel,
    work: Workload,
    kept_per_layer: tuple[int, ...],
    layer_gradients: list[int],
    other_gradients: int,
    layer_copies: list[int] | None = None,
    other_copies: int = 0,
    transient_low_precision_grads: bool = True,
    kept_copies: list[int] | None = None,
    replayed: tuple[bool, ...] | None = None,
    input_gradients: int = 0,
) -> StepPeak:
    """The peak of one micro-step (see the module docstring). ``kept_per_layer``: ``A_j`` (the
    recompute choice's bytes per layer); ``layer_gradients``: ``G_j``; ``other_gradients``: ``G_o``;
    ``layer_copies`` / ``other_copies``: the low-precision weight copies autocast saves for the
    backward (``C_j``, ``C_o``; counted with the activations: all of them at the start of the backward,
    ``C_o + sum_{j<=i} C_j`` at layer ``i``, none at the end; layer ``i``'s weight gradients also arrive
    in low precision before their cast: ``C_i`` more working memory; ``kept_copies``: the copies
    the forward keeps, default ``layer_copies`` (a recomputed layer's are cast again in its
    backward, so it keeps none); unless
    ``transient_low_precision_grads`` is False: the CPU grouped GEMM keeps those in buffers it
    reuses, which the caller counts with ``other_gradients``). ``replayed``: the layers whose MoE
    FFN is recomputed with routing replay (``K_j``; default none); ``input_gradients``:
    ``G_in``, not part of ``other_gradients``."""
    layer_copies = layer_copies or [0] * len(acts.layers)
    leftovers = replay_leftovers(arch, acts, replayed or (False,) * len(acts.layers))
    kept_copies = layer_copies if kept_copies is None else kept_copies
    b = work.itemsize
    outside = acts.outside_bytes + acts.attention_mask_bytes
    below = outside - sum(acts.outside.get(term, 0) for term in HEAD_TERMS)  # freed by the head's backward
    full = [layer.saved_bytes for layer in acts.layers]
    working = layer_working_bytes(arch, acts, b)
    kept_total = sum(kept_per_layer) + sum(kept_copies) + other_copies
    candidates = [
        StepPeak(
            outside + kept_total + other_gradients + loss_working_bytes(arch, acts, b),
            "start of backward",
            outside + kept_total,
            other_gradients,
            loss_working_bytes(arch, acts, b),
        )
    ]
    kept_below = kept_total
    gradients = other_gradients
    records_above = 0  # K_j of the layers whose backward is done
    for index in reversed(range(len(acts.layers))):
        kept_below -= kept_per_layer[index] + kept_copies[index]
        rebuilt = max(full[index], kept_per_layer[index])
        held = below + kept_below + rebuilt + records_above + layer_copies[index]
        # under autocast the layer's weight gradients first arrive in low precision, then are cast
        layer_working = working[index] + (layer_copies[index] if transient_low_precision_grads else 0)
        # the layer's own gradients appear while its working memory goes: the larger of the two
        own = max(layer_working, layer_gradients[index])
        candidates.append(
            StepPeak(held + gradients + own, f"backward of layer {index}", held, gradients, own)
        )
        gradients += layer_gradients[index]
        records_above += leftovers[index]
    gradients += input_gradients
    held = below + records_above
    candidates.append(StepPeak(held + gradients, "end of backward", held, gradients, 0))
    return max(candidates, key=lambda peak: peak.total)
