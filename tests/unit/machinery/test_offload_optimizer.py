"""OffloadOptimizer and GroupwiseApply against torch.optim.AdamW on a tiny MoE language model.

- fp32 model: OffloadOptimizer follows the trajectory of ``torch.optim.AdamW(foreach=False)``
  (each model computes its own gradients) within float rounding: the fused kernel differs from
  torch by about an ulp per step (see tests/unit/kernels/test_cpu_adam.py).
- bf16 model: the reference keeps fp32 masters and sets the bf16 weights to their cast. Against
  torch's AdamW the two are fed the same gradients (lockstep): with independent forward passes one
  master an ulp apart rounds to another bf16 value within a few steps, and Adam turns that into
  lr-sized differences (seen: 0.04 after 20 steps at lr 1e-2). Independently of any lockstep, the
  whole trajectory equals bit for bit one of CPUAdam (the same kernel, no groups) on fp32 masters.
- Memory: ``peak_temporary_bytes`` (below) reads the CPU allocator's allocation and free events.
- ``optimizer._staged = True`` on a CPU model runs the code path of a CUDA model (gradients and
  weight copies through staging buffers, two slots), with synchronous copies.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType

from moe_lm import LMConfig, MoETransformerLM
from moetrain.config import MoEConfig
from moetrain.offload import CPUAdam, GroupwiseApply, OffloadOptimizer
from moetrain.offload.apply_groups import plan_apply_groups

VOCAB = 64
TINY = LMConfig(
    vocab_size=VOCAB,
    d_model=32,
    num_layers=2,
    num_heads=2,
    max_seq_len=16,
    moe=MoEConfig(d_model=32, d_ff=64, num_experts=4, top_k=2, capacity_factor=None),
)
NUM_STEPS = 20
# About an ulp of the weight per step (tests/unit/kernels/test_cpu_adam.py); seen after 20 steps: 3e-7.
PARAM_TOL = {"rtol": 2e-5, "atol": 5e-6}


def make_model(dtype: torch.dtype = torch.float32) -> MoETransformerLM:
    torch.manual_seed(0)
    return MoETransformerLM(TINY).to(dtype)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Matrices with weight decay at the default lr; vectors without, at another lr."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.ndim >= 2]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 3e-3},
    ]


def token_batches(num_steps: int = NUM_STEPS, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, TINY.max_seq_len + 1), generator=generator) for _ in range(num_steps)]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def backward(model: torch.nn.Module, tokens: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    loss_of(model, tokens).backward()


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 5)


def peak_temporary_bytes(fn) -> int:
    """Peak, while ``fn()`` runs, of the bytes the CPU allocator holds above what it held at the start.

    Read from the profiler (``profile_memory=True``): c10's CPU allocator reports every allocation
    and every free, with its size, to the profiler, which keeps them as ``Allocation`` events
    (``alloc_size`` < 0 for a free). Summing the sizes in time order gives the live bytes after
    each event. Unlike a TorchDispatchMode this also sees buffers that kernels allocate inside
    one operator (the intermediate lists of foreach ops, anything in C++), and it needs no guess
    about which outputs are new storage. Memory allocated before ``fn`` and freed inside counts
    negatively, so the peak is the rise above the starting level.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as profiler:
        fn()
    events, stack = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append(event)
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_time_ns):
        live += event.extra_fields.alloc_size
        peak = max(peak, live)
    return peak


# ------------------------------------------------------------------------------------------------
# Apply groups


def test_plan_apply_groups_cuts_the_concatenation_into_equal_ranges():
    numels = [10, 0, 3, 7]  # 20 elements, an empty tensor in the middle
    assert plan_apply_groups(numels) == [[(0, 0, 10), (2, 0, 3), (3, 0, 7)]]
    assert plan_apply_groups(numels, num_apply_groups=4) == [
        [(0, 0, 5)],
        [(0, 5, 10)],
        [(2, 0, 3), (3, 0, 2)],
        [(3, 2, 7)],
    ]
    assert plan_apply_groups(numels, group_numel=8) == [
        [(0, 0, 8)],
        [(0, 8, 10), (2, 0, 3), (3, 0, 3)],
        [(3, 3, 7)],
    ]
    assert plan_apply_groups([2, 1], num_apply_groups=5) == [[(0, 0, 1)], [(0, 1, 2)], [(1, 0, 1)]]
    for num_groups in range(1, 25):  # every element exactly once, in order
        flat = [
            (i, e)
            for group in plan_apply_groups(numels, num_apply_groups=num_groups)
            for i, s, t in group
            for e in range(s, t)
        ]
        assert flat == [(i, e) for i, n in enumerate(numels) for e in range(n)]


