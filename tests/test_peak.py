"""Peak memory: the just-in-time schedule of recomputation, the static peak estimate against the
profiler's measurement, and peak_budget."""
import contextlib
import copy
import pathlib

import pytest
import torch
import torch.fx as fx

import remat_fx as remat
from benchmarks.memory import step_peak_bytes
from remat_fx.memory_budget import fmt_bytes
from remat_fx.passes.peak import alive_at_peak, simulate
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


def _measure(model, inputs, options, grads=False):
    """(plan, measured step peak) of a compile under ``options`` (eager lowering), and with ``grads``
    the parameters' gradients of its first step (one compile for both)."""
    torch._dynamo.reset()
    f = torch.compile(model, backend="remat", options={"lower": "eager", **options}, fullgraph=True)

    def step():
        f(*inputs).backward()

    model.zero_grad(set_to_none=True)
    step()
    plan = remat.last_plan()
    # only when asked for: a parameter the step does not use has no gradient to copy
    got = [p.grad.clone() for p in model.parameters()] if grads else None
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    step()  # warm
    model.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    peak = step_peak_bytes(step)
    model.zero_grad(set_to_none=True)
    return (plan, peak, got) if grads else (plan, peak)


def _spy(monkeypatch, name, record):
    """Wrap the partition pass ``name``; the returned dict is updated with ``record(args, result)``
    at each call."""
    import remat_fx.passes.partition as partition

    seen, real = {}, getattr(partition, name)

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.update(record(args, out))
        return out

    monkeypatch.setattr(partition, name, spy)
    return seen


@pytest.mark.parametrize("name, make", [("mlp", _mlp), ("gpt", _gpt), ("hf_gpt2", _hf_gpt2)])
def test_estimated_peak_within_10_percent_of_measured(name, make):
    model, inputs = make()
    for budget in (None, 0.5, 0.0):
        plan, measured = _measure(model, inputs, {} if budget is None else {"memory_budget": budget})
        assert measured > 0
        assert abs(plan.peak.step - measured) <= 0.1 * measured, (name, budget, plan.peak, measured)


def test_recompute_is_just_in_time_in_compiled_backward(monkeypatch):
    """Every node between a recomputed node and its first backward user is part of that user's
    recompute chain (recomputed too): nothing recomputed waits for unrelated gradient work."""
    model, inputs = _gpt()
    seen = _spy(monkeypatch, "schedule_recompute", lambda args, out: {"bw": args[0], "rec": args[1]})
    _measure(model, inputs, {"memory_budget": 0.3})
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


def test_peak_budget_reads_its_range_from_the_solver_without_partitioning_the_least_saved_plan(monkeypatch):
    """A byte peak_budget's steps stay within the feasible saved bytes: the budget solver gives that
    range, and the least-saved target is partitioned only if the search needs its plan; the plan
    chosen is the one a partition's range gave."""
    from remat_fx.memory_budget import Budget
    from remat_fx.passes import partition, peak

    real, calls = peak.fit_peak, []

    def spy(without_solver_range):
        def fit(cut, feasible, budgets, cap, fraction=None, alike=None):
            def counted(b, *args, **kwargs):
                calls.append((b.get(None), kwargs.get("quick", False)))
                return cut(b, *args, **kwargs)
            if without_solver_range:  # as before: the least-saved target partitioned, without reruns
                feasible = lambda b: counted(b, quick=True)[2].budget  # noqa: E731
            return real(counted, feasible, budgets, cap, fraction, alike)
        return fit

    model, inputs = _gpt()
    free, _ = _measure(model, inputs, {})
    cap = int(free.peak.step * 0.9)
    plans = []
    for without_solver_range in (False, True):
        calls.clear()
        monkeypatch.setattr(partition, "fit_peak", spy(without_solver_range))
        plan, measured = _measure(model, inputs, {"peak_budget": cap})
        plans.append((plan.total_bytes, plan.peak.step, plan.peak_evaluations, list(calls)))
    (saved, step, evaluations, made), (saved0, step0, evaluations0, made0) = plans
    least = (Budget(fraction=0.0), True)
    assert least in made0 and least not in made  # before: a partition for the range alone
    assert (saved, step) == (saved0, step0) and step <= cap
    assert evaluations == evaluations0 - 1


def _fake_plan(saved, peak, step_s, target=None, alike=0):
    from types import SimpleNamespace

    budget = None if target is None else SimpleNamespace(target=target, solver="ilp", alike=alike)
    return SimpleNamespace(total_bytes=saved, peak=SimpleNamespace(step=peak), step_cost_s=step_s, budget=budget,
                           peak_budget=None)


@pytest.mark.parametrize("alike_peak, alike_step, alike_classes, kept", [
    (90, 1.00, 5, True),  # fits, as fast: taken (the blocks' kernels are compiled once)
    (90, 0.99, 5, True),  # faster (fewer reruns to fit): taken
    (101, 0.90, 5, False),  # over the cap
    (90, 1.01, 5, False),  # slower
    (90, 1.00, 0, False),  # no plan alike within the slack: the solver's fastest again
])
def test_peak_budget_solves_its_chosen_target_again_with_blocks_alike(alike_peak, alike_step, alike_classes, kept):
    """Option blocks_alike 'final' (default, Inductor lowering): the target the peak search chose is
    solved again with repeated blocks alike, and that plan taken where it fits the cap and is not
    estimated slower; every other target is solved for the fastest plan."""
    from remat_fx.passes.peak import FINAL_ALIKE, fit_peak

    calls = []
    plans = {None: _fake_plan(200, 150, 0.8),  # the plan without a budget: over the cap
             1000: _fake_plan(120, 95, 1.0, target=1000)}  # fits

    def cut(budgets, fastest_s=None, cap=None, quick=False, alike=None):
        budget = budgets.get(None)
        target = None if budget is None else 1000 if budget.fraction == 0 else budget.nbytes  # 1000: the least
        calls.append((target, alike))
        if alike is not None:
            plan = _fake_plan(110, alike_peak, alike_step, target=target, alike=alike_classes)
        else:
            plan = plans.get(target) or _fake_plan(999, 999, 9.0, target=target)  # any other: over the cap
        return "fw", "bw", plan, {}

    def feasible(budgets):
        from types import SimpleNamespace
        return SimpleNamespace(minimum=1000, maximum=1000)  # one target: the search's answer is 1000

    without = fit_peak(cut, feasible, {}, 100)
    assert without[2] is plans[1000] and all(a is None for _, a in calls)
    calls.clear()
    found = fit_peak(cut, feasible, {}, 100, alike=FINAL_ALIKE)
    assert calls[-1] == (1000, FINAL_ALIKE) and all(a is None for _, a in calls[:-1])
    assert (found[2].total_bytes == 110) == kept and found[2].peak_budget == 100
    # the plan without a budget fits: nothing to solve again
    calls.clear()
    assert fit_peak(cut, feasible, {}, 200, alike=FINAL_ALIKE)[2] is plans[None] and calls == [(None, None)]


def test_a_peak_budget_no_plan_meets_names_the_least_peak_the_search_found():
    """PeakInfeasible names the lowest estimated peak of every plan the search cut: the search toward
    the cap's too, not only the grid's (here the valley, target 2,100, is between two grid targets,
    whose plans peak at 550: the error named 550)."""
    from types import SimpleNamespace

    from remat_fx.passes.peak import PeakInfeasible, fit_peak

    def cut(budgets, fastest_s=None, cap=None, quick=False, alike=None):
        budget = budgets.get(None)
        target = 3000 if budget is None else 1000 if budget.fraction == 0 else budget.nbytes
        return "fw", "bw", _fake_plan(target, 500 + abs(target - 2100) // 2, 1.0, target=target), {}

    with pytest.raises(PeakInfeasible, match=r"the lowest is 500 B \(500 bytes\), saving 2.05 KiB"):
        fit_peak(cut, lambda budgets: SimpleNamespace(minimum=1000, maximum=3000), {}, 50)


@pytest.mark.parametrize("alike_gain_s, kept_over", [(0.001, True), (-0.001, False)])
def test_peak_budget_solves_the_target_over_the_cap_again_with_blocks_alike(alike_gain_s, kept_over):
    """'final' also solves alike the smallest target the search cut over the cap: a plan alike
    saves at most its target, in steps of a block's bytes, and its peak is not the fastest plans'.
    Here the fastest plan of target t saves t and peaks at t + 100 (cap 1600: t <= 1500 fits); a
    plan alike saves 1000 below target 1500 and 1500 above it, peaking 50 over what it saves, and
    takes the one over the cap where it is faster than the plan found."""
    from remat_fx.passes.peak import FINAL_ALIKE, fit_peak

    calls = []

    def cut(budgets, fastest_s=None, cap=None, quick=False, alike=None):
        budget = budgets.get(None)
        target = 3000 if budget is None else 1000 if budget.fraction == 0 else budget.nbytes
        calls.append((target, alike))
        if alike is None:
            return "fw", "bw", _fake_plan(target, target + 100, 2.0 - target / 10000, target=target), {}
        saved = 1500 if target > 1500 else 1000
        step = 2.0 - saved / 10000 - (alike_gain_s if saved == 1500 else 0.0)
        return "fw", "bw", _fake_plan(saved, saved + 50, step, target=target, alike=4), {}

    def feasible(budgets):
        from types import SimpleNamespace
        return SimpleNamespace(minimum=1000, maximum=3000)

    found = fit_peak(cut, feasible, {}, 1600, alike=FINAL_ALIKE)
    searched = [t for t, a in calls if a is None]
    over = min(t for t in searched if t > 1500)
    assert calls[-2:] == [(1500, FINAL_ALIKE), (over, FINAL_ALIKE)]  # after the search, and no others alike
    assert all(a is None for _, a in calls[:-2])
    if kept_over:
        assert found[2].budget.target == over and found[2].total_bytes == 1500 and found[2].peak.step == 1550
        assert found[2].budget.alike and found[2].peak_budget == 1600
    else:  # slower than the plan found (the alike one at 1500 saves 1000: slower too)
        assert found[2].budget.target == 1500 and found[2].total_bytes == 1500 and not found[2].budget.alike
        assert found[2].peak.step == 1600 == found[2].peak_budget


@pytest.mark.slow
def test_budget_zero_is_held_in_per_layer_checkpointings_time_and_the_step_planner_takes_the_least_peak():
    """A 6-block GPT's joint graph planned for Inductor (nothing lowered). Budget 0 by default: its
    reruns within per-layer checkpointing's estimated step, then held under budget 0.05's own plan
    (by reruns whatever their time): not above 0.05. The least peak (reruns whatever their time) is
    budget 0 with peak_slack 0, and the whole-step planner's shared budget 0 (option least_peak)."""
    from remat_fx.options import parse_options
    from remat_fx.passes import partition
    from remat_fx.pareto import _capture, _tracing
    from remat_fx.step import candidates, shared_options
    from tests.test_budget import GPT, GPTConfig, random_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d_model=32, n_head=2, n_layer=6)
    ((gm, joint_inputs, kwargs),) = _capture(GPT(cfg), random_batch(cfg, 2), {})

    def plan(options):
        with _tracing(joint_inputs):
            partition.partition(gm, joint_inputs, options=options, **kwargs)
        return remat.last_plan()

    user = parse_options({"lower": "inductor"})
    assert shared_options(user, 0.0).least_peak and not shared_options(user, 0.05).least_peak
    assert not shared_options(user, None).least_peak
    # a whole-step limit under a user's budget 0 may still go down to the least peak
    assert candidates(parse_options({"memory_budget": 0.0})) == [None, 0.0]
    assert candidates(parse_options({"memory_budget": 0.1})) == [None, 0.05, 0.0]
    least = plan(parse_options({"lower": "inductor", "memory_budget": 0.0, "peak_slack": 0}))
    step_zero = plan(shared_options(user, 0.0))
    zero = plan(parse_options({"lower": "inductor", "memory_budget": 0.0}))
    near = plan(parse_options({"lower": "inductor", "memory_budget": 0.05}))
    assert least.rerun.allowance_s is None and least.rerun.reruns > 0
    assert (step_zero.peak.step, step_zero.total_bytes, step_zero.rerun.names) == \
        (least.peak.step, least.total_bytes, least.rerun.names)
    # peak_budget 0 is that plan, found without a search for another at its peak (three partitions:
    # the plan without a budget, over it, the least peak's, and its target with the blocks alike,
    # option blocks_alike "final", not faster here)
    fraction_zero = plan(parse_options({"lower": "inductor", "peak_budget": 0.0}))
    assert (fraction_zero.peak.step, fraction_zero.total_bytes, fraction_zero.rerun.names) == \
        (least.peak.step, least.total_bytes, least.rerun.names)
    assert fraction_zero.peak_evaluations == 3 and fraction_zero.peak_budget == least.peak.step
    # without reruns budget 0 has no other plan: no envelope is planned (its partition, and the
    # tie-break's look at it without reruns)
    plain = plan(parse_options({"lower": "inductor", "memory_budget": 0.0, "rerun": False}))
    assert plain.rerun is None and plain.peak_evaluations == 2 and plain.budget.held_under is None
    assert zero.total_bytes == least.total_bytes  # both save budget 0's feasible minimum
    assert zero.peak.step <= near.peak.step, (least.peak, zero.peak, near.peak)
    # (here the least peak search's plan is not lower: it keeps the faster of two plans within 1%
    # of each other; on the 8-layer Llama of benchmarks/gpu.py budget 0 is 22% faster and 36% higher)
    if zero.budget.held_under is not None:
        assert (zero.budget.held_by, zero.budget.held_under, zero.budget.held_levels) == ("0.05", near.peak.step, 3)
    else:
        assert zero.rerun.allowance_s is not None and zero.rerun.cost_s <= zero.rerun.allowance_s


@pytest.mark.parametrize("shape, blocks_meet, near_fastest", [((6, 32, 32, 64), False, None),
                                                                ((4, 64, 64, 64), True, None),
                                                                ((4, 64, 64, 64), True, 10.0)])
