"""CUDA graphs by default (cuda_graphs="auto") and what outlives a step under them (passes/graph_pool.py): the
trainable parameters' gradients and the loss are copied out of the graphs' memory pool, so gradient accumulation
and a kept loss read what they would read without CUDA graphs."""

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._dynamo.utils import counters
from torch._inductor import ir
from torch._inductor.cudagraph_trees import get_manager
from torch._inductor.utils import run_and_get_code

import graphopt
from graphopt import pipeline
from graphopt.lowering import cuda
from graphopt.lowering.registry import lowering_for
from graphopt.options import Options, cuda_graphs_decision
from graphopt.passes import graph_pool, recompute
from graphs import relative_error
from models import tiny_lora_model


@pytest.mark.parametrize("target, dynamic, offload, training, on", [
    ("cuda", False, False, True, True),
    ("cuda", True, False, True, False),
    ("cuda", False, True, True, True),
    ("cuda", False, False, False, False),
    ("cpu", False, False, True, False),
    ("hip", False, False, True, False),
    ("mps", False, False, True, False),
])
def test_auto_turns_cuda_graphs_on_for_static_training_graphs_on_nvidia(target, dynamic, offload, training, on):
    lowering = lowering_for(target)  # the target's lowering says whether CUDA graphs were measured faster there
    got, why = cuda_graphs_decision(Options(offload=offload), lowering, dynamic, training)
    assert got is on and why.startswith('cuda_graphs="auto"')


@pytest.mark.parametrize("value", [True, False])
def test_an_explicit_choice_is_kept(value):
    assert cuda_graphs_decision(Options(cuda_graphs=value, offload=True), lowering_for("cpu"), True, False) == \
        (value, f"cuda_graphs={value}")


def test_offload_keeps_cuda_graphs_off_a_training_graph_of_dynamic_shapes():
    """Each size's recorded graph keeps the host buffers it captured: sizes recorded later could find none."""
    cuda = lowering_for("cuda")
    assert cuda_graphs_decision(Options(cuda_graphs=True, offload=True), cuda, False, True)[0] is True
    on, why = cuda_graphs_decision(Options(cuda_graphs=True, offload=True), cuda, True, True)
    assert on is False and "offload kept" in why
    assert cuda_graphs_decision(Options(cuda_graphs=True), cuda, True, True)[0] is True


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_the_decision_sees_dynamic_shapes_and_whether_the_graph_trains(dynamic, training, fresh_dynamo, monkeypatch):
    seen = []

    def decide(options, lowering, is_dynamic, is_training):
        seen.append((is_dynamic, is_training))
        return cuda_graphs_decision(options, lowering, is_dynamic, is_training)

    monkeypatch.setattr(pipeline, "cuda_graphs_decision", decide)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    with torch.set_grad_enabled(training):
        torch.compile(model, backend="graphopt", dynamic=dynamic)(torch.randn(3, 8))
    assert seen == [(dynamic, training)]


def accumulated(forward, model, micro_batches, steps=2):
    """Per step: zero the gradients, forward and backward every micro-batch (gradients add up in .grad), keep the
    loss tensors; return the last step's gradients and every loss, read after all steps ran."""
    losses = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        for ids in micro_batches:
            loss = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return [loss.item() for loss in losses], grads


