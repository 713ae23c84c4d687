"""Measured step peak: what one call of a step allocates at its highest point above its start.

CUDA: the caching allocator's statistics (``max_memory_allocated`` over the call minus
``memory_allocated`` before it). CPU: torch.profiler's allocation events, which see Inductor's
buffers as well as eager ops: the highest running sum of the bytes the call allocates less those
of its own allocations it frees. Frees of blocks allocated before the call are not credited: the
CPU allocator learns a block's size only while a profiler records memory, so such a free made no
event, or one with the stale size of an earlier block at the same address, and the measurement
depended on what ran before it (a 2-layer Llama's step that sets the gradients to None measured
24.2 MiB after an unprofiled step, 8.1 MiB after a profiled one; 24.2 now, every time). A step
that frees the last step's gradients therefore reads their bytes higher on the CPU than CUDA's
statistics, which credit the free. ``experimental_event_tree`` and ``_EventType`` are private
PyTorch APIs: this module is the one place that uses them (checked on torch 2.13 and 2.14).
"""
from __future__ import annotations

import gc
from typing import Callable, Dict, Optional

import torch


def measured_device(device=None, who: str = "remat_fx: the measured step peak") -> torch.device:
    """The device a step's peak is measured on: ``device`` (a torch.device or its name, "cpu" or a
    CUDA device that is available) or, for None, CUDA if available, else the CPU. A ValueError
    naming ``who`` otherwise, before anything runs."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError):
        found = None
    if found is None or found.type not in ("cpu", "cuda"):
        raise ValueError(f"{who}'s device must be 'cpu' or a CUDA device ('cuda', 'cuda:1', a torch.device), "
                         f"got {device!r}")
    if found.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{who}'s device is {device!r}, and no CUDA device is available; give device='cpu' or "
                         f"leave it out")
    if found.type == "cuda" and found.index is not None and found.index >= torch.cuda.device_count():
        raise ValueError(f"{who}'s device is {device!r}, and this process sees {torch.cuda.device_count()} CUDA "
                         f"device(s) (cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return found


def step_peak_bytes(step: Callable[[], object], device: Optional[torch.device] = None) -> int:
    """Incremental peak of one call of ``step()`` (e.g. a forward and backward), in bytes, on
    ``device`` (default: CUDA if available, else the CPU)."""
    device = measured_device(device)
    if device.type == "cuda":
        # garbage of earlier code collected now, not in the middle of the call, where its free would
        # lower the allocator's level below ``before`` and the peak read off it. On the CPU a free of
        # a block from before the call is not credited (module docstring), and a full collection late
        # in a long process costs 0.2-0.3 s a measurement (remat.fit measures each plan twice)
        gc.collect()
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # in time order; at the same time, in the order recorded (the tree in pre-order): a block freed
    # and its address allocated again in one tick must be seen in that order
    events, stack = [], list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    while stack:
        event = stack.pop()
        stack.extend(reversed(event.children))
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            fields = event.typed[1]
            events.append((event.start_time_ns, len(events), fields.alloc_size, fields.ptr))
    return _peak(events)


def _peak(events) -> int:
    """The highest running total of the allocation ``events`` ((time, order, bytes, address); bytes
    below 0: a free) above their start, crediting only frees of blocks they allocated, and a block's
    free when its address is allocated again without one (a block freed on a thread the profiler
    does not follow, e.g. gloo's, where FSDP's collectives drop their buffers, makes no event: the
    address is credited at the latest it can have been freed)."""
    live: Dict[int, int] = {}  # address -> bytes, of the blocks this call allocated
    level = peak = 0
    for _, _, size, ptr in sorted(events):
        if size > 0:
            level += size - live.get(ptr, 0)
            live[ptr] = size
        elif ptr in live:  # not a block allocated before the call (see the module's docstring)
            level -= live.pop(ptr)
        peak = max(peak, level)
    return peak