@pytest.mark.slow
def test_budget_zero_toward_its_cap_also_reruns_whole_blocks_first(monkeypatch, shape, blocks_meet, near_fastest):
    """Budget 0's reruns toward the envelope's cap (budget 0.05's plan) on a backward of numbered
    blocks search whole blocks first. Where the blocks' plan does not meet the cap, the values'
    search runs toward it and its plan is kept (6 blocks, d_model 32). Where it does (4 blocks, d_model
    64), the values' search runs toward the blocks' plan's peak, allowed its time less _NEAR_FASTEST
    and its copied nodes, and its plan is kept only where it gets there: no higher, faster, no more
    copies (on this GPT it does: 303 nodes copied instead of 712, for 0.82 ms of recompute against
    1.96); allowed a tenth of the time (_NEAR_FASTEST 10), it does not, and the blocks' plan is kept.
    GPTs' joint graphs planned for Inductor, nothing lowered."""
    import remat_fx.passes.rerun as rerun
    from remat_fx.options import parse_options
    from remat_fx.passes import partition
    from remat_fx.pareto import _capture, _tracing
    from tests.test_budget import GPT, GPTConfig, random_batch

    if near_fastest is not None:
        monkeypatch.setattr(rerun, "_NEAR_FASTEST", near_fastest)
    torch.manual_seed(0)
    n_layer, d_model, seq, vocab = shape
    cfg = GPTConfig(vocab=vocab, seq=seq, d_model=d_model, n_head=2, n_layer=n_layer)
    ((gm, joint_inputs, kwargs),) = _capture(GPT(cfg), random_batch(cfg, 2), {})
    searches, calls, real, real_call = [], [], rerun._search, partition.rerun_for_peak

    def spy(prog, state, sim, cur, held, floor, cost, allowance, cap, *args, **kwargs):
        history = real(prog, state, sim, cur, held, floor, cost, allowance, cap, *args, **kwargs)
        kept = history[:rerun._prefix(history, cur.peak, cap, 0.0)]
        searches.append(dict(cap=cap, blocks=args[-1], allowance=allowance, max_nodes=kwargs.get("max_nodes"),
                             peak=kept[-1][1].peak if kept else cur.peak, nodes=rerun._copied(kept),
                             seconds=kept[-1][4] if kept else 0.0))
        return history

    def spy_call(*args, **kwargs):
        calls.append(len(searches))  # where each backward's searches start
        return real_call(*args, **kwargs)

    monkeypatch.setattr(rerun, "_search", spy)
    monkeypatch.setattr(partition, "rerun_for_peak", spy_call)
    with _tracing(joint_inputs):
        partition.partition(gm, joint_inputs, options=parse_options({"lower": "inductor", "memory_budget": 0.0}),
                            **kwargs)
    zero = remat.last_plan()
    blocks, values = searches[calls[-1]:]  # budget 0's own searches, toward the cap: blocks first
    assert (blocks["blocks"], values["blocks"]) == (True, False)
    cap = blocks["cap"]
    assert cap is not None and cap == zero.budget.held_under and blocks["allowance"] is None
    assert zero.peak.step <= zero.budget.held_under
    if not blocks_meet:
        assert values["peak"] <= cap < blocks["peak"], (blocks, values)
        assert (values["cap"], values["allowance"], values["max_nodes"]) == (cap, None, None)
        assert zero.rerun.nodes == values["nodes"]
    else:
        assert blocks["peak"] <= cap
        assert values["cap"] == blocks["peak"] and values["max_nodes"] == blocks["nodes"]
        assert values["allowance"] == pytest.approx(blocks["seconds"] / (1 + rerun._NEAR_FASTEST), rel=1e-12)
        if near_fastest is None:  # no higher, faster, fewer copies: the values' plan
            assert values["peak"] <= blocks["peak"] and values["nodes"] < blocks["nodes"], (blocks, values)
            assert values["seconds"] < blocks["seconds"] / (1 + rerun._NEAR_FASTEST)
            assert zero.rerun.nodes == values["nodes"]
        else:  # in a tenth of the blocks' time the values do not get there: the blocks' plan
            assert values["peak"] > blocks["peak"], (blocks, values)
            assert zero.rerun.nodes == blocks["nodes"]
    # the searches above the minimum, toward a cap or within an allowance, go value by value only
    assert all(not s["blocks"] for s in searches[:calls[-1]])


@pytest.mark.parametrize("lower", ["inductor", "eager"])
@pytest.mark.slow
def test_rerun_searches_of_one_backward_simulate_each_program_once_and_plan_the_same(monkeypatch, lower):
    """rerun.Searched: the two rankings under a time allowance, and a later search of the same
    backward toward a cap, take their first steps from the programs earlier searches simulated;
    the plan is the one made with no program kept (a 3-block GPT's joint graph planned at budget 0,
    nothing lowered: the envelope's grid targets under their time allowances, then their plans and
    budget 0's toward its cap). Under the eager lowering the kept reruns are pruned and numbered
    again (_prune), in new items: the programs kept for later searches keep their numbers. With no
    program kept, the states of those simulated and not taken spare simulations too."""
    import remat_fx.passes.rerun as rerun
    from remat_fx.options import parse_options
    from remat_fx.passes import partition
    from remat_fx.pareto import _capture, _tracing
    from tests.test_budget import GPT, GPTConfig, random_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d_model=32, n_head=2, n_layer=3)
    ((gm, joint_inputs, kwargs),) = _capture(GPT(cfg), random_batch(cfg, 2), {})
    budget, calls, real = 0.0, [0], rerun._Program.simulate

    def counted(prog):
        calls[0] += 1
        return real(prog)

    monkeypatch.setattr(rerun._Program, "simulate", counted)
    class Forgets(dict):  # a program's state not kept either
        def __setitem__(self, key, value):
            pass

    made = {}
    for memo in ("none", "states", "kept"):
        with monkeypatch.context() as patch:
            if memo != "kept":  # over its limit from the start: no program kept (each backward's first still is)
                patch.setattr(rerun.Searched, "limit", 0)
            if memo == "none":
                real_init = rerun.Searched.__init__

                def forgetting(self, real_init=real_init):
                    real_init(self)
                    self.outcomes = Forgets()
                patch.setattr(rerun.Searched, "__init__", forgetting)
            calls[0] = 0
            with _tracing(joint_inputs):
                _, bw = partition.partition(gm, joint_inputs,
                                            options=parse_options({"lower": lower, "memory_budget": budget}), **kwargs)
        plan = remat.last_plan()
        numbers = sorted({n.meta[rerun.RERUN] for n in bw.graph.nodes if rerun.RERUN in n.meta})
        assert numbers == list(range(1, plan.rerun.reruns + 1)), (memo, numbers, plan.rerun.reruns)
        made[memo] = (calls[0], plan.total_bytes, plan.peak.step, plan.rerun.names, plan.rerun.cost_s,
                      plan.rerun.nodes, plan.peak_evaluations, [n.name for n in bw.graph.nodes])
    assert made["kept"][1:] == made["none"][1:] == made["states"][1:]
    assert made["none"][3], "no reruns: nothing searched"
    # Inductor's liveness: 108 against 159 (104 against 150 when written); with the states of programs
    # not taken alone, 158 there (as many under the eager lowering, 464: no program not taken tried twice)
    assert made["kept"][0] < made["none"][0] and made["states"][0] <= made["none"][0], made
    assert lower == "eager" or made["states"][0] < made["none"][0], made


def test_a_plannings_forwards_are_each_simulated_once_and_their_peaks_are_the_fresh_ones(monkeypatch):
    """The peak searches finish one partition several times (rerun searches under allowances and
    caps, estimates): each forward's liveness is simulated once per planning, and every plan's
    forward peak and floor are what a fresh simulation gives (a 3-block GPT's joint graph planned at
    budget 0 for Inductor, nothing lowered: 14 estimates and 7 rerun searches on 7 forwards, which
    were 21 simulations of them before)."""
    from remat_fx.options import parse_options
    from remat_fx.passes import partition, peak
    from remat_fx.pareto import _capture, _tracing
    from tests.test_budget import GPT, GPTConfig, random_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d_model=32, n_head=2, n_layer=3)
    ((gm, joint_inputs, kwargs),) = _capture(GPT(cfg), random_batch(cfg, 2), {})
    forwards, estimates, floors = [], [], []
    real_simulate, real_estimate, real_rerun = peak.simulate, partition.estimate_peak, partition.rerun_for_peak
    real_forward = partition.forward_simulation

    def simulate(g, *args, **kw):
        if not args and not kw.get("counted_inputs"):  # a forward: nothing counted from the start
            forwards.append(g)
        return real_simulate(g, *args, **kw)

    def forward_simulation(g, *args, **kw):  # the forward's peak and its inputs' spans, in one
        forwards.append(g)
        return real_forward(g, *args, **kw)

    def estimate(fw, bw, *args, **kw):
        found = real_estimate(fw, bw, *args, **kw)
        estimates.append((fw, found.forward))
        return found

    def rerun(bw, counted, shared, held, floor, *args, **kw):
        floors.append(floor)
        return real_rerun(bw, counted, shared, held, floor, *args, **kw)

    monkeypatch.setattr(peak, "simulate", simulate)
    monkeypatch.setattr(partition, "forward_simulation", forward_simulation)
    monkeypatch.setattr(partition, "estimate_peak", estimate)
    monkeypatch.setattr(partition, "rerun_for_peak", rerun)
    with _tracing(joint_inputs):
        partition.partition(gm, joint_inputs, options=parse_options({"lower": "inductor", "memory_budget": 0.0}),
                            **kwargs)
    assert remat.last_plan().rerun.reruns > 0
    assert len(estimates) > len({id(fw) for fw, _ in estimates}) > 1, len(estimates)  # partitions finished again
    assert len(floors) > 1
    assert len(forwards) == len({id(g) for g in forwards}) == len({id(fw) for fw, _ in estimates}), len(forwards)
    for fw, found in estimates:
        assert found == real_simulate(fw, inline=True)[0]
    assert set(floors) <= {found for _, found in estimates}


def test_of_two_rerun_searches_near_the_lowest_peak_and_alike_in_time_the_fewer_copies_are_kept():
    """_choose: of the value-by-value and the blocks-first searches' kept reruns, those within 1% of
    the lowest peak; of them the fastest, unless another is within 2% of its recompute and copies
    fewer nodes (what Inductor lowers and compiles in the first step)."""
    from remat_fx.passes.rerun import _choose, _Item, _State

    start = _State(1000, 1, 1000)

    def search(peak, seconds, *nodes):  # one rerun each, all of them read in the last program
        kept = []
        for k, n in enumerate(nodes, 1):
            items = [_Item(torch.fx.Graph().placeholder("x"), {}, copy=number) for number in range(1, k + 1)]
            out = torch.fx.Graph().output(None)
            items.append(_Item(out, {object(): i for i in items}))
            kept.append((items, _State(peak, 1, peak), f"r{k}", [None] * n, seconds * k / len(nodes)))
        return kept

    values = search(500, 1.00, 40, 40)  # 80 copies
    assert _choose([values, search(503, 1.015, 10, 10)], start) is not values  # within 1% and 2%: 20 copies
    slower = search(503, 1.03, 10, 10)  # 3% slower: not alike in time
    assert _choose([values, slower], start) is values and _choose([slower, values], start) is values
    higher = search(506, 0.5, 1)  # 1.2% higher: not near the lowest peak, however fast
    assert _choose([values, higher], start) is values
    lower = search(490, 1.2, 90)  # lower by 2%: the only one near the lowest, however slow
    assert _choose([values, lower], start) is lower


def test_peak_budget_under_inductor_plans_the_blocks_alike_and_the_plan_cache_replays_it(tmp_path, monkeypatch):
    """A 6-block GPT's joint graph, planned for the Inductor lowering (nothing lowered) at a
    peak_budget 70% of the way from its least estimated peak to its peak without a budget: the
    search's fastest plan saves different ops in different blocks; by default its target is solved
    again with the blocks alike, which fits the same cap at the same estimated step time. A second
    partition with the plan cache makes that plan again in one cut."""
    from remat_fx.options import parse_options
    from remat_fx.passes import partition
    from remat_fx.pareto import _capture, _tracing
    from tests.test_budget import GPT, GPTConfig, _blocks_of, random_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d_model=32, n_head=2, n_layer=6)
    ((gm, joint_inputs, kwargs),) = _capture(GPT(cfg), random_batch(cfg, 2), {})

    def plan(**options):
        with _tracing(joint_inputs):
            partition.partition(gm, joint_inputs, options=parse_options({"lower": "inductor", **options}), **kwargs)
        return remat.last_plan()

    free, least = plan(), plan(memory_budget=0.0, peak_slack=0)  # budget 0's least peak
    cap = least.peak.step + int(0.7 * (free.peak.step - least.peak.step))
    fastest = plan(peak_budget=cap, blocks_alike=False)
    assert any(len(blocks) < cfg.n_layer for blocks in _blocks_of(fastest).values()), _blocks_of(fastest)
    assert not fastest.budget.alike
    alike = plan(peak_budget=cap)
    assert all(len(blocks) == cfg.n_layer for blocks in _blocks_of(alike).values()), _blocks_of(alike)
    assert alike.budget.alike > 0 and "repeated blocks planned alike" in str(alike.budget)
    assert alike.peak.step <= cap == alike.peak_budget and alike.step_cost_s <= fastest.step_cost_s
    assert alike.budget.target == fastest.budget.target  # the target the search chose, solved again
    assert alike.peak_evaluations == fastest.peak_evaluations + 1
    monkeypatch.setenv("REMAT_FX_PLAN_CACHE", "1")
    monkeypatch.setenv("REMAT_FX_CACHE_DIR", str(tmp_path))
    first, again = plan(peak_budget=cap), plan(peak_budget=cap)
    assert not first.from_cache and again.from_cache and again.peak_evaluations == 1
    assert [(s.name, s.bytes) for s in again.saved] == [(s.name, s.bytes) for s in alike.saved]
    assert again.budget.alike == alike.budget.alike and again.peak.step == alike.peak.step


def test_peak_budget_with_the_blocks_alike_keeps_the_gradients_under_inductor():
    """The same GPT compiled with Inductor (fullgraph) at peak_budget 0.7: the plan kept is the one
    alike (every block saves the same), under its limit, and loss and gradients are eager's."""
    from tests.test_budget import GPT, GPTConfig, _blocks_of, random_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d_model=32, n_head=2, n_layer=6)
    model, inputs = GPT(cfg), random_batch(cfg, 2)
    want_loss = model(*inputs)
    want_loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    loss = torch.compile(model, backend="remat", fullgraph=True, options={"peak_budget": 0.7})(*inputs)
    loss.backward()
    plan = remat.last_plan()
    assert plan.budget.alike > 0 and plan.peak.step <= plan.peak_budget
    assert all(len(blocks) == cfg.n_layer for blocks in _blocks_of(plan).values()), _blocks_of(plan)
    torch.testing.assert_close(loss, want_loss.detach())
    for got, ref in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


# -- rerun: recompute a second time where holding a value sets the peak -------------------------

