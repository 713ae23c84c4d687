"""OFFLOAD: where the tape keeps what OFFLOAD ops save.

An offloader is any object with ``pack(tensor) -> packed`` and
``unpack(packed) -> tensor``, and optionally ``prefetch(packed)``, which the
region calls for every packed tensor as soon as its backward begins, before the
recompute asks for them. Pick one per region (``remat.checkpoint(offloader=...)``)
or for a scope (``with remat.use_offloader(...)``); the default is
:class:`CPUOffloader`.
"""
from __future__ import annotations

import contextlib
import warnings
from contextvars import ContextVar
from typing import Any, Optional

import torch


class CPUOffloader:
    """Moves saved tensors to host memory and back.

    On CUDA the copy goes to pinned memory on a side stream (the forward does not
    wait for it), and ``prefetch`` starts the copy back as soon as the region's
    backward begins. Tensors already on the CPU are kept as they are.
    """

    def __init__(self, pin_memory: bool = True):
        self.pin_memory = pin_memory
        self._streams: dict = {}

    def _stream(self, device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def pack(self, t: torch.Tensor) -> Any:
        if t.device.type != "cuda":
            return t
        stream = self._stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host = torch.empty_like(t, device="cpu", pin_memory=self.pin_memory)  # keeps dense strides
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        t.record_stream(stream)  # keep the device buffer alive until the copy ends
        return _Packed(host, t.device, done)

    def prefetch(self, packed: Any) -> None:
        if isinstance(packed, _Packed) and packed.fetched is None:
            stream = self._stream(packed.device)
            with torch.cuda.stream(stream):
                stream.wait_event(packed.event)
                packed.fetched = packed.host.to(packed.device, non_blocking=True)
                packed.fetched_event = torch.cuda.Event()
                packed.fetched_event.record(stream)

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Packed):
            return packed
        self.prefetch(packed)
        torch.cuda.current_stream(packed.device).wait_event(packed.fetched_event)
        out, packed.fetched = packed.fetched, None  # a retained tape refetches from host next time
        out.record_stream(torch.cuda.current_stream(packed.device))
        return out


class _Packed:
    __slots__ = ("host", "device", "event", "fetched", "fetched_event")

    def __init__(self, host, device, event):
        self.host, self.device, self.event = host, device, event
        self.fetched = None
        self.fetched_event = None


_DEFAULT = CPUOffloader()
_CURRENT: ContextVar[Optional[Any]] = ContextVar("remat_fx_offloader", default=None)


def check_offloader(offloader) -> Any:
    if not (callable(getattr(offloader, "pack", None)) and callable(getattr(offloader, "unpack", None))):
        raise TypeError(
            f"remat_fx: an offloader needs pack(tensor) and unpack(packed) methods, got {offloader!r}"
        )
    return offloader


class use_offloader(contextlib.ContextDecorator):  # noqa: N801 - named as the function it replaced
    """Use ``offloader`` for OFFLOAD ops in checkpoint regions entered inside this block:
    ``with remat.use_offloader(offloader): ...``, or around a function (``@remat.use_offloader(off)``).
    The offloader is checked when it is named; a scope made and never entered nor used to decorate
    (the call without ``with``, which sets nothing) warns when it is dropped."""

    def __init__(self, offloader):
        self.offloader = check_offloader(offloader)
        self._tokens: list = []
        self._entered = False

    def __call__(self, func):
        self._entered = True  # a decorator: entered at each call of ``func``
        return super().__call__(func)

    def __enter__(self):
        self._entered = True
        self._tokens.append(_CURRENT.set(self.offloader))
        return self.offloader

    def __exit__(self, *exc) -> bool:
        _CURRENT.reset(self._tokens.pop())
        return False

    def __del__(self):
        if not getattr(self, "_entered", True):
            warnings.warn(f"remat.use_offloader({self.offloader!r}) was never entered, so it set nothing: it is a "
                          f"scope, write `with remat.use_offloader(...):` around the regions that use it (or give "
                          f"one region remat.checkpoint(..., offloader=...))", RuntimeWarning, stacklevel=2)


def resolve_offloader(option) -> Any:
    """Region option > innermost ``use_offloader`` > the default CPUOffloader."""
    if option is not None:
        return check_offloader(option)
    current = _CURRENT.get()
    return current if current is not None else _DEFAULT