# ------------------------------------------------------------------------------------------------
# Trajectories


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize(
    "grouping",
    [{}, {"num_apply_groups": 3}, {"group_bytes": 20_000}],
    ids=["one-group", "3-groups", "20kB-groups"],
)
def test_fp32_model_follows_torch_adamw(adamw_mode, grouping):
    model, ref_model = make_model(), make_model()
    optimizer = OffloadOptimizer(
        param_groups(model), lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode, **grouping
    )
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    reference = ref_cls(param_groups(ref_model), lr=1e-2, weight_decay=0.1, foreach=False)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, warmup) for opt in (optimizer, reference)]
    for tokens in token_batches():
        for net, opt, scheduler in zip((model, ref_model), (optimizer, reference), schedulers, strict=True):
            backward(net, tokens)
            opt.step()
            scheduler.step()
    assert optimizer.param_groups[1]["lr"] == reference.param_groups[1]["lr"] == 3e-3
    for param, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(param, ref, **PARAM_TOL)
        state, ref_state = optimizer.state[param], reference.state[ref]
        assert torch.equal(state["step"], ref_state["step"])
        torch.testing.assert_close(state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=1e-4, atol=1e-9)
        # An fp32 CPU model is its own master: no second copy of the weights.
        assert state["master"].data_ptr() == param.data_ptr()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_bf16_model_matches_fp32_master_reference(staged):
    """Lockstep against torch.optim.AdamW on fp32 masters (same gradients); and the independent
    trajectory bit for bit against CPUAdam on fp32 masters (the same kernel without groups)."""
    model, kernel_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    optimizer = OffloadOptimizer(param_groups(model), lr=1e-2, weight_decay=0.1, num_apply_groups=4)
    optimizer._staged = staged

    torch_masters = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()]
    torch_ref = torch.optim.AdamW(
        param_groups_like(model, torch_masters), lr=1e-2, weight_decay=0.1, foreach=False
    )
    kernel_masters = [torch.nn.Parameter(p.detach().float()) for p in kernel_model.parameters()]
    for master in kernel_masters:
        master.grad_dtype = None  # lets the fp32 master take the model's bf16 gradient
    kernel_ref = CPUAdam(param_groups_like(kernel_model, kernel_masters), lr=1e-2, weight_decay=0.1)

    for tokens in token_batches():
        backward(model, tokens)
        for master, param in zip(torch_masters, model.parameters(), strict=True):
            master.grad = param.grad.float()
        optimizer.step()
        torch_ref.step()

        backward(kernel_model, tokens)
        for master, param in zip(kernel_masters, kernel_model.parameters(), strict=True):
            master.grad = param.grad
        kernel_ref.step()
        with torch.no_grad():
            for master, param in zip(kernel_masters, kernel_model.parameters(), strict=True):
                param.copy_(master)

    for param, torch_master, kernel_param, kernel_master in zip(
        model.parameters(), torch_masters, kernel_model.parameters(), kernel_masters, strict=True
    ):
        master = optimizer.state[param]["master"]
        assert param.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(param, master.to(torch.bfloat16))  # the weights are the cast master
        torch.testing.assert_close(master, torch_master.detach(), **PARAM_TOL)
        assert torch.equal(master, kernel_master.detach())
        assert torch.equal(param, kernel_param)
        assert torch.equal(optimizer.state[param]["exp_avg"], kernel_ref.state[kernel_master]["exp_avg"])


