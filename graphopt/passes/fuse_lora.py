"""PEFT LoRA Linear → graphopt::lora_down (x·Aᵀ) and graphopt::lora_linear, or graphopt::lora_linear_4bit over a
bitsandbytes 4-bit base.

Matches (after passes/normalize.py) what PEFT's lora.Linear.forward records:
  base = linear(x, W[, bias]);  xa = linear(x[.to(adapter dtype)], A);  out = base + linear(xa, B) * scaling
  [→ .to(result dtype)]
with one active adapter and a frozen plain-linear base, or a bitsandbytes 4-bit base (QLoRA, below). PEFT's
lora_dropout sits between the cast and lora_A: in eval mode (training=False) it is the identity and drops out of
the match; in training it becomes a keep mask drawn in the graph, as CPU eager's dropout draws it
(empty_like(x).bernoulli_(1 - p); under Inductor from its own random stream, as any compiled dropout), which the op
applies to the adapters' input in the forward and to their gradient in the backward. Every linear traced inside a
`lora_B` module is a candidate; one that does not match in full (several active adapters, a trainable base, a
lora_B bias, an in-place or non-constant dropout) stays unfused with a miss record.

A bitsandbytes 4-bit base (`Linear4bit`, NF4 or FP4, double-quantized or not) becomes graphopt::lora_linear_4bit.
bitsandbytes' 4-bit matmul is an autograd.Function, which Dynamo records as one higher-order call whose forward is a
subgraph of its own; PEFT's bnb layer then clones the result:
  xc = x[.to(compute dtype)];  out = autograd_function_apply(fwd, bwd, W.view(-1, 1), xc, *quant state)[0]
  base = out[.to(x's dtype)][.clone()]
where fwd is bitsandbytes::gemm_4bit(xc, B, shape, absmax, blocksize, quant_type, bias=, absmax_8bit=, …) and
nothing else: the op takes gemm_4bit's arguments; where no input needs a gradient Dynamo inlines the Function and
gemm_4bit sits in the graph itself. Under torch.autocast (HF's bf16=True) bitsandbytes still computes the base in
its compute dtype while the adapters run in the autocast dtype, and PEFT adds the base, cast back to x's dtype,
to their output: the op's autocast rule casts x, the bias and the adapters (lowering/ops.py), so the fusion holds
where the compute dtype is the autocast dtype. A base computing in another dtype than its input (without
autocast) or than the autocast dtype, a forward of another form (another bitsandbytes version) and LLM.int8
(`Linear8bitLt`) stay unfused with a miss that says which.

DoRA (use_dora=True) is never fused; it gets one miss per DoRA adapter the graph shows, never two. Dynamo hands
it over in one of two forms:
  * inside the model's graph (when Dynamo can trace PEFT's DoRA code): per adapted layer, two lora_B linears in
    a DoraLinearLayer: lora_B(lora_A(torch.eye)), DoRA's B·A product for its weight norm, and lora_B(lora_A(x)),
    its activation path. One miss, at the activation path, under the adapted layer's module path.
  * apart from the model (PEFT 0.21 with torch 2.13): peft's dequantize_module_weight breaks the graph inside the
    adapter loop of lora.Linear.forward, so Dynamo skips that frame (the base linear, and any other active
    adapter of the layer, run eagerly, in no graph) and compiles only DoraLinearLayer.forward, split at the
    break: the weight product in one graph, the activation path in the next, under the frame's own `lora_B`
    argument (`L['lora_B']`), with nothing that names the layer. Dynamo reuses these graphs for every DoRA layer
    whose shapes fit (after a recompile, any shapes), so the backend sees fewer graphs than DoRA layers: one miss
    per activation graph, named `<DoRA layer>`, whose reason says it stands for every layer that graph runs.

LoRA on a parameter (PEFT's ParamWrapper: `target_parameters`, and what `all-linear` adapts in an MoE model, its
experts' weights and its router) is never fused either: PEFT adds B·A to the weight itself, through
torch.nn.utils.parametrize, and the model multiplies by the sum, so no lora_B linear exists. Dynamo breaks the
graph inside PEFT there (parametrize's in-place swap of the parameter) and compiles each B·A product
(`get_delta_weight`, or `get_delta_factors` for experts) as a graph of its own, which names no layer: one miss
per such graph, named `<LoRA on a parameter>`.
"""

