"""remat.checkpoint: calling convention, gradients, run counts, recompute timing, RNG, nesting."""
import gc
import weakref
from collections import OrderedDict, namedtuple

import pytest
import torch

import remat_fx as remat
from tests.helpers import (EVENTS, RUNS, P, Logged, Split2, alinear, assert_equal_grads, exp, grads, linear)


def _chain(x, w1, w2, w3, p1, p2, p3):
    h = linear(x, w1, "l1", p1)
    h = exp(h, "e1", p2)
    h = linear(h, w2, "l2", p3)
    return linear(h, w3, "l3", P.RECOMPUTE).tanh()


def _params(n=3, d=16):
    return [(0.1 * torch.randn(d, d)).requires_grad_() for _ in range(n)]


POLICIES = {
    "all-save": (P.SAVE, P.SAVE, P.SAVE),
    "all-recompute": (P.RECOMPUTE, P.RECOMPUTE, P.RECOMPUTE),
    "save-save-recompute": (P.SAVE, P.SAVE, P.RECOMPUTE),
    "recompute-save-recompute": (P.RECOMPUTE, P.SAVE, P.RECOMPUTE),
    "save-recompute-save": (P.SAVE, P.RECOMPUTE, P.SAVE),
}


@pytest.mark.parametrize("policies", POLICIES.values(), ids=POLICIES.keys())
def test_gradients_equal_no_checkpoint(mode, policies):
    ws = _params()
    x = torch.randn(8, 16, requires_grad=True)
    want = grads(_chain(x, *ws, *policies).sum(), [x, *ws])

    step = mode(lambda x, *ws: remat.checkpoint()(_chain)(x, *ws, *policies).sum())
    mode.assert_grads(grads(step(x, *ws), [x, *ws]), want)


@pytest.mark.parametrize("policies", POLICIES.values(), ids=POLICIES.keys())
def test_save_runs_once_recompute_twice(policies):
    ws = _params()
    x = torch.randn(8, 16, requires_grad=True)
    remat.checkpoint()(_chain)(x, *ws, *policies).sum().backward()
    names = ("l1", "exp", "l2")
    for name, pol in zip(names, policies):
        assert RUNS[name] == (1 if pol is P.SAVE else 2), (name, pol, dict(RUNS))
    assert RUNS["l3"] == 2


def test_save_feeding_two_recompute_consumers(mode):
    w1, w2, w3 = _params()
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        h = alinear(x, w1, "shared", P.SAVE)
        a = alinear(h, w2, "left", P.RECOMPUTE)
        b = alinear(h, w3, "right", P.RECOMPUTE)
        return a * b

    want = grads(block(x).sum(), [x, w1, w2, w3])
    out = mode(lambda x: remat.checkpoint()(block)(x).sum())(x)
    # the SAVE op's output is kept once for both consumers (x, w1 are leaves: not counted)
    if mode.compiled:
        assert remat.last_plan().bytes_by_owner() == {"shared": 8 * 16 * 4}
    else:
        report = remat.memory_report(out)
        assert report.bytes_by_owner() == {"shared": 8 * 16 * 4}
        inputs = [e for e in report.entries if e.name == "inputs.0" and e.op in ("left", "right")]
        assert sorted(e.bytes for e in inputs) == [0, 8 * 16 * 4]
    mode.assert_grads(grads(out, [x, w1, w2, w3]), want)


def test_tuple_outputs_keep_schema():
    x = torch.randn(4, requires_grad=True)

    def block(x):
        a, b = remat.op(Split2.apply, "split", policy=P.RECOMPUTE)(x)
        return a * b

    out = remat.checkpoint()(block)(x)
    (g,) = grads(out.sum(), [x])
    assert torch.equal(g, 12 * x.detach())
    assert RUNS["split2"] == 2


