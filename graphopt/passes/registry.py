"""The fusion (and rewrite) passes, in the order the pipeline runs them: name → pass(gm, report) → number fused."""

from graphopt.passes.attention import rewrite_attention
from graphopt.passes.fuse_linear_ce import fuse_linear_ce
from graphopt.passes.fuse_lora import fuse_lora
from graphopt.passes.fuse_rmsnorm import fuse_rmsnorm
from graphopt.passes.fuse_rope import fuse_rope
from graphopt.passes.fuse_swiglu import fuse_swiglu
from graphopt.passes.fuse_trl_logprob import fuse_trl_logprob

FUSIONS = {
    "attention": rewrite_attention,  # SDPA: causal mask → is_causal, with padding → one op; repeat_kv → enable_gqa
    "rms_norm": fuse_rmsnorm,
    "rope": fuse_rope,  # q and k of one attention layer
    "swiglu": fuse_swiglu,  # SwiGLU and GeGLU
    "lora": fuse_lora,
    "linear_cross_entropy": fuse_linear_ce,  # lm_head + loss; the logits policy follows (passes/drop_logits.py)
    "trl_logprobs": fuse_trl_logprob,  # TRL's chunked log-prob head (SFT, DPO, GRPO, KTO, RLOO trainers)
}
