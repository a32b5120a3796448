"""graphopt's inference ops in ONNX: the com.graphopt domain, version 3 (docs/export.md documents each schema).

Each op is one node of that domain, its schema registered with onnx (onnx.defs), so onnx.checker checks every use
and a runtime that implements the domain runs the fused op; the node's semantics are the op's reference
(kernels/reference.py). torch.onnx's exporter takes the functions below as its custom_translation_table: each
records the node through onnxscript. A runtime without the domain runs the export made with decompose=True
(graphopt/export.py), standard ONNX ops only.
"""

import onnx
import onnxscript
import torch
from onnx.defs import OpSchema

DOMAIN = "com.graphopt"
VERSION = 3  # 2: a LoRA linear is lora_down, then lora_linear taking its XA; 3: the attention ops' window
FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
INTEGERS = ["tensor(int64)", "tensor(int32)"]

_OPSET = onnxscript.values.Opset(DOMAIN, VERSION)


def _input(name, type_str, doc, optional=False):
    option = OpSchema.FormalParameterOption.Optional if optional else OpSchema.FormalParameterOption.Single
    return OpSchema.FormalParameter(name, type_str, doc, param_option=option)


def _attribute(name, kind, doc):
    return OpSchema.Attribute(name, kind, doc, required=True)


_FLOAT, _INT, _STRING = OpSchema.AttrType.FLOAT, OpSchema.AttrType.INT, OpSchema.AttrType.STRING
_OUT_DTYPE = _attribute("out_dtype", _INT, "the output's element type (onnx.TensorProto data type)")
_SCALE = _attribute("scale", _FLOAT, "the factor of q·kᵀ")
_WINDOW = OpSchema.Attribute("window", _INT, "a sliding window: query i attends key j only where i − j < window; "
                                             "absent: no window", required=False)
_ATTENTION_OUTPUTS = [_input("out", "T", "[B, H, L, D] in q's type"),
                      _input("lse", "tensor(float)", "[H, B·L]: each query's log-sum-exp of its scaled scores, 0 "
                                                      "where it attends nothing")]
_QKV = [_input("q", "T", "[B, H, L, D]"), _input("k", "T", "[B, Hk, L, D], H a multiple of Hk (GQA)"),
        _input("v", "T", "[B, Hk, L, D]")]

