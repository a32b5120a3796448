"""The fusion passes, in the order the pipeline runs them: name → pass(gm, report) → number fused."""

from graphopt.passes.fuse_rmsnorm import fuse_rmsnorm

FUSIONS = {
    "rms_norm": fuse_rmsnorm,
}
