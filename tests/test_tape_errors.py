"""Placeholders, desync detection, name uniqueness, in-place checks: the errors a user sees."""
import pytest
import torch

import remat_fx as remat
from tests.helpers import P, Exp, Linear, exp, grads, linear

SEEN = []


class Inspect(torch.autograd.Function):
    """A RECOMPUTE op that records what it is given before loading its inputs."""

    @staticmethod
    def forward(ctx, x, name):
        handle = remat.get_handle(ctx, name, P.RECOMPUTE)
        SEEN.append(x)
        x = handle.save_or_load_inputs(x)
        SEEN.append(x)
        handle.save_for_backward({"x": x})  # something saved: the recompute reaches this op
        return handle.record_outputs(x * 2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


def test_placeholder_metadata_and_views():
    SEEN.clear()
    w = (0.1 * torch.randn(6, 6)).requires_grad_()
    x = torch.randn(4, 6, requires_grad=True)

    def block(x):
        h = linear(x, w, "save", P.SAVE)
        return Inspect.apply(h.t()[1:], "inspect")  # a view of the SAVE output

    out = remat.checkpoint()(block)(x)
    grads(out.sum(), [x, w])
    fwd_in, fwd_loaded, rec_in, rec_loaded = SEEN
    assert type(fwd_in) is torch.Tensor and fwd_loaded is fwd_in
    assert isinstance(rec_in, remat.Placeholder) and rec_in.producer == "save"
    assert (rec_in.shape, rec_in.stride(), rec_in.storage_offset(), rec_in.dtype, rec_in.device) == (
        fwd_in.shape, fwd_in.stride(), fwd_in.storage_offset(), fwd_in.dtype, fwd_in.device)
    assert type(rec_loaded) is torch.Tensor and torch.equal(rec_loaded, fwd_in)
    # metadata-only ops work on a placeholder; data access raises
    assert rec_in.shape == (5, 4)
    for view in (lambda t: t.transpose(0, 1), lambda t: t.unsqueeze(0), lambda t: t[2:], lambda t: t.unbind(1)[3]):
        got, want = view(rec_in), view(fwd_in)
        assert isinstance(got, remat.Placeholder) and got.producer == "save"
        assert (got.shape, got.stride(), got.storage_offset()) == (want.shape, want.stride(), want.storage_offset())
    with pytest.raises(RuntimeError, match=r"op aten.sum.default reads the output of SAVE op 'save'"):
        rec_in.sum()
    with pytest.raises(RuntimeError, match="SAVE op 'save'"):
        rec_in[0, 0].item()


def test_bare_native_op_on_save_output_names_op_and_fixes():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    out = remat.checkpoint()(lambda x: linear(x, w, "layers.0.qkv", P.SAVE).relu())(x)
    with pytest.raises(RuntimeError) as err:
        out.sum().backward()
    msg = str(err.value)
    assert "op aten.relu.default reads the output of SAVE op 'layers.0.qkv' during recompute" in msg
    assert "1. wrap the consumer with remat.native_op" in msg
    assert "2. move the consumer into a custom autograd Function decorated with remat.auto_forward" in msg
    assert "3. change the policy of 'layers.0.qkv' to CheckpointPolicy.RECOMPUTE" in msg


def test_duplicate_name_raises_at_second_use():
    w = torch.randn(4, 4, requires_grad=True)

    def block(x):
        return linear(linear(x, w, "mlp.up", P.SAVE), w, "mlp.up", P.RECOMPUTE)

    with pytest.raises(RuntimeError, match=r"op name 'mlp.up' is used twice in checkpoint region 'blk'"):
        remat.checkpoint("blk")(block)(torch.randn(2, 4, requires_grad=True))


@pytest.mark.parametrize("case", ["outer and inner", "inner twice"])
def test_same_name_in_nested_regions_compiles_as_it_runs(case):
    """One name in an outer region and in a region nested in it, or in two calls of a nested region
    (a region per layer, the policy per call), runs on the tape and compiles with its gradients: the
    joint graph gives nested region calls one ac_graph_id, and a duplicate-name check keyed on it
    (tried, 2026-12-06) refused both under torch.compile."""
    w = torch.randn(4, 4, requires_grad=True)

    def mm(x, policy):
        return remat.native_op(torch.mm, "mm", policy=policy)(x, w).tanh()

    def f(x):
        if case == "outer and inner":
            body = lambda x: remat.checkpoint("inner")(lambda h: mm(h, P.RECOMPUTE))(mm(x, P.SAVE))  # noqa: E731
        else:
            def body(x):
                for policy in (P.SAVE, P.RECOMPUTE):
                    x = remat.checkpoint("blk")(lambda h, policy=policy: mm(h, policy))(x)
                return x
        return remat.checkpoint("outer")(body)(x)

    x = torch.randn(2, 4, requires_grad=True)
    want = grads(f(x).sum(), [x, w])
    torch._dynamo.reset()
    got = grads(torch.compile(f, backend="remat", fullgraph=True, options={"lower": "eager"})(x).sum(), [x, w])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_same_name_in_different_regions_is_fine():
    w = torch.randn(4, 4, requires_grad=True)
    blk = remat.checkpoint()(lambda x: linear(x, w, "mlp.up", P.SAVE))
    out = blk(blk(torch.randn(2, 4, requires_grad=True)))
    grads(out.sum(), [w])


class _Flip:
    def __init__(self):
        self.calls = 0

    def __call__(self, forward, recompute):
        self.calls += 1
        return forward if self.calls == 1 else recompute


@pytest.mark.parametrize("change, message", [
    ("name", r"diverged from its forward at op #1: forward ran 'b' \(SAVE\), recompute ran 'c' \(SAVE\)"),
    ("policy", r"diverged from its forward at op #1: forward ran 'b' \(SAVE\), recompute ran 'b' \(RECOMPUTE\)"),
    ("fewer", r"op 'b' \(SAVE\) ran in forward but not in recompute"),
    ("shape", r"at op 'b': input 0 was \(4, 4\) float32 on cpu \(stride \(4, 1\), offset 0\) in forward but "
              r"\(4, 2\) float32 on cpu \(stride \(4, 1\), offset 0\) in recompute"),
    ("auto", r"at op 'e': input 0 was \(4, 4\) float32 on cpu \(stride \(4, 1\), offset 0\) in forward but "
             r"\(4, 2\) float32 on cpu"),
])
def test_desync_names_first_diverging_op(change, message):
    w = torch.randn(4, 4, requires_grad=True)
    flip = _Flip()

    def block(x):
        h = linear(x, w, "a", P.RECOMPUTE)
        pick = flip(0, 1)
        if change == "name":
            h = linear(h, w, ("b", "c")[pick], P.SAVE)
        elif change == "policy":
            h = linear(h, w, "b", (P.SAVE, P.RECOMPUTE)[pick])
        elif change == "fewer":
            h = linear(h, w, "b", P.SAVE) if pick == 0 else h * 1
        elif change == "shape":
            h = linear(h if pick == 0 else h[:, :2], w if pick == 0 else w[:2], "b", P.RECOMPUTE)
        elif change == "auto":  # a SAVE op through auto_forward: its inputs are checked too
            h = linear(exp(h if pick == 0 else h[:, :2], "e", P.SAVE), w if pick == 0 else w[:2], "b", P.RECOMPUTE)
        return h.view_as(h)

    out = remat.checkpoint("blk")(block)(torch.randn(4, 4, requires_grad=True))
    with pytest.raises(RuntimeError, match=message):
        out.sum().backward()


def test_inplace_change_to_saved_tensor_is_caught():
    x = torch.randn(4, requires_grad=True)
    out = remat.checkpoint("blk")(lambda x: exp(x * 1, "e", P.SAVE))(x)
    with torch.no_grad():
        out.mul_(2)  # exp saved its output on the tape; this changes it
    with pytest.raises(RuntimeError, match=r"tensor 'y' saved by op 'e' in region 'blk' was modified in place "
                                           r"after it was saved \(version 0 -> 1\)"):
        out.sum().backward()


def test_auto_forward_name_count_mismatch():
    class Bad(torch.autograd.Function):
        @staticmethod
        @remat.auto_forward("x", "y")
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    with pytest.raises(TypeError, match=r"op 'bad'\): the forward saved 1 tensor\(s\) but the decorator names "
                                        r"2: \['x', 'y'\]"):
        remat.checkpoint()(lambda x: remat.op(Bad.apply, "bad", policy=P.SAVE)(x))(torch.ones(2, requires_grad=True))


def test_op_without_auto_forward_raises():
    with pytest.raises(TypeError, match=r"remat.op\('lin'\): .*ran no forward decorated with @remat.auto_forward"):
        remat.op(torch.sin, "lin", policy=P.SAVE)(torch.ones(2))


def test_bad_policy_and_names():
    with pytest.raises(ValueError, match=r"remat.op\('x'\): policy 'keep' is not one of CheckpointPolicy.RECOMPUTE"):
        remat.op(Exp.apply, "x", policy="keep")
    with pytest.raises(TypeError, match="the op name must be a non-empty string"):
        remat.native_op(torch.mm, "", policy=P.SAVE)
    assert remat.op(Exp.apply, "x", policy="save")  # names are accepted, case-insensitive
    # what is not callable, where it is named (it failed at the call: 'str' object is not callable)
    with pytest.raises(TypeError, match=r"^remat.native_op\(fn, 'a'\): fn must be a PyTorch function or op "
                                        r"\(torch.mm, F.gelu\), got str 'mm'$"):
        remat.native_op("mm", "a")
    with pytest.raises(TypeError, match=r"^remat.op\(fn, 'b'\): fn must be an autograd Function's apply "
                                        r"\(Fn.apply\), got int 3$"):
        remat.op(3, "b")


def test_save_for_backward_needs_a_dict():
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            remat.get_handle(ctx, "bad", P.SAVE).save_for_backward([x])
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(TypeError, match=r"handle.save_for_backward of op 'bad' takes a dict of names to tensors"):
        Bad.apply(torch.ones(2, requires_grad=True))


def test_save_op_must_record_outputs():
    class NoRecord(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            handle = remat.get_handle(ctx, "norec", P.SAVE)
            if (ret := handle.maybe_load_saved()) is not None:
                return ret
            handle.save_for_backward({"x": x})
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.ones(2, requires_grad=True)
    out = remat.checkpoint()(lambda x: NoRecord.apply(x).view(-1))(x)
    with pytest.raises(RuntimeError, match=r"SAVE op 'norec' did not call handle.record_outputs"):
        out.sum().backward()


def test_handles_pass_through_outside_regions():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4, requires_grad=True)
    out = linear(x, w, "free", P.SAVE)
    (gw,) = grads(exp(out, "e2", P.SAVE).sum(), [w])
    want = x.detach().t() @ out.detach().exp()
    assert torch.allclose(gw, want, rtol=1e-6)
    assert not isinstance(out, remat.Placeholder)
    assert Linear is not None


def test_a_direct_ctx_save_left_in_a_handle_function_is_refused_where_it_is_called():
    """Converting a Function to the handle protocol and leaving its ``ctx.save_for_backward(x, w)`` line:
    inside a region the two saves override each other, and the recompute failed at the first backward
    with PyTorch's count mismatch naming neither the op nor the fix (or a SAVE op ran again, silently).
    Refused in the forward, naming the op and the handle's call; outside a region the handle passes
    through to ctx, and the direct call stays allowed there."""
    class Converted(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            handle = remat.get_handle(ctx, "mlp.up", P.SAVE)
            if (ret := handle.maybe_load_saved()) is not None:
                return ret
            out = x @ w
            ctx.save_for_backward(x, w)  # left from the Function as it was written
            handle.save_for_backward({"x": x, "w": w})
            return handle.record_outputs(out)

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w.t(), x.t() @ g

    x, w = torch.randn(2, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"^remat_fx: op 'mlp.up' called ctx.save_for_backward inside a "
                                           r"remat.checkpoint region, where its Function took a remat handle: save "
                                           r"through the handle instead, by name, handle.save_for_backward\("):
        remat.checkpoint()(lambda x: Converted.apply(x, w).tanh())(x)
    out = Converted.apply(x, w)  # no region: a pass-through, the direct call allowed
    (gx,) = grads(out.sum(), [x])
    assert torch.allclose(gx, torch.ones(2, 4) @ w.detach().t())
