"""Defaults for the ``remat`` backend, used where ``options`` do not say otherwise.

    import remat_fx
    remat_fx.config.memory_budget = "2GiB"     # every graph compiled with backend="remat"

Options passed to ``torch.compile(..., options=...)`` win over these. A setting is checked when it
is assigned: an unknown name raises an AttributeError naming the nearest setting, a bad value an
OptionError (a ValueError) saying what the setting takes.
"""
from __future__ import annotations

import sys
import types

memory_budget = None  # None: no budget (the tags and the min-cut decide), else as the option
cost_model = "auto"  # "auto" | "roofline" | "flops" | "profile"
solver = "ilp"  # "ilp" (exact, scipy's HiGHS) | "greedy"
solver_time_limit = 10.0  # seconds; past it the ILP's best plan so far, else the greedy one


class _Config(types.ModuleType):
    """This module, checking every assignment with the backend's own option checks."""

    def __setattr__(self, name: str, value) -> None:
        if not name.startswith("_"):
            from remat_fx.options import check_config  # options reads these defaults: imported late

            check_config(name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Config
