"""CPU target: graphopt ops decompose into aten below autograd, so Inductor's C++ backend fuses them into
its generated code while each op's hand-written backward formula (and what it saves) stays."""

import torch

from graphopt.lowering import ops  # noqa: F401  (defines torch.ops.graphopt.*)
from graphopt.kernels import reference

DECOMPOSITIONS = {
    torch.ops.graphopt.rms_norm.default: reference.rms_norm,
    torch.ops.graphopt.rms_norm_backward.default: reference.rms_norm_backward,
    torch.ops.graphopt.gated_activation.default: reference.gated_activation,
    torch.ops.graphopt.gated_activation_backward.default: reference.gated_activation_backward,
}
IMPLEMENTATION = "aten decomposition of kernels/reference.py, compiled by Inductor (C++)"