def test_recompute_starts_when_region_backward_begins():
    """PyTorch recomputes lazily, at the first unpack; remat recomputes before any region node runs."""
    (w,) = _params(1)
    x = torch.randn(4, 16, requires_grad=True)

    def block(x):
        h = linear(x, w, "l", P.RECOMPUTE)
        return Logged.apply(h + 1)  # saves nothing: lazily, recompute would wait for linear's backward

    remat.checkpoint()(block)(x).sum().backward()
    assert EVENTS == [("fw", "l"), ("fw", "l"), ("bw", "logged"), ("bw", "linear")]

    EVENTS.clear()
    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum().backward()
    assert EVENTS == [("fw", "l"), ("bw", "logged"), ("fw", "l"), ("bw", "linear")]


def test_curried_form_is_required():
    with pytest.raises(TypeError, match=r"remat.checkpoint takes options, not the function: write "
                                        r"remat.checkpoint\(\)\(.*<lambda>\)\(\*args\)"):
        remat.checkpoint(lambda x: x)
    def block(x):
        return x
    with pytest.raises(TypeError, match=r"remat.checkpoint\(\)\(.*block\)"):
        remat.checkpoint(block)


def test_an_empty_region_name_is_refused():
    """remat.annotate and remat.native_op refuse an empty name; remat.checkpoint("") took one."""
    with pytest.raises(ValueError, match=r"^remat.checkpoint: the region name must be a non-empty string, got '' "
                                         r"\(leave it out for the function's name\)$"):
        remat.checkpoint("")


def test_unknown_option_lists_valid_ones():
    with pytest.raises(TypeError, match=r"(?s)unknown option\(s\) \['use_reentrant'\].*preserve_rng_state"):
        remat.checkpoint(use_reentrant=True)


@pytest.mark.parametrize("options, error, message", [
    ({"preserve_rng_state": "no"}, TypeError,
     r"^remat.checkpoint: preserve_rng_state must be True or False, got 'no'$"),
    ({"debug": 3}, TypeError, r"^remat.checkpoint: debug must be True or False, got 3$"),
    ({"save": 123}, ValueError, r"option 'save' must be a glob string or a list of them, got 123"),
    ({"offloader": object()}, TypeError, r"an offloader needs pack\(tensor\) and unpack\(packed\) methods"),
])
def test_bad_option_values_are_refused_where_the_region_is_stated(options, error, message):
    """When ``remat.checkpoint(...)`` is written, not when it is bound to a function or run: a string
    ``preserve_rng_state='no'`` read as true (the RNG state was replayed), ``debug=3`` passed on."""
    with pytest.raises(error, match=message):
        remat.checkpoint("r", **options)


@pytest.mark.parametrize("value, message", [
    (namedtuple("Pair", "a b"), r"output is a namedtuple \(Pair\)"),
    (OrderedDict, r"output is a subclass of dict \(OrderedDict\)"),
    ("leaf", r"output\[1\] is a non-tensor leaf of type int"),
    ("nested", r"output\['a'\]\[0\] is a non-tensor leaf of type str"),
])
def test_output_structure_is_checked(value, message):
    x = torch.randn(3, requires_grad=True)

    def block(x):
        if value == "leaf":
            return (x * 2, 3)
        if value == "nested":
            return {"a": ["s"], "b": x * 2}
        if value is OrderedDict:
            return OrderedDict(a=x * 2)
        return value(x * 2, x * 3)

    with pytest.raises(TypeError, match=message):
        remat.checkpoint("blk")(block)(x)


def test_builtin_containers_pass():
    x = torch.randn(3, requires_grad=True)
    out = remat.checkpoint()(lambda x: {"a": [x * 2, (x * 3,)], "b": x.sin()})(x)
    (g,) = grads(out["a"][0].sum() + out["a"][1][0].sum() + out["b"].sum(), [x])
    assert torch.equal(g, 2 + 3 + x.detach().cos())


