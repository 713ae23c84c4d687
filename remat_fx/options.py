"""Validated options of the ``remat`` torch.compile backend.

    torch.compile(model, backend="remat", options={"save": ["*.qkv"], "lower": "eager"})
"""
from __future__ import annotations

import difflib
import numbers
from dataclasses import dataclass, field
from typing import Optional, Tuple, Union

import torch
from torch._dynamo.exc import ShortenTraceback

from remat_fx import config
from remat_fx.memory_budget import Budget, parse_budget
from remat_fx.naming import NameGlobs
from remat_fx.roofline import COST_MODELS, Roofline, parse_roofline

LOWERINGS = ("inductor", "eager")
MONOTONE = ("auto", "nearest", "grid")  # and an int: the levels of the grid the envelope holds in turn ("nearest" = 1)
SOLVERS = ("ilp", "greedy")

_DOC = {
    "save": "glob(s) of node names (<module path>.<op>) to SAVE (never recompute), e.g. "
            "['model.layers.*.mlp.up_proj.mm']; a glob matching a module path selects its output: ['*.qkv']",
    "recompute": "glob(s) of node names or module paths to RECOMPUTE (must recompute)",
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
                  "minimum (budget 0) the reruns may take up to per-layer checkpointing's estimated step, and then "
                  "as long as it takes to hold the peak at or under budget 0.05's plan (with peak_slack 0: the least "
                  "peak they find); with a peak_budget they are not limited by time",
    "monotone": "with peak_slack > 0, how a memory_budget's estimated peak is held at or under larger budgets': "
                "an int k: against the plan of the nearest target above it on a grid of the feasible range, itself held "
                "under the next target above, and so on, k levels up ('nearest' = 1: that target's plan as it "
                "is); 'auto' (the default): 2 levels, and on up while the last level's first plan peaks over the "
                "next level's fastest plan; 'grid': every level up to the top, so that the estimated peak never rises "
                "as the budget falls across the grid's targets (planning takes 2-4x longer)",
    "blocks_alike": "plan repeated blocks (the ops of model.layers.0, model.layers.1, ...) alike, so that Inductor "
                    "compiles one set of kernels for them all, fewer to compile in the first step: a fraction "
                    "(True = 0.01) for every plan of a memory_budget or peak_budget, where that adds at most this "
                    "fraction of the forward's estimated time in recompute; 'final' (default) for a peak_budget "
                    "under the Inductor lowering: the target its search chose and the smallest one it tried over "
                    "the limit solved again alike (up to 0.05), the faster plan alike kept where it fits the "
                    "peak_budget and is not estimated slower; False: never (the fastest "
                    "plans, blocks may differ)",
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
    monotone: Union[int, str] = "auto"  # levels of the grid the envelope holds in turn (int), "auto" (2, more
    # past a bump: passes/peak.py monotone_peak), or "grid": all
    memory_budget: Optional[Budget] = None
    peak_budget: Optional[int] = None  # this graph's own cap in bytes (remat_fx/step.py sets it per graph)
    peak_fraction: Optional[float] = None  # a fraction peak_budget, resolved by this graph against its own range
    step_peak: object = None  # the whole-step peak_budget as given: a Budget, "auto" or None
    least_peak: bool = False  # not a user option: memory budget 0 gets the least peak the reruns find, at any
    # time (remat_fx/step.py's shared budget 0, the low end of whole-step limits), not one held in per-layer
    # checkpointing's time under budget 0.05's peak
    cost_model: str = "auto"
    roofline: "Optional[Roofline | tuple]" = None  # parse_roofline: sorted (key, value) pairs, or a Roofline
    solver: str = "ilp"
    solver_time_limit: float = 10.0
    blocks_alike: Union[str, float, None] = "final"  # "final", None (never) or the recompute (fraction of the forward's
    # estimated time) every budget solve may add to plan repeated blocks alike
    globs: NameGlobs = field(default=None, compare=False, repr=False)
    # the globs the tag pass has warned match nothing: once per compile, shared by the copies
    # (dataclasses.replace) the step planner re-plans the graph with
    warned: set = field(default_factory=set, compare=False, repr=False)

    def key(self) -> tuple:
        """What changes the compiled result (for Inductor's cache)."""
        return (self.save, self.recompute, self.lower, self.schedule, self.rerun, self.peak_slack, self.monotone,
                repr(self.memory_budget), self.peak_budget, self.peak_fraction, repr(self.step_peak), self.least_peak,
                self.cost_model, self.roofline, self.solver, self.solver_time_limit, self.blocks_alike)


class RematError(ShortenTraceback, ValueError):
    """What the user asked of remat cannot be done as asked: a bad option (OptionError) or a limit
    no plan meets (BudgetInfeasible, PeakInfeasible). A ValueError; also one of Dynamo's
    ShortenTraceback errors (the one private torch class this module uses, checked on torch 2.13
    and 2.14), which Dynamo re-raises as they are: under a plain ``torch.compile(...,
    backend="remat")`` the user reads remat's message first, not Dynamo's ``BackendCompilerFailed``
    wrapper around it."""

    def __init__(self, message: str):
        ShortenTraceback.__init__(self, message, first_useful_frame=None)

    def __reduce__(self):  # picklable (a distributed rank sends it to the others): message only
        return type(self), (str(self),)


class OptionError(RematError):
    """A bad ``remat`` option or ``remat_fx.config`` setting."""


OPTIONS = tuple(_DOC)


def valid_options() -> str:
    """One line per option: its name and what it takes."""
    return "\n".join(f"  {k}: {v}" for k, v in _DOC.items())


def did_you_mean(name, valid) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``valid`` to ``name``, else an empty string."""
    close = difflib.get_close_matches(name, list(valid), n=1) if isinstance(name, str) else []
    if not close and isinstance(name, str) and len(name) >= 3:  # 'peak': too short for difflib
        close = [v for v in valid if isinstance(v, str) and v.startswith(name)][:3]
        if close:
            return f" (did you mean {' or '.join(repr(c) for c in close)}?)"
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_names(names, valid, what: str) -> str:
    """``unknown option 'memory_budgt': did you mean 'memory_budget'?`` for one name, a list for several."""
    if len(names) == 1:
        hint = did_you_mean(names[0], valid)
        return f"unknown {what} {names[0]!r}" + (f": {hint[2:-1]}" if hint else "")
    return f"unknown {what}s " + ", ".join(f"{n!r}{did_you_mean(n, valid)}" for n in names)


# -- one check per option: the value as used, or an OptionError naming the option, the value and
# what is accepted. parse_options and remat_fx.config (on assignment) share them.

def _bool(value, what):
    if not isinstance(value, bool):
        raise OptionError(f"{what} must be True or False, got {value!r}")
    return value


def _one_of(choices):
    def check(value, what):
        if value not in choices:
            raise OptionError(f"{what} must be one of {list(choices)}, got {value!r}{did_you_mean(value, choices)}")
        return value
    return check


def _monotone(value, what):
    """'nearest' -> 1, an int >= 1 as it is, 'auto', 'grid'."""
    if value == "nearest":
        return 1
    if isinstance(value, str) and value in ("auto", "grid"):
        return value
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1:  # numpy ints too
        return int(value)
    raise OptionError(f"{what} must be an int >= 1 (the levels of the grid held in turn), 'auto' (the default: 2, "
                      f"more past a bump), 'nearest' (1) or 'grid', got {value!r}{did_you_mean(value, MONOTONE)}")


def monotone_levels(monotone) -> Optional[int]:
    """The levels of the grid option ``monotone`` holds in turn; None: all of them ('grid'); 'auto': 2,
    more where ``monotone_extends``."""
    return None if monotone == "grid" else 2 if monotone == "auto" else monotone


def monotone_extends(monotone) -> bool:
    """Option ``monotone`` goes on up the grid past a bump (passes/peak.py monotone_peak): 'auto'."""
    return monotone == "auto"


def _budget(value, what):
    try:
        return parse_budget(value, what)
    except ValueError as e:
        raise OptionError(str(e)) from None


def _rerun(value, what):
    if not (isinstance(value, bool) or (isinstance(value, str) and value == "auto")):  # not 0, 1 or 0.0
        raise OptionError(f"{what} must be 'auto', True or False, got {value!r}")
    return value


def _peak_slack(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise OptionError(f"{what} must be a fraction of step time in [0, 1), e.g. 0.01 (1%), got {value!r}")
    return float(value)


def _cuda_available() -> bool:  # peak_budget="auto" needs a device to read (tests stand one in)
    return torch.cuda.is_available()


def _peak_budget(value, what):
    if value == "auto":
        if not _cuda_available():
            raise OptionError(f"{what}='auto' reads the free memory of the CUDA device, and no CUDA device is "
                              f"available; give a size (peak_budget='2GiB') or a fraction (0.5)")
        return value
    try:
        budget = parse_budget(value, what, "0 = the least peak found, 1 = the peak without a budget")
    except ValueError as e:
        raise OptionError(f"{e}; or 'auto' (CUDA: the device's free memory)") from None
    if budget is not None and budget.nbytes == 0:  # it was refused as "1 B", after a search
        raise OptionError(f"{what}={value!r} is a size of 0 bytes, under any step's peak; for the least peak any "
                          f"plan reaches, give the fraction 0")
    return budget


def _blocks_alike(value, what):
    if value is True:
        return 0.01
    if value is False:
        return None
    if value == "final":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise OptionError(f"{what} must be True, False, 'final' or the recompute it may add as a fraction of the "
                          f"forward's estimated time in [0, 1), e.g. 0.01, got {value!r}")
    return float(value)


def _roofline(value, what):
    try:
        return parse_roofline(value)
    except ValueError as e:  # its message names the option already
        raise OptionError(str(e).replace("backend 'remat': ", "")) from None


def _time_limit(value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise OptionError(f"{what} must be a positive number of seconds, got {value!r}")
    return float(value)


def _globs(value, what):
    try:
        return NameGlobs(save=value).save  # the same checks for either kind
    except ValueError as e:
        raise OptionError(str(e).replace("option 'save'", what)) from None


_CHECKS = {
    "save": _globs, "recompute": _globs, "lower": _one_of(LOWERINGS), "report": _bool,
    "schedule": _bool, "rerun": _rerun, "peak_slack": _peak_slack, "memory_budget": _budget,
    "monotone": _monotone,
    "peak_budget": _peak_budget, "cost_model": _one_of(COST_MODELS), "roofline": _roofline,
    "solver": _one_of(SOLVERS), "solver_time_limit": _time_limit,
    "blocks_alike": _blocks_alike,
}
# the remat_fx.config settings: the defaults of these options
CONFIG = ("memory_budget", "cost_model", "solver", "solver_time_limit")


def check_option(name: str, value, what: Optional[str] = None):
    """``value`` checked as option ``name`` (and normalised), or an OptionError."""
    return _CHECKS[name](value, what or f"option {name!r}")


def check_config(name: str, value) -> None:
    """What ``remat_fx.config.<name> = value`` checks, at once: a setting that exists, a valid value."""
    if name not in CONFIG:
        raise AttributeError(f"remat_fx.config has no setting {name!r}{did_you_mean(name, CONFIG)}; its settings "
                             f"(the defaults of the backend options of the same names) are {', '.join(CONFIG)}")
    check_option(name, value, f"remat_fx.config.{name}")


def _check_grid(checked: dict, where: str) -> None:
    """Option monotone (given: 'grid' or a number of levels) changes how a memory_budget's plan is held
    under larger budgets' peaks: an OptionError where no such plan is made (it would do nothing). Not
    for a missing memory_budget: remat.fit gives the step's graphs theirs."""
    why = None
    if checked.get("peak_budget") is not None:
        why = "a peak_budget is set: the plan is the fastest under that peak instead"
    elif checked.get("peak_slack", BackendOptions.peak_slack) == 0:
        why = "peak_slack is 0: the budget's fastest plan is kept, with no envelope"
    if why:
        raise OptionError(f"{where}: option 'monotone'={checked['monotone']!r} holds a memory_budget's estimated "
                          f"peak under the larger budgets' peaks, and {why}; drop monotone, or give a memory_budget "
                          f"with peak_slack > 0")


def parse_options(options, where: str = "backend 'remat'") -> BackendOptions:
    """Check ``options`` and return them typed; an OptionError (a ValueError) names the option at
    fault and what it takes, and an unknown option the nearest valid one and the list."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise OptionError(f"{where}: options must be a dict, got {type(options).__name__}\n"
                          f"Valid options:\n{valid_options()}")
    unknown = sorted((k for k in options if k not in _DOC), key=str)
    if unknown:
        raise OptionError(f"{where}: {unknown_names(unknown, _DOC, 'option')}\nValid options:\n{valid_options()}")
    given = {name: options.get(name, config_default) for name, config_default in
             (("memory_budget", config.memory_budget), ("cost_model", config.cost_model),
              ("solver", config.solver), ("solver_time_limit", config.solver_time_limit))}
    given.update(options)
    checked = {}
    for name, value in given.items():
        try:
            checked[name] = check_option(name, value)
        except OptionError as e:
            raise OptionError(f"{where}: {e}") from None
    peak = checked.get("peak_budget")
    if "monotone" in checked:  # as given: 'grid', 'nearest' or a number of levels
        _check_grid(checked, where)
    if "peak_slack" in checked and peak is not None:
        raise OptionError(f"{where}: option 'peak_slack'={checked['peak_slack']!r} bounds the step time a "
                          f"memory_budget's plan may give up for a lower peak, and a peak_budget is set: the plan "
                          f"is the fastest under that peak, whatever its time; drop peak_slack")
    budget = None if peak is None or peak == "auto" else peak
    try:
        globs = NameGlobs(save=checked.get("save", ()), recompute=checked.get("recompute", ()))
    except ValueError as e:
        raise OptionError(f"{where}: {e}") from None
    return BackendOptions(save=checked.get("save", ()), recompute=checked.get("recompute", ()),
                          lower=checked.get("lower", "inductor"), report=checked.get("report", False),
                          schedule=checked.get("schedule", True), rerun=checked.get("rerun", "auto"),
                          peak_slack=checked.get("peak_slack", BackendOptions.peak_slack),
                          monotone=checked.get("monotone", BackendOptions.monotone),
                          memory_budget=checked["memory_budget"],
                          peak_budget=None if budget is None else budget.nbytes,
                          peak_fraction=None if budget is None else budget.fraction, step_peak=peak,
                          cost_model=checked["cost_model"], roofline=checked.get("roofline"),
                          solver=checked["solver"], solver_time_limit=checked["solver_time_limit"],
                          blocks_alike=checked.get("blocks_alike", BackendOptions.blocks_alike),
                          globs=globs)