def param_groups_like(model: torch.nn.Module, tensors: list[torch.Tensor]) -> list[dict]:
    """``param_groups(model)`` with each param replaced by the tensor at its position in ``tensors``."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [
        {**group, "params": [tensors[index[id(p)]] for p in group["params"]]} for group in param_groups(model)
    ]


@pytest.mark.parametrize(
    "make_optimizer",
    [
        lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True),
        lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=True),
    ],
    ids=["adamw-foreach", "sgd-momentum"],
)
def test_groupwise_apply_equals_the_plain_optimizer(make_optimizer):
    model, ref_model = make_model(), make_model()
    optimizer = GroupwiseApply(make_optimizer(param_groups(model)), num_groups=3)
    reference = make_optimizer(param_groups(ref_model))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, warmup) for opt in (optimizer, reference)]
    batches = token_batches()
    for tokens in batches:
        for net, opt, scheduler in zip((model, ref_model), (optimizer, reference), schedulers, strict=True):
            backward(net, tokens)
            if net is model:
                assert len(optimizer.apply_groups()) == 3
            opt.step()
            scheduler.step()
        assert all(p.grad is not None for p in model.parameters())  # hidden gradients are restored
    for param, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(param, ref)
    assert optimizer.param_groups is optimizer.optimizer.param_groups
    assert optimizer.state_dict()["state"].keys() == reference.state_dict()["state"].keys()
    optimizer.zero_grad()
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------------------------
# Memory


def test_peak_temporary_bytes_measures_allocations_and_frees():
    def allocate():
        kept = torch.empty(1000)  # 4000 bytes, then 8000 more at the peak
        del kept
        a = torch.empty(2000)
        return a + 1

    assert 16_000 <= peak_temporary_bytes(allocate) <= 16_000 + 64  # + the scalar 1 as a tensor


def _equal_params(num_params: int, dtype: torch.dtype) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(2)
    params = [
        torch.nn.Parameter(torch.randn(64, 1000, generator=generator).to(dtype)) for _ in range(num_params)
    ]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator).to(dtype)
    return params


def test_groupwise_apply_peak_memory_falls_as_one_over_num_groups():
    """AdamW(foreach=True) allocates sqrt(exp_avg_sq) for all its params at once."""
    peaks = {}
    for num_groups in (1, 2, 4, 8):
        optimizer = GroupwiseApply(
            torch.optim.AdamW(_equal_params(8, torch.float32), foreach=True), num_groups
        )
        optimizer.step()  # the state is allocated on the first step
        peaks[num_groups] = peak_temporary_bytes(optimizer.step)
    total = 8 * 64 * 1000 * 4
    for num_groups, peak in peaks.items():
        assert total / num_groups <= peak <= total / num_groups * 1.05 + 4096, peaks


def test_offload_optimizer_peak_memory_falls_as_one_over_num_groups():
    """Staged (a CUDA model's path): two slots of one group's bf16 gradients and bf16 weight copies
    (4 bytes per element), on the tiny MoE LM whose parameters differ in size (the groups split
    them). Direct (a CPU model): the kernel needs no temporary memory at all."""
    model = make_model(torch.bfloat16)
    backward(model, token_batches(1)[0])
    total_elements = sum(p.numel() for p in model.parameters())
    peaks = {}
    for staged in (True, False):
        for num_groups in (1, 2, 4, 8):
            optimizer = OffloadOptimizer(model.parameters(), num_apply_groups=num_groups)
            optimizer._staged = staged
            optimizer.step()
            peaks[staged, num_groups] = peak_temporary_bytes(optimizer.step)
    for num_groups in (2, 4, 8):
        expected = 2 * total_elements * 4 / num_groups
        assert expected <= peaks[True, num_groups] <= expected * 1.05 + 4096, peaks
        assert peaks[False, num_groups] < 1024, peaks
    assert peaks[True, 1] == pytest.approx(peaks[True, 2], rel=0.05)  # one group needs one slot


# ------------------------------------------------------------------------------------------------
# State dict


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_state_dict_round_trip_continues_the_same_trajectory(dtype):
    batches = token_batches(12)
    model = make_model(dtype)
    optimizer = OffloadOptimizer(param_groups(model), lr=1e-2, weight_decay=0.1, num_apply_groups=3)
    for tokens in batches[:6]:
        backward(model, tokens)
        optimizer.step()
    saved_model = copy.deepcopy(model.state_dict())
    saved = copy.deepcopy(optimizer.state_dict())
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq", "master"}
    for tokens in batches[6:]:
        backward(model, tokens)
        optimizer.step()

    restored_model = make_model(dtype)
    restored_model.load_state_dict(saved_model)
    with torch.no_grad():  # the load must write the masters into the weights
        for param in restored_model.parameters():
            param.zero_()
    restored = OffloadOptimizer(param_groups(restored_model), lr=0.5, num_apply_groups=5)
    restored.load_state_dict(saved)
    for value in saved["state"][0].values():  # a deep copy: the dict no longer matters
        value.fill_(float("nan"))
    assert restored.param_groups[0]["lr"] == 1e-2
    for tokens in batches[6:]:
        backward(restored_model, tokens)
        restored.step()
    for param, restored_param in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(param, restored_param)
        assert torch.equal(optimizer.state[param]["master"], restored.state[restored_param]["master"])
        assert torch.equal(optimizer.state[param]["step"], torch.tensor(12.0))


def test_deep_copied_model_and_optimizer_continue_alike():
    """A deep copy loses the fp32 master's aliasing of the param; the step must still write the param."""
    model = make_model()
    optimizer = OffloadOptimizer(model.parameters(), lr=1e-2, num_apply_groups=2)
    batches = token_batches(4)
    backward(model, batches[0])
    optimizer.step()
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))
    for tokens in batches[1:]:
        for net, opt in ((model, optimizer), (model_copy, optimizer_copy)):
            backward(net, tokens)
            opt.step()
    for param, param_copy in zip(model.parameters(), model_copy.parameters(), strict=True):
        assert torch.equal(param, param_copy)


