"""Traced launches: a graphopt op's launch function, traced over the graph's symbolic sizes into the graph itself,
so that Inductor launches graphopt's Triton kernels from its generated code.

Where CUDA graphs are off (dynamic shapes under cuda_graphs="auto"), the host launches every kernel of the step,
and a step of small batches waits for it: a Triton launch from Python costs 25–50 µs of host time, and a LoRA
layer's launch functions (sizes, splits, configs, allocations) as much again (benchmarks/RESULTS.md, SFT X).
Traced, the launch function runs once, when the graph compiles: its Triton launches become
torch.library.wrap_triton nodes, its allocations and cuBLAS matmuls aten nodes, its sizes and grids expressions of
the graph's symbols. Inductor compiles the kernels with the graph and launches them from its wrapper, the
decisions already made (the packed 1B step 1.86× faster: RESULTS.md, SFT Y). The launch functions make their
decisions without branching on a symbolic size (kernels/lora.py), so the trace adds no guard.

The configs the trace takes are those an eager launch finds to fit the GPU's shared memory (kernels/lora.py
_fitting): each op is launched once eagerly first, on small tensors of its dtypes and rank. Where the trace cannot
be made or checked, the op is called directly instead (lowering/direct.py) and the report's notes say so.

An op may also have a launch function that writes its results over some of its inputs (InPlace): traced where the
graph reads those inputs no more, and Inductor's reinplacing pass, which follows, then launches the kernel on the
inputs' own buffers. Elsewhere the op's other function is traced.
"""

import operator
from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.fx_utils import get_node_storage
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

from graphopt.kernels import layout

_PROBED = set()  # _probe's keys: launched eagerly once in this process


@dataclass(frozen=True)
class InPlace:
    """An op's launch function that writes its results over the op's arguments at positions `overwrites` (and
    returns them), traced where the graph reads those arguments no more; elsewhere `otherwise` is traced."""
    function: Callable
    overwrites: tuple
    otherwise: Callable


def inline(graph: torch.fx.Graph, node: torch.fx.Node, function, traces: dict) -> None:
    """Replaces node (a call of a graphopt op) by the trace of function(*node.args, **node.kwargs) (an InPlace's
    function where node is the last reader of what it overwrites, else its otherwise). traces: the graph's traces
    so far, by op and inputs; a node whose op and inputs (shapes as expressions of the graph's symbols, strides,
    dtypes, the other arguments) match one traced before takes a copy of its trace: a model's layers repeat a few
    such calls dozens of times, and a trace takes a fifth of a second."""
    flat, spec = pytree.tree_flatten((node.args, node.kwargs))
    overwrites = ()  # their indices in flat
    if isinstance(function, InPlace):
        if last_reader(node, function.overwrites):
            overwrites = tuple(next(i for i, leaf in enumerate(flat) if leaf is node.args[p])
                               for p in function.overwrites)
            function = function.function
        else:
            function = function.otherwise
    inputs = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.fx.Node)]
    values = [flat[i].meta["val"] for i in inputs]
    key = (node.target, function, repr(spec), tuple(_signature(v) for v in values),
           tuple(leaf for i, leaf in enumerate(flat) if i not in inputs))
    copy = key in traces
    if not copy:
        _probe(node.target, function, flat, spec, inputs, values)
        traces[key] = _trace(node.target, function, flat, spec, inputs, values, overwrites)
    env, added = {}, []
    placeholders = iter(inputs)
    try:
        with graph.inserting_before(node), detect_fake_mode(values), enable_python_dispatcher():
            for n in traces[key].graph.nodes:
                if n.op == "placeholder":
                    env[n] = flat[next(placeholders)]
                elif n.op == "output":
                    outputs = pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, n.args[0])
                else:
                    env[n] = new = graph.node_copy(n, lambda a: env[a])
                    new.meta[_INLINED] = True
                    added.append(new)
                    if copy:  # its own fake values: a copy's tensors alias those of its own trace only
                        args, kwargs = torch.fx.map_arg((new.args, new.kwargs), lambda a: a.meta["val"])
                        new.meta["val"] = new.target(*args, **kwargs)
    except Exception:  # the graph as it was: the caller calls the op instead
        for new in reversed(added):
            graph.erase_node(new)
        raise
    if isinstance(outputs, (tuple, list)):
        for user in list(node.users):  # operator.getitem(node, i)
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(outputs)
    graph.erase_node(node)


