"""Host-memory measurement helpers for the CPU examples and benchmarks.

Two independent views of "activation bytes held from forward to backward":

* :func:`heap_bytes` asks glibc how many bytes the process currently has
  allocated through ``malloc`` (``mallinfo2()``: ``uordblks``, the bytes in use
  in the main heap and arenas, plus ``hblkhd``, the bytes in ``mmap``-ed chunks,
  which is where large tensors land).  PyTorch's CPU allocator is a thin layer
  over ``posix_memalign``/``free`` with no caching, so the difference of two
  readings taken around a forward pass is the memory the forward left behind:
  everything the autograd graph, PyTorch's checkpoint and remat's tapes keep
  for backward, plus the (tiny) outputs.  Python objects live mostly in
  pymalloc arenas, which are ``mmap``-ed directly and are not counted.
  Linux/glibc >= 2.33 only.

* :class:`SavedTensorBytes` is a ``torch.autograd.graph.saved_tensors_hooks``
  context that counts the unique storages packed into the autograd graph
  (parameters excluded).  It sees only what autograd saves *outside* an inner
  non-reentrant checkpoint region (PyTorch's checkpoint installs its own hooks
  inside the region and those take precedence), i.e. the region inputs that
  the checkpoint saves plus everything outside the regions.  It does not see
  what remat's named tape holds, which is what :func:`remat_fx.memory_report`
  reports.

Typical use::

    gc.collect()
    before = heap_bytes()
    loss = model(idx, targets)
    gc.collect()
    held = heap_bytes() - before
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
from typing import Iterable, Optional

import torch

__all__ = ["heap_bytes", "held_after", "SavedTensorBytes", "fmt_bytes"]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena",     # non-mmapped space allocated (bytes)
        "ordblks",   # number of free chunks
        "smblks",    # number of free fastbin blocks
        "hblks",     # number of mmapped regions
        "hblkhd",    # space allocated in mmapped regions (bytes)
        "usmblks",   # unused
        "fsmblks",   # space in freed fastbin blocks (bytes)
        "uordblks",  # total allocated space (bytes)
        "fordblks",  # total free space (bytes)
        "keepcost",  # top-most releasable space (bytes)
    )]


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
try:
    _mallinfo2 = _libc.mallinfo2
except AttributeError as e:  # glibc < 2.33 or not glibc
    raise ImportError("benchmarks.memory needs glibc >= 2.33 (mallinfo2)") from e
_mallinfo2.restype = _Mallinfo2
_mallinfo2.argtypes = []


def heap_bytes() -> int:
    """Bytes currently allocated through malloc by this process: ``uordblks + hblkhd``."""
    m = _mallinfo2()
    return int(m.uordblks) + int(m.hblkhd)


def held_after(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and return ``(result, bytes it left allocated)``.

    ``gc.collect()`` runs before both readings so that garbage from earlier
    steps (e.g. reference cycles through autograd graphs) is not counted.
    """
    gc.collect()
    before = heap_bytes()
    out = fn(*args, **kwargs)
    gc.collect()
    return out, heap_bytes() - before


class SavedTensorBytes(torch.autograd.graph.saved_tensors_hooks):
    """Count the unique storages autograd packs while this context is active.

    ``exclude`` (e.g. ``model.parameters()``) names tensors whose storages are not
    counted; leaves that require grad (and views of them) are never counted.
    The hooks keep the tensors exactly as autograd would (pack returns the tensor
    itself), so they change neither lifetimes nor memory.
    """

    def __init__(self, exclude: Optional[Iterable[torch.Tensor]] = None):
        self.excluded = {t.untyped_storage().data_ptr() for t in (exclude or ())}
        self.storages: dict = {}  # (device, data_ptr) -> nbytes
        self.packed = 0

        def pack(t: torch.Tensor):
            self.packed += 1
            base = t._base if t._base is not None else t
            if base.is_leaf and base.requires_grad:
                return t
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
                return t
            ptr = st.data_ptr()
            if ptr and ptr not in self.excluded:
                self.storages[(str(t.device), ptr)] = st.nbytes()
            return t

        super().__init__(pack, lambda t: t)

    def __enter__(self) -> "SavedTensorBytes":
        super().__enter__()
        return self

    @property
    def total_bytes(self) -> int:
        return sum(self.storages.values())


def fmt_bytes(n: Optional[float]) -> str:
    """``12.34 MiB`` style, or ``-`` for None."""
    if n is None:
        return "-"
    return f"{n / 2**20:.2f} MiB"


def step_peak_bytes(step) -> int:
    """Incremental peak of one call of ``step`` on the CPU (remat_fx.measure: the profiler's
    allocation events, which see Inductor's buffers as well as eager ops)."""
    from remat_fx.measure import step_peak_bytes as measured

    return measured(step, torch.device("cpu"))


def measure_heap(model, step) -> int:
    """mallinfo2 bytes the forward leaves allocated (gc before both readings); then backward."""
    model.zero_grad(set_to_none=True)
    loss, heap = held_after(step)
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    gc.collect()
    return heap


def measure_hooks(model, step) -> int:
    """Unique non-parameter storages packed by saved_tensors_hooks during the forward."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    with SavedTensorBytes(exclude=model.parameters()) as seen:
        loss = step()
    loss.backward()
    del loss
    model.zero_grad(set_to_none=True)
    gc.collect()
    return seen.total_bytes
