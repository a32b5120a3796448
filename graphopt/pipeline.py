"""The whole pipeline, top to bottom (docs/architecture.md draws it):

  1. capture    Dynamo hands over an FX graph of torch-level calls (before autograd)
  2. normalize  checkpointed regions inlined, their plan the memory plan  passes/checkpoint.py
                one spelling per op                                   passes/normalize.py
  3. fuse       subgraphs → graphopt:: ops, or a miss with a reason   passes/fuse_*.py, in passes/registry.py order
                then the logits policy: a fused loss's logits are not computed unless keep_logits  passes/drop_logits.py
                and the cache policy: the returned KV cache is detached unless cache_grad         passes/detach_cache.py
  4. autograd   aot_autograd traces forward + backward; each graphopt op brings its own backward op
  5. partition  what the backward saves, recomputes or offloads, under memory_budget  passes/recompute.py
                what it offloads, and its peak memory estimate           passes/offload.py; passes/memory.py
                under CUDA graphs, the gradients and the loss leave the graphs' pool  passes/graph_pool.py
                (with options.plan, 4–6 come from the plan directory's caches, the decision from its plan.json)
  6. lower      each graphopt op → the target's implementation; the rest → Inductor (or eager)   lowering/
                after the partition, Inductor's graphs call the ops without custom_op's layers  lowering/direct.py
                or, CUDA graphs off, hold the LoRA ops' traced launches (Inductor launches them)  lowering/traced.py
                and the gated activation's backward written over its inputs where they are read no more
  7. report     the plan every stage added to (graphopt/plan.py), published  graphopt/report.py
  8. hand back  outputs not computed become LogitsNotMaterialized      graphopt/logits.py

Each stage adds its decisions to one Plan; the report renders it once the graph has compiled (or failed to).
"""

import copy

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.exc import RestartAnalysis
from torch._inductor.compile_fx import compile_fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from graphopt import distributed, plan_dir
from graphopt.devices import resolve_target
from graphopt.logits import hand_back
from graphopt.lowering import registry as lowering_registry
from graphopt.lowering.direct import DirectCalls, traced_note
from graphopt.options import Options, check_cuda_graphs, cuda_graphs_decision
from graphopt.passes.checkpoint import checkpointing_as_plan, inline_checkpoints
from graphopt.passes.describe import graph_inputs
from graphopt.passes.detach_cache import detach_cache
from graphopt.passes.drop_logits import drop_logits
from graphopt.passes.normalize import normalize
from graphopt.passes.recompute import Partitioner, weights_bytes
from graphopt.passes.registry import FUSIONS
from graphopt.plan import Plan
from graphopt.report import publish, reports


DYNAMIC_SHAPES = ("dynamic shapes: one graph serves every size of its symbolic dimensions, without CUDA graphs under "
                  "cuda_graphs=\"auto\" (one would be recorded per size: with batches padded to a multiple of a "
                  "bucket size, e.g. pad_to_multiple_of=256, cuda_graphs=True records each bucket once), and with "
                  "masks not provably causal at a symbolic length kept as they are")


def compile_graph(gm, example_inputs, options: Options, explain: bool = False):
    """explain: the graph was traced on the meta device for options.target (graphopt/explain.py); every stage
    decides as it would there, and nothing is compiled: the graphs run as traced."""
    # 1. capture
    plan = Plan(graph=len(reports()), options=options.to_json(), nodes_captured=len(gm.graph.nodes))
    plan.target = options.target if explain else resolve_target(options.target, example_inputs)
    plan.inputs, plan.parameters = graph_inputs(gm, example_inputs)
    plan.distributed = distributed.setup(example_inputs)
    if plan.distributed and plan.distributed["split"]:
        plan.notes.append(f"DDP's optimizer split the step at its gradient buckets; {distributed.SPLIT_ADVICE}")
    saved = None
    if options.plan:  # a plan directory's decisions for this graph take the place of the options' (and searches)
        options, saved = plan_dir.apply(options, plan)

    # 2–3. normalize and fuse
    options = normalize_and_fuse(gm, options, plan)
    dropped = [] if options.keep_logits else drop_logits(gm, plan)
    if not options.cache_grad:
        detach_cache(gm, plan)
    if saved:
        plan_dir.check_same_fusions(saved, plan)

    # 4–6. autograd → partition → lower. The target's lowering says how each graphopt op will run.
    lowering = lowering_registry.lowering_for(plan.target)
    check_cuda_graphs(options, plan.target)
    note = lowering.prepare(gm) if lowering.prepare and not explain else None
    if note:
        plan.notes.append(note)
    dynamic = _has_dynamic_shapes(gm, example_inputs)
    if dynamic:
        plan.notes.append(DYNAMIC_SHAPES)
    if lowering.inductor:  # and whether Inductor replays the graph as CUDA graphs
        training = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                                   for x in example_inputs)
        plan.cuda_graphs = dict(zip(("on", "why"), cuda_graphs_decision(options, lowering, dynamic, training)))
    traced = _launches_traced(lowering, plan, explain)
    lowering_registry.record(gm, lowering, plan, traced=traced)
    try:
        compiled = _autograd_partition_lower(gm, example_inputs, lowering, plan, options, explain, saved, traced)
    except RestartAnalysis:  # Dynamo abandons this graph (e.g. to make a float a tensor) and hands over another
        raise
    except Exception:  # 7. report: what was decided before the failure, to read the error against
        publish(plan, options.report)
        raise
    # 7. report
    publish(plan, options.report)
    # 8. hand back
    return hand_back(compiled, dropped)


