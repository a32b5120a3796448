"""graphopt::lora_down and graphopt::lora_linear: the ops against PEFT's own LoRA layer, opcheck, the pass on PEFT models (counts,
misses), the memory it exists to save, and tiny HF models end to end with the fusion on."""

import contextlib

import peft
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphopt
from graphopt.passes import recompute
from graphopt.passes.fuse_lora import DORA_REASON, PARAMETER_REASON, fuse_lora
from graphopt.passes.describe import module_path
from graphs import count_calls, first_output, relative_error, run_pass
from models import ARCHITECTURES, COMMON, adapted_layers, tiny_lora_model
from test_end_to_end import compile_and_compare

OP = torch.ops.graphopt.lora_linear.default
DOWN = torch.ops.graphopt.lora_down.default
LORA_OFF = {"fusions": {"lora": False}}
FASTEST = {"memory_budget": 1}  # what the fastest plan saves: the tests below count it


def peft_linear(in_features, out_features, r, dtype, bias=True, seed=0, **lora):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=bias)).to(dtype)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], init_lora_weights=False, **lora)
    return peft.get_peft_model(model, config)


def op_args(model, out_dtype):
    layer = model.base_model.model[0]
    base = layer.base_layer
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    return base.weight, base.bias, a, b, layer.scaling["default"], out_dtype


def lora_ops(x, weight, bias, a, b, scaling, out_dtype, *dropout):
    """(out, xa): a LoRA linear as the pass writes it, lora_down then lora_linear."""
    xa = DOWN(x, a, *dropout)
    return OP(x, weight, bias, a, b, xa, scaling, out_dtype, *dropout), xa


