"""OffloadOptimizer(overlap="delayed"): ZeRO-Offload's one-step delayed parameter update, bit for bit.

The reference is the exact optimizer (``overlap="none"``) fed the gradients the delayed run computed,
shifted by one step: the first ``overlap_after_steps`` updates at their own step, later ones one step
late (nothing at the first delayed step), a skipped step's update never, each with the learning
rate and loss scale of the step whose gradients it uses. After every step the delayed run's weights
must equal the reference's exactly (``torch.equal``).

Thread safety: right after ``step()`` returns the test fills every ``.grad`` with NaN and changes
every learning rate (as an LR scheduler does), while the worker may still be running: the update
must read its own snapshots.
"""

import io

import pytest
import torch
import torch.nn.functional as F

from moe_lm import MoETransformerLM
from moetrain.config import OptimConfig
from moetrain.offload import OffloadOptimizer
from tests.unit.machinery.test_offload_optimizer import TINY, VOCAB

NUM_STEPS = 8
BASE_LRS = (1e-2, 3e-3)  # decayed matrices, vectors


def make_model(dtype: torch.dtype) -> MoETransformerLM:
    torch.manual_seed(0)
    return MoETransformerLM(TINY).to(dtype)


def param_groups(model: torch.nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def lr_factor(step: int) -> float:
    return (step + 1) / (NUM_STEPS + 1)  # a different lr every step


def set_lrs(optimizer, step: int) -> list[float]:
    lrs = [base * lr_factor(step) for base in BASE_LRS]
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    return lrs


def batches(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, TINY.max_seq_len + 1), generator=generator) for _ in range(NUM_STEPS)]


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(model, optimizer, tokens, steps, *, found_inf=(), engine_skips=(), scales=None):
    """Runs ``steps`` (1-based step numbers); returns per step (gradients, lrs, scale, skipped) and
    the weights after it. ``found_inf``: steps the GradScaler would skip (``found_inf`` set);
    ``engine_skips``: steps a trainer skips itself (``apply_pending()`` instead of ``step()``);
    ``scales``: the loss scale per step (gradients carry it; the optimizer divides by it)."""
    records, after = [], []
    for t in steps:
        lrs = set_lrs(optimizer, t)
        optimizer.zero_grad(set_to_none=False)  # in place: the next backward writes the same tensors
        batch = tokens[t - 1]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        scale = 1.0 if scales is None else scales[t]
        (loss * scale).backward()
        grads = [p.grad.clone() for p in model.parameters()]
        skipped = t in found_inf or t in engine_skips
        if t in engine_skips:
            optimizer.apply_pending()
        else:
            if scales is not None:
                optimizer.grad_scale = torch.tensor(scale)
            if t in found_inf:
                optimizer.found_inf = torch.tensor(1.0)
            optimizer.step()
            for name in ("grad_scale", "found_inf"):
                optimizer.__dict__.pop(name, None)
        for p in model.parameters():  # the worker may be running: it must not read these
            p.grad.fill_(float("nan"))
        set_lrs(optimizer, t + 100)
        records.append((grads, lrs, scale, skipped))
        after.append(weights(model))
    return records, after


def shifted_reference(dtype, records, warmup: int) -> list[list[torch.Tensor]]:
    """The exact optimizer fed the recorded gradients one step late after ``warmup`` updates."""
    model = make_model(dtype)
    optimizer = OffloadOptimizer(param_groups(model), overlap="none")
    pending, issued, after = None, 0, []

    def feed(grads, lrs, scale):
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g.clone()
        optimizer.grad_scale = torch.tensor(scale)
        optimizer.step()
        del optimizer.grad_scale

    for grads, lrs, scale, skipped in records:
        if pending is not None:
            feed(*pending)
            pending = None
        if not skipped:
            if issued < warmup:
                feed(grads, lrs, scale)
            else:
                pending = (grads, lrs, scale)
            issued += 1
        after.append(weights(model))
    return after