def test_loads_a_torch_adamw_state_dict():
    model, ref_model = make_model(), make_model()
    reference = torch.optim.AdamW(param_groups(ref_model), lr=1e-2, weight_decay=0.1, foreach=False)
    batches = token_batches(6)
    for tokens in batches[:3]:
        backward(ref_model, tokens)
        reference.step()
    model.load_state_dict(ref_model.state_dict())
    optimizer = OffloadOptimizer(param_groups(model), num_apply_groups=2)
    optimizer.load_state_dict(reference.state_dict())  # no "master": taken from the params
    for tokens in batches[3:]:
        for net, opt in ((model, optimizer), (ref_model, reference)):
            backward(net, tokens)
            opt.step()
    for param, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(param, ref, **PARAM_TOL)


# ------------------------------------------------------------------------------------------------
# fp16 loss scaling


def test_grad_scaler_skips_a_non_finite_step_and_lowers_the_scale():
    model = make_model(torch.float16)
    weights0 = [p.detach().clone() for p in model.parameters()]
    optimizer = OffloadOptimizer(param_groups(model), lr=1e-2, weight_decay=0.1, num_apply_groups=3)
    # 2**40 overflows the fp16 gradients; the backoff then lands on 2**10, which does not.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-30)
    tokens = token_batches(1)[0]

    optimizer.zero_grad()
    scaler.scale(loss_of(model, tokens)).backward()
    assert not all(p.grad.isfinite().all() for p in model.parameters())
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0**10
    assert all(torch.equal(p, p0) for p, p0 in zip(model.parameters(), weights0, strict=True))
    assert len(optimizer.state) == 0  # nothing was stepped, not even the step counts
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")

    optimizer.zero_grad()
    scaler.scale(loss_of(model, tokens)).backward()
    scaled_grads = [p.grad.clone() for p in model.parameters()]
    assert all(grad.isfinite().all() for grad in scaled_grads)
    scaler.step(optimizer)  # the unscaling happens inside the fused step
    scaler.update()
    assert scaler.get_scale() == 2.0**10

    masters = [torch.nn.Parameter(p0.float()) for p0 in weights0]
    reference = torch.optim.AdamW(param_groups_like(model, masters), lr=1e-2, weight_decay=0.1, foreach=False)
    for master, grad in zip(masters, scaled_grads, strict=True):
        master.grad = grad.float() * 2.0**-10
    reference.step()
    for param, master in zip(model.parameters(), masters, strict=True):
        assert optimizer.state[param]["step"].item() == 1.0
        torch.testing.assert_close(optimizer.state[param]["master"], master.detach(), **PARAM_TOL)
        assert torch.equal(param, optimizer.state[param]["master"].to(torch.float16))