_INLINED = "graphopt_traced"  # the meta key that marks the nodes inline added


def share_repeats(graph: torch.fx.Graph) -> None:
    """Each node that inline added and that repeats an earlier one (the same operation of the same arguments) is
    replaced by it. Ops that derive one value from a tensor that every layer reads (the padded attention's order
    and bounds from the batch's keep: kernels/padded_attention.py _sequences) then run once in the graph, where
    each layer's trace holds them; a launch function cannot keep them from one trace to the next. Only operations
    whose result follows from their arguments (not in-place ones, random draws or allocations), and whose result
    no kernel writes: each kernel's output stays a buffer of its own, which Inductor's reinplacing writes in
    place."""
    seen = {}
    for node in list(graph.nodes):
        if not node.meta.get(_INLINED) or not _repeatable(node.target) or _written(node):
            continue
        key = (node.target, _frozen(node.args), _frozen(node.kwargs))
        if key in seen:
            node.replace_all_uses_with(seen[key])
            graph.erase_node(node)
        else:
            seen[key] = node


# the trace's own tensors: uninitialized, each a buffer of its own
_ALLOCATIONS = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
                torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
                torch.ops.aten.new_empty_strided.default)


def _repeatable(target) -> bool:
    if getattr(target, "__module__", None) == "_operator":  # getitem, and arithmetic on the graph's symbols
        return True
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags and target not in _ALLOCATIONS)


def _written(node: torch.fx.Node) -> bool:
    """Whether a traced kernel writes node's result (the functional form's tensors_to_clone)."""
    return any(user.target is torch.ops.higher_order.triton_kernel_wrapper_functional
               and any(user.kwargs["kwargs"][name] is node for name in user.kwargs["tensors_to_clone"])
               for user in node.users)


