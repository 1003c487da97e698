"""The fused C++ CPU Adam/AdamW step against torch.optim.Adam/AdamW (foreach=False).

Every SIMD path the CPU has (avx512, avx2, scalar; the ``simd_level`` fixture of conftest.py caps
the kernels with ``ops.set_max_simd_level``) is checked against torch and against the others: the
paths are bit-identical by construction.
The reference for a bf16/fp16 gradient is torch fed ``grad.float() * (1 / grad_scale)``.
"""

import copy
import functools

import pytest
import torch

from moetrain._ext import ops
from moetrain.offload.cpu_adam import CPUAdam, adam_step_, adam_step_multi_

SIMD_LEVELS = ["avx512", "avx2", "scalar"]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
BETAS = (0.9, 0.999)
EPS = 1e-8
# Ours and torch differ by about an ulp of the weight per step (torch's CPU sqrt is not correctly
# rounded, ours is); the moments of AdamW match bit for bit. After 50 steps the largest
# difference seen is a fifth of these tolerances.
PARAM_TOL = {"rtol": 2e-5, "atol": 2e-6}
MOMENT_TOL = {"rtol": 1e-5, "atol": 1e-7}


def make_grads(numel: int, num_steps: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> list:
    """Gradients spanning four decades of magnitude, already multiplied by the loss scale."""
    generator = torch.Generator().manual_seed(seed)
    magnitude_N = 10.0 ** torch.empty(numel).uniform_(-3, 1, generator=generator)
    return [
        (torch.randn(numel, generator=generator) * magnitude_N * scale).to(dtype) for _ in range(num_steps)
    ]


def torch_reference(param0_N, grads, *, adamw, lr, weight_decay, grad_scale=1.0):
    """Runs torch.optim.AdamW / Adam (foreach=False) on ``grad.float() * (1 / grad_scale)``."""
    param_N = param0_N.clone().requires_grad_(True)
    optimizer_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    optimizer = optimizer_cls(
        [param_N], lr=lr, betas=BETAS, eps=EPS, weight_decay=weight_decay, foreach=False
    )
    for grad_N in grads:
        param_N.grad = grad_N.float() * (1.0 / grad_scale)
        optimizer.step()
    state = optimizer.state[param_N]
    return param_N.detach(), state["exp_avg"], state["exp_avg_sq"]


def run_ours(param0_N, grads, *, adamw, lr, weight_decay, grad_scale=1.0, copy_dtype=None):
    param_N = param0_N.clone()
    exp_avg_N = torch.zeros_like(param_N)
    exp_avg_sq_N = torch.zeros_like(param_N)
    copy_N = None if copy_dtype is None else torch.empty(param_N.shape, dtype=copy_dtype)
    for step, grad_N in enumerate(grads, start=1):
        adam_step_(
            param_N,
            grad_N,
            exp_avg_N,
            exp_avg_sq_N,
            step=step,
            lr=lr,
            beta1=BETAS[0],
            beta2=BETAS[1],
            eps=EPS,
            weight_decay=weight_decay,
            adamw=adamw,
            grad_scale=grad_scale,
            param_copy_out=copy_N,
        )
    return param_N, exp_avg_N, exp_avg_sq_N, copy_N


def assert_matches_torch(ours, reference):
    param_N, exp_avg_N, exp_avg_sq_N = ours[:3]
    ref_param_N, ref_exp_avg_N, ref_exp_avg_sq_N = reference
    torch.testing.assert_close(exp_avg_N, ref_exp_avg_N, **MOMENT_TOL)
    torch.testing.assert_close(exp_avg_sq_N, ref_exp_avg_sq_N, **MOMENT_TOL)
    torch.testing.assert_close(param_N, ref_param_N, **PARAM_TOL)


MODES = [
    pytest.param(True, 0.1, id="adamw-wd"),
    pytest.param(False, 0.1, id="adam-l2"),
    pytest.param(True, 0.0, id="no-wd"),
]


@pytest.mark.parametrize("numel", [1, 7, 15, 16, 17, 33, 1000])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize(("adamw", "weight_decay"), MODES)
def test_matches_torch_50_steps(simd_level, numel, grad_dtype, adamw, weight_decay):
    param0_N = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    grads = make_grads(numel, 50, grad_dtype, seed=numel + 1)
    ours = run_ours(param0_N, grads, adamw=adamw, lr=1e-2, weight_decay=weight_decay)
    reference = torch_reference(param0_N, grads, adamw=adamw, lr=1e-2, weight_decay=weight_decay)
    assert_matches_torch(ours, reference)


LARGE_NUMEL = 1_000_003  # many OpenMP chunks plus a vector tail
LARGE_GRAD_SCALE = 1024.0


@functools.cache
def large_case(grad_dtype: torch.dtype):
    """(param0, grads, torch reference) of 50 AdamW steps on LARGE_NUMEL elements with a loss scale;
    computed once per gradient dtype and shared by the SIMD levels."""
    param0_N = torch.randn(LARGE_NUMEL, generator=torch.Generator().manual_seed(0))
    pool = make_grads(LARGE_NUMEL, 4, grad_dtype, seed=1, scale=LARGE_GRAD_SCALE)
    grads = [pool[step % 4] for step in range(50)]
    # torch on one thread: about as fast here, and not 20x slower when another process keeps the
    # second core busy (a 2-thread OpenMP region then waits for it at every op).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        reference = torch_reference(
            param0_N, grads, adamw=True, lr=1e-3, weight_decay=0.01, grad_scale=LARGE_GRAD_SCALE
        )
    finally:
        torch.set_num_threads(threads)
    return param0_N, grads, reference


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
def test_matches_torch_large_with_grad_scale_and_copy(simd_level, grad_dtype):
    param0_N, grads, reference = large_case(grad_dtype)
    ours = run_ours(
        param0_N,
        grads,
        adamw=True,
        lr=1e-3,
        weight_decay=0.01,
        grad_scale=LARGE_GRAD_SCALE,
        copy_dtype=torch.bfloat16,
    )
    assert_matches_torch(ours, reference)
    assert torch.equal(ours[3], ours[0].to(torch.bfloat16))