def normalize_and_fuse(gm, options: Options, plan: Plan) -> Options:
    """Stages 2 and 3 on gm, in place: checkpointed regions inlined (their plan becomes the memory plan: the options
    returned carry it), one spelling per op, then each fusion the options enable, in passes/registry.py order."""
    checkpointed = inline_checkpoints(gm)
    if checkpointed:
        options = checkpointing_as_plan(options, checkpointed, plan)
    normalize(gm)
    for name, fuse in FUSIONS.items():
        if name in options.fusions:
            fuse(gm, plan)
    return options


def _autograd_partition_lower(gm, example_inputs, lowering, plan, options, explain, saved, traced):
    # CUDA graphs: Inductor's CUDA graph trees, split around the ops that cannot be captured (graph_partition).
    # What outlives a step leaves the graphs' memory pool (passes/graph_pool.py): the leaves' gradients.
    graphs = bool(plan.cuda_graphs and plan.cuda_graphs["on"])
    leaf_inputs = (tuple(isinstance(x, torch.Tensor) and x.is_leaf and x.requires_grad for x in example_inputs)
                   if graphs else None)
    # 5. partition: a stage of its own, called by aot_autograd once it has the joint graph; it adds the memory
    # plan to the plan
    partitioner = Partitioner(options.memory_budget, options.offload, options.max_memory_gib,
                              lowering.offload_copies, plan, leaf_inputs, weights_bytes(example_inputs),
                              requested=plan_dir.requested_partition(saved))
    if lowering.inductor and not explain:
        # compile_fx runs aot_autograd, Inductor's joint-graph passes, the partitioner, then its codegen.
        # The target's decompositions apply below autograd: graphopt ops become aten, their backward stays ours.
        decompositions = lowering_registry.InductorDecompositions(lowering.target, traced)
        # As config_patches, not a config.patch block: they must also reach the backward, compiled at its first run.
        settings = dict(custom_partitioner_fn=partitioner)
        calls = None
        if lowering.direct_calls:  # after the partition, the ops called without custom_op's layers, or traced
            calls = DirectCalls(lowering.direct_calls, lowering.traced_launches if traced else {},
                                torch._inductor.config.post_grad_custom_post_pass)
            settings["post_grad_custom_post_pass"] = calls
        # With fallback_random the random ops (fused LoRA dropout's bernoulli_) call torch's generator in the order
        # they run. Inductor's peak-memory reordering sees no dependency between independent draws and may move one
        # past another (pytorch/pytorch#192635): each mask is then another's, eager's stream no longer reproduced.
        if torch._inductor.config.fallback_random:
            settings["reorder_for_peak_memory"] = False
        if graphs:
            settings.update({"triton.cudagraphs": True, "graph_partition": True,
                             "custom_should_partition_ops": list(lowering.uncapturable_ops)})
            # Inductor would move the gradients' copies to the backward's end, one partition fewer per copy,
            # and keep every gradient in the pool until then (passes/graph_pool.py)
            if hasattr(torch._inductor.config.triton, "reorder_for_reducing_graph_partitions"):
                settings["triton.reorder_for_reducing_graph_partitions"] = False
        # Inductor's FX graph cache serves the forward and backward graphs to a later process (the partitioner's
        # uuid keys them with graphopt's code and settings). AOTAutograd's cache, which serves both already
        # partitioned, skips the partitioner and so the decision the plan records: it is on only where the
        # decision is saved, in a plan directory (written by graphopt.optimize, read with options.plan).
        with_decision = bool(options.plan) or plan_dir.writing()
        if with_decision:
            settings["fx_graph_cache"] = True
        with torch._functorch.config.patch(enable_autograd_cache=with_decision):
            compiled = compile_fx(gm, example_inputs, config_patches=settings, decompositions=decompositions)
        if calls and any(node.target in calls.traced for node in gm.graph.nodes):
            plan.notes.append(traced_note(calls))
        if saved is not None and plan.saved_for_backward is None:  # served by AOTAutograd's cache
            plan.saved_for_backward = copy.deepcopy(saved.saved_for_backward)  # this graph's, to add to
        return compiled

    if explain:  # traced on the meta device: each call the target runs in another form is traced in that form
        for target, stand_in in lowering.meta_stand_ins.items():
            for node in gm.graph.find_nodes(op="call_function", target=target):
                node.target = stand_in
        gm.recompile()
    return aot_autograd(
        fw_compiler=boxed_nop,
        bw_compiler=boxed_nop,
        partition_fn=partitioner,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _launches_traced(lowering, plan, explain) -> bool:
    """Whether the graphs Inductor compiles hold the target's traced launches (lowering/traced.py): where they are
    not replayed as CUDA graphs, whose replays cost the host nothing a launch."""
    graphs = bool(plan.cuda_graphs and plan.cuda_graphs["on"])
    return bool(lowering.inductor and not explain and lowering.direct_calls and lowering.traced_launches
                and not graphs)


def _has_dynamic_shapes(gm, example_inputs) -> bool:
    values = list(example_inputs) + [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and free_symbols(v)) for v in values)
