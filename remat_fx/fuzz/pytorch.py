"""The comparison: the same generated programs under PyTorch's own ``activation_memory_budget``.

A case is the program's ``reference`` forward (no remat call) compiled with ``torch.compile``
(default backend, Inductor) at a budget below 1 drawn from the seed, against the same compile at
budget 1 (PyTorch's plan without a budget) under the same seed: loss and gradients must agree at a
float tolerance. This is "equal to the no-recompute run under the same seed": a plan that
recomputes a dropout draws a fresh mask.
"""
from __future__ import annotations

import os
import random
import sys
import time
import warnings

import torch

from remat_fx.fuzz.oracle import Result, _Reference, _step, compare, load
from remat_fx.fuzz.program import Program, generate, render

_BUDGETS = (0.0, 0.1, 0.3, 0.5, 0.7)


def generate_for_pytorch(seed: int) -> Program:
    """Case ``seed``'s compiled program (dropout allowed: PyTorch's lowering is compared with itself)."""
    p = generate(seed, mode="compile", inductor_share=0.0)
    p.options = {"activation_memory_budget": random.Random(seed).choice(_BUDGETS)}
    return p


def check_pytorch(p: Program, backend: str = "inductor") -> Result:
    from torch._functorch import config as functorch_config

    t0 = time.perf_counter()
    source = render(p)
    module = load(source)
    try:
        inputs = module.inputs(p.seed)
        torch.manual_seed(p.seed)
        model = module.Model()
        runs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for budget in (1.0, p.options["activation_memory_budget"]):
                torch._dynamo.reset()
                try:
                    with functorch_config.patch(activation_memory_budget=budget):
                        runs.append(_step(model, torch.compile(_Reference(model), backend=backend), inputs, p.seed))
                except Exception as e:
                    kind = "invalid_program" if budget == 1.0 else "internal_error"
                    first = str(e).splitlines()[0][:200] if str(e) else ""
                    return Result(kind, f"budget {budget}: {type(e).__name__}: {first}",
                                  time.perf_counter() - t0)
        torch._dynamo.reset()
        bad = compare(runs[1], runs[0], exact=False, tol=1e-2 if p.has_autocast else 1e-4)
        result = Result(*bad) if bad else Result("pass")
        if bad and p.has_random:
            result.detail += " (the program has dropout)"
        result.seconds = time.perf_counter() - t0
        return result
    finally:
        os.unlink(module.__file__)
        sys.modules.pop(module.__name__, None)
