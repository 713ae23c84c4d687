"""remat.native_op: SAVE keeps the op's outputs (SAC underneath), RECOMPUTE reruns it."""
import contextlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import remat_fx as remat
from tests.helpers import P, alinear, assert_equal_grads, exp, grads, linear


def _mm_flops_in_backward(out, inputs):
    with FlopCounterMode(display=False) as counter:
        got = grads(out, inputs)
    return counter.get_flop_counts()["Global"].get(torch.ops.aten.mm, 0), got


@pytest.mark.parametrize("policy, forward_mms", [(P.SAVE, 0), (P.RECOMPUTE, 1)])
def test_save_skips_the_op_in_recompute(mode, policy, forward_mms):
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32, requires_grad=True)

    def block(x):
        return remat.native_op(torch.mm, "proj", policy=policy)(x.sin(), w).cos()

    want = grads(block(x).sum(), [x, w])
    out = mode(lambda x: remat.checkpoint()(block)(x).sum())(x)
    flops, got = _mm_flops_in_backward(out, [x, w])
    one_mm = 2 * 16 * 32 * 32
    assert flops == (2 + forward_mms) * one_mm  # two backward mms, plus the recompute under RECOMPUTE
    mode.assert_grads(got, want)


def test_save_caches_outputs_and_reports_them():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    out = remat.checkpoint("blk")(lambda x: remat.native_op(torch.mm, "proj", policy=P.SAVE)(x.sin(), w).cos())(x)
    report = remat.memory_report(out)
    cached = [e for e in report.entries if e.op == "proj"]
    assert [(e.name, e.shape, e.policy, e.bytes) for e in cached] == [("aten.mm.default#0.0", (4, 8), "SAVE", 128)]


def test_save_native_op_saves_input_from_save_op():
    """mm needs its input for the weight gradient: a SAVE op's output is saved for it, not a placeholder."""
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        h = linear(x, w1, "qkv", P.SAVE)
        return remat.native_op(torch.mm, "proj", policy=P.SAVE)(h, w2).tanh()

    want = grads(block(x).sum(), [x, w1, w2])
    out = remat.checkpoint("blk")(block)(x)
    report = remat.memory_report(out)
    assert [(e.op, e.name) for e in report.entries if e.policy == "SAVE"] == [
        ("proj", "inputs.0"), ("proj", "aten.mm.default#0.0")]
    assert_equal_grads(grads(out.sum(), [x, w1, w2]), want)


def test_recompute_native_op_reruns_on_saved_input():
    w1 = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        h = linear(x, w1, "qkv", P.SAVE)
        return remat.native_op(torch.nn.functional.gelu, "act", policy=P.RECOMPUTE)(h)

    want = grads(block(x).sum(), [x, w1])
    assert_equal_grads(grads(remat.checkpoint()(block)(x).sum(), [x, w1]), want)


def test_nested_args_and_kwargs():
    a, b = torch.randn(2, 3, requires_grad=True), torch.randn(2, 3, requires_grad=True)

    def block(a, b):
        h = exp(a, "e", P.SAVE)
        return remat.native_op(torch.cat, "cat", policy=P.RECOMPUTE)([h, b], dim=0).sin()

    want = grads(block(a, b).sum(), [a, b])
    assert_equal_grads(grads(remat.checkpoint()(block)(a, b).sum(), [a, b]), want)


def test_save_native_op_with_randomness_keeps_rng_aligned():
    x = torch.randn(16, 16, requires_grad=True)

    def block(x):
        h = remat.native_op(torch.nn.functional.dropout, "drop1", policy=P.SAVE)(x.sin(), 0.5)
        return torch.nn.functional.dropout(h.cos(), 0.5)  # recomputed: must draw the forward's mask

    torch.manual_seed(5)
    want = grads(block(x).sum(), [x])
    torch.manual_seed(5)
    assert_equal_grads(grads(remat.checkpoint()(block)(x).sum(), [x]), want)