def test_gradients_and_loss_are_routed_through_the_copy(fresh_dynamo, monkeypatch):
    """cuda_graphs=True on the CPU (past the check that refuses it there): Inductor records no CUDA graph, but the
    copies are inserted as on a GPU: the loss in the forward, every trainable parameter's gradient in the
    backward, and nothing else, the gradients in groups, each copied right after its last one is computed; and
    gradient accumulation over two micro-batches equals eager's."""
    monkeypatch.setattr(pipeline, "check_cuda_graphs", lambda options, target: None)
    routed, backwards = [], []
    copy = recompute.copy_out_of_graph_pool

    def spy(forward, backward, *args):
        routed.append(copy(forward, backward, *args))
        backwards.append(backward)
        return routed[-1]

    monkeypatch.setattr(recompute, "copy_out_of_graph_pool", spy)
    model = tiny_lora_model("llama")
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    expected_losses, expected = accumulated(model, model, batches)
    compiled = torch.compile(model, backend="graphopt", options={"cuda_graphs": True})
    (losses, grads), (_, backward_code) = run_and_get_code(accumulated, compiled, model, batches)

    trainable = sum(p.requires_grad for p in model.parameters())
    assert routed == [1 + trainable]
    copy = torch.ops.graphopt.copy_out_of_graph_pool.default
    copies = backwards[0].graph.find_nodes(op="call_function", target=copy)
    assert 1 < len(copies) <= graph_pool.GRADIENT_GROUPS + 1
    assert sum(len(c.args[0]) for c in copies) == trainable
    assert all(c.prev in c.args[0] for c in copies)
    # and Inductor's code keeps them there: computation between every two copies (on a GPU its reordering for
    # fewer graph partitions would move them to the end; graphopt turns it off, which only a GPU run shows)
    lines = backward_code.splitlines()
    calls = [i for i, line in enumerate(lines) if f"= torch.ops.{copy}(" in line]
    assert len(calls) == len(copies)
    kernel = re.compile(r"cpp_fused|extern_kernels|torch\.ops\.graphopt(_cpu)?\.(?!copy_out_of_graph_pool)")
    assert all(any(kernel.search(line) for line in lines[a:b]) for a, b in zip(calls, calls[1:]))
    assert graphopt.last_report().cuda_graphs == {"on": True, "why": "cuda_graphs=True"}
    assert all(relative_error(torch.tensor(a), torch.tensor(b)) <= 1e-5 for a, b in zip(losses, expected_losses))
    assert all(relative_error(grads[n], expected[n]) <= 1e-5 for n in expected)


def test_with_offload_no_prefetch_crosses_a_copy_of_gradients(fresh_dynamo, monkeypatch, force_offload_copies):
    """The lean mode under CUDA graphs (on the CPU, its copies to host memory forced as on a GPU): each copy of
    gradients ends a captured partition, and no reload starts a copy that a reload past such an end waits for
    (an allocation of one partition held outside its outputs, which CUDA graph trees refuse); those reloads load
    their tensor themselves, the report counts them, and the step equals eager's."""
    monkeypatch.setattr(pipeline, "check_cuda_graphs", lambda options, target: None)
    force_offload_copies()
    backwards = []
    copy = recompute.copy_out_of_graph_pool

    def spy(forward, backward, *args):
        backwards.append(backward)
        return copy(forward, backward, *args)

    monkeypatch.setattr(recompute, "copy_out_of_graph_pool", spy)
    model = tiny_lora_model("llama", num_hidden_layers=6)
    batches = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    expected_losses, expected = accumulated(model, model, batches)
    compiled = torch.compile(model, backend="graphopt", options={**LEAN, "cuda_graphs": True})
    losses, grads = accumulated(compiled, model, batches)

    partition, reloaded_in, prefetched_in = 0, {}, {}
    for node in backwards[0].graph.nodes:
        if node.target is torch.ops.graphopt.copy_out_of_graph_pool.default:
            partition += 1
        elif node.target is torch.ops.graphopt.reload.default:
            reloaded_in[node.args[0]] = partition
            prefetched_in.update((token, partition) for token in node.args[4])
    assert partition > 1 and len(reloaded_in) > partition
    assert prefetched_in and all(reloaded_in[token] == at for token, at in prefetched_in.items())
    offload = graphopt.last_report().saved_for_backward["offload"]
    assert 0 < offload["prefetches_dropped"] < offload["tensors"]
    assert "reloads load their tensor unprefetched" in graphopt.last_report().to_text()
    assert all(relative_error(torch.tensor(a), torch.tensor(b)) <= 1e-5 for a, b in zip(losses, expected_losses))
    assert all(relative_error(grads[n], expected[n]) <= 1e-5 for n in expected)


