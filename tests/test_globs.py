"""Globs in compiler mode: a glob naming a module path (``*.qkv``) saves that module's output, and a
glob that matches nothing in a graph warns, with the closest globs that do match."""
import warnings

import pytest
import torch

import remat_fx as remat


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.o = torch.nn.Linear(16, 48), torch.nn.Linear(48, 16)

    def forward(self, x):
        return x + self.o(torch.nn.functional.gelu(self.qkv(x)))  # gelu's backward reads qkv's output


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _run(save):
    """(plan, remat warnings, gradients equal to an uncompiled run's)"""
    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 8, 16)
    model(x).square().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    # at memory budget 0 everything that can be recomputed is, unless a glob says SAVE
    compiled = torch.compile(model, backend="remat", options={"save": save, "lower": "eager", "memory_budget": 0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(x).square().mean().backward()
    for a, b in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(a, b)
    return remat.last_plan(), [str(w.message) for w in caught if "remat_fx" in str(w.message)]


QKV_OUT = 2 * 8 * 48 * 4  # bytes of one qkv output (2x8x48 float32)


def test_a_module_path_glob_saves_the_modules_output_and_a_typo_warns():
    plan, caught = _run(["*.qkv"])
    assert caught == []
    by_module = {}
    for s in plan.saved:
        for path in ("layers.0.qkv", "layers.1.qkv"):
            if f"(the output of module '{path}')" in s.reason:
                by_module[path] = by_module.get(path, 0) + s.bytes
                assert s.reason.startswith("backend option save glob"), s.reason
    assert by_module == {"layers.0.qkv": QKV_OUT, "layers.1.qkv": QKV_OUT}, str(plan)

    typo, caught = _run(["*.qvk"])  # matches nothing: the budget recomputes the qkv outputs, and it says so
    assert not any("qkv" in s.reason for s in typo.saved)
    assert typo.total_bytes < plan.total_bytes
    assert caught == [
        "remat_fx: backend option save glob '*.qvk' matched no node in this graph; did you mean '*.qkv' "
        "(layers.0.qkv, layers.1.qkv)? Node names are <module path>.<op>, e.g. layers.0.qkv.addmm (or the name "
        "given to remat.op, native_op or annotate); a glob that matches a module path (*.qkv) selects that "
        "module's output."]


def test_globs_that_match_node_names_select_those_nodes_only():
    plan, caught = _run(["layers.0.qkv.addmm", "layers.0"])  # a node's name; a module path (a Block)
    assert caught == []
    reasons = {s.name: s.reason for s in plan.saved if s.bytes}
    assert reasons["layers.0.qkv.addmm"] == "backend option save glob"  # as before: that node alone
    assert reasons["layers.0.add"] == "backend option save glob (the output of module 'layers.0')"
    assert not any(name.startswith("layers.1.qkv") for name in reasons), reasons


@pytest.mark.parametrize("glob, close", [
    ("layers.0.qkv.adm", "did you mean 'layers.0.qkv.addmm'"),
    ("zzz", None),
])
def test_unmatched_glob_message(glob, close):
    from remat_fx.passes.tag import unmatched_message

    names = ["layers.0.qkv.view", "layers.0.qkv.addmm", "layers.0.relu"]
    text = unmatched_message(glob, "region 'blk' recompute", names, ["layers", "layers.0", "layers.0.qkv"])
    assert text.startswith(f"remat_fx: region 'blk' recompute glob '{glob}' matched no node in this graph")
    assert (close in text) if close else "did you mean" not in text
    assert "Node names are <module path>.<op>, e.g. layers.0.qkv.addmm" in text


@pytest.mark.parametrize("path, want", [
    ("L['self'].layers[0].qkv", "layers.0.qkv"),
    ("L['self']._modules['layers']._modules['0']", "layers.0"),
    # Hugging Face wraps forward in decorators taking *args: the root module is args[0]
    ("L['args'][0].model.layers[1].mlp", "model.layers.1.mlp"),
    ("G['model'].blocks['attn']", "blocks.attn"),
])
def test_module_paths_start_below_the_root_module(path, want):
    from torch.fx import Graph

    from remat_fx.passes.capture import module_path, module_paths

    node = Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"root": (path.split(".")[0], torch.nn.Module), "leaf": (path, torch.nn.Module)}
    assert module_path(node) == want and module_paths(node) == (want,)


def test_a_region_glob_that_selects_no_named_op_warns_on_the_eager_tape_too(monkeypatch):
    """A region's globs in eager mode select the ops named by remat.op, native_op or annotate: a typo
    warned under torch.compile and was silent on the eager tape, and a module-path glob (which only
    compiler mode's <module path>.<op> names reach) saved a module's output in one mode and nothing,
    silently, in the other. Each warns once a process; a glob that matches stays silent."""
    from remat_fx.runtime import checkpoint as region

    monkeypatch.setattr(region, "_GLOBS_SEEN", set())  # once a process: this test's own process state
    monkeypatch.setattr(region, "_GLOBS_PENDING", {})
    P = remat.CheckpointPolicy
    w = torch.randn(16, 16, requires_grad=True)

    def named(x):
        return remat.native_op(torch.mm, "layers.0.qkv", policy=P.RECOMPUTE)(x, w).tanh()

    x = torch.randn(8, 16)
    with pytest.warns(UserWarning, match=r"^remat_fx: region 'eager_typo' save glob '\*\.qvk' matched none of the "
                                         r"ops its forward named; did you mean '\*\.qkv'\? On the eager tape") as said:
        remat.checkpoint("eager_typo", save=["*.qvk"])(named)(x).sum().backward()
    assert [w.filename for w in said if "eager_typo" in str(w.message)] == [__file__]  # said where the region runs
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat.checkpoint("eager_typo", save=["*.qvk"])(named)(x).sum().backward()  # once a process
        out = remat.checkpoint("eager_match", save=["*.qkv"])(named)(x)  # it matches: kept, no warning
    assert remat.memory_report(out).bytes_by_owner() == {"layers.0.qkv": 8 * 16 * 4}
    out.sum().backward()
    # judged on every call of the forward, as compiler mode judges a region's calls in its graph: a
    # glob naming layer 1's op, on a region name both layers share, is no miss at layer 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = x
        for i in range(2):
            def layer(h, i=i):
                return remat.native_op(torch.mm, f"layers.{i}.mm", policy=P.RECOMPUTE)(h, w).tanh()
            h = remat.checkpoint("eager_shared", save=["layers.1.*"])(layer)(h)
        h.sum().backward()
    block = Block()
    with pytest.warns(UserWarning, match=r"region 'eager_module' save glob '\*\.qkv' matched none of the ops its "
                                         r"forward named; it ran no named op\. .*exist only under torch.compile"):
        remat.checkpoint("eager_module", save=["*.qkv"])(block)(torch.randn(4, 16)).sum().backward()


def test_a_region_that_falls_back_to_the_tape_under_compile_has_its_globs_judged_too(monkeypatch):
    """A region with a graph break inside runs on the eager tape under torch.compile, where compiler
    mode never sees its ops: its glob that selects none of them warns as on the eager tape, at its
    first backward, beside the fallback's warning; one that matches stays silent and is honoured."""
    from remat_fx.runtime import checkpoint as region

    monkeypatch.setattr(region, "_GLOBS_SEEN", set())
    monkeypatch.setattr(region, "_GLOBS_PENDING", {})
    monkeypatch.setattr(region, "_WARNED", set())
    P = remat.CheckpointPolicy
    w = torch.randn(16, 16, requires_grad=True)

    def body(x):
        h = remat.native_op(torch.mm, "layers.0.qkv", policy=P.RECOMPUTE)(x, w).tanh()
        torch._dynamo.graph_break()
        return h.sin()

    x = torch.randn(8, 16)
    for name, glob, said in (("broken_typo", "*.qvk", True), ("broken_match", "*.qkv", False)):
        torch._dynamo.reset()
        f = torch.compile(lambda x: remat.checkpoint(name, save=[glob])(body)(x), backend="remat",
                          options={"lower": "eager"})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = f(x)
            before = [str(m.message) for m in caught if "glob" in str(m.message)]
            if not said:  # the matching glob saves the op, as on the eager tape
                assert remat.memory_report(out).bytes_by_owner() == {"layers.0.qkv": 8 * 16 * 4}
            out.sum().backward()
        msgs = [str(m.message) for m in caught if "remat_fx" in str(m.message)]
        assert before == []  # judged at the backward, on all the forward's calls
        assert any(f"could not trace checkpoint region '{name}'" in m for m in msgs), msgs
        typo = [m for m in msgs if f"region '{name}' save glob" in m]
        assert typo == ([f"remat_fx: region '{name}' save glob '*.qvk' matched none of the ops its forward named; "
                         "did you mean '*.qkv'? On the eager tape a region's globs select the ops named by "
                         "remat.op, native_op or annotate; the <module path>.<op> names of other ops (and a "
                         "module's output, *.qkv) exist only under torch.compile(backend='remat')."]
                        if said else []), msgs
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_a_glob_a_stronger_kind_shadows_whole_warns_in_both_modes(mode, monkeypatch):
    """RECOMPUTE > OFFLOAD > SAVE on a conflict: a save glob that matches only what a recompute glob
    also takes decides nothing, which was silent (the plan just saved less). It warns, naming the
    ops and the fix, in both modes; one that still decides some op stays silent. The same glob in
    both lists is refused where it is written."""
    from remat_fx.runtime import checkpoint as region

    monkeypatch.setattr(region, "_GLOBS_SEEN", set())
    monkeypatch.setattr(region, "_GLOBS_PENDING", {})
    w1, w2 = torch.randn(8, 16, requires_grad=True), torch.randn(16, 8, requires_grad=True)

    def block(x):
        h = remat.native_op(torch.mm, "layers.0.up")(x, w1)
        return remat.native_op(torch.mm, "layers.0.down")(torch.nn.functional.gelu(h), w2)

    def run(name, **globs):
        torch._dynamo.reset()
        step = lambda x: remat.checkpoint(name, **globs)(block)(x).sum()  # noqa: E731
        if mode == "compile":
            step = torch.compile(step, backend="remat", options={"lower": "eager"}, fullgraph=True)
        step(torch.randn(4, 8, requires_grad=True)).backward()

    with pytest.warns(UserWarning, match=r"^remat_fx: region 'shadowed' save glob '\*\.up' decides nothing( in this "
                                         r"graph)?: all it selects \(layers\.0\.up[^)]*\) a recompute glob selects "
                                         r"too, and RECOMPUTE wins a conflict \(RECOMPUTE > OFFLOAD > SAVE\)\. "
                                         r"Narrow the recompute glob, or drop this one\.$"):
        run("shadowed", save=["*.up"], recompute=["layers.*"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run("apart", save=["*.up"], recompute=["*.down"])
    with pytest.raises(ValueError, match=r"^remat.checkpoint: glob '\*\.up' is in both save= and recompute=: "
                                         r"RECOMPUTE wins a conflict, so it would never save anything; keep it in "
                                         r"one of the two$"):
        remat.checkpoint("both", save="*.up", recompute=["*.up"])
    torch._dynamo.reset()


def test_the_same_glob_in_save_and_recompute_options_is_refused_where_written():
    with pytest.raises(remat.OptionError, match=r"^remat_fx.compile: glob '\*\.qkv' is in both save= and "
                                                r"recompute=: RECOMPUTE wins a conflict, so it would never save "
                                                r"anything; keep it in one of the two$"):
        remat.compile(Model(), save=["*.qkv"], recompute="*.qkv")
    with pytest.raises(remat.OptionError, match=r"option 'save' must be a glob string or a list of them, got a "
                                                r"dict \{'\*\.qkv': True\}"):
        remat.compile(Model(), save={"*.qkv": True})


@pytest.mark.parametrize("kind", ["save", "recompute"])
def test_a_glob_naming_an_annotate_block_selects_the_block_in_both_modes(kind):
    """A parity review: the eager tape matches a region glob against a remat.annotate block's name
    (save=["blk"] keeps the block), while compiler mode matched only the names of the block's ops
    (blk.tanh.0): the glob selected nothing there (warned), and recompute=["blk"] on a SAVE block kept
    it compiled, 2,048 bytes the tape did not hold."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True)

    def body(h):
        with remat.annotate("blk", policy=remat.CheckpointPolicy.SAVE if kind == "recompute" else None):
            a = torch.tanh(h @ w1)
        return a @ w2

    def f(x):
        return remat.checkpoint("r", **{kind: ["blk"]})(body)(x)

    x = torch.randn(8, 16)
    eager = remat.memory_report(f(x)).bytes_by_owner()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torch.compile(f, backend="remat", fullgraph=True, options={"lower": "eager"})(x).sum().backward()
    assert [str(w.message) for w in said if "matched no node" in str(w.message)] == []
    plan = remat.last_plan()
    if kind == "save":  # the tanh, which the matmul after it reads (the tape keeps the block's mm too)
        assert eager == {"blk": 2 * 8 * 64 * 4} and plan.bytes_by_owner() == {"blk": 8 * 64 * 4}
    else:
        assert eager == plan.bytes_by_owner() == {}
        assert "blk.tanh.0" in plan.recomputed


@pytest.mark.parametrize("solver", ["ilp", "greedy"])
def test_a_recompute_glob_over_two_regions_keeps_their_boundary_within_a_memory_budget(solver):
    """recompute=['*'] over two checkpoint regions, the second reading the first's output: PyTorch's
    partitioner saves that boundary whatever the tags say (cleanup_recompute_tags), which the budget's
    0-1 program did not know. It counted the softmax recomputed and the partition saved it: "the
    partition saves 1,536 bytes, over the memory budget's target 1,075 that the solver met" (fuzz seed
    8997). The boundary is tagged MUST_SAVE first, with its reason; gradients as eager's."""

    def forward(v0, v1):
        v3 = v0 * v1
        (v6,) = remat.checkpoint("r1")(lambda v3: (torch.softmax(v3, -1),))(v3)

        def second(v1, v6):
            v8 = v6 * 1.0
            v8[:, 0] = v1[:, 0]
            return (v8,)

        (v8,) = remat.checkpoint("r2")(second)(v1, v6)
        return v8.sin().sum()

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 4, 16, generator=g, requires_grad=True) for _ in range(2)]
    forward(*inputs).backward()
    expected = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(forward, backend="remat", fullgraph=True,
                             options={"lower": "eager", "memory_budget": 0.1, "recompute": ["*"], "solver": solver})
    compiled(*inputs).backward()
    assert all(torch.allclose(x.grad, e, rtol=1e-5, atol=1e-6) for x, e in zip(inputs, expected))
    plan = remat.last_plan()
    boundary = [s for s in plan.saved if s.reason.startswith("region boundary: read by a later checkpoint region")]
    assert [s.bytes for s in boundary] == [512], str(plan)
    assert plan.total_bytes <= plan.budget.target, str(plan)


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_a_glob_every_layers_region_shares_warns_only_where_it_selects_in_none(mode, monkeypatch):
    """A review: save=["L[02].fc1"] given to each of 4 layer regions (keep the even layers' fc1)
    warned for every region it found nothing in, in both modes: 2 warnings a step for a glob that
    does its job. It is judged over the regions that share it; a typo in the same place still warns."""
    from remat_fx.runtime import checkpoint as region

    monkeypatch.setattr(region, "_GLOBS_SEEN", set())
    monkeypatch.setattr(region, "_GLOBS_PENDING", {})
    eye = torch.eye(16)

    def layers(x, glob):
        for i in range(4):
            body = lambda h, i=i: remat.native_op(torch.mm, f"L{i}.fc1")(h, eye).sin()  # noqa: E731
            x = remat.checkpoint(f"layers.{i}", save=[glob])(body)(x)
        return x.sum()

    def said(glob):
        torch._dynamo.reset()
        x = torch.randn(8, 16, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "compile":
                torch.compile(lambda x: layers(x, glob), backend="remat", fullgraph=True,
                              options={"lower": "eager"})(x).backward()
            else:
                layers(x, glob).backward()
        return [str(w.message) for w in caught if "glob" in str(w.message)]

    assert said("L[02].fc1") == []
    if mode == "compile":
        assert sorted(remat.last_plan().bytes_by_owner()) == ["L0.fc1", "L2.fc1"]
    typo = said("L[02].fc2")
    assert len(typo) == 4 and all("save glob 'L[02].fc2' matched no" in t for t in typo), typo


@pytest.mark.parametrize("native", [True, False], ids=["native_op", "annotate"])
def test_one_name_with_two_policies_in_a_region_warns_under_compile(native):
    """A review: two ops of one region named alike with opposite policies (SAVE and RECOMPUTE) are
    refused by the eager tape ("used twice"), and compiled they went under one row of the plan
    without a word. Compiled, each op keeps its own policy and a warning names the name; the same
    name with one policy (the calls of a nested region) stays silent."""
    P = remat.CheckpointPolicy
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True)

    def body(x, second):
        if native:
            h = remat.native_op(torch.mm, "mm", policy=P.SAVE)(x, w1)
            return remat.native_op(torch.mm, "mm", policy=second)(torch.tanh(h), w2).sum()
        with remat.annotate("blk", policy=P.SAVE):
            h = x @ w1
        with remat.annotate("blk", policy=second):
            h = torch.tanh(h) @ w2
        return h.sum()

    x = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match=r"is used twice in checkpoint region 'r'"):
        remat.checkpoint("r")(body)(x, P.RECOMPUTE)
    for second, want in ((P.RECOMPUTE, 1), (P.SAVE, 0)):
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.compile(lambda x: remat.checkpoint("r")(body)(x, second), backend="remat", fullgraph=True,
                          options={"lower": "eager"})(x).backward()
        texts = [str(w.message) for w in caught if "different policies" in str(w.message)]
        name = "mm" if native else "blk"
        assert texts == [f"remat_fx: the name '{name}' is given in checkpoint region 'r' to ops with different "
                         f"policies (RECOMPUTE, SAVE); each op keeps its own, but the plan files them under the one "
                         f"name, and the eager runtime refuses a name used twice in one region. Give each call its "
                         f"own name (e.g. with the layer index)."][:want], texts
