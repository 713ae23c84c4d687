"""Options are checked where the user states them: remat.compile(...) and remat.config.<name> = ...
raise at once, unknown names suggest the nearest valid one, and the plain torch.compile path shows
remat's message first (not Dynamo's BackendCompilerFailed wrapper)."""
import re

import pytest
import torch

import remat_fx as remat


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


def test_compile_rejects_a_bad_option_where_it_is_written():
    model = _model()
    with pytest.raises(remat.OptionError, match=r"^remat_fx.compile: option 'memory_budget' takes a fraction in "
                                                r"\[0, 1\] .*; got 'abc' \(units: b, kb"):
        remat.compile(model, memory_budget="abc")  # no forward run: raised by the call itself
    with pytest.raises(ValueError, match=r"^remat_fx.compile: option 'solver' must be one of \['ilp', 'greedy'\], "
                                         r"got 'ilq' \(did you mean 'ilp'\?\)$"):
        remat.compile(model, solver="ilq")


def test_compile_suggests_the_nearest_option_or_torch_compile_keyword():
    model = _model()
    with pytest.raises(remat.OptionError, match=r"^remat_fx.compile: unknown keyword 'memory_budgt': did you mean "
                                                r"'memory_budget'\?\ntorch.compile's keywords: fullgraph, dynamic, "
                                                r"disable; the backend's options:\n  save: "):
        remat.compile(model, memory_budgt=0.3)
    with pytest.raises(remat.OptionError, match=r"unknown keyword 'full_graph': did you mean 'fullgraph'\?"):
        remat.compile(model, full_graph=True)
    with pytest.raises(remat.OptionError, match=r"^remat_fx.compile: mode= picks Inductor's own settings, .* "
                                                r"lower='inductor' \(the default\) or lower='eager'$"):
        remat.compile(model, mode="max-autotune")
    with pytest.raises(remat.OptionError, match=r"pass the options as keywords: remat_fx.compile\(model, "
                                                r"memory_budget=0.3\)"):
        remat.compile(model, options={"memory_budget": 0.3})


def test_torch_compile_with_a_mode_and_backend_remat_is_refused_by_name():
    """It failed inside Dynamo with "backend() got an unexpected keyword argument 'mode'"."""
    torch._dynamo.reset()
    compiled = torch.compile(_model(), backend="remat", mode="max-autotune")
    with pytest.raises(remat.OptionError, match=r"^remat_fx: torch.compile\(\.\.\., backend='remat', "
                                                r"mode='max-autotune'\): remat's backend takes no mode .*"
                                                r"torch._inductor.list_mode_options\('max-autotune'\) lists them\), "
                                                r"or leave mode out\."):
        compiled(torch.randn(4, 8))
    torch._dynamo.reset()
    compiled = torch.compile(_model(), backend="remat", mode="default")  # the default mode is no mode
    compiled(torch.randn(4, 8, requires_grad=True)).sum().backward()


def test_compile_splits_torch_compile_keywords_from_remat_options():
    model = _model()
    x = torch.randn(4, 8)
    model(x).square().sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = remat.compile(model, save=["0.addmm"], lower="eager", fullgraph=True)
    compiled(x).square().sum().backward()
    assert {s.name: s.reason for s in remat.last_plan().saved}["0.addmm"] == "backend option save glob"
    for a, b in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(a, b)


def test_plain_torch_compile_shows_remats_message_first():
    f = torch.compile(lambda x: x.sin(), backend="remat", options={"memory_budgt": 0.3})
    with pytest.raises(remat.OptionError) as info:
        f(torch.ones(2, requires_grad=True))
    assert str(info.value).startswith("backend 'remat': unknown option 'memory_budgt': did you mean "
                                      "'memory_budget'?\nValid options:\n  save: ")
    assert "BackendCompilerFailed" not in str(info.value)