def test_grad_scaler_after_explicit_unscale_for_clipping():
    """bf16 gradients may be unscaled by the scaler (for clipping); then no scale is passed on."""
    model, ref_model = make_model(torch.bfloat16), make_model(torch.bfloat16)
    optimizer = OffloadOptimizer(model.parameters(), lr=1e-2, num_apply_groups=2)
    masters = [torch.nn.Parameter(p.detach().float()) for p in ref_model.parameters()]
    reference = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.0, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    tokens = token_batches(1)[0]
    scaler.scale(loss_of(model, tokens)).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    for master, param in zip(masters, model.parameters(), strict=True):
        master.grad = param.grad.float()
    scaler.step(optimizer)
    scaler.update()
    reference.step()
    for param, master in zip(model.parameters(), masters, strict=True):
        torch.testing.assert_close(optimizer.state[param]["master"], master.detach(), **PARAM_TOL)


# ------------------------------------------------------------------------------------------------
# Bad options


def _params(dtype=torch.float32, shape=(4, 4)):
    return [torch.nn.Parameter(torch.zeros(shape, dtype=dtype))]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_apply_groups": 0}, "num_apply_groups must be an integer >= 1"),
        ({"num_apply_groups": 2.0}, "num_apply_groups must be an integer >= 1"),
        ({"num_apply_groups": True}, "num_apply_groups must be an integer >= 1"),
        ({"group_bytes": 3}, "group_bytes must be an integer >= 4"),
        ({"num_apply_groups": 2, "group_bytes": 1024}, "give at most one of them"),
        ({"lr": -1.0}, "lr must be"),
        ({"lr": float("nan")}, "lr must be"),
        ({"betas": (0.9, 1.0)}, "betas\\[1\\] must be a number in \\[0, 1\\), got 1.0"),
        ({"eps": -1e-8}, "eps must be"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"adamw_mode": "yes"}, "adamw_mode must be True or False"),
    ],
)
def test_bad_options_raise_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffloadOptimizer(_params(), **kwargs)


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([{"params": _params(), "adamw": False}], "option 'adamw' is unknown; allowed: params"),
        ([{"params": _params(), "amsgrad": True}], "amsgrad must be False"),
        ([{"params": _params(), "decoupled_weight_decay": 1}], "decoupled_weight_decay must be True"),
        ([{"params": _params(torch.float64)}], r"param group 0: param 0 dtype must be one of"),
        ([{"params": [torch.nn.Parameter(torch.zeros(4, 4).t())]}], "param 0 must be contiguous"),
        (
            [{"params": _params()}, {"params": [torch.zeros(2, device="meta")]}],
            "param 0 device must be one of",
        ),
    ],
)
def test_bad_param_groups_raise(groups, message):
    with pytest.raises(ValueError, match=message):
        OffloadOptimizer(groups)


def test_bad_gradients_and_state_dicts_raise():
    params = _params()
    optimizer = OffloadOptimizer(params)
    params[0].grad = torch.zeros(4, 4).to_sparse()
    with pytest.raises(ValueError, match="gradient of param 0 must be dense"):
        optimizer.step()
    params[0].grad = torch.zeros(4, 4)
    optimizer.step()
    saved = optimizer.state_dict()
    with pytest.raises(ValueError, match="param_groups must have 1 groups"):
        optimizer.load_state_dict({"state": {}, "param_groups": saved["param_groups"] * 2})
    bad = copy.deepcopy(saved)
    bad["state"][0]["exp_avg"] = torch.zeros(16)
    with pytest.raises(ValueError, match=r"exp_avg must have the param's shape \(4, 4\)"):
        optimizer.load_state_dict(bad)
    bad = copy.deepcopy(saved)
    bad["state"][0]["max_exp_avg_sq"] = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="keys must be"):
        optimizer.load_state_dict(bad)