def assert_equal_weights(actual, expected, what: str) -> None:
    for step, (a_step, e_step) in enumerate(zip(actual, expected, strict=True), 1):
        for i, (a, e) in enumerate(zip(a_step, e_step, strict=True)):
            assert torch.equal(a, e), f"{what}: step {step}, param {i} differs by {(a - e).abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("warmup", [0, 3])
def test_delayed_equals_exact_with_gradients_shifted_by_one_step(dtype, warmup):
    model = make_model(dtype)
    optimizer = OffloadOptimizer(param_groups(model), overlap="delayed", overlap_after_steps=warmup)
    records, after = train(model, optimizer, batches(), range(1, NUM_STEPS + 1))
    assert optimizer.has_pending
    assert_equal_weights(after, shifted_reference(dtype, records, warmup), "delayed vs shifted exact")
    # the warm-up steps are the exact optimizer's own trajectory; the first delayed step is not
    exact = make_model(dtype)
    exact_records, exact_after = train(
        exact, OffloadOptimizer(param_groups(exact)), batches(), range(1, NUM_STEPS + 1)
    )
    assert_equal_weights(after[:warmup], exact_after[:warmup], "warm-up vs exact")
    assert not torch.equal(after[warmup + 1][0], exact_after[warmup + 1][0])
    optimizer.apply_pending()  # the last update reaches the weights
    assert not optimizer.has_pending
    assert optimizer.last_update_s > 0  # the worker's host time of the last update
    assert not torch.equal(weights(model)[0], after[-1][0])


def test_a_skipped_step_skips_its_own_update_only():
    """GradScaler's found_inf at step 4 and a trainer's own skip (apply_pending) at step 6, with a
    loss scale that changes: each skip writes the pending update and starts none."""
    model = make_model(torch.float32)
    optimizer = OffloadOptimizer(param_groups(model), overlap="delayed", overlap_after_steps=1)
    scales = {t: 2.0 ** (10 - t) for t in range(1, NUM_STEPS + 1)}
    records, after = train(
        model, optimizer, batches(), range(1, NUM_STEPS + 1), found_inf={4}, engine_skips={6}, scales=scales
    )
    assert [r[3] for r in records] == [False, False, False, True, False, True, False, False]
    assert_equal_weights(after, shifted_reference(torch.float32, records, 1), "skips")
    steps = {int(s["step"]) for s in optimizer.state.values()}
    assert steps == {NUM_STEPS - 2}  # two skipped steps issued no update
    assert not torch.equal(after[5][0], after[4][0])  # step 5's update landed at step 6's skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_in_the_middle_then_resume_equals_no_stop(dtype):
    """state_dict() at step 5 (an update pending) with the model's weights, both through torch.save;
    a new model and optimizer loading them and running steps 6-8 equal the run that never stopped."""
    tokens = batches()
    model = make_model(dtype)
    optimizer = OffloadOptimizer(param_groups(model), overlap="delayed", overlap_after_steps=2)
    train(model, optimizer, tokens, range(1, 6))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, buffer)
    pending = [float(v["pending"]) for v in optimizer.state_dict()["state"].values()]
    assert pending and set(pending) == {1.0}
    _, no_stop = train(model, optimizer, tokens, range(6, NUM_STEPS + 1))

    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = make_model(dtype)
    resumed.load_state_dict(saved["model"])
    reloaded = OffloadOptimizer(param_groups(resumed), overlap="delayed", overlap_after_steps=2)
    reloaded.load_state_dict(saved["optim"])
    assert reloaded.has_pending
    assert all(torch.equal(a, b) for a, b in zip(weights(resumed), saved["model"].values(), strict=False))
    _, after = train(resumed, reloaded, tokens, range(6, NUM_STEPS + 1))
    assert_equal_weights(after, no_stop, "resumed vs no stop")
    reloaded.wait_pending()
    optimizer.wait_pending()
    for a, b in zip(reloaded.state.values(), optimizer.state.values(), strict=True):
        assert torch.equal(a["master"], b["master"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])


