"""Capture the FX graph Dynamo hands a backend, to test passes on exactly what they will see."""

import copy

import torch


def capture(fn, *args):
    """(graph module, example inputs) of the single graph Dynamo makes of fn(*args)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((copy.deepcopy(gm), list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1, f"expected one graph, Dynamo made {len(graphs)}"
    return graphs[0]


def first_output(gm, inputs):
    """Dynamo graphs return a tuple; these tests' graphs return one tensor."""
    (out,) = gm(*inputs)
    return out


def run_pass(fuse, model, *args):
    """Capture model(*args), normalize it, run one fusion pass: (gm, inputs, output before, report, fused)."""
    from graphopt.passes.normalize import normalize
    from graphopt.plan import Plan

    gm, inputs = capture(model, *args)
    expected = first_output(gm, inputs)
    normalize(gm)
    report = Plan(graph=0)
    return gm, inputs, expected, report, fuse(gm, report)


def count_calls(gm, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def relative_error(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