import operator
import re

import torch
from torch.fx import GraphModule, Node

from graphopt.passes.describe import module_classes, module_path, record_for, source_location
from graphopt.passes.match import (FUSABLE_DTYPES, autocast_dtype, autocast_regions, is_call, is_cast, is_scalar,
                                   is_tensor, only_user, value)
from graphopt.passes.rewrite import Miss, replace

PATTERN = "lora"
PATTERN_4BIT = "lora_4bit"  # the same fusion over a bitsandbytes 4-bit base (QLoRA)
_LINEAR = (torch._C._nn.linear, torch.nn.functional.linear)
_DROPOUT = (torch.nn.functional.dropout, torch.dropout)
_DORA_SOURCE = re.compile(r'File "[^"]*[/\\]peft[/\\]tuners[/\\]lora[/\\]dora\.py"')
DORA_REASON = ("DoRA (use_dora=True) is computed unfused: graphopt::lora_linear has no DoRA magnitude / "
               "weight-norm scaling")
DORA_APART = ("; Dynamo compiled PEFT's DoRA forward as a graph of its own (a graph break inside PEFT), which does "
              "not name the layer and is reused for other DoRA layers: this record stands for every DoRA layer "
              "this graph runs")

# PEFT computes a parameter's B·A in these functions; a LoRA layer's forward never calls them in training
_PARAMETER_DELTA_SOURCE = re.compile(
    r'File "[^"]*[/\\]peft[/\\]tuners[/\\]lora[/\\]layer\.py", line \d+, in get_delta_(?:weight|factors)\b')
PARAMETER_REASON = ("LoRA on a parameter (PEFT's ParamWrapper: target_parameters, and an MoE model's experts and "
                    "router under all-linear) is computed unfused: PEFT adds B·A to the weight itself, where "
                    "graphopt::lora_linear takes the layer's input; Dynamo compiled the product as a graph of its own "
                    "(a graph break inside PEFT), which does not name the parameter and may serve others: this "
                    "record stands for every parameter this graph computes B·A for")


def _linear_args(node: Node):
    args = list(node.args) + [node.kwargs.get("bias")] * (3 - len(node.args))
    return args[0], args[1], args[2]


def _is_lora_b(node: Node) -> bool:
    """A linear traced in a `…lora_B.<adapter>` module of the compiled model."""
    parts = module_path(node).split(".")
    return is_call(node, *_LINEAR) and len(parts) >= 2 and parts[-2] == "lora_B"


def _is_frame_lora_b(node: Node) -> bool:
    """A linear traced in the compiled frame's own `lora_B` argument (PEFT's DoRA forward compiled apart)."""
    stack = node.meta.get("nn_module_stack")
    return is_call(node, *_LINEAR) and bool(stack) and list(stack.values())[-1][0] == "L['lora_B']"


def _in_dora(node: Node) -> bool:
    """Traced in PEFT's DoRA code: inside a Dora*Layer module, or with PEFT's dora.py on the traced stack."""
    return (any(name.startswith("Dora") for name in module_classes(node))
            or bool(_DORA_SOURCE.search(node.meta.get("stack_trace") or "")))


def _is_dora_weight_product(lora_b: Node) -> bool:
    """lora_B(lora_A(torch.eye(...))): DoRA's B·A product for its weight norm, not the layer's activation path."""
    a_out = lora_b.args[0] if lora_b.args else None
    return is_call(a_out, *_LINEAR) and bool(a_out.args) and is_call(a_out.args[0], torch.eye)


def _dora_miss(lora_b: Node, in_model: bool):
    record = record_for(lora_b, PATTERN, DORA_REASON)
    if in_model:  # …<layer>.lora_B.<adapter>: the record names the adapted layer and the adapter
        *layer, _, adapter = record.module.split(".")
        record.module = ".".join(layer) or "<root>"
        record.reason = f"{DORA_REASON} (adapter '{adapter}')"
    else:
        record.module = "<DoRA layer>"
        record.reason = DORA_REASON + DORA_APART
    return record