@pytest.mark.parametrize("policy", [P.SAVE, P.RECOMPUTE])
def test_dropout_identical_gradients(mode, policy):
    (w1, w2) = _params(2)
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        h = torch.nn.functional.dropout(x, 0.3)
        h = linear(h, w1, "l1", policy)
        h = torch.nn.functional.dropout(linear(h, w2, "l2", P.RECOMPUTE), 0.5)
        return h

    torch.manual_seed(7)  # the reference runs in the same mode: compiled dropout draws differently
    want = grads(mode(lambda x: block(x).sum())(x), [x, w1, w2])
    torch.manual_seed(7)
    out = mode(lambda x: remat.checkpoint()(block)(x).sum())(x)
    mode.assert_grads(grads(out, [x, w1, w2]), want)


class DropoutInside(torch.autograd.Function):
    """A SAVE op that consumes randomness: skipping it in recompute must not shift later dropout."""

    @staticmethod
    @remat.auto_forward("mask")
    def forward(ctx, x):
        mask = (torch.rand_like(x) > 0.5).to(x.dtype)
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad * mask


def test_skipped_save_op_keeps_rng_stream_aligned():
    (w,) = _params(1)
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        h = remat.op(DropoutInside.apply, "drop", policy=P.SAVE)(x)
        h = linear(h, w, "l", P.RECOMPUTE)  # input saved (SAVE producer)
        return torch.nn.functional.dropout(h, 0.5)  # recomputed: must draw the same mask

    torch.manual_seed(3)
    want = grads(block(x).sum(), [x, w])
    torch.manual_seed(3)
    out = remat.checkpoint()(block)(x).sum()
    assert_equal_grads(grads(out, [x, w]), want)


def test_autocast_state_replayed():
    (w,) = _params(1)
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        return torch.mm(torch.mm(x, w).tanh(), w)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = grads(block(x).float().sum(), [x, w])
        out = remat.checkpoint()(block)(x)
    assert out.dtype == torch.bfloat16
    assert_equal_grads(grads(out.float().sum(), [x, w]), want)


def test_kwargs_are_passed():
    (w,) = _params(1)
    x = torch.randn(4, 16, requires_grad=True)

    def block(x, *, scale):
        return linear(x * scale, w, "l", P.SAVE)

    out = remat.checkpoint()(block)(x, scale=3.0)
    (g,) = grads(out.sum(), [w])
    assert torch.allclose(g, 3.0 * x.detach().t() @ torch.ones(4, 16), rtol=1e-6)


def test_no_grad_runs_plainly():
    (w,) = _params(1)
    with torch.no_grad():
        out = remat.checkpoint()(lambda x: linear(x, w, "l", P.SAVE))(torch.randn(2, 16))
    assert out.shape == (2, 16) and RUNS["l"] == 1


def test_nested_regions_recompute_inner_twice():
    w1, w2, w3 = _params()
    x = torch.randn(8, 16, requires_grad=True)

    def inner(h):
        return linear(h, w2, "inner.l", P.RECOMPUTE).tanh()

    def outer(x):
        h = linear(x, w1, "outer.save", P.SAVE)  # a SAVE output feeding the nested region
        h = remat.checkpoint("inner")(inner)(h)
        return linear(h, w3, "outer.l", P.RECOMPUTE)

    want = grads(outer(x).sum(), [x, w1, w2, w3])
    RUNS.clear()
    out = remat.checkpoint("outer")(outer)(x).sum()
    assert_equal_grads(grads(out, [x, w1, w2, w3]), want)
    # forward, outer recompute, inner recompute: the multiple-recomputation schedule
    assert RUNS == {"outer.save": 1, "inner.l": 3, "outer.l": 2}


def test_nested_same_function_twice():
    w1, w2 = _params(2)
    x = torch.randn(8, 16, requires_grad=True)
    layer = remat.checkpoint()(lambda h: exp(linear(h, w2, "l", P.SAVE), "e", P.RECOMPUTE))

    def outer(x):
        return layer(layer(linear(x, w1, "in", P.SAVE)))

    want = grads(outer(x).sum(), [x, w1, w2])
    assert_equal_grads(grads(remat.checkpoint()(outer)(x).sum(), [x, w1, w2]), want)