def _held_graph():
    """r1 is held from its recompute to its late use g3, across the peak at g1."""
    g = fx.Graph()
    a, t = g.placeholder("a"), g.placeholder("tangents_1")
    r1 = g.call_function(torch.ops.aten.sin.default, (a,))
    r2 = g.call_function(torch.ops.aten.cos.default, (r1,))
    g1 = g.call_function(torch.ops.aten.mul.Tensor, (t, r2))
    g2 = g.call_function(torch.ops.aten.mul.Tensor, (g1, g1))
    g3 = g.call_function(torch.ops.aten.add.Tensor, (g2, r1))
    g.output((g3,))
    return _module(g)


@pytest.mark.parametrize("device, peak, end", [("cpu", 4, 1), ("cuda", 5, 2)])
def test_an_incoming_gradient_on_cuda_is_held_to_the_backwards_end(device, peak, end):
    """On CUDA the autograd engine holds a backward's incoming gradient until the backward returns
    (passes/peak.py held_to_end): here the peak comes after its last reader, one tensor higher."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from remat_fx.passes.rerun import rerun_for_peak

    g = fx.Graph()
    t, a = g.placeholder("tangents_1"), g.placeholder("a")
    g1 = g.call_function(torch.ops.aten.mul.Tensor, (t, t))  # the gradient's last reader
    r1 = g.call_function(torch.ops.aten.sin.default, (a,))
    r2 = g.call_function(torch.ops.aten.cos.default, (a,))
    r3 = g.call_function(torch.ops.aten.mul.Tensor, (r1, r2))  # g1, r1, r2, r3 (and on CUDA t)
    g.output((g.call_function(torch.ops.aten.add.Tensor, (r3, g1)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    with FakeTensorMode():
        val = torch.empty(4, 4, device=device)
    for node in gm.graph.nodes:
        node.meta["val"] = val
    n = 4 * 4 * 4
    assert simulate(gm, {"tangents_1"}) == (peak * n, end * n)
    top, at, alive = alive_at_peak(gm, {"tangents_1"})
    assert (top, at.name) == (peak * n, "mul_tensor_1")
    assert sorted(k.name for _, k in alive) == sorted(["mul_tensor", "sin_default", "cos_default", "mul_tensor_1"]
                                                      + (["tangents_1"] if device == "cuda" else []))
    # under Inductor every op here is computed inside the add: its output and the gradient, which
    # the add does not write over (a tangent is never donated to the backward: passes/peak.py own_buffer)
    assert simulate(gm, {"tangents_1"}, inline=True)[0] == 2 * n
    _, report = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, lambda node: 1e-6)
    assert report.peak_before == peak * n


def _loss_backward(shift_here: bool, device: str, B=2, S=64, D=32, V=512) -> fx.GraphModule:
    """A causal LM's loss and its backward as AOTAutograd hands them to Inductor: the logits' softmax
    (its reductions computed inside the kernel that writes the gradient), the one-hot targets, the
    gradient read by two matmuls; the labels shifted here (``shift_here``: a pad and a slice of the
    batch, as Hugging Face's loss does) or given shifted (saved by the forward)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    aten, prims = torch.ops.aten, torch.ops.prims

    def loss_backward(h, w, labels):
        logits = aten.mm.default(h, w)
        e = aten.exp.default(aten.sub.Tensor(logits, aten.amax.default(logits, [1], True)))
        p = aten.div.Tensor(e, aten.sum.dim_IntList(e, [1], True))
        if shift_here:
            padded = aten.constant_pad_nd.default(labels, [0, 1], -100.0)
            labels = aten.clone.default(aten.slice.Tensor(padded, 1, 1, 9223372036854775807))
        vocab = prims.iota.default(V, start=0, step=1, dtype=torch.int64, device=h.device, requires_grad=False)
        onehot = aten.eq.Tensor(aten.view.default(labels, [-1, 1]), aten.view.default(vocab, [1, V]))
        grad = aten.sub.Tensor(p, prims.convert_element_type.default(onehot, torch.float32))
        return aten.mm.default(aten.t.default(grad), h), aten.mm.default(grad, aten.t.default(w))

    with FakeTensorMode():
        args = (torch.empty(B * S, D, device=device), torch.empty(D, V, device=device),
                torch.empty(B, S, dtype=torch.int64, device=device))
        return make_fx(loss_backward)(*args)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_on_cuda_a_gradient_whose_kernel_reads_the_labels_through_a_pad_is_not_written_over_the_logits(device):
    """passes/peak.py writes_apart: Inductor on CUDA wrote the loss's gradient over the logits where
    the labels were saved, and into a buffer of its own where its kernel shifted them (measured on
    an H200: 500 MiB over the estimate at budget 0 of benchmarks/gpu.py's Llama). On the CPU it writes
    over them either way. Both liveness walks (the estimate's and the rerun search's) agree."""
    from remat_fx.passes.rerun import rerun_for_peak

    logits = 2 * 64 * 512 * 4
    peaks = {}
    for shift_here in (False, True):
        gm = _loss_backward(shift_here, device)
        top, at, alive = alive_at_peak(gm, inline=True)
        _, report = rerun_for_peak(gm, set(), {}, 0, 0, lambda node: 1e-6, inline=True)
        assert report.peak_before == top
        peaks[shift_here] = (top, sorted(k.name for _, k in alive))
    assert peaks[False] == (logits + 2 * 64 * 32 * 4 + 32 * 512 * 4, ["mm_1", "mm_2", "sub_1"])
    if device == "cpu":
        assert peaks[True][0] == peaks[False][0]
    else:  # the gradient (sub_1) beside the logits (mm) as the gradient is written
        assert peaks[True] == (2 * logits + 1040, ["constant_pad_nd", "mm", "sub_1"])


def _rerun_cast(device: str, readers: int, N=64, chain: int = 0) -> fx.GraphModule:
    """A weight cast to bf16 for a matmul, then a wide temporary (through ``chain`` more matmuls),
    then the cast again for a later matmul (a rerun's copy, ``RERUN_OF`` the first), read through a
    transpose by ``readers`` kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from remat_fx.passes.peak import RERUN_OF

    aten, prims = torch.ops.aten, torch.ops.prims

    def backward(w, a, s):
        first = aten.mm.default(a, aten.t.default(prims.convert_element_type.default(w, torch.bfloat16)))
        wide = aten.mm.default(aten.exp.default(aten.mm.default(first, aten.t.default(a))), a)  # N x 4N
        for _ in range(chain):
            wide = aten.mm.default(wide, s)
        again = aten.t.default(prims.convert_element_type.default(w, torch.bfloat16))
        return tuple(aten.mm.default(wide, again) for _ in range(readers))

    with FakeTensorMode():
        gm = make_fx(backward)(torch.empty(N, N, device=device), torch.empty(4 * N, N, dtype=torch.bfloat16,
                                                                              device=device),
                               torch.empty(N, N, dtype=torch.bfloat16, device=device))
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.prims.convert_element_type.default]
    casts[1].meta[RERUN_OF] = casts[0].name
    return gm


@pytest.mark.parametrize("device, readers, hoisted", [("cpu", 1, False), ("cuda", 1, True), ("cuda", 2, False)])
def test_on_cuda_a_rerun_copy_near_its_original_is_computed_in_its_kernel(device, readers, hoisted):
    """passes/peak.py fused_back: Inductor fuses two kernels that read one buffer and lie close in its
    order, so a rerun's copy of a cast near the first cast is made with it and frees nothing between
    them (measured on an H200: the LM head's weight, 125 MiB twice across the loss's kernel); not on
    the CPU (not seen there), nor where the copy is read through a transpose that several kernels
    read (Inductor realises the transpose: measured, the copies of two MLP weights' casts kept
    kernels of their own). Both liveness walks agree."""
    from remat_fx.passes.peak import RERUN_OF
    from remat_fx.passes.rerun import _Program

    gm = _rerun_cast(device, readers)
    cast = 64 * 64 * 2
    top, at, alive = alive_at_peak(gm, {"a"}, inline=True)
    names = sorted(k.name for _, k in alive)
    assert ("convert_element_type_1" in names) == hoisted, names
    prog = _Program(gm, {"a"}, {}, inline=True)
    assert max(prog.simulate()[0]) == top
    plain = _rerun_cast(device, readers)  # the same graph, the second cast not a rerun's copy
    del [n for n in plain.graph.nodes if n.target is torch.ops.prims.convert_element_type.default][1].meta[RERUN_OF]
    assert top - alive_at_peak(plain, {"a"}, inline=True)[0] == (cast if hoisted else 0)


@pytest.mark.parametrize("between", [63, 64])
def test_on_cuda_a_rerun_copy_is_computed_in_its_originals_kernel_only_within_64_kernels(between):
    """passes/peak.py fused_back: Inductor fuses two kernels that read one buffer only when fewer than
    64 of its nodes lie between them (choices.py ``are_long_distant_nodes``). Both liveness walks
    count them alike: the graph's, and the rerun search's program (passes/rerun.py, which counts
    the kernels of each program once, not once per copy)."""
    from remat_fx.passes.peak import is_kernel
    from remat_fx.passes.rerun import _Program

    def kernels(gm):  # between the two casts, as fused_back counts them
        nodes = list(gm.graph.nodes)
        casts = [i for i, n in enumerate(nodes) if n.target is torch.ops.prims.convert_element_type.default]
        return sum(is_kernel(n, lambda x: x.users, lambda x: x, set(), {}) for n in nodes[casts[0] + 1:casts[1]])

    base = kernels(_rerun_cast("cuda", 1))
    gm = _rerun_cast("cuda", 1, chain=between - base)
    assert kernels(gm) == between
    top, _, alive = alive_at_peak(gm, {"a"}, inline=True)
    assert ("convert_element_type_1" in {k.name for _, k in alive}) == (between < 64)
    assert max(_Program(gm, {"a"}, {}, inline=True).simulate()[0]) == top


@pytest.mark.parametrize("device, buffers", [("cpu", 2), ("cuda", 1)])
def test_on_cuda_an_embeddings_gradient_is_accumulated_into_its_zeros(device, buffers):
    """passes/peak.py written_in_place: Inductor on CUDA puts an embedding's gradient into the zeros
    it starts from (measured on an H200: one 250 MiB buffer, not two); on the CPU (torch 2.13) the
    estimate keeps both."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from remat_fx.passes.rerun import _Program

    aten, V, D, N = torch.ops.aten, 512, 64, 256

    def embedding_backward(ids, grad):
        zeros = aten.full.default([V, D], 0.0, dtype=torch.float32, device=grad.device, pin_memory=False)
        return (aten.index_put.default(zeros, [ids], aten.mul.Tensor(grad, 2.0), True),)

    with FakeTensorMode():
        gm = make_fx(embedding_backward)(torch.empty(N, dtype=torch.int64, device=device),
                                         torch.empty(N, D, device=device))
    top, _, alive = alive_at_peak(gm, inline=True)
    assert top == buffers * V * D * 4 + N * D * 4, sorted(k.name for _, k in alive)  # and the values put
    assert max(_Program(gm, set(), {}, inline=True).simulate()[0]) == top


@pytest.mark.parametrize("budget, inductor, estimate", [("0", 3255.5, 3255.6), ("0.1", 2763.6, 2849.1)])
def test_the_h200_runs_backwards_are_estimated_at_or_just_over_inductors_schedule(budget, inductor, estimate):
    """The backwards benchmarks/gpu.py's 8-layer Llama compiled on an H200 (torch 2.11, bf16) at
    memory budgets 0 and 0.1, printed there and replayed here on fake CUDA tensors
    (benchmarks/fx_replay.py; tests/data/h200_llama8, comments left out). Inductor's own schedule of
    them peaked at 3,255.5 and 2,763.6 MiB, as the allocator measured (docs/benchmarks.md). The
    estimate was 2,882.1 MiB for both, under by 373 MiB at budget 0: the loss's gradient written
    apart from the logits (writes_apart) and a cast computed with its original (fused_back) bring it
    to Inductor's figure; 0.1's, 4.3% over (the embedding's gradient counted beside its zeros:
    written_in_place), is now 3.1% over."""
    from benchmarks import fx_replay

    data = pathlib.Path(__file__).parent / "data" / "h200_llama8"
    _, bw, inputs = fx_replay.estimate(fx_replay.read(str(data / f"b{budget}_bw.py.gz")),
                                       fx_replay.read(str(data / f"b{budget}_fw.py.gz")))
    top = alive_at_peak(bw, inputs.counted, inputs.shared, inline=True, donated=inputs.donated)[0] / 2**20
    assert round(top, 1) == estimate and inductor <= top <= inductor * 1.035


def test_the_h200_budget_01_backwards_rerun_search_replays_here():
    """benchmarks/fx_replay.py --search: the rerun search on a backward an H200 compiled (budget 0.1,
    tests/data/h200_llama8), replayed on fake CUDA tensors toward the lowest peak, the cost model
    left out: the planning work of a CUDA compile, timed without the GPU (docs/benchmarks.md,
    "Planning alone"). The search is deterministic: its reruns, peaks and simulations are these."""
    from benchmarks import fx_replay

    data = pathlib.Path(__file__).parent / "data" / "h200_llama8"
    _, bw, inputs = fx_replay.estimate(fx_replay.read(str(data / "b0.1_bw.py.gz")),
                                       fx_replay.read(str(data / "b0.1_fw.py.gz")))
    line = fx_replay.search(bw, inputs)
    assert "12 reruns, the backward's peak 2849.1 -> 2679.1 MiB, 16 programs simulated" in line, line


def _module(g: fx.Graph) -> fx.GraphModule:
    """A backward-shaped test graph, every value a 4 x 4 float32 tensor."""
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(4, 4)
    return gm


def test_rerun_recomputes_a_held_value_just_before_its_late_use():
    from remat_fx.passes.rerun import RERUN, rerun_for_peak

    gm = _held_graph()
    x, t = torch.randn(4, 4), torch.randn(4, 4)
    want = gm(x, t)
    n = 4 * 4 * 4
    assert simulate(gm, {"tangents_1"}) == (4 * n, n)  # at g1: t, r1, r2, g1
    new, report = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, lambda node: 1e-6)
    order = [(node.name, node.meta.get(RERUN, False)) for node in new.graph.nodes if node.op == "call_function"]
    assert order == [("sin_default", False), ("cos_default", False), ("mul_tensor", False),
                     ("mul_tensor_1", False), ("sin_default_rerun1", True), ("add_tensor", False)]
    assert simulate(new, {"tangents_1"})[0] == 3 * n
    assert (report.reruns, report.nodes, report.peak_before, report.peak_after) == (1, 1, 4 * n, 3 * n)
    assert report.names == ["sin_default"]
    torch.testing.assert_close(new(x, t), want)
    assert [node.name for node in gm.graph.nodes][2] == "sin_default"  # the input graph is left as it was
    # a rerun whose recompute does not fit the time allowance is not made; one that fits is
    same, none = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, lambda node: 1.0, allowance=0.99)
    assert none.reruns == 0 and same is gm and none.allowance_s == 0.99
    _, fits = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, lambda node: 1.0, allowance=1.0)
    assert (fits.reruns, fits.cost_s, fits.peak_after) == (1, 1.0, 3 * n)
    # ... nor one that lowers the peak by less than min_gain (here 25%)
    _, small = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, lambda node: 1e-6, min_gain=0.26)
    assert small.reruns == 0
    # the saved input is held too (a counted placeholder): recomputing r1 would keep `a` alive instead
    same, none = rerun_for_peak(gm, {"a", "tangents_1"}, {}, 0, 0, lambda node: 1e-6)
    assert none.reruns == 0
    # the forward's peak is the floor: nothing to gain in the backward below it
    same, none = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 4 * n, lambda node: 1e-6)
    assert none.reruns == 0


