"""CUDA target: graphopt ops run as Triton kernels (kernels/), registered for the "cuda" device type.

Inductor compiles the rest of the graph and calls these through the op's dispatcher.
"""

import torch

from graphopt.lowering import ops  # noqa: F401  (defines torch.ops.graphopt.*)
from graphopt.kernels import gated_activation, reference, rmsnorm

IMPLEMENTATIONS = {
    torch.ops.graphopt.rms_norm.default: "Triton kernel kernels/rmsnorm.py:_rms_norm_forward_kernel",
    torch.ops.graphopt.rms_norm_backward.default: "Triton kernel kernels/rmsnorm.py:_rms_norm_backward_kernel "
                                                  "(dX, and dW reduced per program band when the weight trains)",
    torch.ops.graphopt.gated_activation.default: "Triton kernel kernels/gated_activation.py:_gated_forward_kernel",
    torch.ops.graphopt.gated_activation_backward.default: "Triton kernel kernels/gated_activation.py:"
                                                          "_gated_backward_kernel (activation recomputed)",
}


def _rms_norm(x, weight, eps, weight_offset, out_dtype):
    if x.shape[-1] > rmsnorm.MAX_HIDDEN:
        return reference.rms_norm(x, weight, eps, weight_offset, out_dtype)
    return rmsnorm.rms_norm_forward(x, weight, eps, weight_offset, out_dtype)


def _rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad):
    if x.shape[-1] > rmsnorm.MAX_HIDDEN:
        return reference.rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad)
    return rmsnorm.rms_norm_backward(grad_out, x, weight, eps, weight_offset, compute_weight_grad)


def register() -> None:
    torch.library.register_kernel("graphopt::rms_norm", "cuda", _rms_norm)
    torch.library.register_kernel("graphopt::rms_norm_backward", "cuda", _rms_norm_backward)
    torch.library.register_kernel("graphopt::gated_activation", "cuda", gated_activation.gated_activation_forward)
    torch.library.register_kernel("graphopt::gated_activation_backward", "cuda",
                                  gated_activation.gated_activation_backward)
