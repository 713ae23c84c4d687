"""PyTorch's own ``activation_memory_budget`` bound to one compiled function.

The budget is a global knob (``torch._functorch.config``) that the min-cut partitioner reads when
a graph is compiled. Setting it around a variant's first call is not enough in a benchmark that
compiles several variants and times them afterwards: ``torch.compile(fn)``'s Inductor wrappers
compare equal to each other, so Dynamo lets a later variant run a graph an earlier one compiled,
and after ``torch._dynamo.reset()`` a variant recompiles outside the budget's scope, at the
default budget. Both happened in benchmarks/llama_depth.py: every PyTorch budget was timed as
budget 1's graph (its step time flat at 0.88-0.90 x eager from budget 1 to 0).

``backend(budget)`` is a Dynamo backend of its own (never equal to another) that runs Inductor's
``compile_fx`` with the budget set, and the AOTAutograd cache off (a hit would skip the partition),
whenever Dynamo compiles with it.
"""
from __future__ import annotations

import torch


def backend(budget: float):
    """A backend for ``torch.compile(fn, backend=backend(b))``: Inductor under PyTorch's
    ``activation_memory_budget = b``."""
    budget = float(budget)

    def inductor_at_budget(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        with torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False):
            return compile_fx(gm, example_inputs)

    inductor_at_budget.__name__ = f"inductor_at_budget_{budget:g}"
    return inductor_at_budget
