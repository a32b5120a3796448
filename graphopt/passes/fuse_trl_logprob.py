"""TRL's chunked log-prob head → graphopt::linear_logprobs, which never holds the [tokens × vocab] logits at once.

TRL's trainers (SFT, DPO, GRPO, KTO, RLOO) patch the model's forward (trl/trainer/utils.py add_fused_lm_head): the
backbone's last hidden states and the next-token labels go to ChunkedLogProbFunction (trl/kernels/chunked_logprob.py),
an autograd.Function returning per-token log-probabilities and, as asked, entropy, log Σ p², mean logit and
is_top1. Left to itself, Dynamo cannot trace that Function: its forward writes each logits tile with torch.mm into
a non-contiguous out= view (a graph break), and PEFT's forward-hook context around the model makes the break skip
the whole PeftModel frame, so no graph the backend sees holds the head; TRL's code then runs between the graphs
(on the GPU, its Triton kernels are compiled by Inductor in the Function's own frames, which TRL 1.15 fails: fp64
scalars in a loop-carried fp32 variable).

So this module shows the head to Dynamo as one call (expose_trl_head, when the backend is loaded), for the TRL
releases whose head it was checked against (VERIFIED_TRL): the Function is allowed in the graph
(torch._dynamo.allow_in_graph), so Dynamo records one call of its apply and finds the outputs' shapes by running it
on fake tensors. Its forward and backward are wrapped to make that safe, and run TRL's code unchanged on real
tensors (_traceable):
- under Dynamo's shape propagation (a fake mode, no tracer recording ops) the forward returns empty outputs of
  TRL's shapes, dtypes and autograd flags: TRL's loop over token chunks (range over the token count) would
  specialize every batch size into a recompile;
- traced by aot_autograd (a call left unfused), both take TRL's torch path (its `_use_triton` answers False
  meanwhile) instead of launching its Triton kernels on tensors without data.
Other TRL releases are not exposed: Dynamo breaks the graph at their head as before, their Function runs uncompiled
(torch._dynamo.disable: compiled in its own frames, TRL 1.15's Triton kernel fails in Inductor), and each graph
that TRL's patched forward contributed to gets a miss saying why.

The pass then replaces each call it can prove: TRL's class from its module, the forward's parameters and optional
outputs as read there, a frozen bias, a positive temperature, softcapping None or positive, constant scalars,
outputs read by index only. The projection runs in the autocast dtype of the call's region (TRL reads it), else
hidden's. Anything else stays TRL's call, with a miss: aot_autograd then traces TRL's torch path, which computes
what TRL computes.
"""

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from graphopt.passes.describe import record_for, source_location
from graphopt.passes.fuse_linear_ce import LOGITS_CHUNK_BYTES
from graphopt.passes.match import FUSABLE_DTYPES, autocast_dtype, autocast_regions, is_scalar, value
from graphopt.passes.rewrite import Miss, replace

PATTERN = "trl_logprobs"
TRL_MODULE = "trl.kernels.chunked_logprob"
TRL_FUNCTION = "ChunkedLogProbFunction"
# TRL releases whose head was read against kernels/reference.py (forward, backward, the patched model forward)
VERIFIED_TRL = ("1.16",)
_PARAMETERS = ("ctx", "hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
               "logit_scale", "outputs")
# the Function's outputs, by position; the op returns them at the same positions (then log_z)
_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _trl_version() -> str:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def _torch_path(module):
    """TRL's torch path instead of its Triton kernels, which cannot run on fake tensors (no data)."""
    use_triton = module._use_triton
    module._use_triton = lambda device: False
    try:
        yield
    finally:
        module._use_triton = use_triton