@settings(max_examples=20)
@given(r=st.sampled_from([1, 8, 128]), features=st.sampled_from([(16, 12), (33, 64)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(), seed=st.integers(0, 99))
def test_op_equals_peft_layer_forward_and_gradients(r, features, dtype, bias, seed):
    """bf16 base with fp32 adapters is PEFT's default mixed setting; the op runs the same operations."""
    model = peft_linear(*features, r, dtype, bias, seed)
    x = torch.randn(2, 5, features[0], generator=torch.Generator().manual_seed(seed), dtype=dtype, requires_grad=True)
    expected = model(x)
    grad_out = torch.randn_like(expected)
    expected.backward(grad_out)
    expected_grads = [x.grad] + [p.grad for n, p in model.named_parameters() if p.requires_grad]
    x.grad = None
    model.zero_grad()
    weight, b, a, bw, scaling, _ = op_args(model, dtype)
    out, xa = lora_ops(x, weight, b, a, bw, scaling, expected.dtype)
    assert not xa.requires_grad  # lora_linear's backward differentiates through it
    out.backward(grad_out)
    grads = [x.grad, a.grad, bw.grad]
    assert out.dtype == expected.dtype and relative_error(out, expected) <= 1e-6
    peft_xa = model.base_model.model[0].lora_A["default"](x.detach().to(a.dtype))  # what PEFT's lora_B is given
    assert xa.dtype == a.dtype and relative_error(xa, peft_xa) <= 1e-6
    for got, want in zip(grads, expected_grads):
        assert got.dtype == want.dtype and relative_error(got, want) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck(dtype):
    model = peft_linear(16, 12, 4, dtype)
    x = torch.randn(3, 16, dtype=dtype, requires_grad=True)
    weight, bias, a, b, scaling, _ = op_args(model, dtype)
    xa = x.detach().to(a.dtype) @ a.detach().t()
    torch.library.opcheck(DOWN, (x, a))
    torch.library.opcheck(OP, (x, weight, bias, a, b, xa, scaling, dtype))
    torch.library.opcheck(torch.ops.graphopt.lora_linear_backward.default,
                          (torch.randn(3, 12, dtype=dtype), x.detach(), xa, weight, a.detach(), b.detach(), scaling))


def test_gradcheck_fp64():
    model = peft_linear(6, 5, 2, torch.float64)
    weight, bias, a, b, scaling, _ = op_args(model, torch.float64)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, a, b: lora_ops(x, weight, bias, a, b, scaling, torch.float64)[0],
                                    (x, a, b))


# --- the Triton kernels (kernels/lora.py): the interpreter on CPU, compiled on CUDA --------------------------

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNEL_DTYPES = [torch.float32, torch.float16] + [torch.bfloat16] * (DEVICE == "cuda")  # interpreter: no bf16


@settings(max_examples=12, deadline=None)
@given(r=st.sampled_from([1, 8, 16, 128]), shape=st.sampled_from([(1, 16, 12), (37, 48, 80), (130, 64, 20),
                                                                  (70, 200, 33)]),
       dtype=st.sampled_from(KERNEL_DTYPES), bias=st.booleans(), scaling=st.sampled_from([0.5, 2.0]),
       seed=st.integers(0, 2**16), traced=st.booleans())
def test_kernels_match_fp64(r, shape, dtype, bias, scaling, seed, traced):
    """Forward and dX, dA, dB against the reference computed in fp64 from the same inputs (bias, shapes, ranks
    below and above the 16 a dot needs); also as the launch functions run when traced into a graph (on a GPU, the
    projections' columns split in runs of TRACED_COLUMNS), run eagerly."""
    from graphopt.kernels import layout

    tokens, in_features, out_features = shape
    g = torch.Generator().manual_seed(seed)

    def randn(*size, dtype=dtype, scale=1.0):
        return (torch.randn(size, generator=g) * scale).to(DEVICE, dtype)

    x, grad = randn(tokens, in_features), randn(tokens, out_features)
    weight = randn(out_features, in_features, scale=in_features ** -0.5)
    b = randn(out_features) if bias else None
    a, bb = randn(r, in_features, dtype=torch.float32, scale=in_features ** -0.5), randn(out_features, r,
                                                                                        dtype=torch.float32)
    with layout.launches_traced() if traced else contextlib.nullcontext():
        assert_kernels_match_fp64(x, grad, weight, b, a, bb, scaling)


def assert_kernels_match_fp64(x, grad, weight, bias, a, b, scaling):
    """Forward (out and the saved x·Aᵀ) and dX, dA, dB of the kernels (kernels/lora.py), each backward from its
    own forward's x·Aᵀ, against the reference computed in fp64 from the same inputs: fp32 to 1e-5; bf16/fp16 no
    further from it than the reference in that dtype, up to rounding."""
    from graphopt.kernels import lora, reference

    dtype = x.dtype
    def run(implementation, x, weight, bias, a, b, grad, out_dtype):
        xa = implementation.lora_down_forward(x, a) if implementation is lora else reference.lora_down(x, a)
        out = (lora.lora_linear_forward(x, weight, bias, b, xa, scaling, out_dtype) if implementation is lora else
               reference.lora_linear(x, weight, bias, a, b, xa, scaling, out_dtype))
        return out, xa, *implementation.lora_linear_backward(grad, x, xa, weight, a, b, scaling)

    got = run(lora, x, weight, bias, a, b, grad, dtype)
    same = run(reference, x, weight, bias, a, b, grad, dtype)
    exact = run(reference, *[t.double() if t is not None else None for t in (x, weight, bias, a, b, grad)],
                torch.float64)
    for name, out, ref, x64 in zip(("out", "xa", "dx", "dA", "dB"), got, same, exact):
        assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous(), name
        bound = 1e-5 if dtype == torch.float32 else 2 * relative_error(ref, x64) + 1e-3
        assert relative_error(out, x64) <= bound, name


@pytest.mark.parametrize("bias", [False, True])
def test_an_output_wider_than_x_adds_the_base_rounded_to_x_dtype(bias):
    """PEFT's 4-bit layer under autocast asks for an fp32 output from an fp16/bf16 x: the kernel adds the base
    matmul rounded to x's dtype, as the reference does, where an output of x's dtype has cuBLAS add the base."""
    from graphopt.kernels import lora, reference

    dtype = KERNEL_DTYPES[-1]
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(37, 48, generator=g).to(DEVICE, dtype), torch.randn(80, 48, generator=g).to(DEVICE, dtype)
    b = torch.randn(80, generator=g).to(DEVICE, dtype) if bias else None
    a, bb = torch.randn(8, 48, generator=g).to(DEVICE), torch.randn(80, 8, generator=g).to(DEVICE)
    out = lora.lora_linear_forward(x, weight, b, bb, lora.lora_down_forward(x, a), 0.5, torch.float32)
    ref = reference.lora_linear(x, weight, b, a, bb, reference.lora_down(x, a), 0.5, torch.float32)
    # 1e-5: on CUDA the low-rank term's dots are tf32x3, a few fp32 units in the last place from the reference's
    assert out.dtype == torch.float32 and relative_error(out, ref) <= 1e-5


class CountedLaunches:
    """kernel[grid](...) as before, its name appended to `launched` first."""

    def __init__(self, kernel, launched):
        self.kernel, self.launched = kernel, launched

    def __getitem__(self, grid):
        self.launched.append(self.kernel.__name__)
        return self.kernel[grid]


def test_a_config_too_large_for_shared_memory_shrinks_until_it_fits(monkeypatch):
    """Large ranks and fp32 tiles need more shared memory than the tuned configs leave room for (rank 128 on the
    H200 did not launch): Triton raises OutOfResources at the launch, and the launch is retried with fewer stages
    (in proportion to the memory wanted over the limit), then the largest block halved, until it fits; the config
    that fit is remembered per key, CONFIGS kept."""
    from triton.runtime.errors import OutOfResources

    from graphopt.kernels import lora

    limit, tried = 232_448, []

    def launch_wanting(bytes_per_stage):  # shared memory ∝ stages × BLOCK_K, as the project kernel's tiles
        def launch(config):
            tried.append((config["num_stages"], config["BLOCK_M"], config["BLOCK_K"]))
            required = bytes_per_stage * config["num_stages"] * config["BLOCK_K"] // 128
            if required > limit:
                raise OutOfResources(required, limit, "shared memory")
            return "launched"
        return launch

    monkeypatch.setattr(lora, "_FITTED", {})
    tuned = dict(lora.CONFIGS["cuda"]["project"])
    assert lora._fitting("project", "cuda", ("key",), launch_wanting(100_000)) == "launched"
    assert tried == [(4, 64, 128), (2, 64, 128)]  # 400,000 bytes wanted: 2 of 4 stages fit, none tried between
    tried.clear()
    assert lora._fitting("project", "cuda", ("larger",), launch_wanting(300_000)) == "launched"
    assert tried == [(4, 64, 128), (1, 64, 128), (1, 64, 64)]  # one stage too large: BLOCK_K halved
    tried.clear()
    lora._fitting("project", "cuda", ("larger",), launch_wanting(300_000))
    assert tried == [(1, 64, 64)]  # remembered
    tried.clear()
    lora._fitting("project", "cuda", ("other key",), launch_wanting(1))
    assert tried == [(4, 64, 128)] and lora.CONFIGS["cuda"]["project"] == tuned

    def never_fits(config):
        raise OutOfResources(300_000, 232_448, "shared memory")

    with pytest.raises(OutOfResources):
        lora._fitting("project", "cuda", ("never",), never_fits)


@pytest.mark.skipif(DEVICE != "cuda", reason="shared memory is a GPU's limit; the interpreter has none")
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("r", [1, 16, 64, 128, 256])
def test_every_common_rank_runs_on_the_gpu(r, dtype):
    """PEFT's usual ranks in every dtype, forward and backward, against fp64: before the configs shrank to fit,
    rank 128 raised OutOfResources on the H200."""
    g = torch.Generator().manual_seed(r)
    x = torch.randn(300, 256, generator=g).to(DEVICE, dtype)
    grad = torch.randn(300, 192, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(192, 256, generator=g) / 16).to(DEVICE, dtype)
    a, b = (torch.randn(r, 256, generator=g) / 16).to(DEVICE), torch.randn(192, r, generator=g).to(DEVICE)
    assert_kernels_match_fp64(x, grad, weight, None, a, b, 2.0)


def test_backward_is_four_triton_launches(monkeypatch):
    """The H200's step is partly launch-bound, so the LoRA backward takes few launches: dY·B one (x·Aᵀ comes
    saved from the forward), dA's and dB's partial sums one, their sum one, and dX's low-rank term one, besides
    cuBLAS's dY·W. Several
    splits, both products' column blocks and a rank below 16 are in play; the gradients are two tensors,
    not views of one buffer (a custom op's outputs may not alias). The projections' columns unsplit (FILL 0):
    a split adds the launch that sums them, counted in the test below."""
    from graphopt.kernels import lora, reference

    platform = "cuda" if DEVICE == "cuda" else "cpu"
    monkeypatch.setitem(lora.CONFIGS[platform], "project", {**lora.CONFIGS[platform]["project"], "FILL": 0})
    monkeypatch.setattr(lora, "_FITTED", {})
    launched = []
    for name, kernel in list(vars(lora).items()):
        if name.endswith("_kernel"):
            monkeypatch.setattr(lora, name, CountedLaunches(kernel, launched))
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(700, 70, generator=g).to(DEVICE), torch.randn(700, 300, generator=g).to(DEVICE)
    weight = torch.randn(300, 70, generator=g).to(DEVICE) / 70 ** 0.5
    a, b = torch.randn(5, 70, generator=g).to(DEVICE) / 70 ** 0.5, torch.randn(300, 5, generator=g).to(DEVICE)
    xa = x @ a.t()
    got = lora.lora_linear_backward(grad, x, xa, weight, a, b, 2.0)
    assert launched == ["_project_kernel", "_reduce_rows_pair_kernel", "_sum_splits_kernel", "_add_low_rank_kernel"]
    exact = reference.lora_linear_backward(grad.double(), x.double(), xa.double(), weight.double(), a.double(),
                                           b.double(), 2.0)
    for name, out, x64 in zip(("dx", "dA", "dB"), got, exact):
        assert out.dtype == torch.float32 and out.is_contiguous() and relative_error(out, x64) <= 1e-5, name
    assert got[1].untyped_storage().data_ptr() != got[2].untyped_storage().data_ptr()


@pytest.mark.parametrize("fill", [0, 12])
def test_projections_split_over_columns_add_up_to_the_product(monkeypatch, fill):
    """A launch of fewer row blocks than the GPU has multiprocessors splits the projections' columns (CONFIGS'
    FILL: programs wanted a multiprocessor): each split's partial product, then one launch that sums them in a
    fixed order; the forward and every gradient stay within fp64's bounds. FILL 0: one launch, no sum. On a GPU
    the columns split only while a CUDA graph records the launches (else each split's sum is a launch the host
    pays for): the test stands in for a capture."""
    from graphopt.kernels import layout, lora

    platform = "cuda" if DEVICE == "cuda" else "cpu"
    launched = []
    for name, kernel in list(vars(lora).items()):
        if name.endswith("_kernel"):
            monkeypatch.setattr(lora, name, CountedLaunches(kernel, launched))
    config = {**lora.CONFIGS[platform]["project"], "BLOCK_M": 32, "BLOCK_K": 16, "FILL": fill}
    monkeypatch.setitem(lora.CONFIGS[platform], "project", config)
    monkeypatch.setattr(lora, "_FITTED", {})
    monkeypatch.setattr(layout, "multiprocessors", lambda device: 1)  # the interpreter's count, on CUDA too
    if DEVICE == "cuda":
        monkeypatch.setattr(layout, "capturing", lambda: True)
    g = torch.Generator().manual_seed(1)
    dtype = KERNEL_DTYPES[-1]
    x, grad = torch.randn(50, 100, generator=g).to(DEVICE, dtype), torch.randn(50, 70, generator=g).to(DEVICE, dtype)
    weight = (torch.randn(70, 100, generator=g) / 10).to(DEVICE, dtype)
    a, b = (torch.randn(8, 100, generator=g) / 10).to(DEVICE), torch.randn(70, 8, generator=g).to(DEVICE)
    assert_kernels_match_fp64(x, grad, weight, None, a, b, 2.0)
    # 50 rows are 2 blocks of 32. FILL 12 wants 6 splits of the forward's 100 columns (4 of 32 columns leave
    # none empty) and of dY·B's 70 (5 of 16), each then summed; dA's and dB's sum runs either way
    assert launched.count("_sum_splits_kernel") == (3 if fill else 1), launched
    if DEVICE == "cuda":  # no capture: one launch a projection, whatever FILL asks
        monkeypatch.setattr(layout, "capturing", lambda: False)
        launched.clear()
        assert_kernels_match_fp64(x, grad, weight, None, a, b, 2.0)
        assert launched.count("_sum_splits_kernel") == 1, launched


def test_trainable_base_weight_is_a_clear_error():
    model = peft_linear(8, 4, 2, torch.float32)
    weight, bias, a, b, scaling, _ = op_args(model, torch.float32)
    weight.requires_grad_(True)
    out, _ = lora_ops(torch.randn(2, 8), weight, bias, a, b, scaling, torch.float32)
    with pytest.raises(RuntimeError, match="must be frozen"):
        out.sum().backward()


# --- the pass ------------------------------------------------------------------------------------------

def mlp(dtype=torch.float32, **lora):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).to(dtype)
    config = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["0", "2"], "init_lora_weights": False,
                                **lora})
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pass_fuses_each_lora_linear(dtype):
    gm, example, expected, report, fused = run_pass(fuse_lora, mlp(dtype), torch.randn(3, 16, dtype=dtype))
    assert fused == 2 == count_calls(gm, OP) == count_calls(gm, DOWN) and report.misses == []
    assert [r.module for r in report.fusions] == ["base_model.model.0", "base_model.model.2"]
    assert relative_error(first_output(gm, example), expected) <= 1e-6


