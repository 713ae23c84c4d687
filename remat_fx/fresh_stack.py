"""Fresh stack: run a function on a new thread's empty Python frame stack, as if on the caller's.

CPython (3.11 on) keeps a thread's Python frames in chunks of 16 KiB. A call that does not fit in
the current chunk maps a new one, and its return unmaps it again at once. A torch.compile backend
runs a few hundred frames deep, so where the end of a chunk falls inside a hot loop of small calls,
every call crossing it maps and unmaps a chunk and faults its pages in again. Measured on the rerun
search of an 8-layer Llama's backward (passes/rerun.py, torch 2.13, Python 3.11): inside the
compile 556,000 ``mmap``/``munmap`` pairs of 16 KiB, 2 million page faults, 17 s of system time,
23.6 s in all; the same search on a new thread, 4.2 s, the time it takes outside the compile.

``on_fresh_stack`` runs the planning on a new thread and waits for it (nothing runs concurrently).
What the planning reads from the caller's context travels with it: its context variables
(``contextvars``), grad mode, the compile context (compile ids in logs) and the active fake mode,
through torch._guards' public helpers. The tracing context does not (``torch._guards.tracing``
would clean the shape environment's stacks on leaving; the partition reads none of it).
Exceptions reach the caller unchanged.
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

_local = threading.local()  # .fresh: this thread was started by on_fresh_stack


def on_fresh_stack(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread with the caller's torch context (see module doc)."""
    if getattr(_local, "fresh", False):  # already shallow: no second thread
        return fn(*args, **kwargs)
    from torch import _guards

    grad = torch.is_grad_enabled()
    compile_ctx = _guards.CompileContext.try_get()
    fake = _guards.active_fake_mode()
    box: dict = {}
    variables = contextvars.copy_context()

    def run():
        _local.fresh = True
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad))
                if compile_ctx is not None:
                    stack.enter_context(_guards.compile_context(compile_ctx))
                if fake is not None:
                    stack.enter_context(fake)
                box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: B036 -- handed to the caller as it was raised
            box["error"] = e

    thread = threading.Thread(target=variables.run, args=(run,), name="remat_fx-plan", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        error = box.pop("error")
        try:
            raise error
        finally:
            del error
    return box["value"]
