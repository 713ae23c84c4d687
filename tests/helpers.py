"""Remat-aware autograd Functions that count their runs, shared by the tests."""
from __future__ import annotations

import collections

import torch

import remat_fx as remat

P = remat.CheckpointPolicy
RUNS: collections.Counter = collections.Counter()  # op name -> forward bodies run
EVENTS: list = []  # ("fw"|"bw", op name) in execution order


def _log(counter_key=None, event=None):
    """Count a run / log an event in eager mode (traced graphs cannot mutate Python lists)."""
    if torch.compiler.is_compiling():
        return
    if counter_key is not None:
        RUNS[counter_key] += 1
    if event is not None:
        EVENTS.append(event)


def reset():
    RUNS.clear()
    EVENTS.clear()


class Linear(torch.autograd.Function):
    """y = x @ w, written with the explicit handle protocol."""

    @staticmethod
    def forward(ctx, x, w, name, policy):
        handle = remat.get_handle(ctx, name, policy)
        if (ret := handle.maybe_load_saved()) is not None:
            return ret
        x = handle.save_or_load_inputs(x)
        _log(name, ("fw", name))
        out = x @ w
        handle.save_for_backward({"x": x, "w": w})
        return handle.record_outputs(out)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        _log(event=("bw", "linear"))
        return grad @ w.t(), x.t() @ grad, None, None


class AutoLinear(torch.autograd.Function):
    """y = x @ w through remat.auto_forward: names reach the compiler too (via remat.op)."""

    @staticmethod
    @remat.auto_forward("x", "w")
    def forward(ctx, x, w):
        y = x @ w
        ctx.save_for_backward(x, w)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), x.t() @ grad


class Exp(torch.autograd.Function):
    """y = exp(x), saves its output; used through remat.op + auto_forward."""

    @staticmethod
    @remat.auto_forward("y")
    def forward(ctx, x):
        _log("exp")
        y = torch.exp(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y


class Split2(torch.autograd.Function):
    """Two outputs (x*2, x*3), saves nothing: checks the tuple schema."""

    @staticmethod
    @remat.auto_forward()
    def forward(ctx, x):
        _log("split2")
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * 2 + g2 * 3


class Logged(torch.autograd.Function):
    """Identity that logs its backward (saves nothing), to observe backward order."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        _log(event=("bw", "logged"))
        return grad


def linear(x, w, name, policy=P.RECOMPUTE):
    return Linear.apply(x, w, name, policy)


def alinear(x, w, name, policy=P.RECOMPUTE):
    return remat.op(AutoLinear.apply, name, policy=policy)(x, w)


def exp(x, name, policy=P.RECOMPUTE):
    return remat.op(Exp.apply, name, policy=policy)(x)


def grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


def assert_equal_grads(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"gradient {i} differs: max abs diff {(a - b).abs().max().item()}"