def _frozen(value):
    """value (a node's arguments) as a hashable key."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _frozen(v)) for k, v in sorted(value.items()))
    if isinstance(value, slice):
        return slice, _frozen(value.start), _frozen(value.stop), _frozen(value.step)
    try:
        hash(value)
    except TypeError:
        return type(value), repr(value)
    return value


def last_reader(node: torch.fx.Node, positions) -> bool:
    """Whether node's arguments at positions are tensors the graph computes (not its inputs, which belong to the
    caller) that nothing reads after node, through any view of their storage, in the graph's order; the order
    Inductor's reinplacing pass checks a mutation against, and which has the last word: a view missed here costs
    a copy there, never a wrong result."""
    args = [node.args[p] for p in positions]
    storages = [get_node_storage(a) if isinstance(a, torch.fx.Node) else None for a in args]
    if None in storages or len(set(storages)) < len(storages):  # each written over by its own result
        return False
    nodes = list(node.graph.nodes)
    after = set(nodes[nodes.index(node) + 1:])
    for arg, storage in zip(args, storages):
        for alias in _sharing(arg, storage):
            if alias.op in ("placeholder", "get_attr") or any(user in after for user in alias.users):
                return False
    return True


def _sharing(n: torch.fx.Node, storage) -> set:
    """n's views and bases in the graph (the nodes whose tensors share its storage, reached through view ops'
    first argument and users), n among them."""
    while (n.op == "call_function" and n.args and isinstance(n.args[0], torch.fx.Node)
           and get_node_storage(n.args[0]) == storage):
        n = n.args[0]
    found, stack = set(), [n]
    while stack:
        m = stack.pop()
        if m not in found:
            found.add(m)
            stack.extend(u for u in m.users if get_node_storage(u) == storage)
    return found


def _trace(op, function, flat, spec, inputs, values, overwrites=()) -> torch.fx.GraphModule:
    def call(*tensors):
        leaves = list(flat)
        for i, tensor in zip(inputs, tensors):
            leaves[i] = tensor if i in overwrites else _realized(tensor)
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        with layout.launches_traced():
            return function(*args, **kwargs)

    with detect_fake_mode(values), enable_python_dispatcher():
        # in Inductor's decompositions, which the graph it joins has been through (aten.t as a permute, ...)
        traced = make_fx(torch.func.functionalize(call), select_decomp_table(), tracing_mode="real")(*values)
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    overwritten = [placeholders[inputs.index(i)] for i in overwrites]
    # functionalize copies the results written over the inputs back into them at the end: the op's caller reads
    # those inputs no more (last_reader), so the trace is the functional kernel call alone, which Inductor's
    # reinplacing pass then launches on the inputs' buffers
    for n in traced.graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
        if n.args[0] in overwritten:
            traced.graph.erase_node(n)
    _accumulate_in_place(traced.graph)
    _check_writes(traced.graph, op, overwritten)
    return traced


def _accumulate_in_place(graph: torch.fx.Graph) -> None:
    """addmm(t, a, b) → graphopt_traced::addmm_(t, a, b) where t is a tensor the trace made (not an input, nor a view
    of one) that nothing else reads. A launch function accumulates a matmul onto a term it wrote first
    (kernels/lora.py: the low-rank term, then x·Wᵀ or dY·W added with β = 1, in the matmul's epilogue);
    functionalize makes that an addmm, which writes a new tensor, and cuBLAS's addmm copies its input into it before
    the matmul: one whole [tokens, out] copy per LoRA output and dX (benchmarks/RESULTS.md, SFT AF and AJ). In
    place, Inductor calls aten's addmm_ (under graphopt's name, ADDMM_) on the term's buffer."""
    graph.eliminate_dead_code()  # the decompositions' unused nodes, which would count as readers
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.addmm.default):
        term = node.args[0]
        storage = get_node_storage(term) if isinstance(term, torch.fx.Node) else None
        if storage is None or node.kwargs:  # β and α other than 1 stay out of place
            continue
        aliases = _sharing(term, storage)
        readers = {user for alias in aliases for user in alias.users} - aliases
        if readers == {node} and not any(alias.op in ("placeholder", "get_attr") for alias in aliases):
            with graph.inserting_before(node):
                graph.call_function(ADDMM_, node.args)
            node.replace_all_uses_with(term)  # the result is the term itself
            graph.erase_node(node)


# aten's addmm_ under a name of graphopt's own, returning nothing. Inductor has no lowering for aten.addmm_
# (functionalization removes it from every graph it is given) and makes one at the first call, but refuses to where
# the environment variable CI is set, the op having a decomposition. An op of another namespace Inductor calls only
# if it returns no alias of what it writes. A plain op of the dispatcher, without torch.library.custom_op's Python
# layers (lowering/direct.py): 3 µs of host time a call, against custom_op's 24 and aten's 2 (CPU).
_LIBRARY = torch.library.Library("graphopt_traced", "DEF")
_LIBRARY.define("addmm_(Tensor(a!) term, Tensor mat1, Tensor mat2) -> ()")


def _addmm_(term, mat1, mat2):
    term.addmm_(mat1, mat2)


_LIBRARY.impl("addmm_", _addmm_, "CompositeExplicitAutograd")
torch.library.register_fake("graphopt_traced::addmm_", lambda term, mat1, mat2: None, lib=_LIBRARY)
ADDMM_ = torch.ops.graphopt_traced.addmm_.default