@pytest.mark.parametrize("grad_scale", [3.0, 0.25])
def test_grad_scale_not_power_of_two(grad_scale):
    param0_N = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    grads = make_grads(1001, 20, torch.float32, seed=3, scale=grad_scale)
    ours = run_ours(param0_N, grads, adamw=False, lr=1e-2, weight_decay=0.1, grad_scale=grad_scale)
    reference = torch_reference(
        param0_N, grads, adamw=False, lr=1e-2, weight_decay=0.1, grad_scale=grad_scale
    )
    assert_matches_torch(ours, reference)


@pytest.mark.parametrize("copy_dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("numel", [1, 17, 1000])
def test_copy_out_equals_cast_of_master(simd_level, copy_dtype, numel):
    param0_N = torch.randn(numel, generator=torch.Generator().manual_seed(4))
    grads = make_grads(numel, 5, torch.bfloat16, seed=5)
    param_N, _, _, copy_N = run_ours(
        param0_N, grads, adamw=True, lr=1e-2, weight_decay=0.1, copy_dtype=copy_dtype
    )
    assert copy_N.dtype == copy_dtype
    assert torch.equal(copy_N, param_N.to(copy_dtype))


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16], ids=DTYPE_IDS.get)
def test_copy_out_rounding_of_arbitrary_bit_patterns(simd_level, copy_dtype):
    """With lr=0 the weight is unchanged: the copy must be torch's cast (round to nearest even, ties,
    overflow to inf, subnormals, NaN) of every fp32 bit pattern we throw at it."""
    generator = torch.Generator().manual_seed(6)
    bits_N = torch.randint(-(2**31), 2**31 - 1, (4099,), generator=generator, dtype=torch.int64)
    ties_N = (torch.randint(0, 2**15, (64,), generator=generator) << 16) | 0x8000  # exact bf16 ties
    special_N = torch.tensor(
        [0.0, -0.0, 1.0, 65504.0, 65520.0, 1e-8, 3e38, float("inf"), float("-inf"), float("nan")]
    )
    param_N = torch.cat(
        [bits_N.to(torch.int32).view(torch.float32), ties_N.to(torch.int32).view(torch.float32), special_N]
    )
    grad_N = torch.zeros_like(param_N)
    copy_N = torch.empty(param_N.shape, dtype=copy_dtype)
    expected_N = param_N.to(copy_dtype)
    adam_step_(
        param_N,
        grad_N,
        torch.zeros_like(param_N),
        torch.zeros_like(param_N),
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        adamw=True,
        param_copy_out=copy_N,
    )
    nan_N = expected_N.isnan()
    assert torch.equal(copy_N.isnan(), nan_N)
    assert torch.equal(copy_N[~nan_N].view(torch.int16), expected_N[~nan_N].view(torch.int16))