def two_adapters():
    model = mlp()
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    return model


def trainable_base():
    model = mlp()
    model.base_model.model[0].base_layer.weight.requires_grad_(True)
    return model


@pytest.mark.parametrize("make, reason, fused", [
    (two_adapters, "several active adapters", 2),
    (trainable_base, "trains", 1),
])
def test_unprovable_lora_layers_stay_unfused_with_a_reason(make, reason, fused):
    model = make()
    gm, example, expected, report, count = run_pass(fuse_lora, model, torch.randn(3, 16))
    assert count == fused and report.misses and all(reason in m.reason for m in report.misses)
    assert relative_error(first_output(gm, example), expected) <= 1e-6


# --- LoRA dropout ------------------------------------------------------------------------------------------

@settings(max_examples=10)
@given(p=st.sampled_from([0.05, 0.1, 0.5]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_op_with_a_dropout_mask_is_peft_with_that_mask(p, dtype, seed):
    """Given the kept elements, the op's forward and gradients are PEFT's layer with torch's dropout arithmetic
    (x · mask · 1/(1 − p)) on the adapters' input, against fp64."""
    layer = peft_linear(24, 20, 4, dtype, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 24, generator=g).to(dtype).requires_grad_()
    keep = torch.rand(3, 5, 24, generator=g) >= p
    weight, bias, a, b, scaling, _ = op_args(layer, dtype)
    out, _ = lora_ops(x, weight, bias, a, b, scaling, dtype, keep, p)
    exact = (torch.nn.functional.linear(x.double(), weight.double(), bias.double())
             + (x.double() * keep * (1 / (1 - p))) @ a.double().t() @ b.double().t() * scaling)
    grad = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, (x, a, b), grad)
    want = torch.autograd.grad(exact, (x, a, b), grad.double())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(out, exact) <= tolerance
    for g_got, g_want in zip(got, want):
        assert relative_error(g_got, g_want) <= tolerance


def test_opcheck_with_a_dropout_mask():
    layer = peft_linear(16, 12, 4, torch.float32)
    x = torch.randn(2, 3, 16, requires_grad=True)
    weight, bias, a, b, scaling, _ = op_args(layer, torch.float32)
    keep = torch.rand(2, 3, 16) >= 0.1
    torch.library.opcheck(DOWN, (x, a, keep, 0.1))
    torch.library.opcheck(OP, (x, weight, bias, a, b, DOWN(x, a, keep, 0.1).detach(), scaling, torch.float32, keep,
                               0.1))


@pytest.mark.parametrize("budget", [1, 0])
def test_compiled_lora_dropout_draws_eagers_stream_and_keeps_its_mask(budget):
    """With Inductor's fallback_random (its random ops call torch's generator, as eager does), the compiled model
    draws exactly eager's dropout masks: loss and every gradient equal eager's. At budget 0 the backward recomputes
    each layer, but never the draw: the mask it applies is the forward's."""
    import torch._inductor.config

    model = tiny_lora_model("llama", lora_dropout=0.1)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options={"memory_budget": budget})
    results = []
    with torch._inductor.config.patch(fallback_random=True):  # the backward compiles at its first run, inside
        for run in (compiled, model):
            torch.manual_seed(7)
            results.append(lora_params_loss_and_grads_lm(run, ids))
    (loss, grads), (eager_loss, eager_grads) = results
    assert graphopt.last_report().summary()["lora"] == 14 and graphopt.last_report().misses == []
    assert relative_error(loss, eager_loss) <= 1e-5
    for name in grads:
        assert relative_error(grads[name], eager_grads[name]) <= 1e-5, name


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_compiled_lora_dropout_statistics(device):
    """Under Inductor's own random stream: a fraction p of the adapters' input dropped, the rest scaled by
    1/(1 − p), a new mask every step. Read off the gradient of lora_B, which is Σ (dropped x · Aᵀ)ᵀ·dY: with A
    the identity and dY ones, each row of dB sums one channel of x as the adapters saw it."""
    p, rows, width = 0.25, 4096, 8
    layer = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(width, 4)),
                                peft.LoraConfig(r=width, target_modules=["0"], lora_dropout=p)).to(device)
    lora_a = layer.base_model.model[0].lora_A["default"].weight
    with torch.no_grad():
        lora_a.copy_(torch.eye(width))
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="graphopt")
    x = torch.ones(rows, width, device=device)
    seen = []
    for _ in range(2):
        layer.zero_grad()
        compiled(x).sum().backward()
        lora_b = layer.base_model.model[0].lora_B["default"].weight
        seen.append(lora_b.grad[0] / layer.base_model.model[0].scaling["default"])  # Σ over rows of dropped x
    assert graphopt.last_report().summary() == {"lora": 1}
    assert "dropout mask" in graphopt.last_report().lowering[0].implementation or device == "cpu"
    kept = seen[0] * (1 - p) / rows  # the fraction kept per channel
    assert torch.allclose(kept, torch.full_like(kept, 1 - p), atol=0.03)
    assert not torch.equal(seen[0], seen[1])  # drawn again each step