def _match(lora_b: Node, autocast):
    a_out, b_weight, b_bias = _linear_args(lora_b)
    if b_bias is not None:
        raise Miss("lora_B has a bias (lora_bias=True)")
    if not is_call(a_out, *_LINEAR) or len(a_out.users) != 1:
        raise Miss("lora_B's input is not the lora_A projection alone (DoRA or a variant)")
    x_adapter, a_weight, a_bias = _linear_args(a_out)
    if a_bias is not None:
        raise Miss("lora_A has a bias")
    dropout_p, dropped = 0.0, []
    if is_call(x_adapter, *_DROPOUT):
        dropout_p, dropped, x_adapter = _dropout(x_adapter), [x_adapter], x_adapter.args[0]
    x = x_adapter.args[0] if is_cast(x_adapter) else x_adapter
    if x_adapter is not x and len(x_adapter.users) != 1:
        raise Miss("the adapter-dtype copy of the input is also used elsewhere")

    mul = only_user(lora_b)
    if not is_call(mul, torch.mul) or len(mul.args) != 2 or mul.args[0] is not lora_b:
        raise Miss("lora_B's output is not scaled once")
    scaling = mul.args[1]
    # a constant, or under torch.compile(dynamic=True) a float the graph reads at each call (Dynamo passes float
    # attributes as graph inputs): the op takes it as it comes, so a changed scaling is used, never a stale one
    if not (is_scalar(scaling) or isinstance(value(scaling), torch.SymFloat)):
        raise Miss("the LoRA scaling is neither a constant nor a float read by the graph")
    add, lora_out = only_user(mul), mul
    if is_cast(add):  # PEFT's bitsandbytes layers cast the LoRA output to the result's dtype, then add (the op
        lora_out, add = add, only_user(add)  # rounds once, after its fp32 add: at most eager's rounding apart)
    if not is_call(add, torch.add) or len(add.args) != 2 or add.kwargs:
        raise Miss("the scaled LoRA output is not added to the base output")
    base = add.args[0] if add.args[1] is lora_out else add.args[1]
    if not is_call(base, *_LINEAR) and "Linear8bitLt" in module_classes(lora_b):  # PEFT's layer for an 8-bit base
        raise Miss("an 8-bit base (bitsandbytes' LLM.int8, load_in_8bit) is not fused: graphopt's op takes 4-bit "
                   "bases (load_in_4bit)")
    # PEFT's bitsandbytes layers clone the base output; a graph input there was computed before a graph break
    if (base.args[0] if base.op == "call_method" and base.target == "clone" else base).op == "placeholder":
        raise Miss("the base output is computed outside this graph (a graph break inside the layer)" + (
            ": bitsandbytes' quantized weights that FSDP2 shards break it (Dynamo cannot trace the swaps of their "
            ".data); fully_shard(..., ignored_params=those weights) keeps them whole on each rank"
            if "lora/bnb.py" in source_location(base) else ""))
    quantized = _quantized_base(base, x, autocast)
    if quantized is not None:
        base_args, base_nodes = quantized
    elif is_call(base, *_LINEAR):
        base_x, weight, bias = _linear_args(base)
        if base_x is not x:
            raise Miss("the base linear and the adapters do not read the same input")
        base_args, base_nodes = (weight, bias), [base]
    else:
        raise Miss("the base output is neither a plain linear nor bitsandbytes' 4-bit matmul (several active "
                   "adapters, an 8-bit or DoRA base)")
    if len(base.users) != 1:
        raise Miss("the base output is also read outside the LoRA layer")
    for t in (base_args[0], base_args[-1]) if quantized is None else (base_args[5],):  # weight and bias; 4-bit: bias
        if t is not None and (not is_tensor(t) or value(t).requires_grad):
            raise Miss("the base weight or bias trains (requires_grad); the fused op keeps them frozen")
    if value(x).dtype not in FUSABLE_DTYPES:
        raise Miss(f"input dtype {value(x).dtype} is not float32, bfloat16 or float16")

    end = add
    if (user := only_user(add)) is not None and is_cast(user):
        end = user
    scaling = float(scaling) if is_scalar(scaling) else scaling
    nodes = [end, add, lora_out, mul, lora_b, a_out, *base_nodes] + dropped + (
        [x_adapter] if x_adapter is not x else [])
    return (x, *base_args, a_weight, b_weight, scaling), dropout_p, end, nodes, quantized is not None