def _traceable(function, module):
    """TRL's forward and backward, unchanged on real tensors (see the module's docstring)."""
    forward, backward = function.forward, function.backward

    @functools.wraps(forward)
    def forward_when_traced(ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                            logit_scale=1.0, outputs=_OUTPUTS[1:]):
        args = (ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                outputs)
        if torch._guards.detect_fake_mode() is None:
            return forward(*args)
        if get_proxy_mode() is None:  # Dynamo's shape propagation
            rows = hidden.shape[0]
            per_token = [hidden.new_empty(rows, dtype=torch.bool if name == "is_top1" else torch.float32)
                         if name == "log_probs" or name in outputs else None for name in _OUTPUTS]
            ctx.mark_non_differentiable(*(t for t in per_token[2:] if t is not None))  # as TRL marks them
            return tuple(per_token)
        with _torch_path(module):
            return forward(*args)

    @functools.wraps(backward)
    def backward_when_traced(ctx, *grads):
        if torch._guards.detect_fake_mode() is None:
            return backward(ctx, *grads)
        with _torch_path(module):
            return backward(ctx, *grads)

    forward_when_traced.graphopt_wraps = forward
    return staticmethod(forward_when_traced), staticmethod(backward_when_traced)


def expose_trl_head():
    """Show TRL's head to Dynamo as one call (see the module's docstring). Returns why an installed TRL's head is
    not shown, else None."""
    if importlib.util.find_spec("trl") is None:
        return None
    try:
        module = importlib.import_module(TRL_MODULE)
    except ImportError as error:
        return f"{TRL_MODULE} does not import ({error})"
    function, version = getattr(module, TRL_FUNCTION), _trl_version()
    if ".".join(version.split(".")[:2]) not in VERIFIED_TRL:
        # Dynamo breaks the graph at the head; left to compile TRL's own frames, Inductor fails on TRL 1.15's
        # kernel (fp64 scalars in an fp32 loop variable): they run as TRL wrote them
        if not hasattr(function.forward, "_torchdynamo_disable"):
            function.forward = staticmethod(torch._dynamo.disable(function.forward))
            function.backward = staticmethod(torch._dynamo.disable(function.backward))
        return (f"TRL {version}'s head is not shown to Dynamo (graphopt::linear_logprobs was checked against TRL "
                f"{', '.join(VERIFIED_TRL)} only): it runs uncompiled, as TRL's code, between graphopt's graphs")
    if not hasattr(function.forward, "graphopt_wraps"):
        function.forward, function.backward = _traceable(function, module)
    torch._dynamo.allow_in_graph(function)
    return None


NOT_EXPOSED = expose_trl_head()  # why TRL's head never reaches a graph, or None


def trl_function(node: Node):
    """TRL's Function class when node is Dynamo's call of its apply (the trampoline allow_in_graph records), else
    None."""
    origin = getattr(node.target, "_origin", None) if node.op == "call_function" else None
    if getattr(origin, "__name__", "") != "produce_trampoline_autograd_apply":
        return None
    fn_cls = inspect.getclosurevars(node.target).nonlocals.get("fn_cls")
    named = (getattr(fn_cls, "__module__", None), getattr(fn_cls, "__qualname__", None))
    return fn_cls if named == (TRL_MODULE, TRL_FUNCTION) else None


def _arguments(fn_cls, node: Node) -> dict:
    forward = inspect.signature(fn_cls.forward)
    if tuple(forward.parameters) != _PARAMETERS:
        raise Miss(f"ChunkedLogProbFunction.forward{forward} is not the form graphopt knows "
                   f"({', '.join(_PARAMETERS)})")
    if tuple(getattr(importlib.import_module(fn_cls.__module__), "OPTIONAL_OUTPUTS", ())) != _OUTPUTS[1:]:
        raise Miss(f"TRL's OPTIONAL_OUTPUTS are not {_OUTPUTS[1:]}")
    try:
        bound = forward.bind(None, *node.args, **node.kwargs)
    except TypeError as error:
        raise Miss(f"unexpected ChunkedLogProbFunction arguments ({error})")
    bound.apply_defaults()
    return bound.arguments