def test_groupwise_apply_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_groups must be an integer >= 1"):
        GroupwiseApply(torch.optim.SGD(_params(), lr=0.1), 0)
    with pytest.raises(ValueError, match="optimizer must be a torch.optim.Optimizer"):
        GroupwiseApply("adam", 2)
    with pytest.raises(ValueError, match="optimizer must be a per-parameter torch optimizer"):
        GroupwiseApply(OffloadOptimizer(_params()), 2)


# ------------------------------------------------------------------------------------------------
# CUDA (skipped on CPU-only machines)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_model_matches_the_cpu_model():
    """Streams, events and pinned staging: a CUDA bf16 model ends where the same model on the CPU
    does (same gradients each step, from the CPU model), bit for bit."""
    cpu_model = make_model(torch.bfloat16)
    cuda_model = copy.deepcopy(cpu_model).cuda()
    cpu_opt = OffloadOptimizer(param_groups(cpu_model), lr=1e-2, weight_decay=0.1)
    cuda_opt = OffloadOptimizer(param_groups(cuda_model), lr=1e-2, weight_decay=0.1, num_apply_groups=5)
    for tokens in token_batches(5):
        backward(cpu_model, tokens)
        for param, cuda_param in zip(cpu_model.parameters(), cuda_model.parameters(), strict=True):
            cuda_param.grad = param.grad.cuda()
        cpu_opt.step()
        cuda_opt.step()
        for param, cuda_param in zip(cpu_model.parameters(), cuda_model.parameters(), strict=True):
            assert torch.equal(param, cuda_param.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_staging_of_large_groups_with_different_layouts_matches_the_cpu():
    """Copies that take milliseconds, in apply groups whose slot layouts differ (1-D parameters,
    then matrices): group i + 2's gradients must not reach the slot before group i's staged
    weights have left it (the order itself is checked on the CPU: test_offload_transfers.py)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(4096,)] * 64 + [(2048, 4096)] * 8  # 67M parameters, about 17M per apply group
    cpu_params = [torch.nn.Parameter(torch.randn(s, generator=generator).bfloat16()) for s in shapes]
    cuda_params = [torch.nn.Parameter(p.detach().cuda()) for p in cpu_params]
    cpu_opt = OffloadOptimizer(cpu_params, lr=1e-2, weight_decay=0.1)
    cuda_opt = OffloadOptimizer(cuda_params, lr=1e-2, weight_decay=0.1, num_apply_groups=4)
    for _ in range(3):
        for param, cuda_param in zip(cpu_params, cuda_params, strict=True):
            param.grad = torch.randn(param.shape, generator=generator).bfloat16()
            cuda_param.grad = param.grad.cuda()
        cpu_opt.step()
        cuda_opt.step()
    for param, cuda_param in zip(cpu_params, cuda_params, strict=True):
        assert torch.equal(param, cuda_param.cpu())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_delayed_update_reads_its_gradients_before_an_in_place_zero_grad():
    """The gradient snapshot of ``overlap="delayed"`` copies the gradients on a side stream while
    ``step()`` returns; ``zero_grad(set_to_none=False)`` right after must not zero them first. The
    copies are large (256 MiB) so that, unordered, the zeroing would overtake them."""
    generator = torch.Generator().manual_seed(0)
    cpu_params = [torch.nn.Parameter(torch.randn(8192, 8192, generator=generator)) for _ in range(1)]
    cuda_params = [torch.nn.Parameter(p.detach().cuda()) for p in cpu_params]
    options = {"lr": 1e-2, "overlap": "delayed", "overlap_after_steps": 0}
    cpu_opt, cuda_opt = OffloadOptimizer(cpu_params, **options), OffloadOptimizer(cuda_params, **options)
    for _ in range(3):
        for param, cuda_param in zip(cpu_params, cuda_params, strict=True):
            param.grad = torch.randn(param.shape, generator=generator)
            cuda_param.grad = param.grad.cuda()
        cpu_opt.step()
        cuda_opt.step()
        cpu_opt.zero_grad(set_to_none=False)
        cuda_opt.zero_grad(set_to_none=False)
    cpu_opt.apply_pending()
    cuda_opt.apply_pending()
    for param, cuda_param in zip(cpu_params, cuda_params, strict=True):
        assert torch.equal(param, cuda_param.cpu())
