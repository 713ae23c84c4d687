"""Lifetimes and edge cases: nothing held after backward, kwargs, pass-through outputs, offload
aliasing and leaks, RNG without preservation, aliases of SAVE outputs, parameters in reports."""
import gc
import weakref

import pytest
import torch

import remat_fx as remat
from tests.helpers import RUNS, P, alinear, assert_equal_grads, exp, grads, linear
from tests.test_checkpoint import DropoutInside


def test_region_inputs_freed_by_backward_while_loss_lives():
    w = torch.randn(16, 16, requires_grad=True)
    h = torch.randn(8, 16, requires_grad=True) * 2  # a non-leaf input only the graph holds
    ref = weakref.ref(h)
    loss = remat.checkpoint()(lambda h: (h @ w).tanh())(h).sum()
    del h
    assert ref() is not None
    loss.backward()
    assert ref() is None  # as with torch.utils.checkpoint; `loss` is still referenced here


@pytest.mark.parametrize("kw", ["debug", "use_reentrant", "context_fn", "early_stop", "preserve_rng_state"])
def test_user_kwargs_named_like_checkpoint_options_reach_the_function(kw):
    x = torch.randn(3, requires_grad=True)
    seen = {}

    def block(x, **kwargs):
        seen.update(kwargs)
        return x * 2

    out = remat.checkpoint()(block)(x, **{kw: "mine"})
    out.sum().backward()
    assert seen == {kw: "mine"} and torch.equal(x.grad, torch.full((3,), 2.0))


def test_output_that_is_an_input_gets_no_hook_or_tape():
    x = torch.randn(4, requires_grad=True)
    a = x * 1
    blk = remat.checkpoint()(lambda a, w: (a, exp(a * w, "e", P.RECOMPUTE)))
    for _ in range(3):
        same, y = blk(a, torch.ones(4))
        assert same is a
        assert len(remat.runtime.report.find_tapes(y)) == 1
        assert remat.runtime.report.find_tapes(same) == []
        RUNS.clear()
        (y.sum() + same.sum()).backward(retain_graph=True)
        assert RUNS["exp"] == 1  # this step's region is recomputed once, no earlier one again


def test_offload_inplace_change_is_caught_with_the_cpu_offloader():
    x = torch.randn(4, requires_grad=True)
    out = remat.checkpoint("blk", offloader=remat.CPUOffloader())(lambda x: exp(x * 1, "e", P.OFFLOAD))(x)
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match=r"tensor 'y' saved by op 'e' in region 'blk' was modified in place"):
        out.sum().backward()


@pytest.mark.parametrize("policy", [P.SAVE, P.OFFLOAD])
def test_tape_freed_without_backward_by_refcount(policy):
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    gc.disable()
    try:
        out = remat.checkpoint()(lambda x: exp(linear(x.sin(), w, "a", policy), "e", policy))(x)
        tape = weakref.ref(remat.runtime.report.find_tapes(out)[0])
        slots = [weakref.ref(s.value) for r in tape().records for _, s in r.slots() if not s.is_param]
        assert len(slots) == 2
        del out
        assert tape() is None and all(s() is None for s in slots)
    finally:
        gc.enable()


class DictOffloader:
    """Packs into a dict (an opaque value, like the CUDA path's pinned-host record)."""

    def pack(self, t):
        return {"data": t.clone()}

    def unpack(self, packed):
        return packed["data"]


def test_report_counts_every_opaque_packed_tensor():
    ws = [torch.randn(8, 8, requires_grad=True) for _ in range(40)]

    def block(h):
        for i, w in enumerate(ws):
            h = linear(h.sin(), w, f"l{i}", P.OFFLOAD)
        return h.view(-1)

    out = remat.checkpoint("blk", offloader=DictOffloader())(block)(torch.randn(4, 8, requires_grad=True))
    offloaded = [e for e in remat.memory_report(out).entries if e.policy == "OFFLOAD"]
    assert len(offloaded) == 40 and sum(e.bytes for e in offloaded) == 40 * 4 * 8 * 4


def test_native_save_does_not_charge_weight_views_and_frozen_weights_are_params():
    lin = torch.nn.Linear(64, 64)
    frozen = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
    x = torch.randn(4, 64, requires_grad=True)

    def block(x):
        h = remat.native_op(torch.nn.functional.linear, "proj", policy=P.SAVE)(x.sin(), lin.weight, lin.bias)
        return linear(h, frozen, "frozen", P.SAVE).sum(-1)

    report = remat.memory_report(remat.checkpoint()(block)(x))
    rows = {(e.op, e.name): (e.policy, e.bytes) for e in report.entries if e.op}
    assert rows[("proj", "aten.addmm.default#0.0")] == ("SAVE", 4 * 64 * 4)
    assert not any("aten.t" in name for _, name in rows)  # the weight's transpose is redone, not cached
    assert rows[("frozen", "w")] == ("PARAM", 0)


def test_no_rng_preservation_does_not_rewind_the_global_rng():
    x = torch.randn(1000, requires_grad=True)
    torch.manual_seed(0)
    out = remat.checkpoint(preserve_rng_state=False)(
        lambda x: remat.op(DropoutInside.apply, "drop", policy=P.SAVE)(x))(x)
    after_forward = torch.rand(3)
    out.sum().backward()
    assert not torch.equal(torch.rand(3), after_forward)


@pytest.mark.parametrize("alias", ["detach", "data", "view_as"])
def test_save_output_reached_through_an_alias_is_saved_for_the_consumer(alias):
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        h = alinear(x, w1, "a", P.SAVE)
        h2 = {"detach": h.detach, "data": lambda: h.data, "view_as": lambda: h.view_as(h)}[alias]()
        return alinear(h2, w2, "b", P.RECOMPUTE) * 1  # w2's gradient needs h2's real values

    want = grads(block(x).sum(), [w2])
    assert_equal_grads(grads(remat.checkpoint()(block)(x).sum(), [w2]), want)


def test_name_keyword():
    out = remat.checkpoint(name="layers.0")(lambda x: exp(x * 1, "e", P.SAVE))(torch.ones(2, requires_grad=True))
    assert {e.region for e in remat.memory_report(out).entries} == {"layers.0"}
    with pytest.raises(TypeError, match="given twice"):
        remat.checkpoint("a", name="b")