def test_a_budget_no_plan_meets_reaches_the_user_as_remats_error():
    """BudgetInfeasible (like PeakInfeasible, tests/test_plan_view.py) is a remat.RematError, which
    Dynamo re-raises as it is: the user catches remat's class and reads remat's text first."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    f = torch.compile(model, backend="remat", options={"lower": "eager", "memory_budget": "1B"})
    with pytest.raises(remat.BudgetInfeasible) as info:
        f(torch.randn(4, 8)).sum().backward()
    assert isinstance(info.value, remat.RematError) and isinstance(info.value, ValueError)
    assert str(info.value).startswith("remat_fx: memory_budget=1 B asks for at most 1 B"), str(info.value)
    assert "Raise the budget to at least 128 bytes" in str(info.value)
    assert "BackendCompilerFailed" not in str(info.value)
    # the input that must stay, as the plan names it (it read "primals_3: ... (graph input)")
    text = str(info.value)
    assert re.search(r"\n    input [\w\[\]]+ \(primals_\d+\): 128 B \(graph input\)\n", text), text


def test_config_checks_each_assignment():
    old = remat.config.memory_budget
    with pytest.raises(remat.OptionError, match=r"^remat_fx.config.memory_budget takes a fraction in \[0, 1\] .*; "
                                                r"got 'abc'"):
        remat.config.memory_budget = "abc"
    assert remat.config.memory_budget == old  # the bad value was not kept
    with pytest.raises(AttributeError, match=r"^remat_fx.config has no setting 'memory_budgt' \(did you mean "
                                             r"'memory_budget'\?\); its settings .* are memory_budget, cost_model, "
                                             r"solver, solver_time_limit$"):
        remat.config.memory_budgt = 0.3
    assert not hasattr(remat.config, "memory_budgt")
    with pytest.raises(ValueError, match=r"^remat_fx.config.solver_time_limit must be a positive number of "
                                         r"seconds, got 0$"):
        remat.config.solver_time_limit = 0
    try:
        remat.config.memory_budget = "2GiB"
        assert remat.config.memory_budget == "2GiB"
    finally:
        remat.config.memory_budget = old


@pytest.mark.parametrize("value, want", [(True, 0.01), (False, None), (0, 0.0), (0.03, 0.03), ("final", "final")])
def test_blocks_alike_takes_a_switch_or_the_recompute_it_may_add(value, want):
    from remat_fx.options import parse_options

    assert parse_options({"blocks_alike": value}).blocks_alike == want
    assert parse_options({}).blocks_alike == "final"


@pytest.mark.parametrize("value", [1.5, -0.1, "yes", "Final", None])
def test_blocks_alike_rejects_what_is_neither(value):
    with pytest.raises(remat.OptionError, match=r"^remat_fx.compile: option 'blocks_alike' must be True, False, "
                                                r"'final' or the recompute it may add as a fraction of the forward's "
                                                r"estimated time in \[0, 1\), e.g. 0.01, got "):
        remat.compile(_model(), blocks_alike=value)


@pytest.mark.parametrize("value", [0, 1, 0.0, "yes", None])
def test_rerun_takes_auto_or_a_bool_not_a_number_equal_to_one(value):
    """0 == False and 1 == True in Python: neither is taken for the switch (0 was, and a budget's
    searches then ran as if reruns were on, without any)."""
    with pytest.raises(remat.OptionError, match=r"^remat_fx.compile: option 'rerun' must be 'auto', True or False, "
                                                rf"got {value!r}$"):
        remat.compile(_model(), rerun=value)


@pytest.mark.parametrize("option", ["memory_budget", "peak_budget"])
def test_a_size_too_large_for_a_number_of_bytes_is_named(option):
    with pytest.raises(remat.OptionError, match=rf"^remat_fx.compile: option '{option}' takes a fraction .*; got "
                                                r"'1e400MiB' \(too large to be a number of bytes\)"):
        remat.compile(_model(), **{option: "1e400MiB"})


def test_pytorchs_own_budget_knob_is_said_to_be_unread_when_remat_has_no_budget():
    """A user coming from PyTorch sets torch._functorch.config.activation_memory_budget and compiles
    with backend="remat": remat plans without a budget (it runs PyTorch's min-cut with the knob at 1),
    and says so at the compile, naming the option to pass; with a remat budget, nothing is said."""
    import warnings

    x = torch.randn(4, 8, requires_grad=True)
    with torch._functorch.config.patch(activation_memory_budget=0.25):
        torch._dynamo.reset()
        with pytest.warns(UserWarning, match=r"^remat_fx: torch._functorch.config.activation_memory_budget is 0.25, "
                                             r"and backend 'remat' does not read it: this graph is planned without a "
                                             r"memory budget. Pass options=\{'memory_budget': 0.25\} to torch.compile"):
            torch.compile(_model(), backend="remat", options={"lower": "eager"})(x).sum().backward()
        assert remat.last_plan().budget is None
        torch._dynamo.reset()
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*activation_memory_budget")
            options = {"lower": "eager", "memory_budget": 0.25}
            torch.compile(_model(), backend="remat", options=options)(x).sum().backward()
        assert remat.last_plan().budget is not None
    torch._dynamo.reset()


def test_numpy_numbers_are_read_as_the_python_numbers_they_hold():
    """A budget computed with numpy (np.int64 bytes, np.float32 fractions) was refused as an unknown
    type ("got int64 ..."); it is read as the int or float it holds, by the same rules."""
    import numpy as np

    from remat_fx.options import parse_options

    assert parse_options({"memory_budget": np.int64(2**30)}).memory_budget.nbytes == 2**30
    assert parse_options({"memory_budget": np.float64(0.25)}).memory_budget.fraction == 0.25
    assert parse_options({"memory_budget": np.int64(1)}).memory_budget.fraction == 1.0  # 0 and 1: fractions
    assert parse_options({"peak_budget": np.int64(2**20)}).peak_budget == 2**20
    with pytest.raises(remat.OptionError, match=r"got 1.5 \(a float must be a fraction"):
        parse_options({"memory_budget": np.float64(1.5)})
    # the other numeric options too (they said "must be a positive number of seconds, got np.int64(5)")
    parsed = parse_options({"solver_time_limit": np.int64(5), "peak_slack": np.float32(0.25), "monotone": np.int64(3),
                            "blocks_alike": np.float64(0.05), "roofline": {"flops_per_s": np.float32(1e12)}})
    assert (parsed.solver_time_limit, parsed.peak_slack, parsed.monotone, parsed.blocks_alike) == (5.0, 0.25, 3, 0.05)
    assert type(parsed.monotone) is int and parsed.roofline == (("flops_per_s", float(np.float32(1e12))),)
    with pytest.raises(remat.OptionError, match=r"option 'peak_slack' must be a fraction of step time"):
        parse_options({"peak_slack": np.float64(1.5)})


def test_a_roofline_is_read_in_any_key_order_and_hashes_with_the_options():
    """The roofline option's dict made the options unhashable: remat.fit's record of what it said
    (keyed by the options) crashed the compile after a fit ("unhashable type: 'dict'"), and two key
    orders were two plan-cache keys. It is kept as sorted (key, value) pairs."""
    from remat_fx.options import parse_options
    from remat_fx.roofline import CPU, device_roofline

    a = parse_options({"roofline": {"flops_per_s": 1e11, "bytes_per_s": 2e10}})
    b = parse_options({"roofline": {"bytes_per_s": 2e10, "flops_per_s": 1e11}})
    assert hash(a.key()) == hash(b.key()) and repr(a.key()) == repr(b.key())
    assert device_roofline(torch.device("cpu"), a.roofline) == type(CPU)(1e11, 2e10, CPU.op_overhead_s)
    assert parse_options({"roofline": a.roofline}).roofline == a.roofline  # parsed again: the same


@pytest.mark.parametrize("roofline, message", [
    ({"flops_per_s": float("nan")}, r"flops_per_s must be a finite number >= 1, got nan"),
    ({"bytes_per_s": float("inf")}, r"bytes_per_s must be a finite number >= 1, got inf"),
    ({"flops_per_s": 10**400}, r"flops_per_s must be a finite number >= 1, got 1000"),
    ({"flops_per_s": 5e-324, "bytes_per_s": 5e-324}, r"flops_per_s must be a finite number >= 1, got 5e-324"),
    ({"op_overhead_s": float("inf")}, r"op_overhead_s must be a finite number >= 0, got inf"),
    ({"op_overhead_s": -1e-6}, r"op_overhead_s must be a finite number >= 0, got -1e-06"),
])
def test_a_roofline_that_is_not_finite_is_refused_when_written(roofline, message):
    """A NaN or infinite roofline, or one so slow that the costs overflow, passed the option's check
    and failed inside scipy's milp at the first compile ("'c' must be a one-dimensional array of
    finite numbers")."""
    from remat_fx.options import parse_options

    with pytest.raises(remat.OptionError, match=r"option 'roofline': " + message):
        parse_options({"roofline": roofline, "memory_budget": 0.5})
