"""Each wrapper of moetrain/_torch_compat.py against the behaviour moetrain relies on. A torch
release that renames or changes one of these private APIs fails here, by name."""

from __future__ import annotations

import torch

from moetrain import _torch_compat


def test_current_graph_task_id_is_minus_one_outside_backward_and_one_id_inside():
    assert _torch_compat.current_graph_task_id() == -1
    assert not _torch_compat.in_backward_pass()
    seen = []

    def note(grad):
        seen.append((_torch_compat.current_graph_task_id(), _torch_compat.in_backward_pass()))

    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(note)
    x.register_hook(note)
    y.sum().backward()
    (first, inside_first), (second, inside_second) = seen
    assert first != -1 and first == second and inside_first and inside_second
    z = x * 3
    z.register_hook(note)
    z.sum().backward()
    assert seen[-1][0] not in (-1, first)  # a new backward pass, a new id
    assert _torch_compat.current_graph_task_id() == -1


def test_storage_use_count_counts_the_owners_of_a_storage():
    buffer = torch.empty(16)
    alone = _torch_compat.storage_use_count(buffer.untyped_storage())
    view = buffer[4:]
    assert _torch_compat.storage_use_count(buffer.untyped_storage()) == alone + 1
    del view
    assert _torch_compat.storage_use_count(buffer.untyped_storage()) == alone
    assert alone == 2  # the tensor's storage and the temporary storage object passed in


def test_grouped_mm_equals_a_loop_of_matmuls():
    assert _torch_compat.grouped_mm_available()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 8, generator=g)
    w = torch.randn(3, 8, 4, generator=g)
    counts = [3, 0, 7]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = _torch_compat.grouped_mm(x, w, offsets)  # torch's CPU kernel: forward only, fp32
    want = torch.cat([x[0:3] @ w[0], x[3:3] @ w[1], x[3:10] @ w[2]])
    torch.testing.assert_close(got, want)


def test_assume_constant_result_marks_what_torch_compiler_marks():
    def ours():
        return 1

    def theirs():
        return 1

    torch.compiler.assume_constant_result(theirs)
    assert (
        vars(_torch_compat.assume_constant_result(ours)) == vars(theirs) == {"_dynamo_marked_constant": True}
    )
    calls = []

    @_torch_compat.assume_constant_result
    def flag():
        calls.append(1)
        return 2.0

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * flag(), fullgraph=True, backend="eager")
    assert float(compiled(torch.ones(()))) == 2.0 and len(calls) == 1  # called while tracing
    assert float(compiled(torch.ones(()))) == 2.0 and len(calls) == 1  # baked into the graph
    torch._dynamo.reset()


def test_tree_map_and_tree_flatten_walk_nested_containers_in_order():
    tree = {"a": (1, [2, 3]), "b": {"c": 4}}
    assert _torch_compat.tree_flatten(tree) == [1, 2, 3, 4]
    assert _torch_compat.tree_map(lambda v: v * 10, tree) == {"a": (10, [20, 30]), "b": {"c": 40}}


def test_torch_dispatch_mode_sees_every_aten_operator():
    assert _torch_compat.TorchDispatchMode is not _torch_compat._MissingDispatchMode
    seen = []

    class Record(_torch_compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = torch.ones(3)
    with Record():
        y = (x + 1).mul(2)
    assert torch.equal(y, torch.full((3,), 4.0)) and seen == ["aten.add", "aten.mul"]


def test_ddp_ignore_parameters_makes_ddp_leave_them_alone():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    _torch_compat.ddp_ignore_parameters(model, ["1.weight"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        assert ddp.parameters_to_ignore == {"1.weight"}
        model(torch.ones(1, 2)).sum().backward()  # the ignored weight still gets its local gradient
        assert model[1].weight.grad is not None
    finally:
        dist.destroy_process_group()
