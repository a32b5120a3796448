"""Targets without a lowering of their own, the `fusions` option, and the backend from a fresh process."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch._inductor.custom_graph_pass import CustomGraphPass

import graphopt
from graphopt.lowering import registry
from graphs import relative_error
from models import adapted_layers, tiny_lora_model
from test_fuse_rmsnorm import GemmaStyle, LlamaStyle, Stack


def small_model():
    torch.manual_seed(0)
    return Stack([LlamaStyle(32), GemmaStyle(32)], 32)


def test_target_without_lowering_runs_the_reference_eagerly(monkeypatch):
    monkeypatch.setattr(registry, "lowering_for", lambda target: _mps_lowering())
    model, x = small_model(), torch.randn(4, 32, requires_grad=True)
    torch._dynamo.reset()
    out = torch.compile(model, backend="graphopt")(x)
    out.sum().backward()
    grad, x.grad = x.grad, None
    expected = model(x)
    expected.sum().backward()
    assert relative_error(out, expected) <= 1e-6 and relative_error(grad, x.grad) <= 1e-5
    report = graphopt.last_report()
    assert len(report.fusions) == 2
    assert all("reference" in r.implementation for r in report.lowering)
    assert report.lowering[0].note.startswith("Apple MPS: every op runs its pure-torch reference")
    assert _original_lowering_for("xpu").note == "no lowering for target 'xpu'"


def _mps_lowering():
    lowering = _original_lowering_for("mps")
    assert not lowering.inductor and lowering.target == "mps"
    return lowering


_original_lowering_for = registry.lowering_for


def test_fusions_option_turns_a_fusion_off():
    model, x = small_model(), torch.randn(4, 32)
    torch._dynamo.reset()
    out = torch.compile(model, backend="graphopt", options={"fusions": {"rms_norm": False}})(x)
    report = graphopt.last_report()
    assert report.fusions == [] and report.misses == [] and report.lowering == []
    assert relative_error(out, model(x)) <= 1e-6


def test_backend_found_without_import_in_a_fresh_process():
    code = (
        "import sys, torch\n"
        "assert 'graphopt' not in sys.modules\n"
        "f = torch.compile(lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),"
        " backend='graphopt')\n"
        "x, w = torch.randn(3, 8), torch.randn(8)\n"
        "y = f(x, w)\n"
        "import graphopt\n"
        "print(len(graphopt.last_report().fusions))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_demo_runs_and_prints_the_report():
    result = subprocess.run([sys.executable, "-m", "graphopt", "demo", "--steps", "2", "--batch", "2", "--seq", "32"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert "step   2  loss" in result.stdout
    assert "fusions (46): rms_norm ×9, rope ×4, swiglu ×4, lora ×28, linear_cross_entropy ×1" in result.stdout
    assert "misses (0)" in result.stdout


def test_cuda_report_names_the_fallback_the_inputs_take():
    """The CUDA lowering's report lines follow the inputs as the ops run them: the flash kernels' dtypes and head
    dims, the LoRA kernels' adapter dtypes."""
    cuda = pytest.importorskip("graphopt.lowering.cuda")
    cpu, bf16, fp32 = torch.device("cpu"), torch.bfloat16, torch.float32

    def heads(dtype, dim):
        return registry.Running(dtype, (2, 8, 16, dim), cpu)

    assert cuda.attention_variant(heads(bf16, 64), heads(bf16, 64), heads(bf16, 64), None) is None
    assert "16-bit" in cuda.attention_variant(heads(fp32, 64), heads(fp32, 64), heads(fp32, 64), None)
    assert "head dim 320" in cuda.attention_variant(heads(bf16, 320), heads(bf16, 320), heads(bf16, 320), None)
    x, weight = registry.Running(bf16, (4, 64), cpu), registry.Running(bf16, (32, 64), cpu)
    adapter, xa = registry.Running(fp32, (8, 64), cpu), registry.Running(fp32, (4, 8), cpu)
    assert cuda.lora_down_variant(x, adapter) is None
    assert cuda.lora_variant(x, weight, None, adapter, adapter, xa) is None
    same, same_xa = registry.Running(bf16, (8, 64), cpu), registry.Running(bf16, (4, 8), cpu)
    assert "all in bfloat16" in cuda.lora_down_variant(x, same)
    assert "all in bfloat16" in cuda.lora_variant(x, weight, None, same, same, same_xa)
    # a 4-bit base is dequantized into x's dtype first: the adapters alone decide
    packed, absmax = registry.Running(torch.uint8, (1024, 1), cpu), registry.Running(fp32, (32,), cpu)
    assert cuda.lora_4bit_variant(x, packed, absmax, None, None, None, None, adapter, adapter, xa) is None
    assert cuda.lora_4bit_variant(x, packed, absmax, None, None, None, None, same, same, same_xa).startswith(
        "Triton kernel kernels/dequantize_4bit.py")