def _moving_peak_graph():
    """Two stretches at the peak (6 x 64 bytes): at g1 (t, x, big, g1) and at k, m (x, k). ``big``
    (128 bytes) is held across the first until h; ``x`` (64 bytes) across both, until out."""
    aten = torch.ops.aten
    g = fx.Graph()
    a, t = g.placeholder("a"), g.placeholder("tangents_1")
    nodes = {}
    for name, op, args in [("x", aten.sin.default, (a,)), ("big", aten.cos.default, (a,)),
                           ("g1", aten.mul.Tensor, (t, t)), ("g2", aten.sum.default, ("g1",)),
                           ("h", aten.mul.Tensor, ("big", "g2")), ("k", aten.cos.default, ("h",)),
                           ("m", aten.sum.default, ("k",)), ("out", aten.add.Tensor, ("x", "m"))]:
        nodes[name] = g.call_function(op, tuple(nodes.get(x, x) for x in args))
        nodes[name].name = name
    g.output((nodes["out"],))
    gm = fx.GraphModule(torch.nn.Module(), g)
    shapes = {"big": (8, 4), "g1": (8, 4), "g2": (0,), "h": (0,), "k": (20, 4), "m": (0,)}
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(shapes.get(node.name, (4, 4)))
    return gm


def test_rerun_under_a_time_allowance_spends_it_where_the_peak_falls():
    """Freeing ``big`` at the first peak frees twice x's bytes for twice its time (the same bytes
    per second), but the peak moves to k, which x's rerun lowers as well: under an allowance that
    buys one of them the search takes x (what it cuts off the top of the whole backward, per
    second), where ranking by bytes freed at the peak took big, kept nothing and left the peak at
    6 x 64 bytes. Without an allowance the search still ranks by bytes freed at the peak."""
    from remat_fx.passes.rerun import rerun_for_peak

    gm = _moving_peak_graph()
    n = 64
    assert simulate(gm, {"tangents_1"})[0] == 6 * n
    cost = lambda node: 2.0 if node.name == "big" else 1.0  # noqa: E731
    new, report = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, cost, allowance=2.0)
    assert (report.names, report.peak_before, report.peak_after, report.cost_s) == (["x"], 6 * n, 5 * n, 1.0)
    assert simulate(new, {"tangents_1"})[0] == 5 * n
    a, t = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(new(a, t), gm(a, t))
    _, lowest = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, cost)
    assert (lowest.names, lowest.peak_after, lowest.cost_s) == (["big", "x"], 5 * n, 3.0)


def test_reruns_that_later_reruns_make_needless_are_taken_out_under_the_eager_lowering(monkeypatch):
    """The rerun search is greedy: it first takes cheap reruns that narrow the backward's peak, and
    later ones, from further back, remake what they did. Under the eager lowering (whose measured
    peak is the estimate) those are taken out again (passes/rerun.py _prune): on the example GPT's
    block (compiled alone, as under FSDP2) at budget 0 with peak_slack 0 (the least peak the reruns
    find, whatever their time), the same estimated peak with fewer reruns
    and FLOPs, a measured step peak within 1% of the search's plan, and eager's gradients."""
    import remat_fx.passes.rerun as rerun
    from examples.gpt import GPTConfig, make_model, random_batch

    cfg = GPTConfig(vocab=512, seq=64, d_model=128, n_head=4, n_layer=1)
    idx, targets = random_batch(cfg, 4, seed=0)

    def step(model):
        model(idx, targets).backward()

    def run(compiled):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = make_model(cfg, "none", "recompute_all")
        if compiled:
            model.blocks[0].compile(backend="remat", options={"lower": "eager", "memory_budget": 0.0, "peak_slack": 0})
        step(model)
        grads = {k: p.grad for k, p in model.named_parameters()}
        plan = remat.last_plan() if compiled else None
        model.zero_grad(set_to_none=True)
        step(model)
        model.zero_grad(set_to_none=True)
        return plan, step_peak_bytes(lambda: step(model)), grads

    _, _, want = run(False)
    with monkeypatch.context() as m:
        m.setattr(rerun, "_prune", lambda prog, keep, state: keep)
        search, search_peak, _ = run(True)
    plan, peak, grads = run(True)
    assert plan.peak.step == search.peak.step, (plan.peak, search.peak)
    assert plan.rerun.reruns < search.rerun.reruns, (plan.rerun, search.rerun)
    assert plan.rerun.flops < search.rerun.flops, (plan.rerun, search.rerun)
    assert peak <= 1.01 * search_peak, (peak, search_peak)
    for k, v in want.items():
        torch.testing.assert_close(grads[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_lowest_peak_search_also_reruns_whole_blocks_first_and_keeps_the_faster_of_two_near_peaks(monkeypatch):
    """At budget 0 with peak_slack 0 (the least peak) on a model of numbered blocks (the example
    GPT's ``blocks.<i>``) a second rerun search first reruns each block whole, from its input, as per-block checkpointing does, each
    block lowering the peak (or narrowing the stretch at it), then goes on value by value. Of the
    two searches' plans the faster is kept where its estimated peak is within 1% of the lower one
    (or, within 2% of the faster's recompute, the one copying fewer nodes: _choose), else the lower:
    never more than 1% above the value-by-value search's peak, and more than 2% slower only at a
    lower peak; gradients as without remat. (On the 8-layer Llama of benchmarks/gpu.py under Inductor the blocks' plan is kept: the
    same measured peak, 11% less step time, docs/budgets.md#reruns; on this small model under the
    eager lowering the values' plan is.)"""
    import remat_fx.passes.rerun as rerun
    from examples.gpt import GPT, GPTConfig, random_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, d_model=32, n_head=2, n_layer=4)
    model = GPT(cfg)
    inputs = random_batch(cfg, 4)
    want = _grads(model, inputs, model)
    searches, real = [], rerun._search

    def spy(prog, *args, **kwargs):
        history = real(prog, *args, **kwargs)
        searches.append((args[-1], [h[2] for h in history], [args[2].peak] + [h[1].peak for h in history]))
        return history

    monkeypatch.setattr(rerun, "_search", spy)
    plans, made = {}, {}
    for first in (False, True):
        monkeypatch.setattr(rerun, "_BLOCKS_FIRST", first)
        searches.clear()
        plans[first], _, got = _measure(model, inputs, {"memory_budget": 0.0, "peak_slack": 0}, grads=True)
        made[first] = list(searches)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert [blocks for blocks, _, _ in made[False]] == [False]
    assert [blocks for blocks, _, _ in made[True]] == [False, True]
    _, names, peaks = made[True][1]
    whole = [name for name in names if name.startswith("blocks.")]
    assert len(set(whole)) >= 2 and names[:len(whole)] == whole, names  # the blocks first
    # each block lowers the peak, or narrows the stretch at it
    assert all(b <= a for a, b in zip(peaks, peaks[1:len(whole) + 1])) and peaks[len(whole)] < peaks[0], peaks
    values, chosen = plans[False], plans[True]
    assert chosen.peak.step <= values.peak.step * 1.01, (fmt_bytes(chosen.peak.step), fmt_bytes(values.peak.step))
    assert chosen.rerun.cost_s <= values.rerun.cost_s * (1 + rerun._NEAR_FASTEST) or \
        chosen.peak.step < values.peak.step, (chosen.rerun, values.rerun)


def test_rerun_keeps_the_fewest_reruns_that_come_within_one_percent_of_the_lowest_peak():
    """The search's last reruns often buy a fraction of a percent of the estimate for long closures
    (copied nodes Inductor compiles and the step runs): the prefix kept stops at the first peak within
    1% of the lowest; with a cap, at the first that meets it."""
    from remat_fx.passes.rerun import _prefix, _State

    def history(*peaks):
        return [(None, _State(peak, 1, peak), f"r{i}", [], 0.0) for i, peak in enumerate(peaks)]

    steps = history(800, 600, 598, 597, 595)
    assert _prefix(steps, 1000, None, 0.0) == 2  # 600 <= 1.01 * 595; the 3 reruns after it are dropped
    assert _prefix(history(900, 700, 500), 1000, None, 0.0) == 3
    assert _prefix(steps, 1000, None, 0.45) == 0  # 600 does not lower 1000 by min_gain's 45%
    assert _prefix(steps, 1000, 598, 0.0) == 3  # a cap: the first that meets it
    assert _prefix([], 1000, None, 0.0) == 0


def _two_held_graph():
    """r1 and s1 are both held from their early use (m) across the peak at g2 to their late uses."""
    g = fx.Graph()
    a, t = g.placeholder("a"), g.placeholder("tangents_1")
    r1 = g.call_function(torch.ops.aten.sin.default, (a,))
    s1 = g.call_function(torch.ops.aten.cos.default, (a,))
    m = g.call_function(torch.ops.aten.mul.Tensor, (r1, s1))
    g1 = g.call_function(torch.ops.aten.mul.Tensor, (t, t))
    g2 = g.call_function(torch.ops.aten.mul.Tensor, (g1, g1))
    g3 = g.call_function(torch.ops.aten.add.Tensor, (g2, r1))
    g4 = g.call_function(torch.ops.aten.add.Tensor, (g3, s1))
    g5 = g.call_function(torch.ops.aten.add.Tensor, (g4, m))
    g.output((g5,))
    return _module(g)


def test_shorten_keeps_the_first_reruns_that_bring_the_backward_to_a_limit():
    """When the backward is compiled the step may show its peak is elsewhere (remat_fx/step.py
    backward_limit): only the first of the search's reruns that bring the backward's estimate to
    that are kept, as the search had made them."""
    from remat_fx.passes.rerun import RERUN, rerun_for_peak, shorten

    gm = _two_held_graph()
    x, t = torch.randn(4, 4), torch.randn(4, 4)
    want = gm(x, t)
    n = 4 * 4 * 4

    def search():
        return rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, lambda node: 1e-6)

    full, report = search()
    assert (report.reruns, report.names, report.peak_before, report.peak_after) == \
        (2, ["sin_default", "cos_default"], 5 * n, 4 * n)
    torch.testing.assert_close(full(x, t), want)
    source, backward0, steps = report._steps
    assert source is gm and backward0 == 5 * n and [s[1] for s in steps] == [5 * n, 4 * n]
    # the first rerun only narrows the peak here: a limit it meets is made up for the prefix
    report._steps = (source, 6 * n, [(steps[0][0], 5 * n, *steps[0][2:]), steps[1]])
    bw, short, higher = shorten(report, full, 5 * n)
    assert [(node.name, node.meta.get(RERUN)) for node in bw.graph.nodes if node.meta.get(RERUN)] == \
        [("sin_default_rerun1", 1)]
    assert (short.reruns, short.names, short.shortened_from, short.nodes) == (1, ["sin_default"], 2, 1)
    assert higher == n
    torch.testing.assert_close(bw(x, t), want)
    assert not report.shortenable and shorten(report, full, 5 * n) is None  # once: the programs are let go

    full, report = search()
    bw, short, higher = shorten(report, full, 5 * n)  # the backward without reruns meets the limit
    assert bw is gm and (short.reruns, short.shortened_from, short.peak_after, higher) == (0, 2, 5 * n, n)
    full, report = search()
    assert shorten(report, full, 5 * n - 1) is None  # every rerun is needed
    full, report = search()
    assert shorten(report, full, None) is None and not report.shortenable  # no limit: let go all the same
    # AOTAutograd handed over a backward with other inputs than the search's (an effect token)
    full, report = search()
    other = copy.deepcopy(full)
    with other.graph.inserting_before(next(iter(other.graph.nodes))):
        other.graph.placeholder("tokens")
    assert shorten(report, other, 5 * n) is None and not report.shortenable


