"""offload=True (passes/offload.py, lowering/transfer.py): on the CPU the plan is made and reported and the graphs
are left alone; with the copies forced on, the rewritten graphs still compute what eager computes, every
offloaded tensor is copied out once and back once, and each layer's first reload prefetches the next layer."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphopt
from graphopt.lowering import transfer
from graphopt.passes import offload as offload_pass
from graphs import relative_error
from models import tiny_lora_model

BUDGETS = [1, 0.3, 0]


def eager_loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def compiled_loss_and_grads(model, ids, options):
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    loss = torch.compile(model, backend="graphopt", options=options)(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_matches(result, expected):
    (loss, grads), (eager_loss, eager_grads) = result, expected
    assert relative_error(loss, eager_loss) <= 1e-5
    assert grads.keys() == eager_grads.keys()
    assert all(relative_error(grads[n], eager_grads[n]) <= 1e-5 for n in grads)


@pytest.fixture
def copies(monkeypatch, force_offload_copies):
    """Counts the transfer ops' calls; calling its "force" entry makes the pipeline insert them on the CPU too."""
    calls = {"offload": 0, "reload": 0, "prefetched": []}
    offload, reload = transfer.offload, transfer.reload

    def counted_offload(x, after, keep, wait):
        calls["offload"] += 1
        return offload(x, after, keep, wait)

    def counted_reload(token, device, prefetch):
        calls["reload"] += 1
        calls["prefetched"].append(len(prefetch))
        return reload(token, device, prefetch)

    monkeypatch.setattr(transfer, "offload", counted_offload)
    monkeypatch.setattr(transfer, "reload", counted_reload)
    calls["force"] = force_offload_copies
    return calls


def test_on_the_cpu_offload_is_planned_and_reported_and_copies_nothing(copies):
    """The plan reads the graph's saved tensors, whatever the architecture; the forced-copies test below runs
    gemma's as well."""
    model = tiny_lora_model("llama")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = eager_loss_and_grads(model, ids)
    for budget in BUDGETS:
        assert_matches(compiled_loss_and_grads(model, ids, {"memory_budget": budget, "offload": True}), expected)
        saved = graphopt.last_report().saved_for_backward
        plan = saved["offload"]
        assert plan["copies_made"] is False and plan["tensors"] > 0, budget
        assert sum(layer.get("offloaded_bytes", 0) for layer in saved["per_layer"].values()) == plan["bytes"]
        assert plan["bytes"] + sum(k["bytes"] for k in plan["kept"]) == saved["bytes"]  # each one accounted for
        assert "(planned only: the target is the host itself)" in graphopt.last_report().to_text()
    assert copies["offload"] == copies["reload"] == 0


@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_forced_copies_compute_what_eager_computes(arch, copies):
    copies["force"]()
    model = tiny_lora_model(arch)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = eager_loss_and_grads(model, ids)
    for budget in BUDGETS:
        copies["offload"] = copies["reload"] = 0
        assert_matches(compiled_loss_and_grads(model, ids, {"memory_budget": budget, "offload": True}), expected)
        plan = graphopt.last_report().saved_for_backward["offload"]
        assert plan["copies_made"] is True
        assert copies["offload"] == copies["reload"] == plan["tensors"] > 0, budget


def test_a_graph_of_symbolic_length_offloads_its_layer_inputs(copies):
    """A graph compiled for every length (batches of changing length) offloads as a static one: each reload takes
    its sizes from the symbols the backward receives, and every length the graph serves computes what eager
    computes."""
    copies["force"]()
    model = tiny_lora_model("llama")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="graphopt", options={"memory_budget": 0, "offload": True})
    reports_before = len(graphopt.reports())
    for length in (16, 11, 23):
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length))
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        expected = eager_loss_and_grads(model, ids)
        copies["offload"] = copies["reload"] = 0
        model.zero_grad(set_to_none=True)
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        assert_matches((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}),
                       expected)
        plan = graphopt.last_report().saved_for_backward["offload"]
        assert copies["offload"] == copies["reload"] == plan["tensors"] > 0, length
        assert not any("symbolic" in kept["reason"] for kept in plan["kept"]), plan["kept"]
    assert len(graphopt.reports()) == reports_before + 1  # one graph served every length
    assert any(note.startswith("dynamic shapes") for note in graphopt.last_report().notes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies to host memory and back need a GPU")
def test_on_the_gpu_a_graph_of_symbolic_length_offloads_into_reused_buffers(copies):
    """Real copies at lengths that change every step: each offloaded tensor goes out and back, the numbers are
    those of the same compile without offload, and a shorter step takes the host buffers of a longer one (nothing
    new is pinned)."""
    model = tiny_lora_model("llama").cuda()
    compiled = {offload: torch.compile(model, backend="graphopt", options={"memory_budget": 0, "offload": offload})
                for offload in (False, True)}
    pinned = []
    for length in (40, 24, 64, 16):
        ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(length)).cuda()
        torch._dynamo.maybe_mark_dynamic(ids, 1)
        results = {}
        for offload, step in compiled.items():
            copies["offload"] = copies["reload"] = 0
            model.zero_grad(set_to_none=True)
            loss = step(input_ids=ids, labels=ids).loss
            loss.backward()
            results[offload] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                               if p.requires_grad}
        assert_matches(results[True], results[False])
        assert copies["offload"] == copies["reload"] > 0, length
        pinned.append(sum(len(buffers) for buffers in transfer._free_buffers.values()))
    assert pinned[1] == pinned[0] and pinned[3] == pinned[2]  # the shorter steps pinned nothing new


