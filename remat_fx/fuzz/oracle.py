"""The oracle: run one generated case with remat and without checkpointing, and compare.

A case passes when its loss and every parameter and input gradient equal the reference's:

- eager runtime (``remat.checkpoint`` regions on the named tape): ``torch.equal`` against
  ``Model.reference`` (the same ops, no checkpointing, no remat call) under the same seed, so
  dropout must draw the forward's masks in recompute (the runtime promises bitwise equality: it
  replays RNG and autocast state and reruns the same ops);
- compiler mode, eager lowering: against ``Model.reference`` compiled with PyTorch's
  ``aot_eager_decomp_partition`` (the same decompositions, no recompute of random ops) under the
  same seed, at a tight tolerance (a recompute redoes the same op on the same inputs, but the
  partition can order float math differently), or else against the eager reference at the same
  tolerance (a region with a graph break in it runs on the eager tape, with eager's ops);
- compiler mode, Inductor lowering (no dropout: Inductor draws its own random numbers): against the
  eager reference at a float tolerance;

and, in compiler mode, no plan of the step saves more than its memory budget's target (per graph,
per annotated region, and a byte budget over the whole step), and with a ``peak_budget`` the step's
estimated peak is within it. An exception is a pass only when it is remat's documented answer to
the options drawn (``BudgetInfeasible`` for a byte budget below the feasible minimum,
``PeakInfeasible`` for a peak budget below the least peak), with its documented text, raised as is
or as the cause of Dynamo's ``BackendCompilerFailed``; anything else is a failure.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Dict, Optional, Tuple

import torch

from remat_fx.fuzz.program import Program, render

# failure kinds (a case that passes has kind "pass" or "expected_error")
KINDS = ("wrong_loss", "wrong_grad", "budget_exceeded", "peak_exceeded", "internal_error", "remat_error",
         "undocumented_text", "invalid_program")

_TOL = {  # relative to the reference's largest magnitude (max |a - b| <= tol * max(max |b|, 1))
    ("eager", False): 1e-5, ("eager", True): 1e-2,        # compiled, eager lowering: fp32 / with bf16 regions
    ("inductor", False): 1e-3, ("inductor", True): 1e-1,  # Inductor against eager
}


@dataclasses.dataclass
class Result:
    kind: str  # "pass", "expected_error", or one of KINDS
    detail: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind in ("pass", "expected_error")

    def __str__(self) -> str:
        return f"{self.kind}" + (f": {self.detail}" if self.detail else "") + f" ({self.seconds:.1f} s)"


_LOADED = [0]


def load(source: str):
    """Import ``source`` as a module, from a file, so that Dynamo and tracebacks see its lines; the
    caller removes the file (``module.__file__``) when done."""
    fd, path = tempfile.mkstemp(prefix="remat_fuzz_", suffix=".py")
    with os.fdopen(fd, "w") as f:
        f.write(source)
    _LOADED[0] += 1
    name = f"remat_fuzz_case_{_LOADED[0]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _step(model: torch.nn.Module, fn: Callable, inputs, seed: int):
    """One training step: (loss, {name: gradient}), gradients of parameters and the two inputs."""
    v0, v1, *ints = inputs
    v0, v1 = v0.clone().requires_grad_(), v1.clone().requires_grad_()
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(seed)
    loss = fn(v0, v1, *ints)
    loss.backward()
    grads = {f"param {n}": p.grad for n, p in model.named_parameters()}
    grads.update({"input v0": v0.grad, "input v1": v1.grad})
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


class _Reference(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model.reference(*args)


def compare(got, want, *, exact: bool, tol: float = 0.0) -> Optional[Tuple[str, str]]:
    """None when equal; else (kind, what differs)."""
    (loss, grads), (ref_loss, ref_grads) = got, want

    def differs(a, b):
        if a is None and b is None:
            return None
        a = torch.zeros_like(b) if a is None else a
        b = torch.zeros_like(a) if b is None else b
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{tuple(a.shape)} {a.dtype} against {tuple(b.shape)} {b.dtype}"
        if exact:
            if torch.equal(a, b):
                return None
        else:
            scale = max(b.abs().max().item() if b.numel() else 0.0, 1.0)
            if (a - b).abs().max().item() <= tol * scale and torch.isfinite(a).all() == torch.isfinite(b).all():
                return None
        diff = (a.float() - b.float()).abs().max().item()
        return f"max abs diff {diff:.3g} (reference max {b.abs().max().item():.3g})"

    if (d := differs(loss, ref_loss)) is not None:
        return "wrong_loss", f"loss {loss.item():.6g} against {ref_loss.item():.6g}: {d}"
    for name in ref_grads:
        if (d := differs(grads.get(name), ref_grads[name])) is not None:
            return "wrong_grad", f"gradient of {name}: {d}"
    return None


def _root(e: BaseException) -> BaseException:
    """The exception Dynamo wrapped (BackendCompilerFailed and its kin carry it as the cause)."""
    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        inner = getattr(e, "inner_exception", None) or e.__cause__
        if inner is None or not type(e).__module__.startswith("torch"):
            break
        e = inner
    return e


def classify_error(e: BaseException, program_options: Dict) -> Result:
    """An exception from the remat run: expected (remat's documented answer to the options drawn) or
    a failure."""
    from remat_fx.options import OptionError
    from remat_fx.passes.budget import BudgetInfeasible
    from remat_fx.passes.peak import PeakInfeasible

    root = _root(e)
    text = f"{type(root).__name__}: {str(root).splitlines()[0] if str(root) else ''}"[:300]
    budget = program_options.get("memory_budget")
    byte_budget = budget is not None and not isinstance(budget, float) and budget not in (0, 1) and not (
        isinstance(budget, str) and budget.endswith("%"))
    if isinstance(root, BudgetInfeasible):
        if "cannot all be met at once" in str(root):  # region budgets (remat.annotate's) that no plan meets together
            return Result("expected_error", text)
        if not byte_budget:
            return Result("remat_error", f"BudgetInfeasible for memory_budget={budget!r}: {text}")
        if "feasible minimum" not in str(root) and "minimum" not in str(root):
            return Result("undocumented_text", text)
        return Result("expected_error", text)
    if isinstance(root, PeakInfeasible):
        if "peak_budget" not in program_options:
            return Result("remat_error", f"PeakInfeasible with no peak_budget: {text}")
        # a graph's ("below every estimated step peak found") or the whole step's ("below every plan found")
        if "below every estimated step peak" not in str(root) and "below every plan found" not in str(root):
            return Result("undocumented_text", text)
        return Result("expected_error", text)
    if isinstance(root, OptionError):
        return Result("remat_error", f"OptionError for options the docs allow: {text}")
    where = "".join(traceback.format_exception(type(root), root, root.__traceback__)[-3:-1]).strip().splitlines()
    detail = text + (f" [at {where[0].strip()}]" if where else "")
    if str(root).startswith("remat_fx") or "remat" in type(root).__module__:
        return Result("remat_error", detail)
    return Result("internal_error", detail)


def _check_plans(options: Dict) -> Optional[Result]:
    """The step's plans against the budgets (compiler mode)."""
    import remat_fx as remat
    from remat_fx.memory_budget import parse_budget

    report = remat.step_report()
    for i, plan, _ in report.calls:
        b = plan.budget
        if b is not None and b.target is not None and plan.total_bytes > b.target:
            return Result("budget_exceeded", f"graph {i} saves {plan.total_bytes:,} bytes, over its target "
                                             f"{b.target:,} (memory_budget={b.budget!r})")
        for name, r in (b.regions.items() if b is not None else ()):
            if r.target is not None and r.achieved > r.target:
                return Result("budget_exceeded", f"graph {i} region {name!r} saves {r.achieved:,} bytes, over "
                                                 f"its target {r.target:,}")
    budget = parse_budget(options.get("memory_budget"))
    if budget is not None and budget.nbytes is not None and report.calls:
        if report.saved_bytes > budget.nbytes:
            return Result("budget_exceeded", f"the step saves {report.saved_bytes:,} bytes, over memory_budget "
                                             f"{options['memory_budget']!r} ({budget.nbytes:,} bytes)")
    if options.get("peak_budget") is not None and report.limit is not None and report.peak is not None:
        if report.peak.peak > report.limit:
            return Result("peak_exceeded", f"estimated step peak {report.peak.peak:,} bytes over peak_budget "
                                           f"{options['peak_budget']!r} ({report.limit:,} bytes)")
    return None


def check_module(module, *, corrupt: Optional[Callable] = None) -> Result:
    """Run the case a loaded module holds (``Model``, ``inputs``, ``MODE``, ``OPTIONS``, ``SEED``).
    ``corrupt(loss, grads)`` rewrites remat's answer before the comparison (to test the oracle)."""
    t0 = time.perf_counter()
    result = _check(module, corrupt)
    result.seconds = time.perf_counter() - t0
    return result


def _check(module, corrupt) -> Result:
    mode, options, seed = module.MODE, dict(module.OPTIONS), module.SEED
    inputs = module.inputs(seed)
    torch.manual_seed(seed)
    model = module.Model()
    autocast = "torch.autocast" in module.SOURCE if hasattr(module, "SOURCE") else True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = eager_want = _step(model, model.reference, inputs, seed)
        except Exception as e:  # the generator wrote a program PyTorch rejects
            return Result("invalid_program", f"the reference raised {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        lower = options.get("lower", "inductor")
        if mode == "compile" and lower == "eager":
            torch._dynamo.reset()
            try:
                want = _step(model, torch.compile(_Reference(model), backend="aot_eager_decomp_partition"), inputs, seed)
            except Exception as e:
                return Result("invalid_program", f"the compiled reference raised {type(e).__name__}: "
                                                 f"{str(e).splitlines()[0][:200]}")
        try:
            if mode == "eager":
                got = _step(model, model.forward, inputs, seed)
            else:
                torch._dynamo.reset()
                compiled = torch.compile(model, backend="remat", options=options)
                got = _step(model, compiled, inputs, seed)
                # a step over a whole-step limit at its first run (its graphs planned one at a time)
                # is planned again as a whole at the next (docs/step.md): the limits are checked
                # on the second step, whose gradients must be right as well
                again = _step(model, compiled, inputs, seed)
        except Exception as e:
            return classify_error(e, options)
        finally:
            if mode == "compile":
                torch._dynamo.reset()
    if corrupt is not None:
        got = corrupt(*got)
    if mode == "eager":
        bad = compare(got, want, exact=True)
    else:
        tol = _TOL[(lower, autocast)]

        def off(result) -> Optional[Tuple[str, str]]:
            # against the compiled reference, or else the eager one: a region with a graph break in it
            # runs on the eager tape, whose ops are eager's, not the decompositions' (case 3657: a layer
            # norm over gathered, near-equal values, where the two differ by 1.9e-5 of the largest)
            bad = compare(result, want, exact=False, tol=tol)
            if bad is not None and want is not eager_want and compare(result, eager_want, exact=False, tol=tol) is None:
                return None
            return bad

        bad = off(got)
        if bad is None:
            bad = off(again)
            if bad is not None:
                bad = (bad[0], f"second step: {bad[1]}")
    if bad is not None:
        return Result(*bad)
    if mode == "compile":
        return _check_plans(options) or Result("pass")
    return Result("pass")


def check_source(source: str, *, corrupt: Optional[Callable] = None) -> Result:
    module = load(source)
    module.SOURCE = source
    try:
        return check_module(module, corrupt=corrupt)
    finally:
        os.unlink(module.__file__)
        sys.modules.pop(module.__name__, None)


def check(program: Program, *, corrupt: Optional[Callable] = None) -> Result:
    """Run one generated case through the oracle."""
    return check_source(render(program), corrupt=corrupt)


if __name__ == "__main__":  # python -m remat_fx.fuzz.oracle case.py
    print(check_source(open(sys.argv[1]).read()))