def test_lora_dropout_in_eval_mode_is_the_identity_and_fused():
    model = mlp(lora_dropout=0.1)
    model.eval()
    gm, example, expected, report, count = run_pass(fuse_lora, model, torch.randn(3, 16))
    assert count == 2 and report.misses == []
    assert all(n.target not in (torch.nn.functional.dropout, torch.dropout) for n in gm.graph.nodes)
    assert torch.equal(first_output(gm, example), expected)


def lora_params_loss_and_grads_lm(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in params if p.requires_grad}


def lora_params_loss_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in params if p.requires_grad}


def compiled_as_eager(model, x):
    """The reports of a graphopt compile of model and the gradients of one step on x, its loss and every gradient
    checked against eager's."""
    torch._dynamo.reset()
    first = len(graphopt.reports())
    loss, grads = lora_params_loss_and_grads(torch.compile(model, backend="graphopt"), x)
    eager_loss, eager_grads = lora_params_loss_and_grads(model, x)
    assert relative_error(loss, eager_loss) <= 1e-5 and set(grads) == set(eager_grads)
    for name in grads:
        assert relative_error(grads[name], eager_grads[name]) <= 1e-5, name
    return graphopt.reports()[first:], grads


def test_compiled_dora_is_reported_and_matches_eager():
    """Where Dynamo compiles DoRA depends on the torch version. torch 2.13 + PEFT 0.21: a graph break in PEFT's DoRA
    code makes it skip lora.Linear.forward and compile DoraLinearLayer.forward in two graphs of its own
    (passes/fuse_lora.py says what they hold); the one holding DoRA's activation path gets one miss, and as this
    model's two layers differ in shape, that graph compiles once per layer. torch 2.11: DoRA is traced inside the
    model's graph, one miss per adapted layer under its path. Either way nothing is fused, and loss and every
    LoRA/DoRA gradient equal eager."""
    model = mlp(use_dora=True)
    reports, grads = compiled_as_eager(model, torch.randn(3, 16))
    assert len(grads) == 6  # lora_A, lora_B, magnitude of each layer
    assert not any(r.pattern == "lora" for report in reports for r in report.fusions)
    per_graph = [[m for m in report.misses if m.pattern == "lora"] for report in reports]
    misses = [m for graph in per_graph for m in graph]
    assert len(misses) == len(adapted_layers(model)) == 2
    if len(reports) == 1:
        assert [m.module for m in misses] == adapted_layers(model)
        assert all(m.reason == f"{DORA_REASON} (adapter 'default')" for m in misses)
    else:
        assert all(len(graph) <= 1 for graph in per_graph)
        assert all(m.module == "<DoRA layer>" and m.reason.startswith(DORA_REASON) and "graph of its own" in m.reason
                   for m in misses)