@pytest.mark.parametrize("reserved_before", [0, 3 * 2**30])
def test_expandable_segments_are_turned_on_at_import_and_the_report_says_what_was_reserved_before(
        monkeypatch, reserved_before):
    """A CUDA device faked on the CPU: graphopt's import turns the allocator's expandable segments on; the note of
    the first compile says how much was reserved before, in fixed segments, and how to avoid it; a user's
    allocator variable wins."""
    from graphopt.lowering import cuda

    settings = []
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: reserved_before > 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved_before)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", settings.append, raising=False)
    monkeypatch.setattr(cuda, "_reserved_before", None)
    for variable in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)

    cuda.expandable_segments_on_import()
    note = cuda.prefer_expandable_segments()
    assert settings == ["expandable_segments:True"]  # once: the compile finds them on
    assert note.startswith("CUDA allocator: expandable segments turned on by graphopt")
    assert ("3.00 GiB were reserved before" in note and "import graphopt before the model loads" in note) == \
        (reserved_before > 0)

    monkeypatch.setattr(cuda, "_reserved_before", None)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    cuda.expandable_segments_on_import()
    assert settings == ["expandable_segments:True"]
    assert (cuda.prefer_expandable_segments()
            == "CUDA allocator: as PYTORCH_ALLOC_CONF=expandable_segments:False sets it")


def test_compiled_graphs_call_the_ops_without_custom_op_layers():
    """After the partition, Inductor's graphs call each opaque graphopt op as the target's direct op
    (lowering/direct.py): same kernel, same numbers, no custom_op autograd layer."""
    model = tiny_lora_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    torch._dynamo.reset()
    seen = set()

    class UserPass(CustomGraphPass):  # a post-grad pass of the user's own: it still runs, on the contract's ops
        def __call__(self, graph):
            seen.update(str(n.target) for n in graph.nodes if "graphopt" in str(n.target))

        def uuid(self):
            return "user pass"

    compiled = torch.compile(model, backend="graphopt")
    with torch._inductor.config.patch(post_grad_custom_post_pass=UserPass()):
        compiled(input_ids=ids, labels=ids).loss.backward()  # compiled: tracing calls the graphopt ops on fakes
    assert {"graphopt.lora_linear.default", "graphopt.lora_linear_backward.default"} <= seen, seen
    model.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        compiled(input_ids=ids, labels=ids).loss.backward()
    names = {event.name for event in profile.events()}
    layers = len(adapted_layers(model))
    for op in ("lora_down", "lora_linear", "lora_linear_backward", "linear_cross_entropy"):
        assert f"graphopt_cpu::{op}" in names and f"graphopt::{op}" not in names, op
    assert sum(e.name == "graphopt_cpu::lora_linear" for e in profile.events()) == layers
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    expected = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(relative_error(g, e) <= 1e-5 for g, e in zip(grads, expected))