SCHEMAS = {
    "rms_norm": OpSchema(
        "rms_norm", DOMAIN, VERSION,
        "Y = X·rsqrt(mean(X², last axis) + eps)·(weight + weight_offset), fp32 math, rounded once to out_dtype.",
        inputs=[_input("X", "T", "any leading shape, normalized over the last axis"),
                _input("weight", "T1", "[hidden]; absent: no scale", optional=True)],
        outputs=[_input("Y", "T2", "X's shape")],
        type_constraints=[("T", FLOATS, ""), ("T1", FLOATS, ""), ("T2", FLOATS, "")],
        attributes=[_attribute("eps", _FLOAT, "added to the mean of squares"),
                    _attribute("weight_offset", _FLOAT, "0, or 1 for Gemma's (1 + weight)"), _OUT_DTYPE]),
    "gated_activation": OpSchema(
        "gated_activation", DOMAIN, VERSION,
        "Y = act(gate)·up in fp32 math, rounded to gate's type; act is silu (SwiGLU) or tanh-approximated gelu "
        "(GeGLU).",
        inputs=[_input("gate", "T", ""), _input("up", "T", "gate's shape")],
        outputs=[_input("Y", "T", "gate's shape")],
        type_constraints=[("T", FLOATS, "")],
        attributes=[_attribute("activation", _STRING, "\"silu\" or \"gelu_tanh\"")]),
    "rope": OpSchema(
        "rope", DOMAIN, VERSION,
        "HF's rotary embedding (rotate_half form) of q and k on their first R = cos's last size channels, the rest "
        "passed through: with x = (x1, x2) the halves of those channels, (x1·c1 − x2·s1, x2·c2 + x1·s2), fp32 math.",
        inputs=[_input("q", "T", "[B, Hq, S, D]"), _input("k", "T1", "[B, Hk, S, D]"),
                _input("cos", "T2", "[B or 1, S, R]"), _input("sin", "T2", "[B or 1, S, R]")],
        outputs=[_input("q_out", "T", "q's shape"), _input("k_out", "T1", "k's shape")],
        type_constraints=[("T", FLOATS, ""), ("T1", FLOATS, ""), ("T2", FLOATS, "")]),
    "lora_down": OpSchema(
        "lora_down", DOMAIN, VERSION,
        "XA = (X as lora_a's type)·Aᵀ: a PEFT LoRA linear's down projection, lora_linear's XA (inference: no "
        "dropout).",
        inputs=[_input("X", "T", "[..., in]"), _input("lora_a", "T1", "[r, in]")],
        outputs=[_input("XA", "T1", "[..., r]")],
        type_constraints=[("T", FLOATS, ""), ("T1", FLOATS, "")]),
    "lora_linear": OpSchema(
        "lora_linear", DOMAIN, VERSION,
        "Y = (X·Wᵀ + bias + XA·Bᵀ·scaling) as out_dtype, XA = lora_down(X, lora_a): PEFT's LoRA linear in its "
        "operations and types.",
        inputs=[_input("X", "T", "[..., in]"), _input("weight", "T", "[out, in], the frozen base"),
                _input("bias", "T", "[out]", optional=True), _input("lora_b", "T1", "[out, r]"),
                _input("XA", "T1", "[..., r]")],
        outputs=[_input("Y", "T2", "[..., out]")],
        type_constraints=[("T", FLOATS, ""), ("T1", FLOATS, ""), ("T2", FLOATS, "")],
        attributes=[_attribute("scaling", _FLOAT, "lora_alpha / r"), _OUT_DTYPE]),
    "padded_attention": OpSchema(
        "padded_attention", DOMAIN, VERSION,
        "Causal attention over a padded batch: query i attends key j when j ≤ i and keep[b, i] and keep[b, j]; "
        "query head h reads kv head h // (H / Hk); a query attending nothing outputs 0.",
        inputs=[*_QKV, _input("keep", "tensor(bool)", "[B, L]: attention_mask ≠ 0")],
        outputs=_ATTENTION_OUTPUTS, type_constraints=[("T", FLOATS, "")], attributes=[_SCALE, _WINDOW]),
    "packed_attention": OpSchema(
        "packed_attention", DOMAIN, VERSION,
        "Causal attention within each document of a packed batch: a document starts at a row's first token and "
        "wherever a position is not the one before it plus 1; query i attends key j when j ≤ i in its document.",
        inputs=[*_QKV, _input("position_ids", "T1", "[B, L]")],
        outputs=_ATTENTION_OUTPUTS, type_constraints=[("T", FLOATS, ""), ("T1", INTEGERS, "")],
        attributes=[_SCALE, _WINDOW]),
}


def _typed_like(ctx, output, like, elem_type=None, last_dim=None):
    """Output `output`'s type: input `like`'s, its element type and last dimension replaced where given."""
    inferred = onnx.TypeProto()
    inferred.CopyFrom(ctx.get_input_type(like))
    tensor = inferred.tensor_type
    if elem_type is not None:
        tensor.elem_type = elem_type
    if last_dim is not None and tensor.HasField("shape") and tensor.shape.dim:
        tensor.shape.dim[-1].CopyFrom(last_dim)
    ctx.set_output_type(output, inferred)


def _out_dtype(ctx):
    return ctx.get_attribute("out_dtype").i


def _infer_lora_down(ctx):
    lora_a = ctx.get_input_type(1).tensor_type
    _typed_like(ctx, 0, 0, lora_a.elem_type, lora_a.shape.dim[0] if _has_dims(lora_a) else None)