@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
@pytest.mark.parametrize("copy_dtype", [None, *GRAD_DTYPES], ids=lambda dtype: DTYPE_IDS.get(dtype, "none"))
def test_simd_paths_are_bit_identical(grad_dtype, copy_dtype):
    numel = 3 * 16384 + 37  # several chunks, a vector body and a tail
    param0_N = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    grads = make_grads(numel, 3, grad_dtype, seed=8, scale=3.0)
    results = {}
    try:
        for level in SIMD_LEVELS:
            ops.set_max_simd_level(level)
            if ops.cpu_adam_simd_path() != level:
                continue
            for adamw in (True, False):
                results[level, adamw] = run_ours(
                    param0_N,
                    grads,
                    adamw=adamw,
                    lr=1e-2,
                    weight_decay=0.1,
                    grad_scale=3.0,
                    copy_dtype=copy_dtype,
                )
    finally:
        ops.set_max_simd_level("avx512")
    for (level, adamw), tensors in results.items():
        for name, tensor, scalar_tensor in zip(
            ("param", "exp_avg", "exp_avg_sq", "copy"), tensors, results["scalar", adamw], strict=True
        ):
            if tensor is not None:
                assert torch.equal(tensor, scalar_tensor), (
                    f"{level} differs from scalar in {name} (adamw={adamw})"
                )


def test_result_does_not_depend_on_thread_count():
    numel = 5 * 16384 + 3
    param0_N = torch.randn(numel, generator=torch.Generator().manual_seed(9))
    grads = make_grads(numel, 3, torch.bfloat16, seed=10)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2):  # explicit: the suite's first pass runs with OMP_NUM_THREADS=1
            torch.set_num_threads(count)
            results.append(run_ours(param0_N, grads, adamw=True, lr=1e-2, weight_decay=0.1))
    finally:
        torch.set_num_threads(threads)
    one_thread, two_threads = results
    for a, b in zip(one_thread[:3], two_threads[:3], strict=True):
        assert torch.equal(a, b)


def test_multi_tensor_matches_single_tensor_calls():
    generator = torch.Generator().manual_seed(11)
    shapes = [(1,), (7,), (16384 + 5,), (3, 5), (40000,)]
    grad_dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16, torch.float32]
    steps = [1, 2, 5, 3, 1]
    copy_dtypes = [None, torch.bfloat16, torch.float16, None, torch.float32]
    params = [torch.randn(shape, generator=generator) for shape in shapes]
    grads = [
        torch.randn(shape, generator=generator).to(dtype)
        for shape, dtype in zip(shapes, grad_dtypes, strict=True)
    ]
    exp_avgs = [torch.rand(shape, generator=generator) for shape in shapes]
    exp_avg_sqs = [torch.rand(shape, generator=generator) for shape in shapes]
    copies = [
        None if dtype is None else torch.empty(shape, dtype=dtype)
        for shape, dtype in zip(shapes, copy_dtypes, strict=True)
    ]
    hyper = {
        "lr": 1e-2,
        "beta1": 0.9,
        "beta2": 0.99,
        "eps": 1e-6,
        "weight_decay": 0.05,
        "adamw": False,
        "grad_scale": 2.0,
    }

    singles = [[t.clone() for t in tensors] for tensors in (params, exp_avgs, exp_avg_sqs)]
    single_copies = [None if c is None else c.clone() for c in copies]
    for i in range(len(shapes)):
        adam_step_(
            singles[0][i],
            grads[i],
            singles[1][i],
            singles[2][i],
            step=steps[i],
            param_copy_out=single_copies[i],
            **hyper,
        )
    adam_step_multi_(params, grads, exp_avgs, exp_avg_sqs, steps=steps, param_copies_out=copies, **hyper)
    for i in range(len(shapes)):
        assert torch.equal(params[i], singles[0][i])
        assert torch.equal(exp_avgs[i], singles[1][i])
        assert torch.equal(exp_avg_sqs[i], singles[2][i])
        if copies[i] is not None:
            assert torch.equal(copies[i], single_copies[i])
    adam_step_multi_([], [], [], [], steps=[], **hyper)  # nothing to do is fine


