"""Validated options of the ``remat`` torch.compile backend.

    torch.compile(model, backend="remat", options={"save": ["*.qkv"], "lower": "eager"})
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

from remat_fx.naming import NameGlobs

LOWERINGS = ("inductor", "eager")

_DOC = {
    "save": "glob(s) of node names to SAVE (must save), e.g. ['*.qkv', 'model.layers.*.mlp.up_proj.mm']",
    "recompute": "glob(s) of node names to RECOMPUTE (must recompute)",
    "lower": "'inductor' (default: C++ on CPU, Triton on CUDA) or 'eager' (run the partitioned FX graphs)",
    "memory_budget": "reserved for the activation-memory-budget issue; not accepted yet",
    "report": "print the plan of every compiled graph (default False)",
}


@dataclass(frozen=True)
class BackendOptions:
    save: Tuple[str, ...] = ()
    recompute: Tuple[str, ...] = ()
    lower: str = "inductor"
    report: bool = False
    globs: NameGlobs = field(default=None, compare=False, repr=False)

    def key(self) -> tuple:
        """What changes the compiled result (for Inductor's cache)."""
        return (self.save, self.recompute, self.lower)


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
    if "memory_budget" in options:
        raise ValueError("backend 'remat': option 'memory_budget' is reserved for the activation memory "
                         "budget and not implemented yet; name what to save with 'save'/'recompute' globs "
                         f"or remat annotations instead. Valid options:\n{_valid()}")
    lower = options.get("lower", "inductor")
    if lower not in LOWERINGS:
        raise ValueError(f"backend 'remat': option 'lower' must be one of {list(LOWERINGS)}, got {lower!r}")
    report = options.get("report", False)
    if not isinstance(report, bool):
        raise ValueError(f"backend 'remat': option 'report' must be True or False, got {report!r}")
    globs = NameGlobs(save=options.get("save"), recompute=options.get("recompute"))
    return BackendOptions(save=globs.save, recompute=globs.recompute, lower=lower, report=report, globs=globs)