def test_without_cuda_graphs_nothing_is_copied(fresh_dynamo, monkeypatch):
    monkeypatch.setattr(recompute, "copy_out_of_graph_pool", lambda *args: pytest.fail("copied without CUDA graphs"))
    model = tiny_lora_model("llama")
    ids = torch.randint(0, 128, (2, 16))
    torch.compile(model, backend="graphopt")(input_ids=ids, labels=ids).loss.backward()
    assert graphopt.last_report().cuda_graphs["on"] is False


def test_the_copy_is_exact_and_fresh():
    xs = [torch.tensor([-0.0, float("inf"), float("nan"), 1e-45]), torch.randn(3, 4).t(),
          torch.ones((), dtype=torch.bfloat16)]
    ys = torch.ops.graphopt.copy_out_of_graph_pool(xs)
    for x, y in zip(xs, ys):
        assert y.dtype == x.dtype and y.shape == x.shape and y.data_ptr() != x.data_ptr()
        assert torch.equal(torch.signbit(x), torch.signbit(y)) and torch.equal(x.isnan(), y.isnan())
        assert torch.equal(x.nan_to_num(), y.nan_to_num())
    assert torch.Tag.cudagraph_unsafe in torch.ops.graphopt.copy_out_of_graph_pool.default.tags
    torch.library.opcheck(torch.ops.graphopt.copy_out_of_graph_pool.default, (xs[1:],))


EDGE_VALUES = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-45, 3.4e38, -2.5e-8]


@given(shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=0, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       edges=st.lists(st.sampled_from(EDGE_VALUES), min_size=1, max_size=8), transpose=st.booleans())
def test_the_copy_equals_its_reference_bit_for_bit(shapes, dtype, edges, transpose):
    """Against the reference, a clone: every value bit for bit (edge values, NaN, -0.0, denormals, in every float
    dtype), shape (empty, scalar) and layout kept, in new memory; an empty list gives an empty list."""
    generator = torch.Generator().manual_seed(len(shapes))
    xs = []
    for shape in shapes:
        x = torch.randn(shape, generator=generator, dtype=torch.float64)
        x.view(-1)[:len(edges)] = torch.tensor(edges, dtype=torch.float64)[:x.numel()]
        x = x.to(dtype)
        xs.append(x.t() if transpose and x.dim() == 2 else x)
    ys = torch.ops.graphopt.copy_out_of_graph_pool(xs)
    assert len(ys) == len(xs)
    for x, y in zip(xs, ys):
        reference = x.clone()
        assert y.dtype == x.dtype and y.shape == x.shape
        if x.numel():  # the layout, where strides mean something: dims longer than 1
            assert [stride for stride, n in zip(y.stride(), y.shape) if n > 1] == \
                [stride for stride, n in zip(reference.stride(), x.shape) if n > 1]
        assert x.numel() == 0 or y.data_ptr() != x.data_ptr()
        bits = _bits(dtype)
        assert torch.equal(y.contiguous().view(-1).view(bits), reference.contiguous().view(-1).view(bits))


def _bits(dtype):
    return {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}[dtype]


LEAN = {"memory_budget": 0, "offload": True}


class _Scheduled:
    """A scheduler node as extracted_outputs_beside_their_kernel reads one: its IR node and its buffers' names."""

    def __init__(self, name, takes_from=None):
        self.name = name
        if takes_from is None:
            self.node = None
        else:  # an output taken out of takes_from's tuple
            self.node = object.__new__(ir.MultiOutput)
            self.node.inputs = [type("Buffer", (), {"get_name": lambda _: takes_from})()]

    def get_buffer_names(self):
        return {self.name}


