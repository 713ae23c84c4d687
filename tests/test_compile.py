"""Compiler mode: backend options, entry point, node names, tags followed by the partition, plans."""
import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

import remat_fx as remat
from tests.helpers import RUNS, P, alinear, exp, grads, linear


def _compile(fn, **options):
    torch._dynamo.reset()
    return torch.compile(fn, backend="remat", options={"lower": "eager", **options}, fullgraph=True)


@pytest.mark.parametrize("options, message", [
    ({"saev": ["*"]}, r"^backend 'remat': unknown option 'saev': did you mean 'save'\?\nValid options:\n  save: "),
    ({"memory_budget": 1.5}, r"option 'memory_budget' takes a fraction in \[0, 1\].*got 1.5 \(a float must be a "
                             r"fraction; for a size write an int number of bytes or a string with a unit, e.g. '1.5GiB'\)"),
    ({"memory_budget": "12 parsecs"}, r"option 'memory_budget' takes .* got '12 parsecs' \(units: b, kb"),
    # a number in a string (a config file's): what to pass instead (a review: only the units were listed)
    ({"memory_budget": "0.5"}, r"option 'memory_budget' takes .* got the string '0.5': for the fraction 0.5, pass "
                               r"the float 0.5, not a string\n"),
    ({"peak_budget": "3000000"}, r"got the string '3000000', a number without a unit: pass the int 3000000 for "
                                 r"bytes, or give the unit, e.g. '3000000B'; or 'auto'"),
    ({"peak_budget": -1}, r"option 'peak_budget' takes a fraction in \[0, 1\] \(0 = the least peak found, 1 = the "
                          r"peak without a budget\), .*got a negative size -1; or 'auto'"),
    ({"cost_model": "vibes"}, r"option 'cost_model' must be one of \['auto', 'roofline', 'flops', 'profile'\]"),
    ({"roofline": {"flops": 1}}, r"option 'roofline' must be a dict with keys from \['flops_per_s'"),
    ({"roofline": {"flop_per_s": 1e9}}, r"got \{'flop_per_s': 1000000000.0\} \(unknown key 'flop_per_s': did you "
                                        r"mean 'flops_per_s'\?\)"),
    ({"lower": "triton"}, r"option 'lower' must be one of \['inductor', 'eager'\], got 'triton'"),
    ({"save": [1]}, r"option 'save' must hold glob strings, got 1"),
    # bytes were read one by one, the first named as the int 120; a prefix too short for difflib got no
    # suggestion (a review)
    ({"save": b"x"}, r"option 'save' must be a glob string or a list of them, got bytes b'x': decode it to a str"),
    ({"peak": 0.3}, r"^backend 'remat': unknown option 'peak': did you mean 'peak_budget' or 'peak_slack'\?\n"),
    ({"report": "yes"}, r"option 'report' must be True or False"),
    ({"monotone": "grid", "memory_budget": 0.3, "peak_slack": 0},
     r"option 'monotone'='grid' holds a memory_budget's estimated peak under the larger budgets' peaks, and "
     r"peak_slack is 0: the budget's fastest plan is kept, with no envelope; drop monotone, or give a memory_budget"),
    ({"monotone": "grid", "memory_budget": 0.3, "peak_budget": "1MiB"}, r"and a peak_budget is set: the plan is the "
                                                                         r"fastest under that peak instead"),
    ({"monotone": 3, "memory_budget": 0.3, "peak_budget": "1MiB"},  # any monotone given, not only 'grid'
     r"option 'monotone'=3 holds a memory_budget's .* and a peak_budget is set"),
    ({"monotone": "nearest", "memory_budget": 0.3, "peak_slack": 0}, r"option 'monotone'=1 holds .* peak_slack is 0"),
    ({"peak_slack": 0.5, "peak_budget": 0.5},
     r"option 'peak_slack'=0.5 bounds the step time a memory_budget's plan may give up for a lower peak, and a "
     r"peak_budget is set: the plan is the fastest under that peak, whatever its time; drop peak_slack"),
    ({"monotone": "grids"}, r"option 'monotone' must be an int >= 1 \(the levels of the grid held in turn\), "
                            r"'auto' \(the default: 2, more past a bump\), 'nearest' \(1\) or 'grid', got 'grids' "
                            r"\(did you mean 'grid'\?\)"),
    ({"monotone": "Auto"}, r"option 'monotone' must be an int >= 1 .*, got 'Auto' \(did you mean 'auto'\?\)"),
    ({"monotone": 0}, r"option 'monotone' must be an int >= 1 .*, got 0\b"),
    ({"monotone": True}, r"option 'monotone' must be an int >= 1 .*, got True\b"),
])
def test_bad_options_are_rejected(options, message):
    """Raised as remat's own error (a ValueError), which Dynamo passes on unwrapped: no
    BackendCompilerFailed around it."""
    f = torch.compile(lambda x: x.sin(), backend="remat", options=options)
    with pytest.raises(remat.OptionError, match=message):
        f(torch.ones(2, requires_grad=True))