def _realized(value):
    """value through an identity as_strided where it is a contiguous tensor, so that Inductor computes it once,
    into a buffer of its own that the op's kernels read through views. Inductor gives a user-defined Triton kernel's
    arguments the strides the trace saw, and an argument it has not yet put in a buffer (a pointwise value: the
    gated activation's output, a norm's, their gradients) it computes again for each kernel that reads it: at the
    MLP, the activation twice in the forward and each of its two gradients three times in the backward, [tokens, MLP
    width] each (benchmarks/RESULTS.md, SFT AA). as_strided's input, instead, Inductor lays out in a buffer with the
    trace's strides where it is computed (the strides exactly for a value, only their order for a view: hence
    contiguous values only, whose layout a view of a contiguous buffer keeps too)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    contiguous = make_contiguous_strides_for(value.shape)
    # compared as expressions of the graph's symbols, so that the check adds no guard; a dimension of one element
    # (static: a dynamic size is at least 2) may have any stride
    if any(str(have) != str(want) for have, want, size in zip(value.stride(), contiguous, value.shape)
           if not (isinstance(size, int) and size == 1)):
        return value
    return torch.as_strided(value, value.shape, value.stride(), value.storage_offset())


def _signature(value):
    """What a trace reads of an input: a tensor's sizes and strides (as expressions of the graph's symbols), dtype
    and device; a symbolic size's expression."""
    if isinstance(value, torch.Tensor):
        return (tuple(map(str, value.shape)), tuple(map(str, value.stride())), str(value.storage_offset()),
                value.dtype, value.device)
    return str(value)


def _check_writes(graph: torch.fx.Graph, op, overwritten=()) -> None:
    """The trace writes only tensors it made (allocations) and the inputs (placeholders) it overwrites. torch's
    analysis of which arguments a Triton kernel writes (its TTIR) can fail, and then takes every argument as
    written: the graph would copy the op's inputs around each launch and write the copies back into them."""
    for n in graph.nodes:
        if n.op == "get_attr":
            raise NotImplementedError(f"{op}: its launch function made a tensor constant")
        if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional:
            written = [n.kwargs["kwargs"][name] for name in n.kwargs["tensors_to_clone"]]
            if any(w.target not in _ALLOCATIONS and w not in overwritten for w in written):
                raise NotImplementedError(f"{op}: a kernel's writes were not found (torch's analysis of its "
                                          f"TTIR), so it would be taken to write its inputs")


def _probe(op, function, flat, spec, inputs, values) -> None:
    """function launched once on small real tensors, outside the fake mode: the configs it takes are compiled and
    fitted to the GPU (kernels/lora.py _fitting) before the trace records them. A config's shared memory follows
    the dtypes and the rank (BLOCK_R), not the other sizes: every size above PROBE_SIZE is cut to it, so that the
    probe, which may run inside a training step (a backward graph compiles at its first run), reserves a few MiB.
    Once per op, probe inputs (their dtypes and cut sizes, which keep the rank) and other arguments."""
    small = [(v.dtype, v.device, tuple(_small(d) for d in v.shape)) if isinstance(v, torch.Tensor) else _small(v)
             for v in values]
    key = (op, tuple(small), tuple(leaf for i, leaf in enumerate(flat) if i not in inputs))
    if key in _PROBED:
        return
    with unset_fake_temporarily(), torch.no_grad():
        leaves = list(flat)
        for i, v in zip(inputs, small):
            leaves[i] = torch.zeros(v[2], dtype=v[0], device=v[1]) if isinstance(v, tuple) else v
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        function(*args, **kwargs)
    _PROBED.add(key)


PROBE_SIZE = 1024  # above the LoRA ranks in use (PEFT's r), which must stay as they are; 4 MiB a tensor at most


def _small(size):
    """A size for the probe: its value where the graph was traced (a symbolic size's hint), at most PROBE_SIZE.
    One size maps to one size, so that the inputs' sizes still agree with each other."""
    value = size.node.hint if isinstance(size, torch.SymInt) else size
    return min(value, PROBE_SIZE) if isinstance(value, int) else value