def test_a_delayed_checkpoint_loads_into_the_exact_optimizer_with_its_update_written():
    model = make_model(torch.float32)
    optimizer = OffloadOptimizer(param_groups(model), overlap="delayed")
    train(model, optimizer, batches(), range(1, 3))
    state = optimizer.state_dict()
    before = weights(model)
    exact = OffloadOptimizer(param_groups(model))
    exact.load_state_dict(state)
    assert not exact.has_pending
    params = [p for group in exact.param_groups for p in group["params"]]  # the state dict's order
    masters = [state["state"][i]["master"] for i in range(len(params))]
    assert all(torch.equal(p.detach(), m) for p, m in zip(params, masters, strict=True))
    assert not all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), before, strict=True))


def test_overlap_options_are_checked():
    params = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError, match="overlap must be one of 'none', 'delayed', got 'async'"):
        OffloadOptimizer(params, overlap="async")
    with pytest.raises(ValueError, match="overlap_after_steps"):
        OffloadOptimizer(params, overlap="delayed", overlap_after_steps=-1)
    with pytest.raises(ValueError, match="optim.overlap must be one of 'none', 'delayed', got 'async'"):
        OptimConfig(name="offload", overlap="async")
    with pytest.raises(ValueError, match="optim.overlap 'delayed' needs optim.name 'offload', got 'adamw'"):
        OptimConfig(overlap="delayed")
    with pytest.raises(ValueError, match="optim.overlap_after_steps must be an integer >= 0"):
        OptimConfig(name="offload", overlap="delayed", overlap_after_steps=-2)
    assert OptimConfig(name="offload", overlap="delayed", overlap_after_steps=5).overlap_after_steps == 5


# ------------------------------------------------------------------------------------------------
# Two gloo ranks: replicated dense parameters (gradients averaged) and each rank's own experts


def _ep_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    dense = torch.nn.Parameter(torch.randn(8, 8) / 8**0.5)
    torch.manual_seed(100 + rank)
    experts = torch.nn.Parameter(torch.randn(2, 8, 8) / 8**0.5)  # this rank's 2 of 4 experts
    params = [dense, experts]
    optimizer = OffloadOptimizer(
        [{"params": params, "lr": 1e-2}], overlap="delayed", overlap_after_steps=1, num_apply_groups=3
    )
    generator = torch.Generator().manual_seed(7 + rank)
    grads, after = [], []
    for _ in range(6):
        x = torch.randn(16, 8, generator=generator)
        h = torch.tanh(x @ dense)
        y = torch.einsum("td,edf->tef", h, experts)
        loss = y.square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dist.all_reduce(dense.grad)
        dense.grad /= world_size
        grads.append([p.grad.clone() for p in params])
        optimizer.step()
        after.append([p.detach().clone() for p in params])
    return {"grads": grads, "after": after}


@pytest.mark.timeout(240)
def test_two_ranks_with_expert_parallel_parameters():
    from tests.helpers.dist_utils import run_distributed

    results = run_distributed(_ep_worker, 2, timeout=200)
    for step in range(6):  # the dense weights stay replicated
        assert torch.equal(results[0]["after"][step][0], results[1]["after"][step][0])
    for rank, result in enumerate(results):
        model = [torch.zeros(8, 8), torch.zeros(2, 8, 8)]
        torch.manual_seed(0)
        model[0] = torch.nn.Parameter(torch.randn(8, 8) / 8**0.5)
        torch.manual_seed(100 + rank)
        model[1] = torch.nn.Parameter(torch.randn(2, 8, 8) / 8**0.5)
        exact = OffloadOptimizer([{"params": model, "lr": 1e-2}])
        pending, expected = None, []
        for step, grads in enumerate(result["grads"]):
            feeds = [pending] if pending is not None else []
            pending = None
            if step < 1:
                feeds.append(grads)
            else:
                pending = grads
            for feed in feeds:
                for p, g in zip(model, feed, strict=True):
                    p.grad = g
                exact.step()
            expected.append([p.detach().clone() for p in model])
        assert_equal_weights(result["after"], expected, f"rank {rank}")