def test_monotone_grid_needs_no_memory_budget_of_its_own():
    """remat.fit gives the step's graphs their memory budget: monotone='grid' is kept for those plans.
    The levels: 'auto' by default, 2 and more past a bump; an int as it is; 'nearest' 1."""
    from remat_fx.options import monotone_extends, monotone_levels, parse_options

    assert parse_options({"monotone": "grid"}).monotone == "grid"
    assert parse_options({}).monotone == "auto"
    assert parse_options({"monotone": 2}).monotone == 2
    assert parse_options({"monotone": "auto"}).monotone == "auto"
    assert parse_options({"monotone": "nearest"}).monotone == 1
    assert parse_options({"monotone": 3}).monotone == 3
    assert [(monotone_levels(m), monotone_extends(m)) for m in ("auto", 2, 1, "grid")] == \
        [(2, True), (2, False), (1, False), (None, False)]


def test_backend_registered_by_entry_point():
    code = ("import sys, torch; f = torch.compile(lambda x: x.sin() * 2, backend='remat', "
            "options={'lower': 'eager'}); x = torch.ones(3, requires_grad=True); f(x).sum().backward(); "
            "assert 'remat_fx' in sys.modules; print(x.grad.tolist())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([2 * torch.ones(1).cos().item()] * 3)


MAX_POOL = """
import torch
m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(36, 2))
x = torch.randn(2, 3, 8, 8)
want = torch.autograd.grad(m(x).sum(), list(m.parameters()))
f = torch.compile(m, backend="remat", fullgraph=True, options={"lower": "eager"})
got = torch.autograd.grad(f(x).sum(), list(m.parameters()))
for a, b in zip(got, want):
    torch.testing.assert_close(a, b)
print("ok")
"""


def test_max_pool2d_under_the_eager_lowering_in_a_fresh_process():
    """Inductor's decomposition of max_pool2d reaches torch._inductor.lowering, which only Inductor's
    lowering imported: a fresh process using the eager lowering failed with an AttributeError
    (checked on torch 2.13.0)."""
    out = subprocess.run([sys.executable, "-c", MAX_POOL], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


@pytest.mark.parametrize("policy, fw_exp, bw_exp", [(P.SAVE, 1, 0), (P.RECOMPUTE, 1, 1)])
def test_partition_follows_tags(policy, fw_exp, bw_exp):
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        return exp(x.sin(), "e", policy).cos()

    want = grads(block(x).sum(), [x])
    got = grads(_compile(lambda x: remat.checkpoint()(block)(x).sum())(x), [x])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    plan = remat.last_plan()
    assert (plan.forward_ops["exp"], plan.backward_ops["exp"]) == (fw_exp, bw_exp)
    saved = {s.name for s in plan.saved if s.bytes}
    assert ("e" in saved) == (policy is P.SAVE)


def test_option_globs_override_call_sites():
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        return exp(exp(x.sin(), "a.e", P.RECOMPUTE), "b.e", P.SAVE).cos()

    _compile(lambda x: remat.checkpoint()(block)(x).sum(), save=["a.*"], recompute=["b.*"])(x).backward()
    plan = remat.last_plan()
    reasons = {s.name: s.reason for s in plan.saved}
    assert reasons["a.e"] == "backend option save glob"
    assert "b.e" not in reasons and plan.backward_ops["exp"] == 1  # b.e rerun in backward


def test_region_globs_in_compiler_mode():
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        return exp(x.sin(), "layers.0.e", P.RECOMPUTE).cos()

    _compile(lambda x: remat.checkpoint(save="*.e")(block)(x).sum())(x).backward()
    assert {s.name: s.reason for s in remat.last_plan().saved}["layers.0.e"] == "region 'block' save glob"


class MLP(torch.nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x):
        return remat.checkpoint("mlp")(self.mlp)(x).sum()


def test_unannotated_model_named_by_module_path():
    torch.manual_seed(0)
    net, x = Net(), torch.randn(4, 16, requires_grad=True)
    want = grads(net(x), [x, *net.parameters()])
    f = _compile(net, save=["mlp.up.addmm"])
    got = grads(f(x), [x, *net.parameters()])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plan = remat.last_plan()
    by_name = {s.name: s for s in plan.saved}
    assert by_name["mlp.up.addmm"].reason == "backend option save glob" and by_name["mlp.up.addmm"].bytes == 4 * 64 * 4
    params = [s for s in plan.saved if s.reason == "parameter"]
    assert params and all(s.bytes == 0 for s in params)
    assert plan.backward_ops["gelu"] == 0 and plan.backward_ops["addmm"] == 0  # only gelu's backward math
    assert "gelu" in str(plan) or "mlp.up.addmm" in str(plan)


@pytest.mark.parametrize("policy", [P.SAVE, P.RECOMPUTE])
def test_annotate_names_native_blocks(mode, policy):
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        with remat.annotate("blk", policy=policy):
            h = (x @ w).sin()
        return h.cos()

    want = grads(block(x).sum(), [x, w])
    out = mode(lambda x: remat.checkpoint()(block)(x).sum())(x)
    report = remat.memory_report(out)
    mode.assert_grads(grads(out, [x, w]), want)
    if mode.compiled:
        plan = remat.last_plan()
        names = {s.name for s in plan.saved if s.bytes}
        assert any(n.startswith("blk.") for n in names) == (policy is P.SAVE)
        assert plan.backward_ops["mm"] == (2 if policy is P.SAVE else 3)  # SAVE: the block's mm not rerun
    else:
        cached = [(e.name, e.policy) for e in report.entries if e.op == "blk"]
        assert cached == ([("aten.mm.default#0.0", "SAVE"), ("aten.sin.default#0.0", "SAVE")]
                          if policy is P.SAVE else [])


def test_a_bad_policy_in_a_region_under_compile_is_its_own_error_not_a_graph_breaks_warning():
    """Dynamo runs a region whose body raises eagerly (a graph break); the body raises again there.
    The user sees the library's error, without the fallback's warning that blamed a graph break
    inside the region (it came first)."""
    w = torch.randn(16, 16, requires_grad=True)

    def body(x):
        return remat.native_op(torch.mm, "mm", policy="keep")(x, w).tanh()

    torch._dynamo.reset()
    remat.runtime.checkpoint._WARNED.clear()
    f = torch.compile(lambda x: remat.checkpoint("bad_policy")(body)(x), backend="remat", options={"lower": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"remat.native_op\('mm'\): policy 'keep' is not one of"):
            f(torch.randn(4, 16))
    assert not [str(w.message) for w in caught if "could not trace" in str(w.message)]


def test_graph_break_in_region_falls_back_to_the_tape():
    w = (0.1 * torch.randn(16, 16)).requires_grad_()
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        h = exp(alinear(x, w, "mm", P.SAVE), "e", P.RECOMPUTE)
        torch._dynamo.graph_break()
        return h.sin()

    want = grads(block(x).sum(), [x, w])
    RUNS.clear()
    torch._dynamo.reset()
    remat.runtime.checkpoint._WARNED.clear()
    f = torch.compile(lambda x: remat.checkpoint("blk")(block)(x).sum(), backend="remat",
                      options={"lower": "eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(x)
    msgs = [str(w.message) for w in caught if "remat_fx" in str(w.message)]
    assert len(msgs) == 1 and "could not trace checkpoint region 'blk'" in msgs[0]
    # said where the region is called: this file, not remat_fx's or torch's
    assert [w.filename for w in caught if "remat_fx" in str(w.message)] == [__file__]
    # the tape holds what eager mode holds: the SAVE op's backward input x is a leaf (PARAM),
    # and its output, read by the RECOMPUTE exp, is saved for it
    assert remat.memory_report(out).bytes_by_owner() == {"mm": 8 * 16 * 4}
    got = grads(out, [x, w])
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert RUNS["exp"] == 2  # forward + recompute: the RECOMPUTE op was rerun


@pytest.mark.parametrize("policy", [P.SAVE, P.RECOMPUTE])
def test_explicit_handle_function_names_reach_the_compiler(policy):
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        return linear(x.cos(), w, "l", policy).sin()

    want = grads(block(x).sum(), [x, w])
    got = grads(_compile(lambda x: remat.checkpoint()(block)(x).sum())(x), [x, w])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plan = remat.last_plan()
    saved = {s.name: s.reason for s in plan.saved}
    assert ("l" in saved) == (policy is P.SAVE)
    if policy is P.SAVE:
        assert saved["l"] == "SAVE at the call site of 'l'"
    assert plan.backward_ops["mm"] == (2 if policy is P.SAVE else 3)  # the op's mm rerun only when RECOMPUTE


def test_annotate_carries_an_explicit_handle_functions_name():
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        with remat.annotate("l", P.SAVE):
            h = linear(x, w, "l", P.SAVE)
        return h.sin()

    _compile(lambda x: remat.checkpoint()(block)(x).sum())(x).backward()
    assert "l.mm.0" in {s.name for s in remat.last_plan().saved}


def test_inductor_plan_recorded_on_every_compile():
    """AOTAutograd's cache would skip the partition (and so the Plan) on a hit: it is off for us."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    x = torch.randn(4, 16, requires_grad=True)
    for _ in range(2):
        torch._dynamo.reset()
        remat.passes.plan._PLANS.clear()
        f = torch.compile(lambda x: remat.checkpoint("mlp")(mlp)(x).sum(), backend="remat",
                          options={"lower": "inductor", "save": ["*.addmm"]}, fullgraph=True)
        f(x).backward()
        plan = remat.last_plan()
        assert plan is not None and plan.lower == "inductor"
        assert {s.reason for s in plan.saved} >= {"backend option save glob"}



def test_inductor_kernel_cache_is_keyed_by_remat_sources(tmp_path, monkeypatch):
    """Inductor's FX graph cache keys a compiled graph by config.custom_partitioner_fn's uuid
    (passes/lower.py RematPartitioner: the options and every remat_fx source file), so kernels
    compiled under an older remat (another fusion rule, other reruns) are not served after an
    upgrade. Checked on torch 2.13.0 and 2.14.1."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_cache

    from remat_fx import plan_cache
    from remat_fx.passes import lower

    source = tmp_path / "rule.py"
    source.write_text("# rule 1\n")
    first = plan_cache.source_digest.__wrapped__(tmp_path)  # uncached: the files as they are now
    # the package's digest, as if it had one more file
    monkeypatch.setattr(lower, "source_digest",
                        lambda: plan_cache.source_digest() + plan_cache.source_digest.__wrapped__(tmp_path))
    x = torch.randn(32, 32, requires_grad=True)

    def compile_once():
        torch._dynamo.reset()
        hit, miss = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        torch.compile(lambda t: (t.sin() @ t).cos().sum(), backend="remat", options={"memory_budget": 0.5},
                      fullgraph=True)(x).backward()
        return counters["inductor"]["fxgraph_cache_hit"] - hit, counters["inductor"]["fxgraph_cache_miss"] - miss

    with fresh_cache(), torch._inductor.config.patch(fx_graph_cache=True):
        assert compile_once() == (0, 2)  # (hits, misses) of the forward and the backward
        assert compile_once() == (2, 0)
        source.write_text("# rule 2\n")
        assert plan_cache.source_digest.__wrapped__(tmp_path) != first
        assert compile_once() == (0, 2)

class Holder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sub_modules = torch.nn.ModuleList([torch.nn.Linear(8, 8)])

    def forward(self, x):
        return remat.checkpoint("r")(lambda x: self.sub_modules[0](x).sin().cos())(x).sum()


def test_user_attribute_names_survive_in_node_names():
    net, x = Holder(), torch.randn(4, 8, requires_grad=True)
    _compile(net, save=["sub_modules.0.addmm"])(x).backward()
    plan = remat.last_plan()
    assert {s.name: s.reason for s in plan.saved}["sub_modules.0.addmm"] == "backend option save glob"
    assert plan.backward_ops["addmm"] == 0
    # sources point at user code (this file), not into the package, wherever the clone lives
    package = os.path.dirname(os.path.abspath(remat.__file__))
    sources = [s.source for s in plan.saved if s.source]
    assert sources and all(package not in src for src in sources), sources
    assert any(os.path.basename(__file__) in src for src in sources), sources


def test_split_outputs_share_one_storage_in_the_plan():
    w = torch.randn(8, 24, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        with remat.annotate("qkv", P.SAVE):
            q, k, v = (x @ w).view(4, 3, 8).unbind(1)
        return (q.sin() * k.cos() * v.tanh()).sum(-1)

    _compile(lambda x: remat.checkpoint()(block)(x).sum())(x).backward()
    owned = {s.fx_name: s.bytes for s in remat.last_plan().saved if s.name.startswith("qkv.")}
    assert sum(owned.values()) == 4 * 24 * 4  # the mm output's one storage, counted once


def test_debug_option_is_eager_only_and_ignored_under_compile():
    x = torch.randn(4, requires_grad=True)
    _compile(lambda x: remat.checkpoint(debug=True)(lambda x: x.sin().cos())(x).sum())(x).backward()
    torch.testing.assert_close(x.grad, -x.detach().sin().sin() * x.detach().cos())


def test_call_site_policy_outside_regions_decides_nothing():
    """As on the eager tape, where a remat op outside any checkpoint region only runs and names:
    the RECOMPUTE written at the call site changes nothing (the min-cut keeps its matmul)."""
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)

    def fn(x):
        return alinear(x.cos(), w, "l", P.RECOMPUTE).sin().sum()

    want = grads(fn(x), [x, w])
    got = grads(_compile(fn)(x), [x, w])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    plan = remat.last_plan()
    assert plan.backward_ops["mm"] == 2 and "l" in {s.name for s in plan.saved}


def _small_joint(model: str):
    """(joint graph module, its inputs, the partition's keyword arguments) of a small GPT ("gpt")
    or Hugging Face Llama ("llama") step, captured once."""
    from remat_fx.pareto import _capture

    torch.manual_seed(0)
    if model == "gpt":
        from tests.test_budget import GPT, GPTConfig, random_batch
        cfg = GPTConfig(vocab=64, seq=32, d_model=32, n_head=2, n_layer=3)
        module, args = GPT(cfg), random_batch(cfg, 2)
    else:
        import transformers
        cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=88, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                       max_position_embeddings=16, use_cache=False)
        llama = transformers.LlamaForCausalLM(cfg)
        ids = torch.randint(0, 64, (2, 16))
        module, args = (lambda ids: llama(ids, labels=ids).loss), (ids,)
    ((gm, joint_inputs, kwargs),) = _capture(module, args, {})
    return gm, joint_inputs, kwargs


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_remats_reordering_of_the_backward_is_pytorchs(monkeypatch, model):
    """passes/engine_order.py ``reorder``, which the partition puts in the place of PyTorch's
    ``reordering_to_mimic_autograd_engine`` (private; checked here on the installed torch: 2.13,
    2.14 in CI's selection): at every min-cut of budget 0's planning (recomputed forward ops placed
    among the gradient ops), PyTorch's function run on the same backward gives the same nodes in the
    same order (op, name, target, arguments), and remat's module is lazy (its code unwritten)."""
    from torch._functorch import partitioners
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from remat_fx.options import parse_options
    from remat_fx.passes import engine_order, partition
    from remat_fx.pareto import _tracing

    gm, joint_inputs, kwargs = _small_joint(model)
    pytorchs, ours_of, compared = partitioners.reordering_to_mimic_autograd_engine, engine_order.reorder, []

    def spell(g: torch.fx.GraphModule):
        return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs)) for n in g.graph.nodes]

    def both(bw):
        ours = ours_of(bw)
        assert spell(ours) == spell(pytorchs(bw))
        compared.append(isinstance(ours, _LazyGraphModule) and type(ours)._needs_recompile())
        return ours

    monkeypatch.setattr(engine_order, "reorder", both)
    with _tracing(joint_inputs):
        partition.partition(gm, joint_inputs, options=parse_options({"lower": "inductor", "memory_budget": 0.0}),
                            **kwargs)
    assert partitioners.reordering_to_mimic_autograd_engine is pytorchs
    assert len(compared) >= 2 and all(compared), compared  # every min-cut compared, each module lazy
    assert remat.last_plan().recomputed_fx  # budget 0: the backward recomputes forward ops


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_the_min_cuts_repeated_extractions_are_served_as_pytorch_makes_them(monkeypatch, model):
    """passes/extract_once.py: in budget 0's planning, every graph the memo serves in place of
    PyTorch's ``_extract_graph_with_inputs_outputs`` (private; checked here on the installed torch:
    2.13, 2.14 in CI's selection) is the one a fresh extraction makes: the same nodes in the same
    order (op, name, target, arguments), and for a backward the same node meta (``classify_nodes``
    reads only the forward's names). Both repeats are served (each min-cut's second backward, each
    later min-cut's forward alone), PyTorch's functions are back after, and the plan is the one
    planned without the memo (saved names, reruns, estimated peak)."""
    import contextlib

    from torch._functorch import partitioners

    from remat_fx.options import parse_options
    from remat_fx.passes import extract_once, partition
    from remat_fx.pareto import _tracing

    gm, joint_inputs, kwargs = _small_joint(model)
    extract, classify = partitioners._extract_graph_with_inputs_outputs, partitioners.classify_nodes
    serve, checked = extract_once._Served.extract, {"backward": 0, "forward_only": 0}

    def spell(graph: torch.fx.Graph, meta: bool):
        return [(n.op, n.name, str(n.target), str(n.args), str(n.kwargs))
                + ((sorted(n.meta), str(n.meta.get("recompute"))) if meta else ()) for n in graph.nodes]

    def checking(self, *args, **kw):
        before = dict(self.served)
        graph = serve(self, *args, **kw)
        for kind in checked:
            if self.served[kind] > before[kind]:
                assert spell(graph, kind == "backward") == spell(extract(*args, **kw), kind == "backward")
                checked[kind] += 1
        return graph

    def plan(memo: bool):
        if not memo:
            monkeypatch.setattr(partition, "extracted_once", contextlib.nullcontext)
        with _tracing(joint_inputs):
            partition.partition(gm, joint_inputs, options=parse_options({"lower": "inductor", "memory_budget": 0.0}),
                                **kwargs)
        monkeypatch.undo()
        found = remat.last_plan()
        return sorted(s.name for s in found.saved), found.rerun.reruns if found.rerun else 0, found.peak.step

    monkeypatch.setattr(extract_once._Served, "extract", checking)
    with_memo = plan(True)
    assert partitioners._extract_graph_with_inputs_outputs is extract and partitioners.classify_nodes is classify
    assert checked["backward"] >= 2 and checked["forward_only"] >= 1, checked  # several min-cuts: both repeats served
    assert with_memo == plan(False)


def _four_gelu_layers():
    """(model, input, parameters, eager gradients of the sum of squares) of four Linear+GELU layers."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(4)])
    x = torch.randn(8, 16)
    params = list(model.parameters())
    return model, x, params, torch.autograd.grad(model(x).pow(2).sum(), params)


def test_a_captured_joint_graph_planned_outside_dynamo_gets_lazy_modules_from_the_min_cut(monkeypatch):
    """passes/lazy_module.py lazy_modules: remat.pareto plans captured joint graphs again outside
    Dynamo (remat.fit and the whole-step planner lower a step's graphs again there), and Dynamo is what
    sets ``torch.fx._lazy_graph_module._use_lazy_graph_module`` (private; checked on torch 2.13 and 2.14
    here). Inside remat's partition the modules PyTorch's min-cut makes are lazy there too (none has
    written its code when ``raise_getitems`` gets it), and the flag is as it was once the partition is
    done; the plan is the one a compile makes."""
    from torch._functorch import partitioners
    from torch.fx import _lazy_graph_module
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from remat_fx.options import parse_options
    from remat_fx.passes import partition
    from remat_fx.pareto import _capture, _tracing

    model, x, _, _ = _four_gelu_layers()
    loss = lambda x: model(x).pow(2).sum()  # noqa: E731
    ((gm, joint_inputs, kwargs),) = _capture(loss, (x,), {"lower": "eager", "memory_budget": 0.0})
    compiled = remat.last_plan()
    raised, real_raise = [], partitioners.raise_getitems

    def raise_getitems(gm):
        raised.append(isinstance(gm, _LazyGraphModule) and type(gm)._needs_recompile())
        return real_raise(gm)

    monkeypatch.setattr(partitioners, "raise_getitems", raise_getitems)
    assert _lazy_graph_module._use_lazy_graph_module_flag is False  # outside Dynamo
    with _tracing(joint_inputs):
        options = parse_options({"lower": "eager", "memory_budget": 0.0})
        partition.partition(gm, joint_inputs, options=options, **kwargs)
    plan = remat.last_plan()
    assert raised and all(raised), raised  # forward and backward of each min-cut: not written
    assert _lazy_graph_module._use_lazy_graph_module_flag is False
    assert [s.name for s in plan.saved] == [s.name for s in compiled.saved] and plan.peak.step == compiled.peak.step


def test_the_min_cuts_max_flow_is_boykov_kolmogorovs_and_the_plans_are_the_default_flows(monkeypatch):
    """passes/max_flow.py: inside remat's partition PyTorch's min-cut (``solve_min_cut``) reaches
    ``networkx.minimum_cut`` with networkx's Boykov-Kolmogorov max-flow (checked on torch 2.13 here,
    2.14 in CI's selection); the function is networkx's own again after. Without the swap (the
    default flow, preflow-push) each budget's plan saves and reruns the same values, with the same
    estimated peak, and the gradients are eager's."""
    import contextlib

    import networkx
    from networkx.algorithms.flow import boykov_kolmogorov

    from remat_fx.passes import partition

    flows, real = [], networkx.minimum_cut

    def spy(flowG, s, t, capacity="capacity", flow_func=None, **kwargs):
        flows.append(flow_func)
        return real(flowG, s, t, capacity=capacity, flow_func=flow_func, **kwargs)

    monkeypatch.setattr(networkx, "minimum_cut", spy)
    model, x, params, want = _four_gelu_layers()

    def plans():
        found = []
        for budget in (0.0, 0.5):
            f = _compile(model, memory_budget=budget)
            got = torch.autograd.grad(f(x).pow(2).sum(), params)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
            plan = remat.last_plan()
            found.append(([s.name for s in plan.saved], plan.total_bytes, plan.peak.step,
                          plan.rerun.names if plan.rerun else None))
        return found

    swapped = plans()
    assert flows and all(f is boykov_kolmogorov for f in flows), flows
    assert networkx.minimum_cut is spy
    flows.clear()
    monkeypatch.setattr(partition, "boykov_kolmogorov_flow", contextlib.nullcontext)
    assert plans() == swapped
    assert flows and all(f is None for f in flows), flows  # networkx's default


def test_the_partitions_modules_write_their_code_when_first_called(monkeypatch):
    """passes/lazy_module.py: the forward and backward the partition hands back are lazy graph
    modules (``torch.fx._lazy_graph_module._LazyGraphModule``, private; checked on torch 2.13 and
    2.14 here, 2.11 on the GPU image), whose Python code is written when first called: a plan
    search that makes a dozen backwards writes the code of none of them (benchmarks/planning.py),
    the one PyTorch's partitioner reorders included (passes/engine_order.py, undone after).
    The compiled step's gradients are those of the model run eagerly."""
    from torch._functorch import partitioners
    from torch.fx._lazy_graph_module import _LazyGraphModule

    from remat_fx.passes import lower

    reordering = partitioners.reordering_to_mimic_autograd_engine
    handed, raised = [], []
    real, real_raise = lower.partition, partitioners.raise_getitems

    def spy(*args, **kwargs):
        fw, bw = real(*args, **kwargs)
        handed.append((fw, bw, type(bw)._needs_recompile()))
        return fw, bw

    def raise_getitems(gm):  # the min-cut raises the getitems of the forward, then the reordered backward
        raised.append(isinstance(gm, _LazyGraphModule))
        return real_raise(gm)

    monkeypatch.setattr(lower, "partition", spy)
    monkeypatch.setattr(partitioners, "raise_getitems", raise_getitems)
    model, x, params, want = _four_gelu_layers()
    f = _compile(model, memory_budget=0.0)
    got = torch.autograd.grad(f(x).pow(2).sum(), params)
    assert len(handed) == 1
    fw, bw, unwritten = handed[0]
    assert isinstance(fw, _LazyGraphModule) and isinstance(bw, _LazyGraphModule)
    assert unwritten, "the backward's code was written before it was called"
    assert raised and all(raised), raised  # not written again there (passes/engine_order.py)
    assert partitioners.reordering_to_mimic_autograd_engine is reordering  # PyTorch's, once the partition is done
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


class _ChangesItsInput(torch.nn.Module):
    """The forward changes a graph input in place (a plain ``add_``, on a view, a buffer's ``copy_``)."""

    def __init__(self, how):
        super().__init__()
        self.how, self.l1, self.l2 = how, torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.register_buffer("cache", torch.zeros(5, 6))

    def forward(self, x, z):
        h = torch.sin(self.l1(x))
        if self.how == "add_":
            z.add_(h.detach() * 0.5)
            return torch.cos(h) * z
        if self.how == "view":
            z[:, :2].mul_(2.0)
            return torch.cos(h) * z
        self.cache.copy_(h.detach() * 0.5 + self.cache)
        return self.l2(torch.tanh(h) * self.cache)


@pytest.mark.parametrize("how", ["add_", "view", "buffer"])
@pytest.mark.parametrize("options", [{"memory_budget": 0}, {"memory_budget": 0.5}, {"recompute": ["*"]}],
                         ids=["budget 0", "budget 0.5", "recompute *"])
def test_a_forward_that_changes_its_input_in_place_keeps_what_read_the_old_value(how, options):
    """A helper's review: AOTAutograd writes an input the forward changes back at the forward's end
    (a copy_ into it); a budget or a recompute glob recomputed in backward what had read its old value
    from the input, which by then held the new one: silently wrong gradients (0.84 on the weight at
    budget 0; PyTorch's own Inductor at activation_memory_budget=0 gives the same wrong numbers)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _ChangesItsInput(how).double()
    compiled_model = copy.deepcopy(model)
    x, z = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    x1, z1 = x.clone().requires_grad_(), z.clone()
    model(x1, z1).pow(2).sum().backward()
    compiled = torch.compile(compiled_model, backend="remat", options={"lower": "eager", **options}, fullgraph=True)
    x2, z2 = x.clone().requires_grad_(), z.clone()
    compiled(x2, z2).pow(2).sum().backward()
    assert torch.equal(z1, z2) and torch.equal(model.cache, compiled_model.cache)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-12, atol=1e-12, msg=name)
    reads = [s for s in remat.last_plan().saved if "changes it in place" in s.reason]
    assert reads, remat.last_plan()  # the reader of the old value is kept, and says why