def _quantized_base(base: Node, x: Node, autocast):
    """(lora_linear_4bit's base arguments: packed, shape, absmax, blocksize, quant_type, bias, absmax_8bit,
    absmax_code, absmax_offset; the nodes that compute the base) when base is bitsandbytes' 4-bit matmul of x
    (see the module's docstring), None when it is not that call at all; Miss when it is, in a form not fused.
    autocast: the dtype of the autocast region the layer runs in, or None."""
    nodes, node = [], base
    if node.op == "call_method" and node.target == "clone" and len(node.args) == 1 and not node.kwargs:
        nodes, node = nodes + [node], node.args[0]
    if is_cast(node):
        nodes, node = nodes + [node], node.args[0]
    if _op_name(node.target) == "bitsandbytes::gemm_4bit":  # no input needs a gradient: traced inline
        gemm, apply, outer = node, None, {}
    else:
        apply = node.args[0] if is_call(node, operator.getitem) and node.args[1] == 0 else None
        if not is_call(apply, torch.ops.higher_order.autograd_function_apply):
            return None
        forward = getattr(apply.graph.owning_module, apply.args[0].target)
        calls = [n for n in forward.graph.nodes
                 if n.op == "call_function" and _op_name(n.target) != "_set_grad_enabled"]
        gemm = calls[0] if len(calls) == 1 and _op_name(calls[0].target) == "bitsandbytes::gemm_4bit" else None
        if gemm is None:
            raise Miss("the base is an autograd.Function other than bitsandbytes' 4-bit matmul as graphopt knows it "
                       f"(its forward calls {', '.join(_op_name(n.target) for n in calls) or 'nothing'})")
        outer = dict(zip(forward.graph.find_nodes(op="placeholder"), apply.args[2:]))  # its inputs → this graph's

    def ours(arg):
        return outer.get(arg, arg) if isinstance(arg, Node) else arg

    args = dict(zip(("A", "B", "shapeB", "absmax", "blocksize", "quant_type"), gemm.args)) | gemm.kwargs
    packed = args["B"]
    if not (packed.op == "call_method" and packed.target == "view" and packed.args[1:] == (-1, 1)):
        raise Miss("bitsandbytes' 4-bit matmul reads its packed weight in a form graphopt does not know")
    # inside the Function's forward the view is of its input, already W.view(-1, 1) here; inline it is that view
    packed = ours(packed.args[0]) if apply is not None else packed

    computed = ours(args["A"])
    if computed is not x and not (is_cast(computed) and computed.args[0] is x):
        raise Miss("the 4-bit base and the adapters do not read the same input")
    if autocast is not None and value(computed).dtype != autocast:
        raise Miss(f"the 4-bit base computes in {value(computed).dtype} under torch.autocast to {autocast} "
                   f"(bnb_4bit_compute_dtype differs from the autocast dtype): not fused, so as not to change the "
                   f"base's rounding")
    if autocast is None and value(computed).dtype != value(x).dtype:
        raise Miss(f"the 4-bit base computes in {value(computed).dtype}, its input is {value(x).dtype} "
                   f"(bnb_4bit_compute_dtype differs from the model's dtype): not fused, so as not to change the "
                   f"base's rounding")
    if args["quant_type"] not in ("nf4", "fp4"):
        raise Miss(f"bitsandbytes quant_type {args['quant_type']!r} is not NF4 or FP4")
    base_args = (packed, list(args["shapeB"]), ours(args["absmax"]), args["blocksize"], args["quant_type"],
                 ours(args.get("bias")), ours(args.get("absmax_8bit")), ours(args.get("absmax_code")),
                 ours(args.get("absmax_offset")))
    return base_args, nodes + [node] + ([apply] if apply is not None else []) + (
        [computed] if computed is not x else [])


def _op_name(target) -> str:
    return target.name() if hasattr(target, "name") else getattr(target, "__name__", str(target))


