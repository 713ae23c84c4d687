"""remat_fx: explicit, named activation rematerialization for PyTorch.

    import remat_fx as remat
    y = remat.checkpoint()(block)(x)                          # eager runtime
    compiled = remat.compile(model, memory_budget=0.3)        # compiler mode
"""
from remat_fx import config
from remat_fx.annotate import annotate
from remat_fx.backend import backend, compile
from remat_fx.measured_fit import FitResult, fit
from remat_fx.options import OptionError, RematError
from remat_fx.pareto import ParetoPoint, pareto
from remat_fx.passes.budget import BudgetInfeasible
from remat_fx.passes.peak import PeakInfeasible
from remat_fx.passes.plan import BudgetReport, Plan, SavedActivation, last_plan
from remat_fx.policy import CheckpointPolicy
from remat_fx.runtime.checkpoint import checkpoint
from remat_fx.runtime.handle import RematHandle, get_handle
from remat_fx.runtime.offload import CPUOffloader, use_offloader
from remat_fx.runtime.ops import auto_forward, native_op, op
from remat_fx.runtime.placeholder import Placeholder
from remat_fx.runtime.report import MemoryReport, SavedEntry, memory_report
from remat_fx.step import StepReport, step_report

__all__ = [
    "BudgetInfeasible",
    "BudgetReport",
    "FitResult",
    "OptionError",
    "PeakInfeasible",
    "RematError",
    "StepReport",
    "fit",
    "step_report",
    "ParetoPoint",
    "Plan",
    "SavedActivation",
    "annotate",
    "backend",
    "compile",
    "config",
    "pareto",
    "last_plan",
    "CPUOffloader",
    "CheckpointPolicy",
    "MemoryReport",
    "Placeholder",
    "RematHandle",
    "SavedEntry",
    "auto_forward",
    "checkpoint",
    "get_handle",
    "memory_report",
    "native_op",
    "op",
    "use_offloader",
]
__version__ = "0.1.0"