def _infer_lora_linear(ctx):
    weight = ctx.get_input_type(1).tensor_type
    _typed_like(ctx, 0, 0, _out_dtype(ctx), weight.shape.dim[0] if _has_dims(weight) else None)


def _has_dims(tensor_type):
    return tensor_type.HasField("shape") and bool(tensor_type.shape.dim)


def _infer_attention(ctx):
    _typed_like(ctx, 0, 0)
    lse = onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, [None, None])
    ctx.set_output_type(1, lse)


# What the outputs' types are, so that ONNX's shape inference (and the exporter's optimizer) type the values
# every com.graphopt node writes.
_INFERENCE = {
    "rms_norm": lambda ctx: _typed_like(ctx, 0, 0, _out_dtype(ctx)),
    "gated_activation": lambda ctx: _typed_like(ctx, 0, 0),
    "rope": lambda ctx: (_typed_like(ctx, 0, 0), _typed_like(ctx, 1, 1)),
    "lora_down": _infer_lora_down,
    "lora_linear": _infer_lora_linear,
    "padded_attention": _infer_attention,
    "packed_attention": _infer_attention,
}
for _name, _schema in SCHEMAS.items():
    _schema.set_type_and_shape_inference_function(_INFERENCE[_name])
    if not onnx.defs.has(_name, DOMAIN):
        onnx.defs.register_schema(_schema)
_OPS = {name: onnxscript.values.Op(_OPSET, name, schema) for name, schema in SCHEMAS.items()}


# --- the translations: graphopt op (its FX arguments) → one com.graphopt node --------------------------------

def rms_norm(x, weight, eps: float, weight_offset: float, out_dtype: int):
    return _OPS["rms_norm"](x, weight, eps=eps, weight_offset=weight_offset, out_dtype=out_dtype)


def gated_activation(gate, up, activation: str):
    return _OPS["gated_activation"](gate, up, activation=activation)


def rope(q, k, cos, sin):
    return _OPS["rope"](q, k, cos, sin)


def lora_down(x, lora_a, dropout_mask=None, dropout_p: float = 0.0):
    return _OPS["lora_down"](x, lora_a)


def lora_linear(x, weight, bias, lora_a, lora_b, xa, scaling: float, out_dtype: int, dropout_mask=None,
                dropout_p: float = 0.0):
    return _OPS["lora_linear"](x, weight, bias, lora_b, xa, scaling=scaling, out_dtype=out_dtype)


def _window(window):
    return {} if window is None else {"window": window}


def padded_attention(q, k, v, keep, scale: float, window=None):
    return _OPS["padded_attention"](q, k, v, keep, scale=scale, **_window(window))


def packed_attention(q, k, v, position_ids, scale: float, window=None):
    return _OPS["packed_attention"](q, k, v, position_ids, scale=scale, **_window(window))


TRANSLATIONS = {getattr(torch.ops.graphopt, name).default: globals()[name] for name in SCHEMAS}


def check(node) -> None:
    """ExportError for a graphopt op call that com.graphopt has no translation for."""
    from graphopt.export import ExportError

    if node.target not in TRANSLATIONS:
        raise ExportError(f"{node.target} has no com.graphopt translation: export with decompose=True (standard ONNX "
                          f"ops), format=\"torch\", or leave its fusion out (options={{\"fusions\": {{...: False}}}})")


def to_onnx(program, input_names, output_names):
    """The ONNX program of an ExportedProgram, graphopt's ops as com.graphopt nodes (or none, decomposed)."""
    onnx_program = torch.onnx.export(program, dynamo=True, custom_translation_table=TRANSLATIONS,
                                     input_names=input_names, output_names=output_names, verbose=False)
    first = onnx_program.model.graph.inputs[0].shape
    onnx_program.rename_axes({first[0]: "batch", first[1]: "seq"})  # the names graphopt/export.py gives them
    return onnx_program
