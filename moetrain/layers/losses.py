"""Router auxiliary losses and the autograd helper that feeds them to ``loss.backward()``.

Legend: T tokens, E experts, K choices per token.
"""

from __future__ import annotations

import torch


def load_balancing_loss(probs_TE: torch.Tensor, expert_ids_TK: torch.Tensor) -> torch.Tensor:
    """Switch/GShard load-balancing loss ``E * sum_e f_e * P_e``.

    ``f_e`` is the share of the ``T*K`` routed slots assigned to expert ``e`` (before any capacity
    cut; not differentiable) and ``P_e`` the mean over tokens of the router's probability for ``e``,
    normalised per token so that ``sum_e P_e = 1`` (the identity for a plain softmax; it divides by
    the number of prototype groups for a grouped softmax and makes sigmoid scores a distribution).
    The loss is 1 for perfectly uniform routing and reaches E when every token picks one expert.
    """
    num_tokens, num_experts = probs_TE.shape
    if num_tokens == 0:
        return probs_TE.sum() * 0.0
    distribution_TE = probs_TE / probs_TE.sum(dim=-1, keepdim=True).clamp_min(
        torch.finfo(probs_TE.dtype).tiny
    )
    mean_prob_E = distribution_TE.mean(dim=0)
    slots_S = expert_ids_TK.reshape(-1)
    counts_E = probs_TE.new_zeros(num_experts).scatter_add_(
        0, slots_S, torch.ones_like(slots_S, dtype=probs_TE.dtype)
    )
    slot_share_E = counts_E / expert_ids_TK.numel()
    return num_experts * torch.dot(slot_share_E, mean_prob_E)


def sequence_balance_loss(
    probs_TE: torch.Tensor,
    expert_ids_TK: torch.Tensor,
    seq_len: int | None = None,
    sequence_lengths_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """The load-balancing loss within each sequence, averaged over the sequences (DeepSeek-V3's
    sequence-wise balance loss): ``mean_b E * sum_e f_be * P_be`` with ``f_be`` the share of
    sequence b's ``n_b * K`` slots that chose expert e and ``P_be`` the mean over its ``n_b`` tokens
    of the normalised probability of e. Tokens are in sequence-major order: ``B = T / seq_len``
    sequences of ``seq_len`` tokens (``[B, S]`` flattened), or sequences of the lengths
    ``sequence_lengths_B`` (integers summing to T, e.g. the real tokens of each padded sample;
    sequences of length 0 are left out of the mean). 1 when every sequence is balanced, E when each
    sequence sends all its tokens to one expert."""
    num_tokens, num_experts = probs_TE.shape
    if num_tokens == 0:
        return probs_TE.sum() * 0.0
    distribution_TE = probs_TE / probs_TE.sum(dim=-1, keepdim=True).clamp_min(
        torch.finfo(probs_TE.dtype).tiny
    )
    if sequence_lengths_B is not None:
        return _varlen_sequence_balance_loss(distribution_TE, expert_ids_TK, sequence_lengths_B)
    sequences, top_k = num_tokens // seq_len, expert_ids_TK.shape[1]
    mean_prob_BE = distribution_TE.view(sequences, seq_len, num_experts).mean(dim=1)
    slots_BS = expert_ids_TK.reshape(sequences, seq_len * top_k)
    counts_BE = probs_TE.new_zeros(sequences, num_experts).scatter_add_(
        1, slots_BS, torch.ones_like(slots_BS, dtype=probs_TE.dtype)
    )
    share_BE = counts_BE / (seq_len * top_k)
    return num_experts * (share_BE * mean_prob_BE).sum(dim=1).mean()


def _varlen_sequence_balance_loss(
    distribution_TE: torch.Tensor, expert_ids_TK: torch.Tensor, lengths_B: torch.Tensor
) -> torch.Tensor:
    """:func:`sequence_balance_loss` for sequences of ``lengths_B`` tokens (no host sync).

    Token t belongs to sequence ``b = #{i : cumsum(lengths)[i] <= t}`` (clamped to ``B - 1``), so
    lengths that do not sum to T (unchecked on a GPU or in compiled code) give a wrong loss, never
    an out-of-bounds index."""
    num_tokens, num_experts = distribution_TE.shape
    sequences, top_k = lengths_B.shape[0], expert_ids_TK.shape[1]
    if sequences == 0:  # only reachable with unchecked lengths (T > 0 tokens in no sequence)
        return distribution_TE.sum() * 0.0
    ends_B = lengths_B.cumsum(0)
    token_T = torch.arange(num_tokens, device=ends_B.device, dtype=ends_B.dtype)
    sequence_T = torch.searchsorted(ends_B, token_T, right=True).clamp_max_(sequences - 1)
    tokens_B = lengths_B.to(distribution_TE.dtype)
    prob_sum_BE = distribution_TE.new_zeros(sequences, num_experts).index_add_(0, sequence_T, distribution_TE)
    mean_prob_BE = prob_sum_BE / tokens_B.clamp_min(1)[:, None]
    counts_BE = distribution_TE.new_zeros(sequences * num_experts).index_add_(
        0,
        (sequence_T[:, None] * num_experts + expert_ids_TK).reshape(-1),
        distribution_TE.new_ones(num_tokens * top_k),
    )
    share_BE = counts_BE.view(sequences, num_experts) / (tokens_B * top_k).clamp_min(1)[:, None]
    present_B = (lengths_B > 0).to(distribution_TE.dtype)
    per_sequence_B = num_experts * (share_BE * mean_prob_BE).sum(dim=1)
    return (per_sequence_B * present_B).sum() / present_B.sum().clamp_min(1)


def router_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """ST-MoE router z-loss ``mean_t (logsumexp_e logits[t, e])^2``; keeps router logits small."""
    if logits_TE.shape[0] == 0:
        return logits_TE.sum() * 0.0
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``output``; in backward, ``aux_loss`` receives gradient 1 (times ``scale``), as if
    ``scale * aux_loss`` had been added to the loss that ``output`` flows into."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux_loss, ctx.scale), None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Returns ``output`` unchanged, arranged so that ``loss.backward()`` on anything computed from
    it also back-propagates ``scale * aux_loss`` (Megatron's "aux loss auto-scaler" trick): the model
    does not have to return its aux losses for them to train the router."""
    if not (torch.is_grad_enabled() and aux_loss.requires_grad and output.requires_grad):
        return output
    return _AttachAuxLoss.apply(output, aux_loss, scale)