@pytest.mark.parametrize("outer", [P.SAVE, P.OFFLOAD])
@pytest.mark.parametrize("inner", ["native SAVE", "native OFFLOAD", "Function SAVE", "annotate SAVE"])
def test_a_save_op_nested_in_a_save_block_leaves_the_blocks_later_calls_their_own_outputs(mode, outer, inner):
    """A SAVE op inside a SAVE remat.annotate block, then the same op on inputs of the same shapes:
    the block's cache counted the nested op's call in the forward, which in recompute replays from its
    own cache (or, a Function, does not run), so the block's replay gave the later matmul the nested
    one's output: silently wrong gradients (x and w1 here), and where the shapes differ a shape error
    from inside PyTorch's checkpoint (fuzz case 3877: a SAVE Function before a dropout attention)."""
    torch.manual_seed(0)
    w1, w2 = (torch.randn(8, 8, requires_grad=True) for _ in range(2))
    x = torch.randn(12, 8, requires_grad=True)

    def block(x, on=True):
        with remat.annotate("blk", outer) if on else contextlib.nullcontext():
            if not on:
                a = x @ w1
            elif inner == "Function SAVE":
                a = alinear(x, w1, "fn", P.SAVE)
            elif inner == "annotate SAVE":
                with remat.annotate("inner", P.SAVE):
                    a = torch.matmul(x, w1)
            else:
                a = remat.native_op(torch.matmul, "nat", getattr(P, inner.split()[1]))(x, w1)
            b = torch.matmul(x, w2)  # the same op as the nested one's, on inputs of the same shapes
            c = torch.sin(b)  # whose backward reads b
        return torch.sigmoid(c) * 3, a  # ops after the block: the recompute runs through it

    def loss(outs):
        return outs[0].sum() + outs[1].sin().sum()

    want = grads(loss(block(x, on=False)), [x, w1, w2])
    got = grads(mode(lambda x: loss(remat.checkpoint()(block)(x)))(x), [x, w1, w2])
    mode.assert_grads(got, want)


