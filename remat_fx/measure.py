"""Measured step peak: what one call of a step allocates at its highest point above its start.

CUDA: the caching allocator's statistics (``max_memory_allocated`` over the call minus
``memory_allocated`` before it). CPU: torch.profiler's memory timeline, which sees Inductor's
buffers as well as eager ops (highest point minus the first sample). ``MemoryProfileTimeline`` is
a private PyTorch API: this module is the one place that uses it (checked on torch 2.13 and 2.14).
"""
from __future__ import annotations

import gc
from typing import Callable, Optional

import torch


def step_peak_bytes(step: Callable[[], object], device: Optional[torch.device] = None) -> int:
    """Incremental peak of one call of ``step()`` (e.g. a forward and backward), in bytes, on
    ``device`` (default: CUDA if available, else the CPU)."""
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    if device.type != "cpu":
        raise ValueError(f"remat_fx: measuring the step peak on {device.type} is not supported (cuda, cpu)")
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    totals = [sum(by_category) for by_category in sizes]  # per timestamp, all categories
    return int(max(totals) - totals[0]) if totals else 0