def test_lora_on_a_parameter_is_reported_and_matches_eager():
    """PEFT's ParamWrapper (target_parameters; what all-linear adapts in an MoE model's experts and router) adds B·A
    to the weight: one miss, for the graph computing that product, beside the plain LoRA layer fused; loss and
    every gradient equal eager."""
    reports, grads = compiled_as_eager(mlp(target_modules=["2"], target_parameters=["0.weight"]), torch.randn(3, 16))
    assert len(grads) == 4
    misses = [m for report in reports for m in report.misses]
    assert [(m.pattern, m.module, m.reason) for m in misses] == [("lora", "<LoRA on a parameter>", PARAMETER_REASON)]
    assert [r.pattern for report in reports for r in report.fusions] == ["lora"]  # layer 2, past the break


@pytest.fixture
def dora_in_the_model_graph(monkeypatch):
    """PEFT 0.21's dequantize_module_weight asks `type(weight).__module__.startswith("torchao.")`, which torch 2.13's
    Dynamo cannot trace. For a plain nn.Linear base it returns the weight; with exactly that in its place Dynamo
    traces DoRA inside the model's graph, the form a PEFT or torch without that graph break hands over."""
    monkeypatch.setattr(peft.tuners.lora.dora, "dequantize_module_weight", lambda module: module.weight)