def test_rerun_under_inductor_copies_the_inlined_op_a_late_reader_reads_through():
    """Under Inductor's liveness a cheap pointwise op read by two kernels (h) is computed inside
    each, so the value it reads (r1) stays alive until h's last reader, past the peak. The rerun
    copies r1 *and* h just before that reader (h alone would still read the held r1)."""
    from remat_fx.passes.rerun import RERUN, rerun_for_peak

    g = fx.Graph()
    a, t = g.placeholder("a"), g.placeholder("tangents_1")
    aten = torch.ops.aten
    r1 = g.call_function(aten.mm.default, (a, a))  # materialised (an extern kernel), held
    h = g.call_function(aten.mul.Tensor, (r1, r1))  # early, read by e (early) and o2 (late): inlined
    e = g.call_function(aten.neg.default, (h,))
    g1 = g.call_function(aten.mm.default, (t, e))
    g2 = g.call_function(aten.mm.default, (g1, t))  # the peak: t, r1, g1, g2
    o2 = g.call_function(aten.sub.Tensor, (g2, h))
    g.output((g.call_function(aten.mm.default, (o2, o2)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(4, 4)
    n = 4 * 4 * 4
    assert _inlined(gm) == {"mul_tensor"}
    assert simulate(gm, {"tangents_1"}, inline=True)[0] == 4 * n
    new, report = rerun_for_peak(gm, {"tangents_1"}, {}, 0, 0, lambda node: 1e-6, inline=True)
    order = [(node.target, bool(node.meta.get(RERUN))) for node in new.graph.nodes if node.op == "call_function"]
    assert order[-4:] == [(aten.mm.default, True), (aten.mul.Tensor, True), (aten.sub.Tensor, False),
                          (aten.mm.default, False)], order
    assert report.reruns == 1 and report.names == ["mm_default"]
    assert simulate(new, {"tangents_1"}, inline=True)[0] == 3 * n == report.peak_after
    x, tt = torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(new(x, tt), gm(x, tt))


def _grads(model, inputs, fn):
    model.zero_grad(set_to_none=True)
    fn(*inputs).backward()
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.slow
def test_rerun_makes_the_peak_fall_with_the_budget():
    """Estimated step peaks never rise as the memory budget shrinks under the default peak_slack
    (without reruns they did: at 0 the backward recomputed every layer before the last layer's
    gradients); gradients unchanged; the measured peak follows the estimate. With the
    default peak_slack, above the budget's minimum the reruns and the tie-break together keep the
    estimated step time within 3% of the budget's fastest plan and never raise its peak (unless
    the monotone envelope picks a lower-peak plan that fits). At the minimum (budget 0) the time
    target gives way: with peak_slack 0 the reruns take the lowest peak they find; with the default
    they may take up to per-layer checkpointing's estimated step, and then what it takes to hold the
    peak at or under budget 0.05's own plan, so it is faster than the least peak and not above 0.05."""
    model, inputs = _gpt()
    want = _grads(model, inputs, model)
    plans = {}
    sweep = (1.0, 0.6, 0.2, 0.0)
    for budget in sweep:
        for slack in (0.0, 0.03):
            options = {"memory_budget": budget, "peak_slack": slack}
            if (budget, slack) == (0.0, 0.0):  # the least peak, measured below
                plan, on_peak, got = _measure(model, inputs, options, grads=True)
            else:
                torch._dynamo.reset()
                f = torch.compile(model, backend="remat", fullgraph=True, options={"lower": "eager", **options})
                got = _grads(model, inputs, f)
                plan = remat.last_plan()
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            plans[budget, slack] = plan
        fast, plan = plans[budget, 0.0], plans[budget, 0.03]
        if budget > 0:
            assert plan.peak.step <= fast.peak.step
            assert fast.rerun.reruns == 0  # peak_slack=0: nothing may be spent on the peak
            assert plan.rerun.allowance_s is not None and plan.rerun.cost_s <= plan.rerun.allowance_s
            assert plan.step_cost_s <= 1.03 * fast.step_cost_s * (1 + 1e-9) or \
                plan.peak.step < fast.peak.step  # the monotone envelope's lower-peak plan
        else:  # peak_slack 0: the least peak, whatever its time; the default: faster, at a peak not over 0.05's
            assert fast.rerun.allowance_s is None and fast.rerun.reruns > 0
            assert fast.peak.step <= plan.peak.step and plan.step_cost_s <= fast.step_cost_s * (1 + 1e-9), \
                (fast.peak, plan.peak, fast.step_cost_s, plan.step_cost_s)
    torch._dynamo.reset()
    f = torch.compile(model, backend="remat", fullgraph=True, options={"lower": "eager", "memory_budget": 0.05})
    _grads(model, inputs, f)
    near = remat.last_plan()  # budget 0.05 as its own compile plans it (its envelope included)
    zero = plans[0.0, 0.03]
    assert zero.peak.step <= near.peak.step, (zero.peak, near.peak)
    if zero.budget.held_under is not None:  # reruns within per-layer checkpointing's time did not reach 0.05's peak
        assert (zero.budget.held_by, zero.budget.held_under) == ("0.05", near.peak.step), zero.budget
        assert f"held at or under {fmt_bytes(near.peak.step)}, the estimated peak of budget 0.05's" in str(zero)
    else:  # they did: the reruns had that time and no more
        assert zero.rerun.allowance_s is not None and zero.rerun.cost_s <= zero.rerun.allowance_s, zero.rerun
    # the default slack; 0.05 (and 0 under it) may rise over 0.2 with the default two levels: the
    # whole grid's envelope holds them (test_estimated_peak_is_non_increasing_down_the_low_budgets)
    peaks = [plans[b, 0.03].peak.step for b in sweep]
    assert peaks[:-1] == sorted(peaks[:-1], reverse=True), peaks
    # peak_budget 0, the least peak of its range (budget 0 with peak_slack 0): at most its peak and time
    torch._dynamo.reset()
    f = torch.compile(model, backend="remat", fullgraph=True, options={"lower": "eager", "peak_budget": 0.0})
    for a, b in zip(_grads(model, inputs, f), want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    least, zero = remat.last_plan(), plans[0.0, 0.0]
    assert least.peak.step <= zero.peak.step, (least.peak.step, zero.peak.step)
    assert least.rerun is not None and least.rerun.allowance_s is None
    assert least.step_cost_s <= zero.step_cost_s * (1 + 1e-9), (least.step_cost_s, zero.step_cost_s)
    off, off_peak = _measure(model, inputs, {"memory_budget": 0.0, "rerun": False})
    on = plans[0.0, 0.0]  # the least peak
    assert on.rerun.reruns > 0 and off.rerun is None
    assert on.peak.step < 0.7 * off.peak.step and on_peak < 0.7 * off_peak, (on.peak, off.peak, on_peak, off_peak)
    assert abs(on.peak.step - on_peak) <= 0.1 * on_peak
    assert on.rerun.flops > 0 and on.backward_flops == off.backward_flops + on.rerun.flops
    assert "values recomputed a second time" in str(on)


def test_budget_zero_peak_at_or_below_per_block_checkpointing():
    model, inputs = _gpt()
    block, _ = _gpt(checkpoint="torch")

    def step():
        block(*inputs).backward()

    step()
    block.zero_grad(set_to_none=True)
    per_block = step_peak_bytes(step)
    plan, measured = _measure(model, inputs, {"memory_budget": 0.0})
    assert measured <= per_block, (measured, per_block, plan.peak)


def test_rerun_copies_sit_just_before_their_first_use(monkeypatch):
    """Between a rerun copy and its first user lie only other copies (its closure); a copied view,
    which allocates nothing, may wait longer for a later user of its base's copy."""
    from remat_fx.passes.peak import is_view
    from remat_fx.passes.rerun import RERUN

    model, inputs = _gpt()
    seen = _spy(monkeypatch, "rerun_for_peak", lambda args, out: {"bw": out[0]})
    plan, _ = _measure(model, inputs, {"memory_budget": 0.0, "peak_slack": 0})  # one rerun search: the least peak
    nodes = list(seen["bw"].graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    copies = [n for n in nodes if n.meta.get(RERUN) and not is_view(n)]
    assert copies
    # each copy carries the number of its rerun (passes/lower.py keeps two reruns' kernels apart)
    numbers = {n.meta[RERUN] for n in nodes if n.meta.get(RERUN)}
    assert numbers == set(range(1, plan.rerun.reruns + 1)), (numbers, plan.rerun.reruns)
    for node in copies:
        first = min(index[u] for u in node.users)
        assert all(n.meta.get(RERUN) for n in nodes[index[node] + 1:first]), node.name


def test_rerun_option():
    model, inputs = _mlp()
    with pytest.raises(Exception, match="option 'rerun' must be 'auto', True or False, got 'yes'"):
        torch.compile(model, backend="remat", options={"rerun": "yes"})(*inputs)
    plan, _ = _measure(model, inputs, {})
    assert plan.rerun is None  # auto: no budget, no rerun


def test_rerun_under_inductor_keeps_gradients_and_lowers_the_measured_peak():
    """Inductor lowers the backward with the reruns in place (its fusion is kept from pulling a
    rerun back to where the value was first computed): gradients as eager, measured peak lower."""
    model, inputs = _gpt()
    want = _grads(model, inputs, model)
    peaks = {}
    for rerun in (False, "auto"):
        torch._dynamo.reset()
        f = torch.compile(model, backend="remat", options={"memory_budget": 0.0, "rerun": rerun}, fullgraph=True)
        got = _grads(model, inputs, f)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        plan = remat.last_plan()

        def step():
            f(*inputs).backward()

        step()
        model.zero_grad(set_to_none=True)
        peaks[rerun] = (step_peak_bytes(step), plan)
        model.zero_grad(set_to_none=True)
    (off, _), (on, plan) = peaks[False], peaks["auto"]
    assert plan.rerun.reruns > 0
    assert on < 0.9 * off, (on, off)  # 20% lower here; parameter gradients are most of this tiny step


def test_inductor_liveness_computes_lone_pointwise_ops_inside_their_reader():
    """Under Inductor a pointwise op read by one fusible op is computed inside that op's kernel (no
    buffer of its own, its inputs live until that op); one read by an extern kernel (mm), even
    through a view, is materialised."""
    g = fx.Graph()
    a, w = g.placeholder("a"), g.placeholder("w")
    s = g.call_function(torch.ops.aten.sin.default, (a,))  # read by cos only: inlined
    c = g.call_function(torch.ops.aten.cos.default, (s,))  # read by mm through a view: materialised
    v = g.call_function(torch.ops.aten.view.default, (c, [4, 4]))
    m = g.call_function(torch.ops.aten.mm.default, (v, w))
    e = g.call_function(torch.ops.aten.exp.default, (m,))  # a graph output: materialised
    g.output((e,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(4, 1) if node.name in ("w", "mm_default", "exp_default") else torch.empty(4, 4)
    assert _inlined(gm) == {"sin_default"}
    n, small = 4 * 4 * 4, 4 * 4
    # op by op (inputs not counted): at cos, {sin, cos} is the peak
    assert simulate(gm, set()) == (2 * n, small)
    # inlined: sin takes nothing; the peak is cos and mm's output
    assert simulate(gm, set(), inline=True) == (n + small, small)
    # `a` counted (a saved activation, donated to the backward): it lives until cos, which reads it
    # through sin and, of its size and dying there, is written over it (in place)
    assert simulate(gm, {"a"}, inline=True, donated={"a"}) == (n + small, small)
    assert simulate(gm, {"a"}, inline=True) == (2 * n, small)  # not donated: cos's output beside it
    assert simulate(gm, {"a"}) == (2 * n, small)  # op by op: a, sin at sin
    x, wt = torch.randn(4, 4), torch.randn(4, 1)
    torch.testing.assert_close(gm(x, wt)[0], torch.exp(torch.cos(torch.sin(x)) @ wt))


def _inlined(gm):
    from remat_fx.passes.peak import inlined_nodes

    return {n.name for n in inlined_nodes(gm.graph.nodes, lambda n: n.all_input_nodes, lambda n: n.users)}


def test_inductor_liveness_recomputes_cheap_shared_pointwise_ops_in_each_reader():
    """A pointwise op read by several fusible ops is computed again inside each (as Inductor does
    on reuse) unless its body, with what is inlined into it, uses exp/log/tanh/sigmoid (on CPU) or
    reads more than Inductor's realize_reads_threshold buffers: those are materialised."""
    from torch._inductor import config

    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(6)]
    aten = torch.ops.aten

    def op(target, *args):
        return g.call_function(target, args)

    cheap = op(aten.mul.Tensor, xs[0], xs[1])  # read twice: recomputed in both readers
    shifted = op(aten.add.Tensor, cheap, xs[2])  # one reader (the exp): inlined into it
    heavy = op(aten.exp.default, shifted)  # read twice, a heavy body: materialised
    wide = xs[0]
    for x in xs[1:]:  # a chain of adds, each read once, ending in a node read twice
        wide = op(aten.add.Tensor, wide, x)
    outs = [op(aten.neg.default, cheap), op(aten.sin.default, cheap), op(aten.neg.default, heavy),
            op(aten.cos.default, heavy), op(aten.neg.default, wide), op(aten.sin.default, wide)]
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(4, 4)
    wide_name, chain = wide.name, {n.name for n in gm.graph.nodes if n.target is aten.add.Tensor} - {"add_tensor"}
    assert config.realize_reads_threshold == 4  # the chain below reads 6 buffers
    assert _inlined(gm) == {"mul_tensor", "add_tensor"} | (chain - {wide_name})
def test_inductor_liveness_counts_reads_as_inductor_does_and_inlines_into_a_gather():
    """Inductor's realise-on-reuse counts the buffers a body reads; a view of an op computed in
    place (an expand of an iota: a cross-entropy's one-hot targets) reads none. And a gather is a
    load at computed indices: the pointwise op it reads (a log-softmax) is computed inside it. Both
    were counted as materialised, which put a bf16 GPT-2's float32 log-softmax and its gradient,
    twice the logits, into the whole-step estimate (27-32% over the measured peak on an H200)."""
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(5)]
    idx = g.placeholder("idx")
    aten = torch.ops.aten

    def op(target, *args):
        return g.call_function(target, args)

    ramps = [op(aten.expand.default, op(aten.view.default, op(aten.arange.default, 4), [4, 1]), [4, 4])
             for _ in range(2)]
    picked = op(aten.where.self, op(aten.eq.Tensor, ramps[0], xs[0]), xs[1], xs[2])
    shared = op(aten.mul.Tensor, picked, ramps[1])  # reads x0, x1, x2 (the ramps: none); read twice
    logp = op(aten.sub.Tensor, xs[3], xs[4])  # read by the gather only
    outs = [op(aten.neg.default, shared), op(aten.sin.default, shared), op(aten.gather.default, logp, 1, idx)]
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        long = node.target in (aten.arange.default, aten.view.default, aten.expand.default) or node.name == "idx"
        shape = {"arange_default": (4,), "view_default": (4, 1), "idx": (4, 1), "gather_default": (4, 1)}
        shape.update({"arange_default_1": (4,), "view_default_1": (4, 1)})
        node.meta["val"] = torch.empty(shape.get(node.name, (4, 4)), dtype=torch.long if long else torch.float)
    inlined = _inlined(gm)
    assert {shared.name, picked.name, logp.name} <= inlined, inlined
    n = 4 * 4 * 4
    # the outputs (two 4x4, one 4x1) are the only buffers: nothing of the shared mul or the sub
    assert simulate(gm, set(), inline=True)[0] == 2 * n + 4 * 4
    # what Inductor does not compute at the indices: a reduction read by a gather (realised
    # first), and anything an index by a bool mask reads (ATen's index, on a materialised input)
    g = fx.Graph()
    a, idx, mask = g.placeholder("a"), g.placeholder("idx"), g.placeholder("mask")
    total = g.call_function(aten.sum.dim_IntList, (a, [1], True))
    neg = g.call_function(aten.neg.default, (a,))
    g.output((g.call_function(aten.gather.default, (total, 1, idx)), g.call_function(aten.index.Tensor, (neg, [mask]))))
    gm = fx.GraphModule(torch.nn.Module(), g)
    vals = {"a": torch.empty(4, 4), "idx": torch.zeros(4, 1, dtype=torch.long), "mask": torch.zeros(4, dtype=torch.bool),
            "sum_dim_int_list": torch.empty(4, 1), "neg_default": torch.empty(4, 4), "gather_default": torch.empty(4, 1),
            "index_tensor": torch.empty(2, 4)}
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["val"] = vals[node.name]
    assert _inlined(gm) == set(), _inlined(gm)


def _residual_chain(g: fx.Graph, h: fx.Node, ms, outs: list):
    """(module, names of the adds): h = h + m for each m, each sum read by the next add and by a
    neg (two readers), the last by a sin; the negs, the sin and ``outs`` are the outputs."""
    aten = torch.ops.aten
    chain = []
    for m in ms:
        outs.append(g.call_function(aten.neg.default, (h,)))
        h = g.call_function(aten.add.Tensor, (h, m))
        chain.append(h.name)
    outs.append(g.call_function(aten.sin.default, (h,)))
    g.output(tuple(outs))
    return fx.GraphModule(torch.nn.Module(), g), chain


def test_inductor_liveness_computes_an_embedding_inside_its_readers():
    """Inductor lowers an embedding as a pointwise load of the weight's rows (two reads: the
    weight and the indices), so read by several fusible ops it is computed inside each, and the
    residual adds after it count its reads: here the third add reads five buffers and is the one
    materialised. Counted as materialised, the embedding made the fourth add the materialised one,
    and on a Llama's backward at budget 0 every layer's residual chain was off by one add: Inductor
    held 0.5 MiB per layer more than the estimate (7.9 MiB at 32 layers)."""
    from torch._inductor import config

    aten = torch.ops.aten
    g = fx.Graph()
    weight, ids = g.placeholder("weight"), g.placeholder("ids")
    ms = [g.placeholder(f"m{i}") for i in range(4)]
    emb = g.call_function(aten.embedding.default, (weight, ids))
    gm, chain = _residual_chain(g, emb, ms, [])
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["val"] = torch.zeros(8, dtype=torch.long) if node.name == "ids" else \
                torch.empty(100, 4) if node.name == "weight" else torch.empty(8, 4)
    assert config.realize_reads_threshold == 4
    # emb: 2 reads, add 1: 3, add 2: 4 (inlined); add 3: 5 (materialised); add 4: read once
    assert _inlined(gm) == {emb.name, chain[0], chain[1], chain[3]}, _inlined(gm)
    n = 8 * 4 * 4  # bytes of one (8, 4) float tensor
    # at the fourth neg: add 3's buffer and the four negs; at the sin (add 4 computed inside it,
    # reading add 3, which dies there): the sin written over add 3, and the four negs
    assert simulate(gm, set(), inline=True)[0] == 5 * n


def test_inductor_liveness_computes_position_ids_inside_their_readers():
    """Position ids made from an iota (Hugging Face's GPT-2: iota, + the cache length, read by the
    position embedding, a mask's cat and compares) read no buffer: Inductor computes the index
    inside each reader, a cat included (into its slice of the output), so the residual chain after
    the two embeddings counts three reads (the weights and the token ids) and its third add is the
    one materialised. Counted as materialised (an iota read by several ops, an add read by a cat),
    they made the second add the materialised one, and every layer's residual chain was off by one
    add: at budget 0 an 8-layer GPT-2 (d 256) measured 46.15 MiB against an estimate of 38.11, and
    the example GPT 43.05 against 36.35, both above their peaks at budget 0.1."""
    aten, prims = torch.ops.aten, torch.ops.prims
    g = fx.Graph()
    wte, ids, wpe = g.placeholder("wte"), g.placeholder("ids"), g.placeholder("wpe")
    ms = [g.placeholder(f"m{i}") for i in range(3)]
    iota = g.call_function(prims.iota.default, (8,), {"start": 0, "step": 1, "dtype": torch.int64,
                                                       "device": torch.device("cpu"), "requires_grad": False})
    pos = g.call_function(aten.add.Tensor, (iota, 1))
    mask = g.call_function(aten.ge.Scalar, (iota, 3))
    both = g.call_function(aten.cat.default, ([pos, pos],))
    emb = g.call_function(aten.embedding.default, (wte, ids))
    emb1 = g.call_function(aten.embedding.default, (wpe, pos))
    h = g.call_function(aten.add.Tensor, (emb, emb1))
    gm, chain = _residual_chain(g, h, ms, [mask, both])
    chain.insert(0, h.name)
    ints = torch.zeros(8, dtype=torch.long)
    vals = {"ids": ints, "wte": torch.empty(100, 4), "wpe": torch.empty(9, 4), iota.name: ints, pos.name: ints,
            mask.name: torch.zeros(8, dtype=torch.bool), both.name: torch.zeros(16, dtype=torch.long)}
    for node in gm.graph.nodes:
        if node.op != "output":
            node.meta["val"] = vals.get(node.name, torch.empty(8, 4))
    # the embeddings' sum: 3 reads, + m0: 4, + m1: 5 (materialised), + m2: read once
    assert _inlined(gm) == {iota.name, pos.name, emb.name, emb1.name, chain[0], chain[1], chain[3]}, _inlined(gm)


def test_inductor_liveness_reads_a_reduction_as_its_own_buffer():
    """Inductor realises a reduction when it lowers it (unless it unrolls a short one into a
    pointwise sum), so an RMSNorm's output, read by two kernels, loads the residual sum's four
    inputs and the mean's buffer: five reads, and it is materialised. Counted through the mean (to
    the same four inputs), it was inlined: on a one-layer Llama at budget 0.15 (with reruns that
    promised 11.8%) Inductor held it across the logits' gradient, and the step measured 4,147,208
    bytes against an estimate of 3,932,676; now 3,932,680."""
    aten = torch.ops.aten
    for width, materialised in ((16, True), (4, False)):  # 16 elements reduced; 4 < unroll threshold 8
        g = fx.Graph()
        a, b, c, d = (g.placeholder(x) for x in "abcd")
        h = g.call_function(aten.add.Tensor, (g.call_function(aten.add.Tensor, (g.call_function(
            aten.add.Tensor, (a, b)), c)), d))
        sq = g.call_function(aten.mul.Tensor, (h, h))
        mean = g.call_function(aten.mean.dim, (sq, [-1], True))
        eps = g.call_function(aten.add.Tensor, (mean, 1e-6))
        r = g.call_function(aten.rsqrt.default, (eps,))
        y = g.call_function(aten.mul.Tensor, (h, r))
        g.output((g.call_function(aten.neg.default, (y,)), g.call_function(aten.sin.default, (y,))))
        gm = fx.GraphModule(torch.nn.Module(), g)
        for node in gm.graph.nodes:
            if node.op != "output":
                node.meta["val"] = torch.empty(8, 1 if node in (mean, eps, r) else width)
        assert (y.name not in _inlined(gm)) == materialised, (width, _inlined(gm))
        assert {h.name, sq.name, mean.name, r.name} <= _inlined(gm), _inlined(gm)


# -- peak tie-break: among plans of about the same time under the budget, the lowest peak -------

@pytest.mark.slow
def test_peak_slack_picks_the_lowest_estimated_peak_within_the_slack():
    """With a fractional budget the plan may save less than the budget allows when that lowers the
    estimated step peak for at most peak_slack more estimated step time; peak_slack=0 gives the
    fastest plan. Saved bytes stay under the budget and gradients are unchanged."""
    model, inputs = _gpt()
    want = _grads(model, inputs, model)
    lowered, held = 0, []
    for budget in (0.8, 0.6, 0.4, 0.2):
        plans = {}
        for slack in (0.0, 0.02):
            torch._dynamo.reset()
            f = torch.compile(model, backend="remat", fullgraph=True,
                              options={"lower": "eager", "memory_budget": budget, "peak_slack": slack})
            for a, b in zip(_grads(model, inputs, f), want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            plans[slack] = remat.last_plan()
        fast, plan = plans[0.0], plans[0.02]
        assert fast.budget.lowered_to is None
        assert plan.budget.target == fast.budget.target and plan.total_bytes <= plan.budget.target
        assert plan.peak.step <= fast.peak.step
        if plan.budget.held_under is not None:
            # the monotone envelope held it under a larger budget's plan, whatever the time (0.6:
            # under 0.7's plan held under 0.8's, by default; the envelope's own tests are below)
            held.append(budget)
            assert plan.budget.held_met and plan.peak.step <= plan.budget.held_under < fast.peak.step
        elif plan.budget.lowered_to is not None:
            lowered += 1
            assert plan.peak.step < fast.peak.step and plan.total_bytes <= plan.budget.lowered_to
            assert plan.step_cost_s <= 1.02 * fast.step_cost_s * (1 + 1e-9)
            assert plan.budget.fastest_peak <= fast.peak.step  # the fastest plan, with its own reruns
            assert "for a lower estimated peak" in str(plan)
        else:  # the fastest plan, and reruns only if they lower its peak within the slack
            assert plan.total_bytes == fast.total_bytes
            assert plan.peak.step == fast.peak.step or plan.rerun.reruns > 0
            assert plan.step_cost_s <= 1.02 * fast.step_cost_s * (1 + 1e-9)
    assert lowered > 0 and held == [0.6], held


def test_peak_tie_break_walks_on_peaks_without_reruns_and_searches_reruns_once(monkeypatch):
    """The tie-break's walk compares the plans of its lower targets by their estimated peak without
    reruns; only the plan it ends on gets a rerun search (the fastest plan has its own already),
    and that plan is taken only if its peak with reruns is lower than the fastest plan's."""
    import remat_fx.passes.partition as partition
    import remat_fx.passes.peak as peak

    searches, calls = [0], []
    real_search, real_lower = partition.rerun_for_peak, peak.lower_peak

    def search(*args, **kwargs):
        searches[0] += 1
        return real_search(*args, **kwargs)

    def lower(cut, budgets, first, slack):
        before = searches[0]
        out = real_lower(cut, budgets, first, slack)
        # the reports as lower_peak left them (the envelope may pick a plan lower_peak gave it, for
        # a grid target under its budget, and re-report it as its budget's)
        calls.append((searches[0] - before, first[2], out[2], out[2].budget.lowered_to))
        return out

    monkeypatch.setattr(partition, "rerun_for_peak", search)
    monkeypatch.setattr(partition, "lower_peak", lower)
    monkeypatch.setattr(peak, "lower_peak", lower)
    model, inputs = _gpt()
    lowered = 0
    for budget in (0.8, 0.6):  # the first lowered, the second not (eager lowering)
        calls.clear()
        searches[0] = 0
        torch._dynamo.reset()
        f = torch.compile(model, backend="remat", fullgraph=True, options={"lower": "eager", "memory_budget": budget})
        _grads(model, inputs, f)
        assert calls
        for k, (n, first, chosen, lowered_to) in enumerate(calls):
            assert n <= 1  # the walk's last plan, and no other
            if lowered_to is not None:
                lowered += 1
                assert chosen.rerun is not None  # its peak counts its reruns
                # searched here, or this partition's search was made for an earlier walk (the
                # envelope's grid targets above the budget walk too; a partition of the same tags
                # and time allowance is finished once)
                assert n == 1 or any(c.rerun is chosen.rerun for _, _, c, _ in calls[:k]), (budget, k)
                assert chosen.peak.step < first.peak.step
                # the walk's plans were estimated without a rerun search each
                assert remat.last_plan().peak_evaluations > searches[0] + 1
            else:
                assert chosen is first
    assert lowered > 0


def test_monotone_envelopes_last_resort_reruns_the_feasible_minimum_toward_the_bound_not_to_its_least(
        monkeypatch):
    """Where the budget's reruns cannot reach its bound and no grid target under it meets it, the
    envelope takes the feasible minimum's partition with its reruns toward the bound, the fastest
    plan that meets it: not the least peak those reruns find whatever their time (until 2026-12-06:
    planned as on CUDA, benchmarks/gpu.py's Llama in bf16 took 125 reruns to 9.44 MiB at budget 0.1
    where its bound was 12.90, docs/budgets.md "Planned as on CUDA"). Feasible range 0..1000, budget
    0.06 (first plan 600) under target 100's plan (400); reruns toward a cap reach it only down to each
    partition's floor: 550 for the budget's own, 500 for the grid target 50 under it, 200 for the
    minimum's, whose search toward the cap stops at the bound."""
    from remat_fx.passes import peak as P
    from remat_fx.passes.plan import BudgetReport

    first = {60: 600, 100: 400, 50: 650, 0: 900}
    floor = {60: 550, 50: 500, 0: 200}
    asked = []

    def cut(budgets, fastest_s=None, cap=None, quick=False, alike=None, **kwargs):
        budget = budgets[None]
        target = budget.nbytes if budget.nbytes is not None else int(budget.fraction * 1000)
        asked.append((target, cap, kwargs))
        report = BudgetReport(budget=f"{target / 1000:g}", target=target, achieved=max(target, 8), minimum=0,
                              maximum=1000, solver="ilp", solve_seconds=0.0, estimated_cost_s=0.0)
        own = first.get(target, 1000 + target)
        if kwargs.get("least"):  # the lowest peak, whatever its time
            peak, step_s = floor[target], 3.0
        elif cap is None:
            peak, step_s = own, 1.0
        else:  # toward the cap, at most down to the partition's floor
            peak = max(floor.get(target, own), min(own, cap))
            step_s = 1.0 + (own - peak) / 1000
        plan = _fake_plan(max(target, 8), peak, step_s, target=target)
        plan.budget = report
        return "fw", "bw", plan, {}

    monkeypatch.setattr(P, "lower_peak", lambda cut, budgets, first, slack: first)  # no tie-break here
    budgets = {None: P.Budget(nbytes=60)}
    chosen = cut(budgets)
    found = P.monotone_peak(cut, budgets, chosen, 0.03, 1)
    assert (0, 400, {}) in asked, asked  # the minimum's partition, its reruns toward the bound
    assert not any(kwargs for _, _, kwargs in asked), asked
    plan = found[2]
    assert (plan.peak.step, plan.total_bytes, plan.step_cost_s) == (400, 8, 1.5)
    report = plan.budget
    assert (report.held_under, report.held_met, report.budget, report.target) == (400, True, "0.06", 60)


def _grid_cut(first: dict, asked: list):
    """A stand-in for partition's ``cut`` over the feasible range 0..1000: target t's plan peaks at
    ``first[t]`` (1000 + t where not given), or at a cap given it (its reruns toward it reach it, at a
    tenth of a second more); ``asked`` gets (target, quick) of each call."""
    from remat_fx.passes.plan import BudgetReport

    def cut(budgets, fastest_s=None, cap=None, quick=False, alike=None):
        target = budgets[None].nbytes
        asked.append((target, quick))
        report = BudgetReport(budget=f"{target / 1000:g}", target=target, achieved=target, minimum=0, maximum=1000,
                              solver="ilp", solve_seconds=0.0, estimated_cost_s=0.0)
        own = first.get(target, 1000 + target)
        plan = _fake_plan(target, own if cap is None else min(own, cap), 1.0 + (0.1 if cap is not None else 0.0),
                          target=target)
        plan.budget = report
        return "fw", "bw", plan, {}

    return cut


@pytest.mark.parametrize("levels, extend, peak, held_levels", [
    (1, False, 600, 1), (2, False, 500, 2), (3, False, 400, 3), (None, False, 400, None), (2, True, 400, 3)])
def test_monotone_envelope_holds_the_nearby_target_under_the_ones_above_it_option_monotone_levels(
        monkeypatch, levels, extend, peak, held_levels):
    """Option monotone: the budget's bound is the nearest grid target's plan, itself held under the
    next target's, ``levels`` targets up (None: 'grid', all of them). Feasible range 0..1000, so the
    grid targets are 1000 x (1, 0.9, ..., 0.15, 0.1, 0.05); budget 0.06's first plan peaks at 600,
    target 100's at 700, 150's at 500, 200's at 400, and the ones above at 1000 + their target: with
    1 level the budget is compared with 100's first plan and keeps 600, which budget 0.1's own
    compile holds at 500 (2 levels see that); 150 itself is held at 200's 400 (3 levels and the
    whole grid see that, and monotone='auto': 2 levels, and 150's first plan is a bump over
    200's, so one more). A plan held under a bound reaches it; the report says what it was held under."""
    from remat_fx.passes import peak as P

    asked = []
    cut = _grid_cut({60: 600, 100: 700, 150: 500, 200: 400}, asked)
    monkeypatch.setattr(P, "lower_peak", lambda cut, budgets, first, slack: first)  # no tie-break here
    budgets = {None: P.Budget(nbytes=60)}
    chosen = cut(budgets)
    found = P.monotone_peak(cut, budgets, chosen, 0.03, levels, extend)
    assert found[2].peak.step == peak
    if extend:  # 250 was asked (the check of 200, not a bump), and the top (1000) for each check; nothing else
        assert {t for t, _ in asked if t > 200} == {250, 1000}, asked
    report = found[2].budget
    if levels == 1:
        assert found is chosen and report.held_under is None
    else:
        assert (report.held_under, report.held_by, report.held_met) == (peak, "0.1", True)
        assert report.held_final == (levels is None) and report.held_levels == held_levels
        said = {2: "plan held under the next grid target's", 3: "plan held in turn under the 2 grid targets above it",
                None: "plan"}[held_levels]
        assert f"held at or under {fmt_bytes(peak)}, the estimated peak of budget 0.1's {said} (the monotone " \
            "envelope" in str(report), str(report)


def test_monotone_auto_goes_no_further_than_two_levels_where_the_second_is_no_bump(monkeypatch):
    """monotone='auto' where the chain's second level (150, first plan 500) peaks at or under the
    fastest plan of the target above it (200: 600): two levels, as monotone=2, the check of 200
    the only partition more (nothing above 200 asked)."""
    from remat_fx.passes import peak as P

    asked = []
    cut = _grid_cut({60: 600, 100: 700, 150: 500, 200: 600}, asked)
    monkeypatch.setattr(P, "lower_peak", lambda cut, budgets, first, slack: first)  # no tie-break here
    budgets = {None: P.Budget(nbytes=60)}
    found = P.monotone_peak(cut, budgets, cut(budgets), 0.03, 2, True)
    assert found[2].peak.step == 500 and found[2].budget.held_levels == 2
    assert {t for t, _ in asked if t > 150} == {200, 1000} and (200, False) in asked, asked  # fastest plans, reruns


def test_monotone_auto_goes_on_up_where_the_top_of_the_grid_peaks_under_the_chain(monkeypatch):
    """monotone='auto' where saving the most peaks lowest (the top, 1000: 300; every other grid
    target's first plan 700, none a bump over the level above it): the chain's last level is a bump
    over the top's plan, so the chain goes on up to the top, and budget 0.06 is held at 300, not kept
    at its first plan's 600 (a bump two levels or more under the top: 8 Linear+GELU blocks with a
    graph break, d 64, its first graph's plan at budget 0.6 peaked at 2.88 MB where 0.7's, held under
    the top's 2.82 MB, saved a fifth of the bytes; measured step peak 7.41 MB at 0.6, 6.88 at 0.7)."""
    from remat_fx.passes import peak as P

    asked = []
    cut = _grid_cut({60: 600, 1000: 300, **{t: 700 for t in (100, 150, 200, 250, 300, 400, 500, 600, 700, 800,
                                                             900)}}, asked)
    monkeypatch.setattr(P, "lower_peak", lambda cut, budgets, first, slack: first)  # no tie-break here
    budgets = {None: P.Budget(nbytes=60)}
    found = P.monotone_peak(cut, budgets, cut(budgets), 0.03, 2, True)
    assert found[2].peak.step == 300 and found[2].budget.held_under == 300, found[2].budget
    assert found[2].budget.held_met and found[2].budget.held_by == "0.1"
    without = P.monotone_peak(cut, budgets, cut(budgets), 0.03, 2, False)  # monotone=2: the top unseen
    assert without[2].peak.step == 600


@pytest.mark.parametrize("monotone", [
    pytest.param(2, marks=pytest.mark.xfail(
        strict=True, reason="with monotone=2 (the default until 2026-12-06) the envelope holds a budget under the "
        "nearest grid target's plan held under the next target's, not that target's own envelope: the test GPT's 0.05 "
        "keeps 182,660 bytes, "
        "0.1's first plan held under 0.15's first plan, where budget 0.1 itself goes down to 162,180 (0.15 being "
        "held under 0.2's); monotone=3, 'auto' or 'grid' see that (docs/budgets.md)")),
    "auto", "grid"])
@pytest.mark.slow
def test_estimated_peak_is_non_increasing_down_the_low_budgets(monotone):
    """The issue's "monotone by construction, in the estimate": each smaller memory budget's
    estimated step peak at most the larger one's (the test GPT, eager lowering). Option
    monotone="grid" holds each budget under the nearby grid target's own envelope, up the grid;
    monotone=2 holds it under that target's plan held one level up only, and 0.05 rises over 0.1;
    'auto' goes on up past 0.15's first plan, a bump over 0.2's."""
    model, inputs = _gpt()
    budgets = (0.3, 0.2, 0.15, 0.1, 0.05, 0.0)
    # the joint graph traced once and planned at each budget as a compile plans it (remat.pareto;
    # tests/test_budget.py test_pareto_plans_the_joint_graph_a_compile_plans_under_its_lowering)
    points = remat.pareto(model, inputs, budgets, options={"lower": "eager", "monotone": monotone}, progress=False)
    peaks = []
    for budget, point in zip(budgets, points):
        (plan,) = point.plans
        assert point.est_peak == plan.peak.step
        peaks.append(plan.peak.step)
        assert plan.budget.budget == f"{budget:g}"  # the report keeps the user's budget
        assert plan.total_bytes <= plan.budget.target
        held = plan.budget.held_under
        if held is not None:  # the report says what it was held under, and whether it got there
            assert plan.budget.held_final == (monotone == "grid")
            if monotone == "auto":  # 2 levels at least, more past a bump
                assert plan.budget.held_levels >= 2 + (budget == 0), plan.budget
            elif monotone != "grid":
                assert plan.budget.held_levels == monotone + (budget == 0)  # 0: under 0.05's own
            assert plan.budget.held_met == (plan.peak.step <= held)
            assert f"held at or under {fmt_bytes(held)}" in str(plan) or not plan.budget.held_met
        assert peaks == sorted(peaks, reverse=True), peaks


def test_inductor_liveness_writes_a_pointwise_output_over_an_input_dying_there():
    """Inductor writes a pointwise kernel's output over an input of the same size that dies in that
    kernel (saved activations are donated to the backward): not over one still read later, nor over
    one of another size."""
    aten = torch.ops.aten

    def graph(read_a_later: bool):
        g = fx.Graph()
        a, c, w = g.placeholder("a"), g.placeholder("c"), g.placeholder("w")
        s = g.call_function(aten.add.Tensor, (a, c))  # a: 4x4, c: 4x1 (broadcast); read by mm: a buffer
        m = g.call_function(aten.mm.default, (s, w))
        g.output((g.call_function(aten.mul.Tensor, (m, a)) if read_a_later else m,))
        gm = fx.GraphModule(torch.nn.Module(), g)
        for node in gm.graph.nodes:
            big = node.name in ("a", "add_tensor", "mul_tensor")
            node.meta["val"] = torch.empty(4, 4) if big else torch.empty(4, 1)
        return gm

    n, small = 4 * 4 * 4, 4 * 4
    # at the add: a (written over by the add's output) and c; then the add's output and mm's
    assert simulate(graph(False), {"a", "c"}, inline=True, donated={"a", "c"})[0] == n + small
    assert simulate(graph(False), {"a", "c"})[0] == 2 * n + small  # op by op: a, c and the add's output
    # a not donated (a tangent, or a forward output the caller holds): not written over
    assert simulate(graph(False), {"a", "c"}, inline=True)[0] == 2 * n + small
    # a read again by the last op: not written over
    assert simulate(graph(True), {"a", "c"}, inline=True, donated={"a", "c"})[0] == 2 * n + small


def test_inductor_liveness_runs_an_mm_read_by_an_add_as_an_addmm():
    """Inductor folds ``mm(a, b) + c`` into one addmm at the add (post-grad pass): the mm's output
    takes no memory of its own and its inputs stay alive until the add. An mm with another reader
    is left alone."""
    aten = torch.ops.aten
    g = fx.Graph()
    a, b, c = g.placeholder("a"), g.placeholder("b"), g.placeholder("c")
    m1 = g.call_function(aten.mm.default, (a, b))  # read by the add only: folded into it
    w = g.call_function(aten.exp.default, (c,))  # between the mm and the add; read twice, heavy: a buffer
    s1 = g.call_function(aten.add.Tensor, (w, m1))
    m2 = g.call_function(aten.mm.default, (s1, s1))  # read twice: an mm of its own
    s2 = g.call_function(aten.add.Tensor, (m2, w))
    g.output((g.call_function(aten.mm.default, (s2, m2)),))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in gm.graph.nodes:
        node.meta["val"] = {"a": torch.empty(4, 16), "b": torch.empty(16, 4)}.get(node.name, torch.empty(4, 4))
    assert _inlined(gm) == {"mm_default"}
    n = 4 * 4 * 4
    # `a` (4n, counted) lives until the add that runs the mm: at the add a, w and s1 are alive
    assert simulate(gm, {"a"}, inline=True)[0] == 6 * n
    assert simulate(gm, {"a"})[0] == 5 * n  # op by op `a` dies at the mm (the peak: a and its output)
    x = [torch.randn(4, 16), torch.randn(16, 4), torch.randn(4, 4)]
    s1v = torch.exp(x[2]) + x[0] @ x[1]
    m2v = s1v @ s1v
    torch.testing.assert_close(gm(*x)[0], (m2v + torch.exp(x[2])) @ m2v)


def test_peak_slack_option():
    model, inputs = _mlp()
    with pytest.raises(Exception, match=r"option 'peak_slack' must be a fraction of step time in \[0, 1\)"):
        torch.compile(model, backend="remat", options={"peak_slack": 2})(*inputs)


def test_inductor_kernels_do_not_fuse_across_a_rerun():
    """Under Inductor a fused kernel runs once all it reads is ready and allocates all its outputs
    when it starts, so two kernels fused across a rerun either compute the rerun early (held as the
    first copy was) or run a reader of the first copy after the rerun (both copies alive): far
    fusions with a rerun between them or in the later one are refused, and at any distance those
    across the copies of a rerun the earlier kernel is not part of; a rerun's copies fuse with each
    other and their readers, and the rest is left to Inductor."""
    from remat_fx.passes.lower import _KeepRerunsLate
    from remat_fx.passes.rerun import RERUN

    class Origin:
        def __init__(self, rerun):
            self.meta = {RERUN: rerun} if rerun else {}

    class SNode:  # what the fusion choice reads of Inductor's scheduler nodes
        def __init__(self, order, rerun=0):
            self.min_order = self.max_order = order
            self.node = type("IR", (), {"origins": {Origin(rerun)}})()

        def get_nodes(self):
            return [self]

    class Prior:
        def can_fuse(self, scheduler, node1, node2, score):
            return True

    copies = {20: 1, 21: 1, 25: 2, 26: 2}  # position: its rerun's number
    nodes = [SNode(i, rerun=copies.get(i, 0)) for i in range(40)]
    scheduler = type("Scheduler", (), {"nodes": nodes})()
    choices = _KeepRerunsLate(Prior())
    assert not choices.can_fuse(scheduler, nodes[5], nodes[30], 0)  # a reader of the first copy, pulled late
    assert not choices.can_fuse(scheduler, nodes[30], nodes[5], 0)
    assert not choices.can_fuse(scheduler, nodes[20], nodes[2], 0)  # the rerun itself, pulled early
    assert not choices.can_fuse(scheduler, nodes[17], nodes[22], 0)  # near, but across rerun 1's copies
    assert not choices.can_fuse(scheduler, nodes[21], nodes[27], 0)  # rerun 1 with a reader of rerun 2's
    assert choices.can_fuse(scheduler, nodes[20], nodes[21], 0)  # one rerun's copies
    assert choices.can_fuse(scheduler, nodes[20], nodes[22], 0)  # ... and their reader
    assert choices.can_fuse(scheduler, nodes[15], nodes[19], 0)  # near, no rerun between them
    assert choices.can_fuse(scheduler, nodes[27], nodes[39], 0)  # far, but no rerun between them
    assert choices.can_fuse(scheduler, nodes[0], nodes[19], 0)


def llama_step(loss, model, ids):
    """(gradients, measured step peak) of one step of benchmarks/llama_depth.py's model, after a
    first step that compiles a compiled ``loss``."""
    from benchmarks.llama_depth import grads_of

    model.zero_grad(set_to_none=True)
    loss(ids).backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    peak = step_peak_bytes(lambda: loss(ids).backward())
    model.zero_grad(set_to_none=True)
    return grads, peak


@pytest.mark.slow
def test_measured_peak_never_rises_as_the_budget_falls_on_an_8_layer_llama_under_inductor():
    """The whole step of an 8-layer Hugging Face Llama (from a LlamaConfig; benchmarks/llama_depth.py)
    lowered by Inductor: the measured step peak (profiler memory timeline) does not rise as the
    memory budget falls from 1 to 0, nor does remat's estimate (the monotone envelope,
    passes/peak.py monotone_peak; the low end, where PyTorch's peak rises again); at 0
    it is at or below eager per-layer torch.utils.checkpoint's (its reruns within per-layer
    checkpointing's estimated step, or held under budget 0.05's plan); saved bytes within each
    budget; gradients equal eager's.

    Inductor's C++ code depends on torch's thread count (its kernels' parallel loops and split
    reductions), and so does the measured peak: this runs at 2 threads, PyTorch's default on a 2-core
    machine, where the issue's CPU figures and benchmarks/llama_depth.py were measured; the suite's
    workers run at 1 (tests/conftest.py), where the low end's order is open (the test below)."""
    from argparse import Namespace
    from benchmarks.llama_depth import build

    shape = Namespace(layers=8, hidden=128, intermediate=256, vocab=1000, seq=256, batch=4)  # the issue's shape
    with _threads(2):
        _llama_budgets_down(build, shape)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "open: on 1 thread Inductor's C++ kernels differ, and the low budgets' measured peaks, all within 0.7% of "
    "each other, are not ordered (0.15 / 0: 15,987,208 / 16,003,592 bytes): the monotone envelope holds the "
    "estimates, which are 0.8-1.2% over the measured at 0.15 and 0.1 (docs/budgets.md)"))
def test_measured_peak_at_budget_0_is_at_or_under_0_15s_on_one_thread():
    """The test above's Llama on 1 thread, budgets 0.15 and 0 alone: 0 measures 16 KiB over 0.15
    (docs/budgets.md, "Measured, the low end is ordered only as far as the estimate is right")."""
    from argparse import Namespace
    from benchmarks.llama_depth import build

    shape = Namespace(layers=8, hidden=128, intermediate=256, vocab=1000, seq=256, batch=4)
    peaks = {}
    with _threads(1):
        for budget in (0.15, 0.0):
            torch._dynamo.reset()
            model, loss, ids = build(shape)
            compiled = torch.compile(loss, backend="remat", fullgraph=True,
                                     options={"lower": "inductor", "memory_budget": budget})
            _, peaks[budget] = llama_step(compiled, model, ids)
    assert peaks[0.0] <= peaks[0.15], peaks


@contextlib.contextmanager
def _threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _llama_budgets_down(build, shape):
    run = llama_step

    model, loss, ids = build(shape)
    want, _ = run(loss, model, ids)
    model, loss, ids = build(shape, checkpoint=True)
    _, per_layer = run(loss, model, ids)
    peaks, estimates = {}, {}
    for budget in (1.0, 0.15, 0.0):  # 0.4 too before: 50 s of the suite's 15 minutes
        torch._dynamo.reset()
        model, loss, ids = build(shape)
        compiled = torch.compile(loss, backend="remat", fullgraph=True,
                                 options={"lower": "inductor", "memory_budget": budget})
        got, peaks[budget] = run(compiled, model, ids)
        plan = remat.last_plan()
        estimates[budget] = plan.peak.step
        if budget < 1:
            assert plan.total_bytes <= plan.budget.target
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6)
    measured = list(peaks.values())
    assert measured == sorted(measured, reverse=True), (peaks, per_layer)
    assert list(estimates.values()) == sorted(estimates.values(), reverse=True), estimates
    assert peaks[0.0] <= per_layer, (peaks, per_layer)
    assert peaks[0.0] < 0.5 * peaks[1.0], peaks
    zero = plan.rerun
    assert zero.reruns > 0 and (plan.budget.held_by == "0.05" or zero.cost_s <= zero.allowance_s), (plan.budget, zero)


@pytest.mark.slow
def test_estimated_peak_never_rises_as_the_budget_falls_on_a_wide_llama_under_the_eager_lowering():
    """The H200 table's 8-layer Llama at 1/8 scale (hidden 256, vocab 4,000, batch 4 x 256: its
    vocab/hidden and tokens/hidden ratios), the eager lowering, whose measured peak is the estimate
    on this model. Budget 0.3's fastest plan peaks above 0.4's, and its reruns cannot bring it
    down to that: the envelope took the feasible minimum's plan (47.90 MiB, saving 8 KiB, 120
    reruns), below 0.15's 64.51 and 0.1's 58.47 MiB. It now takes the plan of the largest grid
    target under 0.3 that meets the bound (76.51 MiB, saving 29.65 MiB, 2 reruns)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=2,
                                   num_key_value_heads=2, vocab_size=4000, max_position_embeddings=256, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 4000, (4, 256), generator=torch.Generator().manual_seed(0))
    # the joint graph captured once and planned at each budget, as a compile plans it
    # (test_budget.py test_pareto_plans_the_joint_graph_a_compile_plans_under_its_lowering)
    points = remat.pareto(lambda i: model(i, labels=i).loss, (ids,), [0.3, 0.15, 0.1], options={"lower": "eager"},
                          progress=False)
    estimates = {float(p.budget): p.est_peak for p in points}
    assert estimates[0.1] <= estimates[0.15] <= estimates[0.3], {b: f"{e / 2**20:.2f} MiB" for b, e in estimates.items()}
    assert points[-1].plans[0].rerun.reruns < 20  # not the feasible minimum's plan (120 reruns)


def test_a_budgets_fusions_pull_no_kernel_ahead_of_the_ones_before_it():
    """Under a remat budget two kernels do not fuse where the later one reads a kernel that runs
    between them (passes/lower.py _pulls_forward): the fused kernel starts where the earlier one
    did, so what it reads moves ahead, alive across the kernels in between. Without the rule a
    one-layer Hugging Face Llama at budget 0.15 measured 4.50 MiB against remat's estimate of 3.75
    (torch 2.13 on CPU; the 8-layer Llama of benchmarks/llama_depth.py at 0.15 15.34 against
    13.98, at 0 13.52 against 12.39), as Inductor's own schedule said too. With it the measured
    step peak is the estimate, and the gradients eager's. The rule reads Inductor's scheduler
    (``name_to_buf``, ``name_to_fused_node``, ``defining_op``, ``read_writes``, ``max_order``),
    checked on torch 2.13.0 and 2.14.1: where one is missing nothing is refused and this fails."""
    from argparse import Namespace
    from benchmarks.llama_depth import build

    shape = Namespace(layers=1, hidden=128, intermediate=256, vocab=1000, seq=128, batch=4)
    model, loss, ids = build(shape)
    want, _ = llama_step(loss, model, ids)
    torch._dynamo.reset()
    model, loss, ids = build(shape)
    compiled = torch.compile(loss, backend="remat", fullgraph=True,
                             options={"lower": "inductor", "memory_budget": 0.15})
    got, peak = llama_step(compiled, model, ids)
    estimate = remat.last_plan().peak.step
    assert peak <= 1.02 * estimate, (peak, estimate)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6)


def test_a_budgets_lowering_keeps_the_order_the_schedule_gave_it():
    """Under a remat budget Inductor's reordering for peak memory is off, as its buffer reuse is
    (passes/lower.py _keeps_peak): by its own estimate it moved one block's attention recompute
    into the MLP's backward, beside the MLP's gradient (2,630,152 bytes measured against 2,233,864
    in the schedule's order, torch 2.13 on CPU). The example GPT's block at budget 0.3, alone:
    remat's measured step peak at or below PyTorch's at the same activation_memory_budget, and its
    gradients PyTorch's."""
    from examples.gpt import GPTConfig, make_model

    cfg = GPTConfig(vocab=512, seq=64, d_model=128, n_head=4, n_layer=1)
    x = torch.randn(4, 64, 128, generator=torch.Generator().manual_seed(0))
    peaks, grads = {}, {}
    for system in ("torch", "remat"):
        torch._dynamo.reset()
        block = make_model(cfg, "none", "recompute_all").blocks[0]
        if system == "torch":
            block.compile()
            patch = {"activation_memory_budget": 0.3}
        else:
            block.compile(backend="remat", options={"memory_budget": 0.3})
            patch = {}
        inp = x.clone().requires_grad_()
        with torch._functorch.config.patch(enable_autograd_cache=False, **patch):
            block(inp).sum().backward()  # compiles
            grads[system] = [inp.grad.clone()] + [p.grad.clone() for p in block.parameters()]
            peaks[system] = step_peak_bytes(lambda: block(inp).sum().backward())
    assert peaks["remat"] <= peaks["torch"], peaks
    for a, b in zip(grads["remat"], grads["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _walk(peaks: dict, seconds: dict = None):
    """lower_peak over a stand-in for partition's ``cut``: ``peaks`` maps each saved-bytes target
    (of a 1,000-byte budget) to the estimated peak of its plan; returns (plan chosen, targets
    partitioned in order, with True where the partition ran its rerun search)."""
    from types import SimpleNamespace

    from remat_fx.memory_budget import Budget
    from remat_fx.passes.peak import lower_peak
    from remat_fx.passes.plan import BudgetReport

    seconds = seconds or {}
    cuts = []

    def cut(budgets, fastest_s=None, quick=False):
        target = budgets[None].nbytes
        cuts.append((target, not quick))
        report = BudgetReport(budget="0.5", target=target, achieved=target, minimum=100, maximum=2000,
                              solver="ilp", solve_seconds=0.0, estimated_cost_s=0.0)
        plan = SimpleNamespace(budget=report, step_cost_s=seconds.get(target, 1.0), rerun=None,
                               peak=SimpleNamespace(step=peaks[target]))
        return None, None, plan

    first = cut({None: Budget(nbytes=1000)})
    cuts.clear()
    chosen = lower_peak(cut, {None: Budget(nbytes=1000)}, first, slack=0.03)
    return chosen[2], cuts


def test_peak_tie_break_solves_its_last_target_first_and_ends_there_when_it_is_lower():
    """The walk over saved-bytes targets 0.95 / 0.9 / 0.85 / 0.8 of the budget's solves 0.8 first:
    lower than the fastest plan, the walk ends there (one partition, then its rerun search);
    otherwise it goes from 0.95 and stops at the first target that does not lower the peak; a target
    slower than the slack allows, or none lower, keeps the fastest plan."""
    # 0.8 lower than the fastest plan: one partition of the walk, then that target with its reruns
    plan, cuts = _walk({1000: 500, 950: 480, 900: 470, 850: 460, 800: 450})
    assert cuts == [(1000, False), (800, False), (800, True)]
    assert plan.budget.lowered_to == 800 and plan.peak.step == 450
    assert plan.budget.target == 1000 and plan.budget.fastest_peak == 500
    assert "solved at a lower target, 800 B, for a lower estimated peak (the fastest plan under" in str(plan.budget)
    # the same peak at a lower step time (the reruns' times differ): taken, and said so (it said "for a
    # lower estimated peak")
    plan, cuts = _walk({1000: 500, 950: 500, 900: 500, 850: 500, 800: 500}, seconds={800: 0.99})
    assert cuts == [(1000, False), (800, False), (800, True)]
    assert plan.budget.lowered_to == 800 and plan.peak.step == plan.budget.fastest_peak == 500
    assert "solved at a lower target, 800 B, for the same estimated peak at a lower estimated step time (the " \
        "fastest plan under 1000 B: est. peak 500 B, est. step 1000.0 ms)" in str(plan.budget), str(plan.budget)
    # 0.8 not lower: the walk from 0.95, ending at the first miss (0.85), keeps 0.9
    plan, cuts = _walk({1000: 500, 950: 480, 900: 470, 850: 475, 800: 510})
    assert cuts == [(1000, False), (800, False), (950, False), (900, False), (850, False), (900, True)]
    assert plan.budget.lowered_to == 900 and plan.peak.step == 470
    # 0.8 lower but over the time slack (3%): not taken; nor is 0.95, no lower than the fastest
    plan, cuts = _walk({1000: 500, 950: 500, 900: 400, 850: 400, 800: 400}, seconds={800: 1.05})
    assert cuts == [(1000, False), (800, False), (950, False)]
    assert plan.budget.lowered_to is None and plan.peak.step == 500


def test_peak_tie_breaks_walk_ends_where_a_fifth_fewer_saved_bytes_peak_to_the_byte_where_the_fastest_plan_does():
    """Where target 0.8's plan (no faster) peaks exactly where the fastest plan does, the peak is set by
    what the saved bytes do not change (the gradients near the backward's end: an 8-layer Llama of
    hidden 1024 planned as on CUDA peaks at 489.82 MiB at every budget): the walk ends there, one
    partition, not two. A peak one byte lower at 0.8 still walks from 0.95."""
    plan, cuts = _walk({1000: 500, 950: 480, 900: 470, 850: 460, 800: 500})
    assert cuts == [(1000, False), (800, False)]
    assert plan.budget.lowered_to is None and plan.peak.step == 500
    plan, cuts = _walk({1000: 500, 950: 480, 900: 470, 850: 460, 800: 501})
    assert cuts == [(1000, False), (800, False), (950, False), (900, False), (850, False), (850, True)]
    assert plan.budget.lowered_to == 850 and plan.peak.step == 460


def test_a_peak_budget_under_a_memory_budget_reports_the_users_budget():
    """A peak_budget's search solves saved-bytes targets under the memory_budget's: the plan's report
    keeps the user's budget and target and notes the target solved for, and the fastest plan's
    estimates (it said "budget 26.17 KiB: target 26.17 KiB", the 0.5 gone)."""
    torch._dynamo.reset()
    model, inputs = _gpt()
    f = torch.compile(model, backend="remat", options={"lower": "eager", "memory_budget": 0.5, "peak_budget": 0.3})
    f(*inputs).backward()
    plan = remat.last_plan()
    report = plan.budget
    assert report.budget == "0.5" and plan.total_bytes <= report.lowered_to < report.target
    assert report.fastest_peak > plan.peak.step
    assert str(report).startswith("budget 0.5: target ") and "solved at a lower target" in str(report)


def test_the_tie_breaks_walk_stops_above_the_feasible_minimum():
    """lower_peak solves lower saved-bytes targets within the time slack, never the feasible minimum
    itself: that target is budget 0's, whose plan's reruns are allowed per-layer checkpointing's
    time, not the slack's (target 1,000 at 0.8 is the minimum, 800, here: it was solved)."""
    from types import SimpleNamespace

    from remat_fx.memory_budget import Budget
    from remat_fx.passes.peak import lower_peak

    asked = []

    def cut(budgets, fastest_s=None, cap=None, quick=False, alike=None):
        target = budgets[None].nbytes
        asked.append(target)
        report = SimpleNamespace(target=target, minimum=800, solver="ilp", lowered_to=None)
        return "fw", "bw", SimpleNamespace(peak=SimpleNamespace(step=5000 - target), step_cost_s=1.0, rerun=None,
                                           budget=report), {}

    budgets = {None: Budget(nbytes=1000)}
    assert lower_peak(cut, budgets, cut(budgets), 0.05)[2].budget.target == 1000
    assert min(asked) > 800, asked