def _match(fn_cls, node: Node, regions: dict) -> dict:
    args = _arguments(fn_cls, node)
    hidden, weight, bias, targets = (value(args[name]) for name in ("hidden", "weight", "bias", "targets"))
    if not all(isinstance(t, torch.Tensor) for t in (hidden, weight, targets)) or not (
            bias is None or isinstance(bias, torch.Tensor)):
        raise Miss("hidden, weight or targets is not a tensor")
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1 or targets.dtype != torch.long:
        raise Miss("not [tokens, hidden] rows, a [vocab, hidden] weight and int64 targets")
    if hidden.dtype not in FUSABLE_DTYPES or weight.dtype not in FUSABLE_DTYPES:
        raise Miss(f"hidden {hidden.dtype} or weight {weight.dtype} is not float32/bfloat16/float16")
    if bias is not None and bias.requires_grad:
        raise Miss("the lm_head bias trains; the fused op keeps it frozen")
    temperature, softcap, scale = (args[name] for name in ("temperature", "final_logit_softcapping", "logit_scale"))
    if not (is_scalar(temperature) and temperature > 0):
        raise Miss(f"temperature {temperature!r} is not a positive constant")
    if softcap is not None and not (is_scalar(softcap) and softcap > 0):
        # TRL caps at `softcap or 1.0`: 0.0 would cap at 1.0, a form graphopt does not reproduce
        raise Miss(f"final_logit_softcapping {softcap!r} is neither None nor a positive constant")
    if not is_scalar(scale):
        raise Miss(f"logit_scale {scale!r} is not a constant")
    outputs = args["outputs"]
    if not (isinstance(outputs, tuple) and set(outputs) <= set(_OUTPUTS)):
        raise Miss(f"outputs {outputs!r}: graphopt knows {_OUTPUTS}")
    asked = [name == "log_probs" or name in outputs for name in _OUTPUTS]
    for user in node.users:
        if not (user.op == "call_function" and user.target is operator.getitem and isinstance(user.args[1], int)
                and 0 <= user.args[1] < len(_OUTPUTS) and asked[user.args[1]]):
            raise Miss("the head's outputs are read otherwise than by the index of a computed output")
    # TRL computes in autocast's dtype, else in hidden's
    compute_dtype = autocast_dtype(regions[node], hidden.device.type) or hidden.dtype
    return dict(args=args, asked=asked, softcap=float(softcap or 0.0), compute_dtype=compute_dtype,
                vocab=weight.shape[0])


def fuse_trl_logprob(gm: GraphModule, report) -> int:
    """Replace each provable call of TRL's head with one graphopt::linear_logprobs node; record fusions and
    misses."""
    fused = 0
    regions = autocast_regions(gm.graph)
    for node in list(gm.graph.nodes):
        fn_cls = trl_function(node)
        if fn_cls is None:
            continue
        try:
            m = _match(fn_cls, node, regions)
        except Miss as miss:
            report.misses.append(record_for(node, PATTERN, str(miss)))
            continue
        a = m["args"]
        chunk_rows = max(1, LOGITS_CHUNK_BYTES // (m["vocab"] * 4))
        op_args = (a["hidden"], a["weight"], a["bias"], a["targets"], float(a["temperature"]), m["softcap"],
                   float(a["logit_scale"]), m["compute_dtype"], *m["asked"][1:], chunk_rows)
        # the getitems read the same positions; TRL's 5-tuple is not the op's value
        op = replace(node, torch.ops.graphopt.linear_logprobs.default, op_args,
                     meta={k: v for k, v in node.meta.items() if k not in ("example_value", "val")})
        rows = value(a["hidden"]).shape[0]
        report.fusions.append(dataclasses.replace(  # typed as the logits it never materializes
            record_for(op, PATTERN), dtype=str(m["compute_dtype"]).removeprefix("torch."),
            shape=[n if isinstance(n, int) else str(n) for n in (rows, m["vocab"])]))
        fused += 1
    if NOT_EXPOSED:
        _miss_unexposed_head(gm, report)
    gm.recompile()
    return fused


def _miss_unexposed_head(gm: GraphModule, report) -> None:
    """Another TRL release's head is never in a graph: a graph that TRL's patched forward contributed to says why."""
    for node in gm.graph.nodes:
        # traced in TRL's forward (add_fused_lm_head), not the backbone; TRL may be installed outside site-packages
        # (`pip install --target` onto PYTHONPATH), whose paths the report keeps whole
        if "trl/trainer/utils.py:" in source_location(node):
            report.misses.append(record_for(node, PATTERN, NOT_EXPOSED))
            return