def dora_llama():
    config_cls, model_cls, extra = ARCHITECTURES["llama"]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **extra, "num_hidden_layers": 1, "use_cache": False}))
    return peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                      init_lora_weights=False, use_dora=True))


@pytest.mark.parametrize("make, example, layers", [
    (lambda: mlp(use_dora=True), lambda: torch.randn(3, 16), 2),
    (dora_llama, lambda: torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)), 7),
], ids=["mlp", "llama"])
def test_dora_in_the_model_graph_is_one_miss_per_adapted_layer(dora_in_the_model_graph, make, example, layers):
    """Each DoRA layer traces two lora_B linears (its B·A weight product and its activation path): one miss, under
    the adapted layer's path, none for the weight product."""
    model = make()
    gm, inputs, expected, report, fused = run_pass(fuse_lora, model, example())
    assert fused == 0 and report.fusions == []
    assert [m.module for m in report.misses] == adapted_layers(model) and len(report.misses) == layers
    assert all(m.pattern == "lora" and m.reason == f"{DORA_REASON} (adapter 'default')" for m in report.misses)
    assert relative_error(first_output(gm, inputs), expected) <= 1e-6


def test_dora_next_to_a_plain_second_adapter(dora_in_the_model_graph):
    """DoRA and a plain LoRA adapter both active: one DoRA miss per layer, and the second adapter's miss as without
    DoRA."""
    model = mlp(use_dora=True)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])
    gm, inputs, expected, report, fused = run_pass(fuse_lora, model, torch.randn(3, 16))
    assert fused == 0
    assert [(m.module, m.reason.startswith(DORA_REASON)) for m in report.misses] == [
        ("base_model.model.0", True), ("base_model.model.0.lora_B.second", False),
        ("base_model.model.2", True), ("base_model.model.2.lora_B.second", False)]
    assert "several active adapters" in report.misses[1].reason
    assert relative_error(first_output(gm, inputs), expected) <= 1e-6


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("merge", ["merge_adapter", "merge_and_unload"])
def test_merged_adapters_leave_no_lora_nodes_and_no_misses(merge, use_dora):
    model = mlp(use_dora=use_dora)
    x = torch.randn(3, 16)
    with torch.no_grad():
        unmerged = model(x)
    model = getattr(model, merge)() or model  # merge_adapter merges in place and returns None
    gm, inputs, expected, report, fused = run_pass(fuse_lora, model, x)
    assert not [n for n in gm.graph.nodes if "lora_" in module_path(n) or "lora_" in n.name]
    assert fused == 0 and report.fusions == [] and report.misses == []
    assert relative_error(expected, unmerged) <= 1e-5


