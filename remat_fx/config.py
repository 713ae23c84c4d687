"""Defaults for the ``remat`` backend, used where ``options`` do not say otherwise.

    import remat_fx
    remat_fx.config.memory_budget = "2GiB"     # every graph compiled with backend="remat"

Options passed to ``torch.compile(..., options=...)`` win over these.
"""
from __future__ import annotations

memory_budget = None  # None: no budget (the tags and the min-cut decide), else as the option
cost_model = "auto"  # "auto" | "roofline" | "flops" | "profile"
solver = "ilp"  # "ilp" (exact, scipy's HiGHS) | "greedy"
solver_time_limit = 10.0  # seconds; past it the ILP's best plan so far, else the greedy one
