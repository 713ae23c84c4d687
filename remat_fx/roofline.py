"""The cost model's vocabulary, shared by the options (ground floor) and passes/cost.py: the cost
model names, a device's roofline (peak FLOP/s, memory bandwidth, per-op overhead), its defaults and
the ``roofline`` option's parsing."""
from __future__ import annotations

import difflib
import math
import numbers
from dataclasses import dataclass, fields
from typing import Optional

import torch

COST_MODELS = ("auto", "roofline", "flops", "profile")


@dataclass(frozen=True)
class Roofline:
    flops_per_s: float
    bytes_per_s: float
    op_overhead_s: float


# defaults: a few-core CPU with AVX2 fp32, and a datacenter GPU (bf16 tensor cores)
CPU = Roofline(flops_per_s=5e10, bytes_per_s=1e10, op_overhead_s=5e-6)
CUDA = Roofline(flops_per_s=4e14, bytes_per_s=2.5e12, op_overhead_s=5e-6)


def parse_roofline(value) -> "Optional[Roofline | tuple]":
    if value is None or isinstance(value, Roofline):
        return value
    if isinstance(value, tuple) and all(isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str)
                                        for kv in value):
        value = dict(value)  # parsed already (options parsed again)
    names = [f.name for f in fields(Roofline)]
    if not isinstance(value, dict) or set(value) - set(names):
        unknown = [k for k in value if k not in names] if isinstance(value, dict) else []
        close = difflib.get_close_matches(str(unknown[0]), names, n=1) if unknown else []
        hint = f" (unknown key {unknown[0]!r}: did you mean {close[0]!r}?)" if close else \
            f" (unknown key {unknown[0]!r})" if unknown else ""
        raise ValueError(f"backend 'remat': option 'roofline' must be a dict with keys from {names}, "
                         f"got {value!r}{hint}")
    for k, v in value.items():
        least = 0.0 if k == "op_overhead_s" else 1.0  # under 1 FLOP or byte a second: costs overflow to inf
        try:
            ok = not isinstance(v, bool) and isinstance(v, numbers.Real) and math.isfinite(float(v)) and v >= least
        except OverflowError:  # an int too large for a float
            ok = False
        if not ok:
            raise ValueError(f"backend 'remat': option 'roofline': {k} must be a finite number >= {least:g}, got {v!r}")
    # completed with the device's defaults once the device is known; a sorted tuple of (key, float), so
    # that the options hash (the step's record keys by them) and compare alike in any key order
    return tuple(sorted((k, float(v)) for k, v in value.items()))


def device_roofline(device: torch.device, override=None) -> Roofline:
    base = CUDA if device.type == "cuda" else CPU
    if override is None:
        return base
    if isinstance(override, Roofline):
        return override
    return Roofline(**{**base.__dict__, **{k: float(v) for k, v in dict(override).items()}})