# --- what it saves, and whole models ----------------------------------------------------------------------

def compiled_step_saves(options):
    """One compiled forward + backward of a bf16 model whose adapters PEFT keeps in fp32: (every tensor autograd
    held between the two, the report's saved_for_backward before the backward, and after it)."""
    torch._dynamo.reset()
    model = tiny_lora_model("llama", torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    ids = torch.randint(0, 128, (2, 16))
    held = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t):
        loss = torch.compile(model, backend="graphopt", options=options)(input_ids=ids, labels=ids).loss
    before = graphopt.last_report().saved_for_backward
    loss.backward()
    return held, before, graphopt.last_report().saved_for_backward


def saved_fp32_activations(options):
    """Shapes of fp32 tensors [tokens, hidden] the compiled forward saves for the backward."""
    held, _, _ = compiled_step_saves(options)
    return [tuple(t.shape) for t in held if t.dtype == torch.float32 and t.dim() >= 2 and t.shape[-1] in (64, 128)
            and t.numel() >= 2 * 16 * 64]


def test_fused_lora_never_saves_an_fp32_copy_of_its_input():
    assert saved_fp32_activations({**LORA_OFF, **FASTEST}), "unfused, PEFT's fp32 copies of the inputs are saved"
    assert saved_fp32_activations(FASTEST) == []
    assert saved_fp32_activations({}) == []