def test_step_bumps_version_so_autograd_sees_the_in_place_update():
    param = torch.nn.Parameter(torch.randn(8))
    loss = (param * param).sum()  # saves param for backward
    version = param._version
    adam_step_(param.detach(), torch.ones(8), torch.zeros(8), torch.zeros(8), **_step_kwargs())
    assert param._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_memory_probe_touches_the_same_buffers():
    """The benchmark's roofline kernel: p += g, m += g, v += g, copy = p."""
    grad_N = torch.randn(16384 + 9).to(torch.bfloat16)
    param_N, exp_avg_N, exp_avg_sq_N = (torch.randn(grad_N.numel()) for _ in range(3))
    expected = [t + grad_N.float() for t in (param_N, exp_avg_N, exp_avg_sq_N)]
    copy_N = torch.empty(grad_N.numel(), dtype=torch.bfloat16)
    ops.adam_memory_probe_(param_N, grad_N, exp_avg_N, exp_avg_sq_N, copy_N)
    for tensor, expected_tensor in zip((param_N, exp_avg_N, exp_avg_sq_N), expected, strict=True):
        assert torch.equal(tensor, expected_tensor)
    assert torch.equal(copy_N, param_N.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------------
# CPUAdam


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
def test_cpu_adam_matches_torch_optimizer(adamw_mode, grad_dtype):
    generator = torch.Generator().manual_seed(12)
    shapes = [(3, 5), (17,), (1,), (64, 33)]
    ours = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    refs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p in ours:
        p.grad_dtype = None  # lets p.grad hold a bf16 / fp16 gradient

    def groups(params):
        return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]

    optimizer = CPUAdam(groups(ours), lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    reference = ref_cls(groups(refs), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(50):
        for i, (p, ref) in enumerate(zip(ours, refs, strict=True)):
            if step % 7 == 3 and i == 1:  # a param without a gradient this step keeps its step count
                p.grad, ref.grad = None, None
                continue
            grad = torch.randn(p.shape, generator=generator).to(grad_dtype)
            p.grad = grad
            ref.grad = grad.float()
        optimizer.step()
        reference.step()
    for p, ref in zip(ours, refs, strict=True):
        torch.testing.assert_close(p.detach(), ref.detach(), **PARAM_TOL)
        ours_state, ref_state = optimizer.state[p], reference.state[ref]
        assert set(ours_state) == {"step", "exp_avg", "exp_avg_sq"}
        assert torch.equal(ours_state["step"], ref_state["step"])
        torch.testing.assert_close(ours_state["exp_avg"], ref_state["exp_avg"], **MOMENT_TOL)
        torch.testing.assert_close(ours_state["exp_avg_sq"], ref_state["exp_avg_sq"], **MOMENT_TOL)


def test_cpu_adam_grad_scale_and_closure():
    param = torch.nn.Parameter(torch.randn(100))
    ref = torch.nn.Parameter(param.detach().clone())
    optimizer = CPUAdam([param], lr=1e-2)
    reference = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.0, foreach=False)
    grad = torch.randn(100)
    param.grad = grad * 512.0
    ref.grad = grad.clone()
    assert optimizer.step(lambda: 1.5, grad_scale=512.0) == 1.5
    reference.step()
    torch.testing.assert_close(param.detach(), ref.detach(), **PARAM_TOL)


def test_cpu_adam_state_dict_round_trips_with_torch_adamw():
    generator = torch.Generator().manual_seed(13)
    param = torch.nn.Parameter(torch.randn(50, generator=generator))
    optimizer = CPUAdam([param], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        param.grad = torch.randn(50, generator=generator)
        optimizer.step()
    state_dict = copy.deepcopy(optimizer.state_dict())  # load_state_dict would share the tensors
    assert state_dict["param_groups"][0]["decoupled_weight_decay"] is True

    # ours -> torch.optim.AdamW: continuing both gives the same weights.
    ref = torch.nn.Parameter(param.detach().clone())
    reference = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    reference.load_state_dict(state_dict)
    # torch.optim.AdamW -> ours (a fresh CPUAdam in Adam mode takes the mode from the state dict).
    restored_param = torch.nn.Parameter(param.detach().clone())
    restored = CPUAdam([restored_param], lr=0.5, adamw_mode=False)
    restored.load_state_dict(copy.deepcopy(reference.state_dict()))
    assert restored.param_groups[0]["decoupled_weight_decay"] is True
    assert restored.param_groups[0]["lr"] == 1e-2
    for _ in range(3):
        grad = torch.randn(50, generator=generator)
        param.grad, ref.grad, restored_param.grad = grad, grad.clone(), grad.clone()
        optimizer.step()
        reference.step()
        restored.step()
    torch.testing.assert_close(param.detach(), ref.detach(), **PARAM_TOL)
    assert torch.equal(param, restored_param)
    assert torch.equal(optimizer.state[param]["step"], torch.tensor(6.0))


# ------------------------------------------------------------------------------------------------
# Bad inputs


def _step_kwargs(**overrides):
    kwargs = {
        "step": 1,
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "adamw": True,
    }
    kwargs.update(overrides)
    return kwargs


def _buffers(numel=8):
    return torch.zeros(numel), torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)


@pytest.mark.parametrize(
    ("position", "bad", "message"),
    [
        (0, torch.zeros(8, dtype=torch.float64), "param .*float32"),
        (0, torch.zeros(8, dtype=torch.bfloat16), "param .*float32"),
        (1, torch.zeros(8, dtype=torch.int32), "grad must be float32, bfloat16 or float16"),
        (1, torch.zeros(9), "grad has 9 elements but param has 8"),
        (2, torch.zeros(7), "exp_avg has 7 elements"),
        (3, torch.zeros(8, dtype=torch.float16), "exp_avg_sq must be float32"),
        (0, torch.zeros(16)[::2], "param must be contiguous"),
        (1, torch.zeros(4, 2).t(), "grad must be contiguous"),
        (2, torch.zeros(8, device="meta"), "exp_avg must be a CPU tensor"),
    ],
)
def test_bad_tensors_raise_naming_the_argument(position, bad, message):
    tensors = list(_buffers())[:4]
    tensors[position] = bad
    with pytest.raises(RuntimeError, match=message):
        adam_step_(*tensors, **_step_kwargs())


def test_bad_copy_out_and_aliasing_raise():
    param, grad, exp_avg, exp_avg_sq = _buffers()
    with pytest.raises(RuntimeError, match="param_copy_out has 4 elements"):
        adam_step_(param, grad, exp_avg, exp_avg_sq, param_copy_out=torch.zeros(4), **_step_kwargs())
    with pytest.raises(RuntimeError, match="param_copy_out must be float32, bfloat16 or float16"):
        adam_step_(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            param_copy_out=torch.zeros(8, dtype=torch.int8),
            **_step_kwargs(),
        )
    with pytest.raises(RuntimeError, match="distinct"):
        adam_step_(param, grad, exp_avg, exp_avg, **_step_kwargs())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"step": 0}, "step must be >= 1"),
        ({"lr": -1.0}, "lr must be"),
        ({"beta1": 1.0}, "beta1 must be in"),
        ({"beta2": -0.1}, "beta2 must be in"),
        ({"eps": float("nan")}, "eps must be"),
        ({"weight_decay": -0.1}, "weight_decay must be"),
        ({"grad_scale": 0.0}, "grad_scale must be"),
        ({"grad_scale": float("inf")}, "grad_scale must be"),
    ],
)
def test_bad_hyperparameters_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        adam_step_(*_buffers(), **_step_kwargs(**overrides))


