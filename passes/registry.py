"""The fusion passes, in the order the pipeline runs them: name → pass(gm, report) → number fused."""

from graphopt.passes.fuse_rmsnorm import fuse_rmsnorm
from graphopt.passes.fuse_swiglu import fuse_swiglu

FUSIONS = {
    "rms_norm": fuse_rmsnorm,
    "swiglu": fuse_swiglu,  # SwiGLU and GeGLU
}