def _dropout(node: Node) -> float:
    """The probability a training-mode dropout drops with (0.0 in eval mode: the identity)."""
    names = ("input", "p", "training", "inplace") if node.target is torch.nn.functional.dropout else (
        "input", "p", "train")
    args = dict(zip(names, node.args)) | node.kwargs
    p, training = args.get("p", 0.5), args.get("training", args.get("train", True))
    if args.get("inplace", False):
        raise Miss("the LoRA dropout is in place")
    if not isinstance(training, bool) or not is_scalar(p) or not 0 <= p < 1:
        raise Miss(f"the LoRA dropout's p={p!r} or training={training!r} is not a constant (p in [0, 1))")
    if len(node.users) != 1:
        raise Miss("the dropped input is also used elsewhere")
    return float(p) if training else 0.0


def _keep_mask(gm: GraphModule, x: Node, adapter_dtype: torch.dtype, p: float) -> Node:
    """Nodes drawing the elements a dropout of x keeps: CPU eager's draw, empty_like(x).bernoulli_(1 - p)."""
    noise = gm.graph.call_function(torch.empty_like, (x,), {"dtype": adapter_dtype})
    drawn = gm.graph.call_method("bernoulli_", (noise, 1.0 - p))
    keep = gm.graph.call_method("to", (drawn, torch.bool))
    fake = value(x)
    noise.meta = dict(x.meta, example_value=torch.empty_like(fake, dtype=adapter_dtype))
    drawn.meta = dict(noise.meta)
    keep.meta = dict(x.meta, example_value=torch.empty_like(fake, dtype=torch.bool))
    return keep


def fuse_lora(gm: GraphModule, report) -> int:
    """Replace each matched LoRA linear with graphopt::lora_down (x·Aᵀ) and graphopt::lora_linear (or
    lora_linear_4bit) taking it; record fusions and misses."""
    fused = 0
    dora_recorded = set()
    regions = autocast_regions(gm.graph)
    for lora_b in [n for n in gm.graph.nodes if _is_lora_b(n) or _is_frame_lora_b(n)]:
        in_model = _is_lora_b(lora_b)
        if _in_dora(lora_b):
            if not _is_dora_weight_product(lora_b) and module_path(lora_b) not in dora_recorded:
                dora_recorded.add(module_path(lora_b))
                report.misses.append(_dora_miss(lora_b, in_model))
            continue
        if not in_model:
            continue  # a frame's own lora_B outside DoRA: not a candidate (as before)
        try:
            autocast = autocast_dtype(regions[lora_b], value(lora_b).device.type)
            args, dropout_p, end, nodes, quantized = _match(lora_b, autocast)
        except Miss as miss:
            report.misses.append(record_for(lora_b, PATTERN, str(miss)))
            continue
        x, lora_a = args[0], args[-3]
        with gm.graph.inserting_before(end):
            dropout = (_keep_mask(gm, x, value(lora_a).dtype, dropout_p), dropout_p) if dropout_p else ()
            xa = gm.graph.call_function(torch.ops.graphopt.lora_down.default, (x, lora_a, *dropout))
        xa.meta = dict(end.meta, example_value=value(_linear_args(lora_b)[0]))  # lora_A's output, as autocast made it
        target = torch.ops.graphopt.lora_linear_4bit.default if quantized else torch.ops.graphopt.lora_linear.default
        op = replace(end, target, (*args[:-1], xa, args[-1], value(end).dtype, *dropout), dead=nodes)
        report.fusions.append(record_for(op, PATTERN_4BIT if quantized else PATTERN))
        fused += 1
    delta = next((n for n in gm.graph.nodes if _PARAMETER_DELTA_SOURCE.search(n.meta.get("stack_trace") or "")),
                 None)
    if delta is not None:
        record = record_for(delta, PATTERN, PARAMETER_REASON)
        record.module = "<LoRA on a parameter>"
        report.misses.append(record)
    _erase_unused_subgraphs(gm)
    gm.recompile()
    return fused


def _erase_unused_subgraphs(gm: GraphModule) -> None:
    """The forward and backward subgraphs of the 4-bit matmuls fused away: nothing reads them any more."""
    for node in gm.graph.find_nodes(op="get_attr"):
        if not node.users and isinstance(getattr(gm, node.target, None), GraphModule):
            gm.graph.erase_node(node)
            delattr(gm, node.target)
