"""The ``remat`` torch.compile backend: capture -> tag -> partition -> lower, one pass a file.

    torch.compile(model, backend="remat", options={"save": ["*.qkv"], "lower": "eager"})
    remat_fx.compile(model, save=["*.qkv"], lower="eager")   # the same, options checked here

Registered under the ``torch_dynamo_backends`` entry point, so ``backend="remat"``
works without importing remat_fx first.
"""
from __future__ import annotations

import inspect
import warnings

import torch

from remat_fx.options import OPTIONS, OptionError, parse_options, unknown_names, valid_options
from remat_fx.step import compile_graph


def backend(gm, example_inputs, options=None, mode=None):
    """A torch.compile backend; ``options`` as in :func:`remat_fx.options.parse_options`. Each graph
    is planned as part of its training step (remat_fx/step.py). ``mode`` (torch.compile's, which
    Dynamo hands a backend named by string) is refused: see _refuse_mode."""
    try:
        if mode is not None and mode != "default":
            raise OptionError(_refuse_mode(mode))
        parsed = parse_options(options)
    except OptionError as e:
        # Dynamo re-raises it as it is (not as BackendCompilerFailed), its traceback cut to start here
        e.first_useful_frame = inspect.currentframe()
        raise
    _warn_torch_budget(parsed)
    return compile_graph(gm, example_inputs, parsed)


def _refuse_mode(mode) -> str:
    """torch.compile(model, backend="remat", mode=...) failed at the first call with a TypeError from
    inside Dynamo ("backend() got an unexpected keyword argument 'mode'")."""
    return (f"remat_fx: torch.compile(..., backend='remat', mode={mode!r}): remat's backend takes no mode (a "
            f"mode is a set of Inductor settings). Its Inductor lowering reads torch._inductor.config when a graph "
            f"compiles: set there what the mode would (torch._inductor.list_mode_options({mode!r}) lists them), or "
            f"leave mode out.")


def _warn_torch_budget(parsed) -> None:
    """PyTorch's own budget knob set, and no budget in remat's options: remat plans the graph without
    a budget (its min-cut runs with PyTorch's knob at 1.0), which a user coming from PyTorch would
    not expect. Said once per graph compiled, where the compile reads it."""
    theirs = torch._functorch.config.activation_memory_budget
    if theirs != 1.0 and parsed.memory_budget is None and parsed.step_peak is None and parsed.peak_budget is None \
            and parsed.peak_fraction is None:
        warnings.warn(f"remat_fx: torch._functorch.config.activation_memory_budget is {theirs!r}, and backend "
                      f"'remat' does not read it: this graph is planned without a memory budget. Pass "
                      f"options={{'memory_budget': {theirs!r}}} to torch.compile (the same meaning: a fraction of "
                      f"the saved bytes between the least and the most), or set the knob back to 1.0.",
                      UserWarning, stacklevel=2)


# torch.compile's own keywords that remat_fx.compile passes on; every other keyword is a remat option
COMPILE_KWARGS = ("fullgraph", "dynamic", "disable")


def compile(model=None, *, fullgraph: bool = False, dynamic=None, disable: bool = False, **options):
    """``torch.compile(model, backend="remat", options=options, fullgraph=..., dynamic=..., disable=...)``,
    with ``options`` checked here, where they are written, rather than at the first call:

        compiled = remat_fx.compile(model, memory_budget=0.3, fullgraph=True)

    ``fullgraph``, ``dynamic`` and ``disable`` are torch.compile's; every other keyword is a backend
    option (docs/compiler.md). A bad one raises an OptionError (a ValueError) at once."""
    for name, why in (("mode", "mode= picks Inductor's own settings, and torch.compile does not take it together "
                               "with a backend's options; remat's lowering is the option lower='inductor' "
                               "(the default) or lower='eager'"),
                      ("backend", "the backend is 'remat'; for another one call torch.compile"),
                      ("options", "pass the options as keywords: remat_fx.compile(model, memory_budget=0.3)")):
        if name in options:
            raise OptionError(f"remat_fx.compile: {why}")
    unknown = sorted(k for k in options if k not in OPTIONS)
    if unknown:
        raise OptionError(f"remat_fx.compile: {unknown_names(unknown, (*OPTIONS, *COMPILE_KWARGS), 'keyword')}\n"
                          f"torch.compile's keywords: {', '.join(COMPILE_KWARGS)}; the backend's options:\n"
                          f"{valid_options()}")
    parse_options(options, where="remat_fx.compile")
    return torch.compile(model, backend="remat", options=dict(options), fullgraph=fullgraph, dynamic=dynamic,
                         disable=disable)
