"""CPU target: graphopt ops decompose into aten below autograd, so Inductor's C++ backend fuses them into
its generated code while each op's hand-written backward formula stays; lora_linear stays opaque (below)."""

import torch

from graphopt.lowering import ops  # noqa: F401  (defines torch.ops.graphopt.*)
from graphopt.kernels import reference

# lora_linear stays one opaque op: decomposed, Inductor's partitioner chose to save the adapter-dtype (fp32)
# copy of x again, the memory the op exists to avoid; opaque, the backward saves x in its own dtype.
LORA_OPAQUE = "kernels/reference.py matmuls as one op (saves x in its own dtype, not an fp32 copy)"

DECOMPOSITIONS = {
    torch.ops.graphopt.rms_norm.default: reference.rms_norm,
    torch.ops.graphopt.rms_norm_backward.default: reference.rms_norm_backward,
    torch.ops.graphopt.gated_activation.default: reference.gated_activation,
    torch.ops.graphopt.gated_activation_backward.default: reference.gated_activation_backward,
}
_DECOMPOSED = "aten decomposition of kernels/reference.py, compiled by Inductor (C++)"
IMPLEMENTATIONS = {op: _DECOMPOSED for op in DECOMPOSITIONS} | {
    op: LORA_OPAQUE for op in (torch.ops.graphopt.lora_linear.default, torch.ops.graphopt.lora_linear_backward.default)
}