def test_each_layer_prefetches_the_next_one_the_backward_reads():
    plan = offload_pass.OffloadPlan(num_fwd_outputs=1, offloaded=["a", "b", "c", "d", "e"],
                                    groups={"a": "layers.2", "b": "layers.2", "c": "layers.1", "d": "layers.0",
                                            "e": "layers.0"})
    assert plan.prefetch_after() == {"a": ["c"], "c": ["d", "e"]}


def test_budget_zero_offloads_the_layer_inputs(copies):
    """Budget 0 saves each decoder layer's input (the residual stream); offload moves all but the last layer's,
    which the backward reads first."""
    model = tiny_lora_model("llama")
    ids = torch.randint(0, 128, (2, 16))
    compiled_loss_and_grads(model, ids, {"memory_budget": 0, "offload": True})
    saved = graphopt.last_report().saved_for_backward
    hidden_bytes = 2 * 16 * 64 * 4
    assert saved["offload"]["bytes"] >= hidden_bytes
    assert saved["per_layer"]["base_model.model.model.layers.0"].get("offloaded_bytes", 0) >= hidden_bytes


@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
       transposed=st.booleans(), edge=st.sampled_from([0.0, float("inf"), float("-inf"), float("nan"), 1e-30]))
def test_offload_and_reload_give_back_every_value(shape, dtype, transposed, edge):
    """A copy out and back is exact for every dtype, layout and edge value: the fp64 view of what comes back is
    the fp64 view of what went out (NaN where NaN was), contiguous, in memory of its own; the forward keeps a
    one-byte token on x's device, not the copy."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype)
    x.view(-1)[0] = edge
    if transposed:
        x = x.transpose(0, -1)
    token = torch.ops.graphopt.offload(x, [], [], True)
    assert token.shape == (1,) and token.dtype == torch.uint8 and token.device == x.device
    x_before = x.clone()
    x.fill_(7)  # the copy was taken when offload ran
    back = torch.ops.graphopt.reload(token, list(x.shape), x.dtype, torch.device("cpu"), [])
    assert back.shape == x.shape and back.dtype == x.dtype and back.is_contiguous()
    torch.testing.assert_close(back.double(), x_before.double(), rtol=0, atol=0, equal_nan=True)


def test_transfer_ops_pass_opcheck_and_their_fakes_match():
    """opcheck calls an op several times over the same inputs, which a reload cannot take (its host buffer goes
    back to the free ones): reload's fake is compared with it by hand, and a second reload is a clear error."""
    x = torch.randn(3, 5)
    torch.library.opcheck(torch.ops.graphopt.offload.default, (x, [], [], True))
    token = torch.ops.graphopt.offload(x, [], [], True)
    args = (token, [3, 5], x.dtype, torch.device("cpu"), [torch.ops.graphopt.offload(x + 1, [token], [x], False)])
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.graphopt.reload.default(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                   for a in args[:4]], [])
    real = torch.ops.graphopt.reload.default(*args)
    assert (fake.shape, fake.dtype, fake.device) == (real.shape, real.dtype, real.device) and torch.equal(real, x)
    with pytest.raises(RuntimeError, match="already reloaded.*retain_graph=True.*without offload"):
        torch.ops.graphopt.reload.default(*args)


def test_transfer_ops_are_captured_with_the_step():
    """No host tensor crosses a graph's boundary and no op is cut out of the CUDA graphs: the copies are
    captured with the rest of the step (lowering/transfer.py)."""
    for op in (torch.ops.graphopt.offload.default, torch.ops.graphopt.reload.default):
        assert torch.Tag.cudagraph_unsafe not in op.tags


