"""Peak memory: the just-in-time schedule of recomputation, the static peak estimate against the
profiler's measurement, and peak_budget."""
import pytest
import torch
import torch.fx as fx

import remat_fx as remat
from benchmarks.memory import step_peak_bytes
from remat_fx.passes.peak import simulate
from remat_fx.passes.schedule import schedule_recompute
from tests.test_budget import _gpt, _hf_gpt2, _mlp


def _graph():
    """A backward graph as PyTorch's partitioner may emit it: the recompute (r1, r2) first."""
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("tangents_1")
    r1 = g.call_function(torch.ops.aten.sin.default, (a,))
    r1.name = "r1"
    r2 = g.call_function(torch.ops.aten.cos.default, (r1,))
    r2.name = "r2"
    g1 = g.call_function(torch.ops.aten.mul.Tensor, (b, b))
    g2 = g.call_function(torch.ops.aten.mul.Tensor, (g1, r2))
    g3 = g.call_function(torch.ops.aten.add.Tensor, (g2, r1))
    g.output((g3,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node, shape in zip(gm.graph.nodes, [(4, 4)] * 7):
        node.meta["val"] = torch.empty(shape)
    return gm


def test_schedule_moves_recompute_to_first_use_and_keeps_results():
    gm = _graph()
    x, t = torch.randn(4, 4), torch.randn(4, 4)
    want = gm(x, t)
    moved = schedule_recompute(gm, {"r1", "r2"})
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    assert moved == 2 and order == ["mul_tensor", "r1", "r2", "mul_tensor_1", "add_tensor"]
    torch.testing.assert_close(gm(x, t), want)


def test_simulated_liveness_of_a_small_graph():
    gm = _graph()
    n = 4 * 4 * 4
    # order a, t, r1, r2, g1=t*t, g2=g1*r2, g3=g2+r1: at g1, {t, r1, r2, g1} are live (a died after r1)
    assert simulate(gm, {"a", "tangents_1"}) == (4 * n, n)
    # inputs not counted (they exist before the step): at g2, {r1, r2, g1, g2}
    assert simulate(gm, set()) == (4 * n, n)
    assert simulate(gm, {"tangents_1"}) == (4 * n, n)


def _measure(model, inputs, options):
    torch._dynamo.reset()
    f = torch.compile(model, backend="remat", options={"lower": "eager", **options}, fullgraph=True)

    def step():
        f(*inputs).backward()

    step()
    plan = remat.last_plan()
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    step()  # warm
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    peak = step_peak_bytes(step)
    model.zero_grad(set_to_none=True)
    return plan, peak


@pytest.mark.parametrize("name, make", [("mlp", _mlp), ("gpt", _gpt), ("hf_gpt2", _hf_gpt2)])
def test_estimated_peak_within_10_percent_of_measured(name, make):
    model, inputs = make()
    for budget in (None, 0.5, 0.0):
        plan, measured = _measure(model, inputs, {} if budget is None else {"memory_budget": budget})
        assert measured > 0
        assert abs(plan.peak.step - measured) <= 0.1 * measured, (name, budget, plan.peak, measured)


def test_recompute_is_just_in_time_in_compiled_backward():
    """Every node between a recomputed node and its first backward user is part of that user's
    recompute chain (recomputed too): nothing recomputed waits for unrelated gradient work."""
    model, inputs = _gpt()
    seen = {}
    real = schedule_recompute

    def spy(bw, recomputed):
        moved = real(bw, recomputed)
        seen["bw"], seen["rec"] = bw, recomputed
        return moved

    import remat_fx.passes.partition as partition
    partition.schedule_recompute = spy
    try:
        _measure(model, inputs, {"memory_budget": 0.3})
    finally:
        partition.schedule_recompute = real
    nodes = list(seen["bw"].graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    assert seen["rec"]
    for node in nodes:
        if node.name not in seen["rec"]:
            continue
        first = min(index[u] for u in node.users)
        between = nodes[index[node] + 1:first]
        assert all(n.name in seen["rec"] for n in between), (node.name, [n.name for n in between])


def test_peak_budget_is_met_and_errors_below_the_lowest_peak():
    model, inputs = _gpt()
    free, free_peak = _measure(model, inputs, {})
    cap = int(free.peak.step * 0.9)
    plan, measured = _measure(model, inputs, {"peak_budget": cap})
    assert plan.peak.step <= cap and measured <= cap * 1.1 and plan.peak_budget == cap
    assert plan.peak_evaluations >= 2
    with pytest.raises(Exception, match=r"peak_budget [0-9.]+ KiB \([0-9,]+ bytes\) is below every estimated step "
                                        r"peak found: the lowest is .* Raise peak_budget to at least"):
        _measure(model, inputs, {"peak_budget": 1024})
