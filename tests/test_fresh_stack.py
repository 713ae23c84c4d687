"""remat_fx/fresh_stack.py: planning runs on a new thread's frame stack with the caller's context."""
import contextvars
import threading

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from remat_fx.fresh_stack import on_fresh_stack
from remat_fx.options import OptionError


def _where():
    return threading.current_thread(), torch.is_grad_enabled(), torch._guards.active_fake_mode()


def test_runs_on_another_thread_with_the_callers_grad_mode_and_fake_mode():
    mode = FakeTensorMode()
    with torch.no_grad(), mode:
        thread, grad, fake = on_fresh_stack(_where)
        x = on_fresh_stack(torch.ones, 3, 4)
    assert thread is not threading.current_thread() and thread.name == "remat_fx-plan"
    assert grad is False and fake is mode
    assert type(x).__name__ == "FakeTensor" and x.shape == (3, 4)
    # and outside them, none of it leaks in
    thread, grad, fake = on_fresh_stack(_where)
    assert grad is True and fake is None
    assert torch._guards.active_fake_mode() is None


_VAR = contextvars.ContextVar("test_fresh_stack", default="unset")


def test_context_variables_travel_with_the_call_and_do_not_come_back():
    def read_and_set():
        seen = _VAR.get()
        _VAR.set("set on the planning thread")
        return seen

    token = _VAR.set("the caller's")
    try:
        assert on_fresh_stack(read_and_set) == "the caller's"
        assert _VAR.get() == "the caller's"
    finally:
        _VAR.reset(token)


def test_a_nested_call_stays_on_the_planning_thread():
    outer, inner = on_fresh_stack(lambda: (threading.current_thread(), on_fresh_stack(threading.current_thread)))
    assert inner is outer is not threading.current_thread()


def test_an_error_reaches_the_caller_as_raised():
    def fail(name):
        raise OptionError(f"bad option {name!r}")

    with pytest.raises(OptionError, match="bad option 'x'") as info:
        on_fresh_stack(fail, name="x")
    assert any(frame.name == "fail" for frame in info.traceback)  # the planning thread's frames kept
    with pytest.raises(KeyboardInterrupt):
        on_fresh_stack(lambda: (_ for _ in ()).throw(KeyboardInterrupt()))


def test_the_compiled_partition_runs_on_the_planning_thread(monkeypatch):
    import remat_fx.passes.partition as partition

    seen = []
    real = partition._partition

    def spy(*args):
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(partition, "_partition", spy)
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() * 2).cos().sum(), backend="remat", options={"lower": "eager"},
                      fullgraph=True)
    x = torch.randn(8, requires_grad=True)
    f(x).backward()
    ref = x.detach().clone().requires_grad_()
    (ref.sin() * 2).cos().sum().backward()
    assert seen == ["remat_fx-plan"]
    torch.testing.assert_close(x.grad, ref.grad)