def test_a_capture_takes_only_buffers_pinned_before_it_and_keeps_them(monkeypatch):
    """Under a CUDA graph capture nothing can be pinned: an offload takes a free host buffer or raises, naming the
    fix; and a reload leaves the buffer to the graph being recorded, whose replays write and read it. Outside a
    capture the reload frees it for the next offload. (The bookkeeping of lowering/transfer.py's GPU path, run on
    the CPU with the capture stubbed.)"""
    monkeypatch.setattr(transfer, "_free_buffers", {})
    monkeypatch.setattr(transfer, "_host_of", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = torch.randn(3, 5)
    with pytest.raises(RuntimeError, match=r"no host buffer of 60 bytes \(shape \(3, 5\).*pinned before this "
                                           r"capture.*one forward at a time.*'cuda_graphs': False"):
        transfer._take_buffer(x)
    pinned = torch.empty(64, dtype=torch.uint8)
    transfer._free_buffers[x.device] = [pinned]
    assert transfer._take_buffer(x) is pinned and transfer._free_buffers[x.device] == []
    token = torch.zeros(1, dtype=torch.uint8)
    transfer._host_of[token.data_ptr()] = (pinned, pinned[:60].view(torch.float32).view(3, 5))
    transfer._release(token)
    assert transfer._host_of[token.data_ptr()][0] is pinned and transfer._free_buffers[x.device] == []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    transfer._release(token)
    assert token.data_ptr() not in transfer._host_of and transfer._free_buffers[x.device] == [pinned]


def test_a_buffer_left_at_a_reused_token_address_is_never_freed(monkeypatch):
    """A token's address taken by a new offload while its buffer was never reloaded (the CUDA graphs that saved it
    gone, their pool's addresses reused): the buffer is not dropped, which during a capture would make the next
    capture fail as it starts (docs/architecture.md). Eagerly it goes back to the free ones; under a capture it is
    held, as it may be another recorded graph's."""
    monkeypatch.setattr(transfer, "_free_buffers", {torch.device("cpu"): []})
    monkeypatch.setattr(transfer, "_host_of", {})
    monkeypatch.setattr(transfer, "_held_for_graphs", [])
    token, first, second = torch.zeros(1, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8), \
        torch.empty(64, dtype=torch.uint8)
    for capturing, buffer in ((False, first), (True, second)):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        transfer._host_of[token.data_ptr()] = (buffer, buffer)
        transfer._retire(token)
        assert token.data_ptr() not in transfer._host_of
    assert transfer._free_buffers[torch.device("cpu")] == [first] and transfer._held_for_graphs == [second]


def test_an_offload_takes_the_smallest_free_buffer_that_holds_it(monkeypatch):
    """Sizes that change every step reuse the buffers of longer steps: the smallest free one that holds the
    tensor's bytes, whatever its shape and dtype; a new one only when none does."""
    small, large, larger = (torch.empty(n, dtype=torch.uint8) for n in (32, 128, 256))
    monkeypatch.setattr(transfer, "_free_buffers", {torch.device("cpu"): [larger, small, large]})
    assert transfer._take_buffer(torch.empty(10, 3, dtype=torch.float32)) is large  # 120 bytes
    assert transfer._take_buffer(torch.empty(4, dtype=torch.bfloat16)) is small
    assert transfer._free_buffers[torch.device("cpu")] == [larger]


def test_each_layer_waits_for_the_copies_of_the_layer_before(copies):
    """In the forward, the first offload of each layer takes the tokens and tensors of the layer before's (so
    that Inductor keeps those tensors until their copies are waited for), the others nothing, and the last
    offload waits for every copy still running: its own and its layer's."""
    copies["force"]()
    model = tiny_lora_model("llama", num_hidden_layers=4)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    seen = []
    offload = transfer.offload

    def watched(x, after, keep, wait):
        token = offload(x, after, keep, wait)
        seen.append((token, list(after), list(keep), wait))
        return token

    transfer.offload = watched
    try:
        compiled_loss_and_grads(model, ids, {"memory_budget": 0, "offload": True})
    finally:
        transfer.offload = offload
    assert len(seen) >= 2  # budget 0: the inputs of all layers but the last
    tokens = [token for token, *_ in seen]
    for i, (_, after, keep, wait) in enumerate(seen):
        assert wait is (i == len(seen) - 1)
        assert len(after) == len(keep)
        assert all(any(a is t for t in tokens[:i]) for a in after)  # earlier offloads only
    assert sum(len(after) for _, after, _, _ in seen) == len(seen) - 1  # one offload a layer at budget 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copies to host memory and back need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "gemma"])
def test_on_the_gpu_every_copy_goes_out_and_back_and_prefetches_arrive(arch, dtype, copies, monkeypatch):
    """Real copies on the side stream, run eagerly (cuda_graphs=False; under CUDA graphs: tests/test_graph_pool.py):
    loss and gradients as without offload, in each step (the second reuses the pinned buffers), each offloaded
    tensor copied out and back once a step, and some reloads served by a prefetch. Against the default compile
    without offload, which runs under CUDA graphs."""
    served = []
    reload = transfer.reload

    def watched(token, device, prefetch):
        served.append(token.data_ptr() in transfer._prefetched)
        return reload(token, device, prefetch)

    monkeypatch.setattr(transfer, "reload", watched)
    model = tiny_lora_model(arch, dtype).cuda()
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    for budget in (1, 0):
        expected = compiled_loss_and_grads(model, ids, {"memory_budget": budget})
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="graphopt",
                                 options={"memory_budget": budget, "offload": True, "cuda_graphs": False})
        for _ in range(2):
            copies["offload"] = copies["reload"] = 0
            model.zero_grad(set_to_none=True)
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            got = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            assert relative_error(got[0].float(), expected[0].float()) <= tolerance
            assert all(relative_error(got[1][n].float(), expected[1][n].float()) <= tolerance for n in got[1])
        plan = graphopt.last_report().saved_for_backward["offload"]
        assert plan["copies_made"] and copies["offload"] == copies["reload"] == plan["tensors"] > 0
        assert not graphopt.last_report().cuda_graphs["on"]
    assert any(served)