def test_outputs_taken_out_of_a_tuple_follow_their_kernel():
    """Inductor's peak-memory order may put an op that ends a CUDA graph partition (a gradients' copy) between a
    kernel of several outputs and the nodes that take them out of its tuple: they move up beside their kernel
    (nested tuples too), the rest keeps its order; a tuple made outside the nodes leaves the order as it was."""
    kernel, copy, first, second = (_Scheduled("kernel"), _Scheduled("copy"), _Scheduled("first", "kernel"),
                                   _Scheduled("second", "kernel"))
    inner, user = _Scheduled("inner", "second"), _Scheduled("user")
    moved = cuda.extracted_outputs_beside_their_kernel([kernel, copy, first, user, second, inner])
    assert [n.name for n in moved] == ["kernel", "first", "second", "inner", "copy", "user"]
    unmoved = [copy, _Scheduled("orphan", "elsewhere"), user]
    assert cuda.extracted_outputs_beside_their_kernel(unmoved) == unmoved


@pytest.mark.parametrize("partitions", [True, False])
def test_inductor_runs_its_peak_memory_order_through_the_move(partitions, monkeypatch, fresh_dynamo):
    """The move above patches torch's internals: Inductor's scheduler must still look its peak-memory reordering up
    when it runs it (torch 2.11 and 2.13 do). With graph partitions on, a compile reaches the move; off, it does
    not. The allocations' move (tests/test_lowering.py) is reached in a graph with graphopt's traced launches
    (its post-grad pass, with ops to trace), either way, and in no other."""
    from graphopt.lowering.direct import DirectCalls

    seen, allocations = [], []
    move, allocations_move = cuda.extracted_outputs_beside_their_kernel, cuda.allocations_beside_their_first_reader
    monkeypatch.setattr(cuda, "extracted_outputs_beside_their_kernel", lambda nodes: seen.append(nodes) or move(nodes))
    monkeypatch.setattr(cuda, "allocations_beside_their_first_reader",
                        lambda nodes: allocations.append(nodes) or allocations_move(nodes))
    traced = DirectCalls({}, dict(cuda.TRACED))
    for calls, moved in ((None, False), (traced, True)):
        seen.clear()
        allocations.clear()
        torch._dynamo.reset()
        with torch._inductor.config.patch(graph_partition=partitions, fx_graph_cache=False,
                                          post_grad_custom_post_pass=calls):
            torch.compile(lambda x: (x.sin() @ x).cos().sum(), backend="inductor")(torch.randn(8, 8))
        assert bool(seen) is partitions
        assert bool(allocations) is moved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch, options", [("llama", {}), ("llama", LEAN), ("gemma", LEAN)],
                         ids=["llama-defaults", "llama-lean", "gemma-lean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_cuda_graphs_replay_and_accumulate_gradients_right(dtype, arch, options, fresh_dynamo):
    """The default options, and the lean mode whose copies to host memory are captured too, on a GPU: CUDA graphs
    recorded and replayed (none skipped); two steps of two micro-batches each, the losses read after both steps,
    equal to the same compile without CUDA graphs (the same kernels: to rounding), and in fp32 to eager. Gemma:
    its fused loss's outputs were once cut from their op by a graph partition (docs/architecture.md)."""
    model = tiny_lora_model(arch, dtype).cuda()
    batches = [torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(s)).cuda() for s in (1, 2)]
    without = torch.compile(model, backend="graphopt", options={**options, "cuda_graphs": False})
    expected_losses, expected = accumulated(without, model, batches)
    torch._dynamo.reset()
    skips_before = counters["inductor"]["cudagraph_skips"]
    compiled = torch.compile(model, backend="graphopt", options=options)
    accumulated(compiled, model, batches)  # warm-up and recording
    losses, grads = accumulated(compiled, model, batches)  # replays
    assert graphopt.last_report().cuda_graphs["on"] is True
    assert counters["inductor"]["cudagraph_skips"] == skips_before
    assert list(get_manager(torch.cuda.current_device(), create_if_none_exists=False).get_roots())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    assert losses == pytest.approx(expected_losses, rel=tolerance)
    errors = {n: relative_error(grads[n].float(), expected[n].float()) for n in expected}
    assert max(errors.values()) <= tolerance, sorted(errors.items(), key=lambda e: -e[1])[:3]
    if dtype == torch.float32:
        eager_losses, eager = accumulated(model, model, batches)
        assert losses == pytest.approx(eager_losses, rel=1e-5)
        assert all(relative_error(grads[n], eager[n]) <= 1e-5 for n in eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_the_gpu_an_op_that_synchronizes_runs_between_the_recorded_partitions(fresh_dynamo):
    """masked_scatter's backward counts the mask on the host, which a capture forbids, yet its output has a known
    size, so Inductor would capture it (TRL's log-prob head scatters its per-token results so): the CUDA lowering
    names it, and the graph records and replays around it, gradients as eager."""
    weight = torch.randn(16, 1, device="cuda", requires_grad=True)

    def step(x, mask):
        return torch.zeros(mask.shape, device="cuda").masked_scatter(mask, (x @ weight).squeeze(-1)).square().sum()

    compiled = torch.compile(step, backend="graphopt")
    skips_before = counters["inductor"]["cudagraph_skips"]
    for seed in range(3):  # warm-up, recording, replay
        generator = torch.Generator().manual_seed(seed)
        x, mask = torch.randn(32, 16, generator=generator).cuda(), (torch.rand(4, 8, generator=generator) > 0.5).cuda()
        loss = compiled(x, mask)
        grad, = torch.autograd.grad(loss, weight)
        expected_loss = step(x, mask)
        expected, = torch.autograd.grad(expected_loss, weight)
        assert loss.item() == pytest.approx(expected_loss.item(), rel=1e-5)
        assert relative_error(grad, expected) <= 1e-5
    assert graphopt.last_report().cuda_graphs["on"] is True
    assert counters["inductor"]["cudagraph_skips"] == skips_before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_a_forward_without_cuda_graphs_between_a_recorded_forward_and_its_backward(dtype, fresh_dynamo):
    """DPO's step without TRL: the policy's forward (recorded as CUDA graphs), then the same model under no_grad
    (another graph, which runs without CUDA graphs), then the policy's backward. The call in between is a
    top-level call of a compiled model, and must not end the step inside the backward: warm-up, recording and
    replays give the losses and gradients of the same compile without CUDA graphs."""
    model = tiny_lora_model("llama", dtype).cuda()
    batches = [torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(s)).cuda() for s in (1, 2)]

    def steps(forward):
        losses = []
        for ids in batches * 2:
            model.zero_grad(set_to_none=True)
            loss = forward(input_ids=ids, labels=ids).loss
            with torch.no_grad():
                reference = forward(input_ids=ids, labels=ids).loss
            loss.backward()
            losses += [loss.detach(), reference]
        return [x.item() for x in losses], {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    expected_losses, expected = steps(torch.compile(model, backend="graphopt", options={"cuda_graphs": False}))
    torch._dynamo.reset()
    skips_before, reports_before = counters["inductor"]["cudagraph_skips"], len(graphopt.reports())
    losses, grads = steps(torch.compile(model, backend="graphopt"))
    assert any(report.cuda_graphs["on"] for report in graphopt.reports()[reports_before:])
    assert counters["inductor"]["cudagraph_skips"] == skips_before
    tolerance = 1e-5 if dtype == torch.float32 else 1e-3
    assert losses == pytest.approx(expected_losses, rel=tolerance)
    errors = {n: relative_error(grads[n].float(), expected[n].float()) for n in expected}
    assert max(errors.values()) <= tolerance, sorted(errors.items(), key=lambda e: -e[1])[:3]