def test_retain_graph_keeps_tape():
    (w1, w2) = _params(2)
    x = torch.randn(4, 16, requires_grad=True)

    def block(x):
        return linear(exp(linear(x, w1, "a", P.SAVE), "e", P.SAVE), w2, "b", P.RECOMPUTE)

    out = remat.checkpoint()(block)(x).sum()
    out.backward(retain_graph=True)
    first = [t.grad.clone() for t in (x, w1, w2)]
    out.backward()
    assert_equal_grads([t.grad for t in (x, w1, w2)], [2 * g for g in first])


def test_second_backward_without_retain_graph_is_an_error():
    (w,) = _params(1)
    x = torch.randn(4, 16, requires_grad=True)
    out = remat.checkpoint()(lambda x: exp(linear(x, w, "a", P.SAVE), "e", P.RECOMPUTE))(x).sum()
    out.backward()
    with pytest.raises(RuntimeError, match="second time|already"):
        out.backward()


@pytest.mark.parametrize("policy", [None, P.SAVE, P.RECOMPUTE])
def test_autograd_grad_and_double_backward(policy):
    (w,) = _params(1)
    x = torch.randn(4, 16, requires_grad=True)

    def block(x):
        if policy is None:
            return torch.tanh(x @ w)
        return exp(linear(x, w, "l", policy), "e", P.RECOMPUTE)

    (gx,) = torch.autograd.grad(block(x).sum(), [x], create_graph=True)
    (want,) = torch.autograd.grad(gx.pow(2).sum(), [w])
    (gx2,) = torch.autograd.grad(remat.checkpoint()(block)(x).sum(), [x], create_graph=True)
    (got,) = torch.autograd.grad(gx2.pow(2).sum(), [w])
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


def _tape_weakrefs(out):
    refs = []
    for tape in remat.runtime.report.find_tapes(out):
        for rec in tape.records:
            for _, slot in rec.slots():
                if not slot.is_param:
                    refs.append(weakref.ref(slot.value))
    return refs


def test_tape_tensors_freed_after_backward():
    (w1, w2) = _params(2)
    x = torch.randn(4, 16, requires_grad=True)

    def block(x):
        return linear(exp(linear(x, w1, "a", P.SAVE), "e", P.SAVE), w2, "b", P.RECOMPUTE)

    out = remat.checkpoint()(block)(x).sum()
    refs = _tape_weakrefs(out)
    assert len(refs) >= 2 and all(r() is not None for r in refs)
    out.backward()
    assert [r() for r in refs] == [None] * len(refs)  # no gc.collect(): freed by refcount


def test_tape_freed_when_backward_never_runs():
    (w1,) = _params(1)
    x = torch.randn(4, 16, requires_grad=True)
    out = remat.checkpoint()(lambda x: exp(linear(x, w1, "a", P.SAVE), "e", P.SAVE))(x)
    refs = _tape_weakrefs(out)
    tape_ref = weakref.ref(remat.runtime.report.find_tapes(out)[0])
    assert refs and all(r() is not None for r in refs)
    del out
    assert tape_ref() is None and [r() for r in refs] == [None] * len(refs)
    gc.collect()


def test_trailing_ops_that_save_nothing_are_not_rerun_nor_kept_for():
    """The recompute stops after the region's last saved tensor: a trailing RECOMPUTE op that
    saves nothing is not rerun, and the SAVE output it reads is not kept for it. (The SAVE op's
    own backward input, sin(x), is remade by the recompute: the tape keeps nothing for it either.)"""
    (w,) = _params(1)
    x = torch.randn(8, 16, requires_grad=True)

    def block(x):
        h = alinear(x.sin(), w, "mm", P.SAVE)
        return remat.native_op(torch.add, "residual", policy=P.RECOMPUTE)(x, h)

    want = grads(block(x).sum(), [x, w])
    out = remat.checkpoint()(block)(x)
    report = remat.memory_report(out)
    assert [(e.op, e.name, e.policy) for e in report.entries] == [("", "inputs.0", "PARAM")]
    assert_equal_grads(grads(out.sum(), [x, w]), want)