def test_partitioner_recomputes_the_gated_product_instead_of_saving_it(monkeypatch):
    """The down projection's LoRA backward reads silu(gate)·up. The partitioner (passes/recompute.py)
    recomputes it from gate and up, which the activation's own backward keeps, instead of saving a third
    [tokens × intermediate] tensor per layer; with torch's default ban it is saved."""
    def intermediate_sized(held):  # tiny llama: 2 layers, 2 × 16 tokens, intermediate 128
        return [t for t in held if t.shape[-1] == 128 and t.numel() == 2 * 16 * 128]

    held, _, _ = compiled_step_saves(FASTEST)
    assert len(intermediate_sized(held)) == 2 * 2
    config = recompute.partitioner_config
    monkeypatch.setattr(recompute, "partitioner_config", lambda budget: {
        **config(budget), "ban_recompute_materialized_backward": True})
    held, _, _ = compiled_step_saves(FASTEST)
    assert len(intermediate_sized(held)) == 3 * 2


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_lora_models_match_eager(arch):
    model = tiny_lora_model(arch)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    report = compile_and_compare(model, ids, torch.float32)
    per_layer = 4 if arch == "phi3" else 7  # Phi-3 packs qkv and gate/up into one projection each
    assert report.summary()["lora"] == 2 * per_layer and report.misses == []
    assert graphopt.last_report() is report


def test_report_counts_what_the_forward_saves_and_lora_drops_the_fp32_copies():
    """The report's saved_for_backward is exactly what autograd holds between forward and backward, and with the
    LoRA fusion on, a bf16 model with fp32 adapters keeps no fp32 activation but x·Aᵀ ([tokens, rank 8], which
    PEFT's autograd keeps too)."""
    def saved_report(options):
        held, before, saved = compiled_step_saves(options)
        assert before == saved  # known once the forward compiles: the partitioner decides it then
        assert saved["tensors"] + saved["inputs_kept"] == len(held)
        assert saved["bytes"] + saved["inputs_kept_bytes"] == sum(t.numel() * t.element_size() for t in held)
        return saved

    unfused, fused = saved_report({**LORA_OFF, **FASTEST}), saved_report(FASTEST)
    assert "float32" in [t["dtype"] for t in unfused["largest"]]
    assert [t for t in fused["largest"] if t["dtype"] == "float32" and t["shape"][-1] != 8] == []
    assert fused["bytes"] < unfused["bytes"]
    assert "saved for backward (memory_budget 1): " in graphopt.last_report().to_text()