@pytest.mark.parametrize("how", ["annotate", "native_op", "glob"])
def test_a_recompute_op_inside_a_save_block_is_recomputed_not_cached(how):
    """A helper's parity review: a RECOMPUTE op inside a SAVE remat.annotate block (an inner block, a
    RECOMPUTE native_op, or one a region's recompute glob names) was cached by the block as if SAVE
    (its sin, its mm and its dropout: 5,120 bytes more here), while compiler mode recomputes it. It
    now runs past the block's cache and again in the recompute, from the RNG state it began with: the
    block's replay skips the dropout before it without drawing."""
    w1, w2 = torch.randn(16, 64, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def inner(a):
        return torch.nn.functional.dropout(torch.sin(a), 0.3) @ w2

    def block(h, on=True):
        with remat.annotate("outer", P.SAVE) if on else contextlib.nullcontext():
            a = torch.nn.functional.dropout(torch.tanh(h @ w1), 0.5)
            if not on:
                b = inner(a)
            elif how == "annotate":
                with remat.annotate("outer.inner", P.RECOMPUTE):
                    b = inner(a)
            else:
                b = remat.native_op(inner, "outer.inner", P.RECOMPUTE if how == "native_op" else None)(a)
            c = torch.nn.functional.dropout(b.exp(), 0.2)
        return c.relu()

    torch.manual_seed(1)
    want = grads(block(x, on=False).sum(), [x, w1, w2])
    torch.manual_seed(1)
    out = remat.checkpoint("r", recompute=["outer.inner"] if how == "glob" else [])(block)(x)
    cached = sorted((e.name, e.bytes) for e in remat.memory_report(out).entries if e.op == "outer" and e.bytes)
    assert cached == [("aten.empty_like.default#0.0", 2048), ("aten.empty_like.default#1.0", 512),
                      ("aten.exp.default#0.0", 512), ("aten.mm.default#0.0", 2048),
                      ("aten.mul.Tensor#0.0", 2048), ("aten.mul.Tensor#1.0", 512), ("aten.tanh.default#0.0", 2048)]
    assert_equal_grads(grads(out.sum(), [x, w1, w2]), want)


@pytest.mark.parametrize("policy", [P.SAVE, P.OFFLOAD])  # OFFLOAD kept in place on the CPU was not checked
def test_mutating_cached_output_is_caught(policy):
    x = torch.randn(4, 4, requires_grad=True)

    def block(x):
        h = remat.native_op(torch.sin, "sin", policy=policy)(x)
        return h

    out = remat.checkpoint("blk")(block)(x)
    with torch.no_grad():
        out.add_(1)
    with pytest.raises(RuntimeError, match=r"output aten.sin.default#0.0 of native op 'sin' in region 'blk' was "
                                           r"modified in place after the op ran \(version 0 -> 1\)"):
        (out * x).sum().backward()


def test_an_offloaded_output_modified_in_place_later_in_the_region_is_caught():
    """A helper's review: OFFLOAD with the default CPUOffloader keeps a CPU tensor as it is, and its
    in-place change later in the forward went unchecked (SAVE raised): silently wrong gradients."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        h = remat.native_op(torch.sin, "s", P.OFFLOAD)(x @ w)
        z = (h * 2) * x
        h.add_(1)  # valid in plain PyTorch; the recompute would replay the changed h
        return z.sin() + h

    with pytest.raises(RuntimeError, match=r"output aten.sin.default#0.0 of native op 's' in region 'r' was "
                                           r"modified in place after the op ran \(version 0 -> 1\)"):
        remat.checkpoint("r")(block)(x).sum().backward()


@pytest.mark.parametrize("policy", [P.SAVE, P.OFFLOAD])
@pytest.mark.parametrize("how", ["annotate mul_", "annotate mul_ add_", "annotate relu inplace",
                                 "annotate dropout inplace", "native add_", "annotate copy_ into a buffer"])
def test_an_in_place_op_in_a_save_block_on_a_tensor_from_before_it_runs_again_in_recompute(mode, policy, how):
    """A helper's review: the recompute answered the in-place op from the block's cache, so the recomputed
    tensor kept its value from before the change for the ops after the block (silently wrong gradients,
    max abs diff 27.7). The op now runs again on the recomputed tensor."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def body(x, on=True):
        h = (x @ w).cos()  # made before the block
        buffer = torch.zeros(4, 8)
        if how == "native add_":
            (remat.native_op(torch.Tensor.add_, "add_", policy) if on else torch.Tensor.add_)(h, 1.5)
        else:
            with remat.annotate("blk", policy) if on else contextlib.nullcontext():
                if how == "annotate mul_":
                    h.mul_(3)
                elif how == "annotate mul_ add_":  # the second was answered from the cache (a second review)
                    h.mul_(3)
                    h.add_(1)
                elif how == "annotate copy_ into a buffer":  # a leaf made without grad before the block
                    buffer.copy_(h.sin())
                    buffer += 1
                elif how == "annotate relu inplace":
                    torch.nn.functional.relu(h, inplace=True)
                else:
                    torch.nn.functional.dropout(h, 0.5, inplace=True)
        return (h * x).sin() + (buffer * x if how.endswith("buffer") else 0)  # reads h after the block

    torch.manual_seed(3)
    want = grads(body(x, on=False).sum(), [x, w])
    torch.manual_seed(3)
    got = grads(mode(lambda x: remat.checkpoint("r")(body)(x).sum())(x), [x, w])
    mode.assert_grads(got, want)


def test_a_random_op_writing_in_place_into_a_tensor_from_before_a_save_block_is_refused():
    x = torch.randn(4, 8, requires_grad=True)

    def body(x):
        h = x.cos()
        with remat.annotate("blk", P.SAVE):
            h.uniform_()
        return (h * x).sin()

    with pytest.raises(RuntimeError, match=r"^remat_fx: aten.uniform_.default in 'blk' \(region 'r'\) writes random "
                                           r"values in place into a tensor made before it: the recompute cannot draw "
                                           r"them again as the forward did\. Make the block RECOMPUTE, or draw into a "
                                           r"new tensor \(torch.rand_like\) inside it\.$"):
        remat.checkpoint("r")(body)(x)


@pytest.mark.parametrize("how", ["a region called twice", "a weight cast before the block", "a plain cast"])
def test_a_weight_autocast_cast_before_a_save_block_is_cast_again_in_its_recompute(how):
    """A helper's review: under autocast a weight cast before a SAVE block comes from autocast's cast
    cache in the forward (no cast in the block), while the recompute, its cast cache empty, casts it:
    the replay failed with PyTorch's "_to_copy ... not found in storage", or, where the recompute stopped
    early, took the block's next cached cast of the same shape for it (silently wrong gradients)."""
    torch.manual_seed(0)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(8, 8, requires_grad=True)
    y = torch.randn(8, 8, requires_grad=True)

    def twice(on):
        def block(h):
            with remat.annotate("mlp", P.SAVE) if on else contextlib.nullcontext():
                h2 = h @ w
            return h2.sin() * h

        h = x
        for i in range(2):
            h = remat.checkpoint(f"layer{i}")(block)(h) if on else block(h)
        return h.float().sum()

    def cast_before(on):
        def body(x, y):
            a = x.sin()
            with remat.annotate("blk", P.SAVE) if on else contextlib.nullcontext():
                h1 = a @ w  # w's cast is in autocast's cache: none here in the forward
                c = y.to(torch.bfloat16)  # another cast, of the same shape
            return h1.float() + c.float()  # nothing after saves a tensor: the recompute stops early

        z = x @ w
        out = remat.checkpoint("r")(body)(x, y) if on else body(x, y)
        return out.sum() + z.float().sum()

    def plain_cast(on):  # no autocast: a cast of a tensor the recompute makes anew (a review of b480cde)
        def body(x, y):
            a = x.sin()
            with remat.annotate("blk", P.SAVE) if on else contextlib.nullcontext():
                g = a.double() * y.double()
            return g

        return (remat.checkpoint("r")(body)(x, y) if on else body(x, y)).sum()

    step = {"a region called twice": twice, "a weight cast before the block": cast_before}.get(how, plain_cast)
    results = []
    for on in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(on)
        results.append(grads(loss, [x, y, w] if step is cast_before else [x, y] if step is plain_cast else [x, w]))
    assert_equal_grads(results[1], results[0])


@pytest.mark.parametrize("how", ["dropout in a SAVE native_op", "relu_ in a SAVE block"])
def test_a_second_backward_through_a_retained_graph_replays_in_place_answers_again(how):
    """A helper's review: the first recompute's answers to in-place ops (dropout's bernoulli_, a relu_)
    bumped the cached tensors' versions, and the second backward refused them as "modified in place"
    (the error that itself advises retain_graph=True)."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def body(x, on=True):
        if how.startswith("dropout"):
            a = (remat.native_op(torch.nn.functional.dropout, "drop", P.SAVE) if on
                 else torch.nn.functional.dropout)(x @ w, 0.5)
        else:
            with remat.annotate("blk", P.SAVE) if on else contextlib.nullcontext():
                a = (x @ w).relu_()
        return (a.sin() * x).sin()

    results = []
    for on in (False, True):
        torch.manual_seed(7)
        out = remat.checkpoint("r")(body)(x) if on else body(x, on=False)
        out.sum().backward(retain_graph=True)
        out.sum().backward()
        results.append([x.grad.clone(), w.grad.clone()])
        x.grad = w.grad = None
    assert_equal_grads(results[1], results[0])


def test_outside_region_is_plain_call():
    x = torch.randn(3, 3)
    assert torch.equal(remat.native_op(torch.mm, "mm", policy=P.SAVE)(x, x), x @ x)


def test_annotate_not_entered_or_used_as_a_decorator_is_said():
    """remat.annotate is a context manager: a bare call named nothing without a word (the block's ops
    ran unnamed, their policy unset), and a decorator failed with "'_EagerBlock' object is not
    callable". Each now says what to write."""
    import gc
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        remat.annotate("blk", P.SAVE)
        gc.collect()
        with remat.annotate("used", P.SAVE):
            torch.ones(2).sin()
        gc.collect()
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert said == ["remat.annotate('blk') was never entered, so it named nothing and set no policy: it is a "
                    "context manager, write `with remat.annotate('blk', ...):` around the ops it names"], said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TypeError, match=r"^remat.annotate\('blk'\) is a context manager, not a decorator: write "
                                            r"`with remat.annotate\('blk', \.\.\.\):` around the ops it names$"):
            remat.annotate("blk")(torch.sin)(torch.ones(2))
        gc.collect()
    assert not [w for w in caught if w.category is RuntimeWarning]  # said once, by the error
    # warnings made errors (-W error, filterwarnings=error): not swallowed, Python reports it from __del__
    import sys
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            remat.annotate("blk")
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert [type(u.exc_value) for u in unraisable] == [RuntimeWarning], unraisable
