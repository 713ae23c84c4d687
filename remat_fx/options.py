"""Validated options of the ``remat`` torch.compile backend.

    torch.compile(model, backend="remat", options={"save": ["*.qkv"], "lower": "eager"})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from remat_fx import config
from remat_fx.memory_budget import Budget, parse_budget
from remat_fx.naming import NameGlobs
from remat_fx.passes.cost import COST_MODELS, Roofline, parse_roofline

LOWERINGS = ("inductor", "eager")
SOLVERS = ("ilp", "greedy")

_DOC = {
    "save": "glob(s) of node names to SAVE (must save), e.g. ['*.qkv', 'model.layers.*.mlp.up_proj.mm']",
    "recompute": "glob(s) of node names to RECOMPUTE (must recompute)",
    "lower": "'inductor' (default: C++ on CPU, Triton on CUDA) or 'eager' (run the partitioned FX graphs)",
    "memory_budget": "fraction in [0, 1], size ('512MiB', '1.5GB', '50%') or int bytes: saved activation "
                     "bytes allowed (default remat_fx.config.memory_budget, None = no budget)",
    "peak_budget": "the estimated peak of the whole training step allowed (every graph of the step): a size "
                   "('60MiB') or int bytes, a fraction in [0, 1] (0 = the least peak found, 1 = the peak without a "
                   "budget), or 'auto' (CUDA: what the device has free, less 10%); the fastest plan under it is "
                   "searched (with memory_budget, within that too)",
    "cost_model": "recompute cost estimate for the budget solver: 'auto' (roofline, pointwise fused under "
                  "Inductor), 'roofline', 'flops' or 'profile' (measured op times)",
    "roofline": "override the device roofline: {'flops_per_s': ..., 'bytes_per_s': ..., 'op_overhead_s': ...}",
    "solver": "'ilp' (exact 0-1 program, HiGHS; default) or 'greedy'",
    "solver_time_limit": "seconds for the ILP before falling back to its best plan so far (default 10)",
    "report": "print the plan of every compiled graph (default False)",
    "schedule": "move each recomputed node to just before its first backward use (default True)",
    "rerun": "recompute a value a second time in backward where holding it would set the step's peak: "
             "'auto' (default: with a memory_budget or peak_budget), True or False",
    "peak_slack": "with a memory_budget above its feasible minimum, the fraction of the fastest plan's "
                  "estimated step time that may be spent to lower the step's estimated peak: by reruns and by "
                  "saving less than the budget allows (default 0.03; 0 = the fastest plan, no reruns). At the "
                  "minimum (budget 0) and with a peak_budget the reruns are not limited by time",
}


@dataclass(frozen=True)
class BackendOptions:
    save: Tuple[str, ...] = ()
    recompute: Tuple[str, ...] = ()
    lower: str = "inductor"
    report: bool = False
    schedule: bool = True
    rerun: object = "auto"  # "auto", True or False
    peak_slack: float = 0.03
    memory_budget: Optional[Budget] = None
    peak_budget: Optional[int] = None  # this graph's own cap in bytes (remat_fx/step.py sets it per graph)
    peak_fraction: Optional[float] = None  # a fraction peak_budget, resolved by this graph against its own range
    step_peak: object = None  # the whole-step peak_budget as given: a Budget, "auto" or None
    cost_model: str = "auto"
    roofline: Optional[Roofline] = None
    solver: str = "ilp"
    solver_time_limit: float = 10.0
    globs: NameGlobs = field(default=None, compare=False, repr=False)

    def key(self) -> tuple:
        """What changes the compiled result (for Inductor's cache)."""
        return (self.save, self.recompute, self.lower, self.schedule, self.rerun, self.peak_slack,
                repr(self.memory_budget), self.peak_budget, self.peak_fraction, repr(self.step_peak),
                self.cost_model, self.roofline, self.solver, self.solver_time_limit)


def _valid() -> str:
    return "\n".join(f"  {k}: {v}" for k, v in _DOC.items())


def parse_options(options) -> BackendOptions:
    """Check ``options`` and return them typed; a ValueError lists the valid ones."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ValueError(f"backend 'remat': options must be a dict, got {type(options).__name__}. "
                         f"Valid options:\n{_valid()}")
    unknown = sorted(set(options) - set(_DOC))
    if unknown:
        raise ValueError(f"backend 'remat': unknown option(s) {unknown}. Valid options:\n{_valid()}")
    lower = options.get("lower", "inductor")
    if lower not in LOWERINGS:
        raise ValueError(f"backend 'remat': option 'lower' must be one of {list(LOWERINGS)}, got {lower!r}")
    report = options.get("report", False)
    if not isinstance(report, bool):
        raise ValueError(f"backend 'remat': option 'report' must be True or False, got {report!r}")
    schedule = options.get("schedule", True)
    if not isinstance(schedule, bool):
        raise ValueError(f"backend 'remat': option 'schedule' must be True or False, got {schedule!r}")
    rerun = options.get("rerun", "auto")
    if rerun not in ("auto", True, False) or (rerun == 1 and not isinstance(rerun, bool)):
        raise ValueError(f"backend 'remat': option 'rerun' must be 'auto', True or False, got {rerun!r}")
    slack = options.get("peak_slack", BackendOptions.peak_slack)
    if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack < 1:
        raise ValueError(f"backend 'remat': option 'peak_slack' must be a fraction of step time in [0, 1), e.g. "
                         f"0.01 (1%), got {slack!r}")
    try:
        budget = parse_budget(options.get("memory_budget", config.memory_budget), "option 'memory_budget'")
    except ValueError as e:
        raise ValueError(f"backend 'remat': {e}") from None
    peak = options.get("peak_budget")
    if peak == "auto" and not torch.cuda.is_available():
        raise ValueError("backend 'remat': option 'peak_budget'='auto' reads the free memory of the CUDA device, and "
                         "no CUDA device is available; give a size (peak_budget='2GiB') or a fraction (0.5)")
    if peak != "auto":
        try:
            peak = parse_budget(peak, "option 'peak_budget'")
        except ValueError as e:
            raise ValueError(f"backend 'remat': {e}; or 'auto' (CUDA: the device's free memory)") from None
    cost_model = options.get("cost_model", config.cost_model)
    if cost_model not in COST_MODELS:
        raise ValueError(f"backend 'remat': option 'cost_model' must be one of {list(COST_MODELS)}, got {cost_model!r}")
    roofline = parse_roofline(options.get("roofline"))
    solver = options.get("solver", config.solver)
    if solver not in SOLVERS:
        raise ValueError(f"backend 'remat': option 'solver' must be one of {list(SOLVERS)}, got {solver!r}")
    limit = options.get("solver_time_limit", config.solver_time_limit)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"backend 'remat': option 'solver_time_limit' must be a positive number of seconds, "
                         f"got {limit!r}")
    globs = NameGlobs(save=options.get("save"), recompute=options.get("recompute"))
    return BackendOptions(save=globs.save, recompute=globs.recompute, lower=lower, report=report,
                          schedule=schedule, rerun=rerun, peak_slack=float(slack), memory_budget=budget,
                          peak_budget=None if peak is None or peak == "auto" else peak.nbytes,
                          peak_fraction=None if peak is None or peak == "auto" else peak.fraction, step_peak=peak,
                          cost_model=cost_model, roofline=roofline, solver=solver,
                          solver_time_limit=float(limit), globs=globs)