def test_multi_tensor_bad_inputs_name_the_index():
    param, grad, exp_avg, exp_avg_sq = _buffers()
    kwargs = _step_kwargs()
    del kwargs["step"]
    with pytest.raises(ValueError, match="same length"):
        adam_step_multi_([param], [grad, grad], [exp_avg], [exp_avg_sq], steps=[1], **kwargs)
    with pytest.raises(ValueError, match="param_copies_out"):
        adam_step_multi_([param], [grad], [exp_avg], [exp_avg_sq], steps=[1], param_copies_out=[], **kwargs)
    with pytest.raises(RuntimeError, match=r"grads\[1\] has 3 elements"):
        adam_step_multi_(
            [param, param.clone()],
            [grad, torch.zeros(3)],
            [exp_avg, exp_avg.clone()],
            [exp_avg_sq, exp_avg_sq.clone()],
            steps=[1, 1],
            **kwargs,
        )
    with pytest.raises(ValueError, match=r"steps\[0\] must be >= 1"):
        adam_step_multi_([param], [grad], [exp_avg], [exp_avg_sq], steps=[0], **kwargs)


def test_cpu_adam_rejects_bad_params_and_hyperparameters():
    with pytest.raises(ValueError, match="param 0 of param group 0 must be a contiguous float32 CPU tensor"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4, 4).t())])
    with pytest.raises(ValueError, match="lr"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4))], lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4))], betas=(0.9, 1.0))
    optimizer = CPUAdam([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="param 0 of param group 1"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]})


@pytest.mark.parametrize(
    "group",
    [{"params": [torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]}, {"params": [], "eps": -1.0}],
)
def test_a_refused_param_group_is_not_kept_and_the_next_step_runs(group):
    kept = torch.nn.Parameter(torch.ones(4))
    optimizer = CPUAdam([kept], lr=0.1)
    if not group["params"]:
        group["params"] = [torch.nn.Parameter(torch.zeros(4))]
    with pytest.raises(ValueError):
        optimizer.add_param_group(group)
    assert len(optimizer.param_groups) == 1
    kept.grad = torch.ones(4)
    optimizer.step()
    assert torch.all(kept < 1)