@pytest.mark.parametrize("name", ["lora_down", "lora_linear", "lora_linear_backward"])
def test_direct_ops_pass_opcheck_and_equal_the_contracts_op(name):
    """A direct op (lowering/direct.py) is the graphopt op's schema, fake and kernel without custom_op's layers:
    opcheck's schema, fake-tensor and dynamic-shape checks pass, and it computes what the graphopt op does."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 8, generator=g), torch.randn(6, 8, generator=g)
    a, b, grad = torch.randn(4, 8, generator=g), torch.randn(6, 4, generator=g), torch.randn(3, 5, 6, generator=g)
    xa = torch.ops.graphopt.lora_down(x, a)
    args = {"lora_down": (x, a), "lora_linear": (x, w, None, a, b, xa, 2.0, torch.float32),
            "lora_linear_backward": (grad, x, xa, w, a, b, 2.0)}[name]
    direct = getattr(torch.ops.graphopt_cpu, name).default
    assert registry.lowering_for("cpu").direct_calls[getattr(torch.ops.graphopt, name).default] is direct
    torch.library.opcheck(direct, args)
    expected = getattr(torch.ops.graphopt, name)(*args)
    got = direct(*args)
    as_tuple = lambda out: out if isinstance(out, tuple) else (out,)  # noqa: E731
    assert all(torch.equal(e, r) for e, r in zip(as_tuple(expected), as_tuple(got), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("options", [{}, {"memory_budget": 0, "offload": True}], ids=["defaults", "lean"])
def test_dynamic_graphs_launch_the_lora_kernels_from_inductors_code(options, monkeypatch):
    """Where CUDA graphs are off (a graph of dynamic shapes), the LoRA ops' launch functions are traced into the
    graphs (lowering/traced.py): Inductor's generated code launches graphopt's kernels, the ops are not called,
    one dynamic graph serves every later length, and loss and gradients stay eager's. In the lean mode the
    backward recomputes gate and up, and the gated activation's backward writes its gradients over them."""
    from graphopt.lowering import traced
    from graphopt.report import reports

    in_place, last_reader = [], traced.last_reader
    monkeypatch.setattr(traced, "last_reader", lambda *args: in_place.append(last_reader(*args)) or in_place[-1])
    model = tiny_lora_model("llama").cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options=options)
    for length in (12, 20, 28):  # 12: a static graph; 20: the dynamic one, which 28 reuses
        ids = torch.randint(0, model.config.vocab_size, (2, length), device="cuda")
        model.zero_grad()
        graphs = len(reports())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            compiled(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        expected = [p.grad for p in model.parameters() if p.requires_grad]
        assert max(relative_error(g, e) for g, e in zip(grads, expected)) <= 1e-4, length
    assert len(reports()) == graphs  # no compile at 28
    called = {e.name for e in profile.events() if "lora" in e.name and "graphopt" in e.name}
    assert not called, called
    assert any("traced into the graphs" in note and "lora_linear" in note for note in reports()[-1].notes)
    if options:
        assert in_place and all(in_place), in_place


def _scheduled(name, reads=(), allocation=False):
    """A scheduler node as allocations_beside_their_first_reader reads one: an allocation (aten.empty, which
    computes nothing) or a kernel reading the buffers named."""
    from torch._inductor.scheduler import BaseSchedulerNode, NopKernelSchedulerNode

    node = object.__new__(NopKernelSchedulerNode if allocation else BaseSchedulerNode)
    node.read_writes = SimpleNamespace(reads=[SimpleNamespace(name=r) for r in reads])
    node.unmet_dependencies = ()
    node.get_buffer_names = lambda: {name}
    node.name = name
    return node


def test_allocations_move_beside_their_first_reader():
    """Inductor's peak-memory order may allocate a traced launch's output (an aten.empty, ready from the graph's
    start) long before its kernel: each allocation moves to just before its first reader, the rest keeps its
    order, and an allocation nothing reads (a graph output) stays where it was."""
    from graphopt.lowering import cuda

    a, b, out = (_scheduled(n, allocation=True) for n in ("a", "b", "out"))
    x, y = _scheduled("x"), _scheduled("y")
    first, second, third = _scheduled("first", ["a"]), _scheduled("second", ["b", "a"]), _scheduled("third", ["b"])
    moved = cuda.allocations_beside_their_first_reader([a, b, x, out, first, y, second, third])
    assert [n.name for n in moved] == ["x", "out", "a", "first", "y", "b", "second", "third"]
    unmoved = [x, out, y]
    assert cuda.allocations_beside_their_first_reader(unmoved) is unmoved


def _compiling_env():
    """The environment of tests/traced_launches.py's process: without Triton's interpreter, and with CI set, where
    Inductor refuses what it is lenient with elsewhere (an implicit fallback for an aten op with a decomposition)."""
    return {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "CI": "1"}


def test_traced_launches_add_no_guard_and_repeat_one_trace_per_call():
    """lowering/traced.py on the NVIDIA launch path, without a GPU (tests/traced_launches.py, in a process of its
    own: Triton's interpreter, which the CPU tests use, cannot be traced): each LoRA op becomes its Triton launches
    (wrap_triton), allocations and matmuls over the symbolic token count, without a guard on it, and a model's
    repeated calls copy one trace per op. Lowered by Inductor, each layer's input and gradient (pointwise values)
    are computed into one buffer each, however many kernels read them: without lowering/traced.py's _realized,
    Inductor computes a copy for each Triton kernel that reads one (x twice, the gradient three times a layer).
    The gated activation's backward writes its gradients over gate and up where nothing reads them after it."""
    env = _compiling_env()
    script = Path(__file__).with_name("traced_launches.py")
    run = subprocess.run([sys.executable, str(script), "3"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["graphopt_calls_left"] == [] and result["guards"] == [], result
    # a layer: x·Aᵀ, the low-rank add; dY·B, dA and dB, their sum, dX's low-rank; and the gated backward's kernel
    # in the two layers whose gate and up nothing reads after it (the last layer's is its reference, fused by
    # Inductor), launched on gate's and up's buffers: no copy of them is left after Inductor's reinplacing
    assert result["launches"] == 3 * 6 + 2
    assert result["gated_launches_in_place"] == [True, True]
    assert result["clones_after_reinplacing"] == []
    # x·Wᵀ and dY·W added onto the low-rank terms in place (traced._accumulate_in_place): the trace is functional,
    # and its addmm would write a second [tokens, out] beside the term, which cuBLAS's addmm copies into it first
    assert result["addmms"] == 0 and result["addmms_in_place"] == 6 and result["mms"] == 0
    # one per op (the gated backward's two forms, one each)
    assert sorted(result["traces"]) == sorted([f"graphopt.{op}.default" for op in (
        "lora_down", "lora_linear", "lora_linear_backward", "gated_activation_backward",
        "gated_activation_backward")])
    assert ("gated_activation_backward, lora_down, lora_linear, lora_linear_backward, padded_attention, "
            "padded_attention_backward, rope, rope_backward are traced into the graphs" in result["note"])
    assert result["buffers_per_input"] == {"x_1": 3, "w_1": 0, "a_1": 0, "b_1": 0, "grad_1": 3}


def test_traced_projections_split_their_columns_whatever_the_token_count():
    """Traced, a projection's row count is a symbol, and its launch takes one split of the columns per
    TRACED_COLUMNS (kernels/lora.py _column_splits) and one launch more that sums them: x·Aᵀ over 2,048 columns in
    two, dY·B over 96 in one. The split adds no guard and no copy."""
    from graphopt.kernels import lora

    assert lora.CONFIGS["cuda"]["project"]["TRACED_COLUMNS"] == 1024
    env = _compiling_env()
    script = Path(__file__).with_name("traced_launches.py")
    run = subprocess.run([sys.executable, str(script), "1", "2048"], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["projection_splits"] == [2, 1], result
    assert result["launches"] == 6 + 1
    assert result["guards"] == [] and result["clones_after_reinplacing"] == []


def test_traced_rope_and_padded_attention_launch_from_inductors_code_and_find_the_sequences_once():
    """RoPE's and the padded attention's launch functions traced over the symbolic length (tests/traced_launches.py
    attention): each layer's rotation a launch forward and backward, the attention's row moves (q, k, v to the flat
    layout and the output back; in the backward five there and three back) and the flash kernels' two calls, without
    a guard and with no copy left after reinplacing. The batch's sequences (kernels/padded_attention.py _sequences)
    are derived by one call for the graph, where each of the four attention calls' traces holds one, and Inductor
    calls it as it is: its sort, lowered, would guard the length."""
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("traced_launches.py")), "2", "attention"],
                         env=_compiling_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["graphopt_calls_left"] == [] and result["guards"] == [], result
    assert result["kernels"] == {"_rope_kernel": 2 * 2, "_rows_kernel": 2 * (4 + 8)}
    assert result["flash_calls"] == 2 * 2 and result["sequences_calls"] == 1 and result["sorts"] == 0
    assert result["clones_after_reinplacing"] == []
    assert sorted(result["traces"]) == sorted(f"graphopt.{op}.default" for op in (
        "rope", "rope_backward", "padded_attention", "padded_attention_backward"))
    assert "padded_attention, padded_attention_backward, rope, rope_backward are traced" in result["note"]


def test_share_repeats_merges_only_what_traces_added_and_what_follows_from_its_arguments():
    """traced.share_repeats: of two inlined nodes of one operation on the same arguments the second reads the first's
    result (and so do their repeated users); the graph's own nodes, allocations, random draws and a tensor a traced
    kernel writes stay as they are."""
    from graphopt.lowering import traced

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")

    def inlined(target, *args, **kwargs):
        node = graph.call_function(target, args, kwargs)
        node.meta[traced._INLINED] = True
        return node

    negs = [inlined(aten.neg.default, x) for _ in range(2)]
    sums = [inlined(aten.sum.default, neg) for neg in negs]  # equal once the negs are one
    own = [graph.call_function(aten.neg.default, (x,)) for _ in range(2)]
    empties = [inlined(aten.empty.memory_format, [4], dtype=torch.float32) for _ in range(2)]
    draws = [inlined(aten.rand_like.default, x) for _ in range(2)]
    written = [inlined(aten.clone.default, x) for _ in range(2)]
    launches = [inlined(torch.ops.higher_order.triton_kernel_wrapper_functional, kernel_idx=0, constant_args_idx=0,
                        grid=[(1, 1, 1)], tma_descriptor_metadata={}, kwargs={"OUT": w}, tensors_to_clone=["OUT"])
                for w in written]
    graph.output((*sums, *own, *empties, *draws, *launches))
    traced.share_repeats(graph)
    left = list(graph.nodes)
    assert negs[0] in left and negs[1] not in left and sums[0] in left and sums[1] not in left
    assert all(n in left for n in own + empties + draws + written + launches)
    assert graph.output_node().args[0][:2] == (sums[0], sums[0])


def test_traced_accumulate_adds_onto_the_term_in_place_in_inductors_code(monkeypatch):
    """lowering/traced.py _accumulate_in_place as a post-grad pass, through Inductor's code generation and run (CPU):
    the addmm onto a term nothing else reads becomes graphopt_traced::addmm_ on the term's buffer, one whose term is
    read again stays an addmm, and the results equal eager's. With CI set, where Inductor calls no aten in-place op
    it was not given."""
    from torch._inductor.utils import run_and_get_code

    from graphopt.lowering import traced

    class Accumulate(CustomGraphPass):
        def __call__(self, graph):
            traced._accumulate_in_place(graph)

        def uuid(self):
            return "accumulate in place"

    def step(x, a, b):
        once = torch.addmm(torch.sin(x) * 2, a, b)  # the term read by the addmm alone
        term = torch.cos(x)
        twice = torch.addmm(term, a, b)  # and by the sum below
        return once * 3, twice + term

    monkeypatch.setenv("CI", "1")
    torch._dynamo.reset()
    inputs = torch.randn(64, 32), torch.randn(64, 16), torch.randn(16, 32)
    with torch._inductor.config.patch(post_grad_custom_pre_pass=Accumulate(), fx_graph_cache=False):
        results, (code, *_) = run_and_get_code(torch.compile(step, backend="inductor"), *inputs)
    assert code.count("torch.ops.graphopt_traced.addmm_.default(") == 1, code
    assert all(relative_error(r, e) <= 1e-6 for r, e in zip(results, step(*inputs)))


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), inner=st.integers(1, 24), cols=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_traced_addmm_in_place_accumulates_as_an_fp64_matmul_and_passes_opcheck(rows, inner, cols, dtype, seed):
    """graphopt_traced::addmm_ (lowering/traced.py ADDMM_): term += mat1·mat2 in place, nothing returned, against
    the sum computed in fp64 from the same inputs; its schema, fake and dispatch through torch.library.opcheck."""
    from graphopt.lowering import traced

    g = torch.Generator().manual_seed(seed)
    term, mat1, mat2 = (torch.randn(shape, generator=g).to(dtype) for shape in ((rows, cols), (rows, inner),
                                                                                  (inner, cols)))
    expected = term.double() + mat1.double() @ mat2.double()
    storage = term.data_ptr()
    assert traced.ADDMM_(term, mat1, mat2) is None
    assert term.data_ptr() == storage
    assert relative_error(term, expected) <= (1e-6 if dtype == torch.float32 else 1e-2)
    torch.library.opcheck(traced.ADDMM_, (term, mat1, mat2))


def test_an_op_whose_trace_fails_is_called_directly_and_the_note_says_so(monkeypatch):
    from graphopt.lowering import traced
    from graphopt.lowering.direct import DirectCalls, traced_note
    from traced_launches import lora_calls_over_symbolic_tokens

    def fail(graph, node, function, traces):
        raise NotImplementedError("no GPU driver to analyse the kernels' writes")

    monkeypatch.setattr(traced, "inline", fail)
    gm, _ = lora_calls_over_symbolic_tokens(layers=1)
    lowering = registry.lowering_for("cuda")
    calls = DirectCalls(lowering.direct_calls, lowering.traced_launches)
    calls(gm.graph)
    targets = {str(n.target) for n in gm.graph.nodes if "graphopt" in str(n.target)}
    assert targets == {"graphopt_cuda.lora_down.default", "graphopt_cuda.lora_linear.default",
                       "graphopt_cuda.lora_linear_backward.default", "graphopt_cuda.gated_activation_backward.default"}
    note = traced_note(calls)
    assert "; gated_activation_backward, lora_down, lora_linear, lora_linear_backward called directly" in note
    assert "no GPU driver" in note


@torch.library.custom_op("graphopt_test::allocates_inside", mutates_args=())
def allocates_inside(x: torch.Tensor) -> torch.Tensor:
    """An op Inductor calls as a fallback, like attention's backward: what it allocates while it runs, Inductor's
    estimate of the graph's memory cannot see."""
    return x.clone()


@allocates_inside.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("graphopts", [True, False], ids=["graphopt's graph", "another graph"])
def test_no_buffer_is_held_for_reuse_across_a_fallback_in_graphopts_graphs(graphopts):
    """Inductor hands a freed buffer to a later allocation of its size where its estimate of the live memory has
    room: across a fallback op the estimate misses what the op allocates, so in graphopt's graphs the buffer is
    freed at its last use instead (lowering/cuda.py reuse_where_the_estimate_sees). Other graphs keep Inductor's
    choice."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    from graphopt.lowering.direct import DirectCalls

    def step(x):
        first = allocates_inside(torch.sin(x) * 3)  # sin·3 is a buffer of x's size, free after this op
        second = allocates_inside(first)
        return torch.cos(second) * 2, first, second  # a new buffer of that size, after the second op

    post_pass = DirectCalls({}) if graphopts else None
    with config.patch(post_grad_custom_post_pass=post_pass, fx_graph_cache=False):
        torch._dynamo.reset()
        x = torch.randn(4096)
        result, (code,) = run_and_get_code(torch.compile(step, backend="inductor"), x)
    torch._dynamo.reset()
    torch.testing.assert_close(result[0], torch.cos(torch.sin(x) * 3) * 2)
    assert ("# reuse" in code) is not graphopts, code


def test_the_report_names_the_gated_backward_that_runs_where_launches_are_traced():
    """Where CUDA graphs are off the gated activation's backward is traced, not decomposed (lowering/cuda.py
    TRACED): the report's line for it says so; under CUDA graphs, Inductor's fused kernel."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphopt.lowering import cuda

    gate, up = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    gm = make_fx(lambda g, u: torch.ops.graphopt.gated_activation(g, u, "silu"))(gate, up)
    lowering = registry.lowering_for("cuda")
    lines = {}
    for traced in (False, True):
        plan = SimpleNamespace(lowering=[])  # the part of the plan record adds to
        registry.record(gm, lowering, plan, traced=traced)
        lines[traced] = {r.op: r.implementation for r in plan.lowering}
    backward = "graphopt.gated_activation_backward.default"
    assert lines[False][backward] == cuda.IMPLEMENTATIONS[torch.ops.graphopt.gated_activation_backward.default]
    assert lines[True][backward].startswith("Triton kernel kernels/gated_activation.py")
    assert "over gate and up" in lines[True][backward]
    assert lines[True]["graphopt.gated_activation.default"] == lines[False]["graphopt.gated_activation.default"]


@pytest.mark.parametrize("case, expected", [("dead after", True), ("a view read after", False),
                                            ("read after", False), ("a graph input", False),
                                            ("one tensor twice", False)])
def test_the_gated_backward_overwrites_only_what_nothing_reads_after_it(case, expected):
    """lowering/traced.py last_reader, which picks the gated backward's in-place trace: gate and up computed in
    the graph, distinct, and read by nothing after the call, through no view either."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from graphopt.lowering.traced import last_reader

    def backward(x, dh):
        gate, up = (x, x + 1) if case == "a graph input" else (x * 2, x + 1)
        if case == "one tensor twice":
            up = gate
        view = gate.view(-1)
        grads = torch.ops.graphopt.gated_activation_backward(dh, gate, up, "silu")
        if case == "a view read after":
            return (*grads, view * 3)
        return (*grads, up * 3) if case == "read after" else grads

    gm = make_fx(backward, tracing_mode="fake")(torch.randn(4, 8), torch.randn(4, 8))
    [node] = gm.graph.find_nodes(op="call_function", target=torch.ops.graphopt.gated_activation_backward.default)
    assert last_reader(node, (1, 2)) is expected
