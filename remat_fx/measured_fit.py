"""remat.fit: plan a training step against its *measured* peak, and remember the answer on disk.

    step = lambda: (model.zero_grad(set_to_none=True), loss_fn(model(x)).backward())
    result = remat.fit(step, peak="6GiB")      # model compiled with backend="remat"
    print(result)                              # the budget chosen, measured peaks of what was tried

The estimate (remat_fx/step.py) is off by what the lowering fuses and what the allocator does;
this runs the real step instead. It runs ``step`` once (compiling every graph of the step), then
plans all the step's graphs with one shared memory budget, starting from the largest on the grid
whose whole-step *estimate* fits the limit: each candidate is lowered again, run, and its peak
measured (CUDA: the allocator's statistics; CPU: the profiler's allocation events). What the
measurement adds to the estimate there is carried to the other budgets: the next one measured is
the largest it predicts to fit (above the start if that fitted, below if not), then the one above
the largest that fits, to confirm it, and past those a bisection or, down the grid, the next it
predicts, else the smallest budget (``_largest_fitting``). The largest budget whose measured peak
fits is kept, with its plans in place. If none fits, a :class:`~remat_fx.passes.peak.PeakInfeasible`
error names the least measured peak.

The choice is cached on disk (``cache_dir``, default ``$REMAT_FX_CACHE_DIR`` or
``~/.cache/remat_fx``), keyed by each graph (its code, its inputs' shapes and dtypes, the torch
version, remat_fx's own source), its options and the limit: the next run of the same job compiles
each graph straight at the chosen budget, measures it (twice, the larger counting, as the search
does) and searches no more.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import pathlib
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch
import torch.utils._pytree as pytree

from remat_fx.measure import measured_device, step_peak_bytes
from remat_fx.memory_budget import fmt_bytes, parse_budget
from remat_fx.options import BackendOptions
from remat_fx.passes.peak import PeakInfeasible
from remat_fx.passes.plan import record
from remat_fx.plan_cache import cache_root, source_digest, switched_on, write_atomic
from remat_fx.ranks import agreed, together
from remat_fx.step import STEP, CompiledGraph, _signature, auto_limit, candidates, estimate_curve, shared_options

log = logging.getLogger("remat_fx")


@dataclass
class FitResult:
    limit: int  # bytes the measured step peak must stay under
    fraction: Optional[float]  # the shared memory_budget chosen (None: the compile's own, ``compiled``)
    measured: int  # the measured step peak with it
    tried: Dict[Optional[float], int] = field(default_factory=dict)  # shared memory_budget -> measured peak
    estimates: Dict[Optional[float], int] = field(default_factory=dict)  # -> whole-step estimate
    cached: bool = False  # taken from the plan cache, no search
    graphs: int = 0
    calls: int = 0
    seconds: float = 0.0
    compiled: Optional[float] = None  # the compile's memory_budget, a fraction, that None stands for (else none)

    def __str__(self) -> str:
        name = f"memory_budget {_named(self.fraction, self.compiled)}"
        graphs = f"all {self.graphs} graphs" if self.graphs != 1 else "its 1 graph"
        calls = f"{self.calls} call{'' if self.calls == 1 else 's'}"
        text = (f"remat.fit: {name} for {graphs} ({calls}) of the step: measured peak "
                f"{fmt_bytes(self.measured)} <= limit {fmt_bytes(self.limit)}"
                + (" (from the plan cache)" if self.cached else f" ({len(self.tried)} plans measured)")
                + f" in {self.seconds:.1f} s")
        for f, m in self.tried.items():
            est = self.estimates.get(f)
            text += (f"\n  {_named(f, self.compiled):>5s}: measured {fmt_bytes(m)}"
                     + ("" if est is None else f", estimated {fmt_bytes(est)}")
                     + ("  <- chosen" if f == self.fraction else ""))
        return text


def _named(fraction: Optional[float], compiled: Optional[float]) -> str:
    """A shared budget as the result says it: None is the compile's own fraction (step.py
    shared_options), or none."""
    if fraction is not None:
        return f"{fraction:g}"
    return "none" if compiled is None else f"{compiled:g} (the compile's)"


@dataclass
class _Scope:
    limit: int
    directory: Optional[pathlib.Path]
    key: object = None  # the limit as the cache keys it (default: ``limit``)

    def __post_init__(self):
        if self.key is None:
            self.key = self.limit

    def keys(self) -> list:
        """The keys a cached choice is looked up under: ``key``, and for peak="auto" the buckets on
        either side of it too (a limit just across a bucket's edge from the last run's; the plan
        found is measured against this run's limit all the same)."""
        if isinstance(self.key, tuple) and self.key[0] == "auto":
            return [self.key, ("auto", self.key[1] - 1), ("auto", self.key[1] + 1)]
        return [self.key]


_AUTO_STEP = 0.01  # peak="auto": the cache keys the limit to within this fraction


def _auto_key(limit: int) -> tuple:
    """peak="auto"'s limit (the device's free memory, which moves by some MiB from run to run: the CUDA
    context, cuBLAS's workspaces, another process) as the cache keys it: in steps of ``_AUTO_STEP``."""
    return ("auto", int(math.log(max(limit, 1)) / math.log1p(_AUTO_STEP)))


_ACTIVE: List[_Scope] = []
_ABSENT = object()


def _entry(graph: CompiledGraph, options: BackendOptions, limit) -> str:
    from remat_fx import __version__

    # the global state the graph runs under (autocast, grad mode) too: the same graph under bf16 autocast
    # fits a limit another budget fits in float32 (a helper's review: the float32 choice was taken)
    text = repr((graph.key, options.key(), limit, __version__, source_digest(), graph.global_state))
    return "fit-" + hashlib.sha256(text.encode()).hexdigest()[:32] + ".json"


def _say_if_compiled_before(graphs, scope: _Scope) -> None:
    """A fit with a cache whose step's graphs were compiled before it (warm-up steps) searches, whatever
    its cache holds for them: said where the cache has an entry for one of them (it was silent, and
    each run of the job searched again)."""
    if scope.directory is None or all(g.cached is scope for g in graphs):
        return
    held = [g for g in graphs if g.cached is not scope
            and any((scope.directory / _entry(g, g.options, key)).is_file() for key in scope.keys())]
    if held:
        log.warning("remat_fx: remat.fit: graph(s) %s of the step were compiled before this fit (a step ran "
                    "before it), so the choice its cache holds for them is not used and it searches again: "
                    "call remat.fit before the step's first run to start from the cache",
                    ", ".join(str(g.index) for g in held))


def searching() -> bool:
    """Whether a ``fit`` is running (its graphs are re-planned from their joint graphs)."""
    return bool(_ACTIVE)


def cached_options(graph: CompiledGraph, options: BackendOptions) -> Optional[BackendOptions]:
    """Inside ``fit`` with a cache: the options the cache chose for this graph, else None."""
    if not _ACTIVE or _ACTIVE[-1].directory is None:
        return None
    scope = _ACTIVE[-1]
    for key in scope.keys():
        try:
            entry = json.loads((scope.directory / _entry(graph, options, key)).read_text())
            break
        except (OSError, ValueError):
            continue
    else:
        return None
    graph.cached = scope  # this fit's, not an earlier one's in the process
    return shared_options(options, entry["fraction"])


def _save(graphs, fraction, measured, scope: _Scope) -> None:
    """The choice, on disk for the next run; a folder that cannot be written is warned of, not raised
    (the search's result stands)."""
    try:
        for g in graphs:
            write_atomic(scope.directory / _entry(g, g.options, scope.key),
                         json.dumps({"fraction": fraction, "measured": measured, "limit": scope.limit,
                                     "graph": g.key, "torch": torch.__version__}).encode())
    except OSError as e:
        warnings.warn(f"remat_fx: remat.fit could not keep its choice in {scope.directory} ({e}); the next run "
                      f"searches again (cache_dir= a folder it can write, or cache=False)", stacklevel=3)


_PEAK_HINT = ("remat_fx: remat.fit's peak must be a size with a unit ('6GiB', '512MiB'), an int number of bytes, "
              "or 'auto' (CUDA: the device's free memory less 10%)")


def _limit(peak) -> int:
    if isinstance(peak, str) and peak == "auto":
        try:
            return auto_limit()
        except ValueError:
            raise ValueError("remat_fx: remat.fit's peak='auto' reads the free memory of the CUDA device, and no "
                             "CUDA device is available; give a size instead, e.g. peak='2GiB'") from None
    if isinstance(peak, numbers.Integral) and not isinstance(peak, bool):
        peak = int(peak)  # numpy's ints too, as peak_budget takes them
    elif isinstance(peak, numbers.Real) and not isinstance(peak, bool):
        peak = float(peak)  # numpy's floats: the float's message below, not "got float32"
    if isinstance(peak, bool) or not isinstance(peak, (int, float, str)):
        raise ValueError(f"{_PEAK_HINT}, got {type(peak).__name__} {peak!r}")
    if isinstance(peak, int) and peak in (0, 1):  # fractions to parse_budget (a memory_budget's 0 and 1)
        raise ValueError(f"{_PEAK_HINT}, got {peak}: no step peaks at {peak} byte(s) or under")
    if isinstance(peak, float):
        raise ValueError(f"{_PEAK_HINT}, got the float {peak!r}: fit measures the step's peak in bytes (a fraction "
                         f"is a memory_budget's or a peak_budget's, options of the compile); for a size write an int "
                         f"or a string with a unit, e.g. '{peak:g}GiB'")
    if isinstance(peak, str):
        try:
            number = float(peak)
        except ValueError:
            number = None
        if number is not None and 1 < number < 2**63 and number == int(number):  # '1e9', '4096': bytes, likely
            raise ValueError(f"{_PEAK_HINT}, got the string {peak!r}, a number without a unit: pass the int "
                             f"{int(number)} for bytes, or give the unit, e.g. '{int(number)}B'")
        if number is not None and math.isfinite(number) and number > 0:  # (parse_budget's says a fraction is taken)
            raise ValueError(f"{_PEAK_HINT}, got the string {peak!r}, a number without a unit: give the unit, e.g. "
                             f"'{peak.strip()}GiB', or pass an int number of bytes")
    try:
        budget = parse_budget(peak, "remat.fit's peak")
    except ValueError as e:
        detail = str(e).rsplit("; got ", 1)[-1]  # parse_budget's hint is a memory_budget's (fractions too)
        raise ValueError(f"{_PEAK_HINT}, got {detail}") from None
    if budget is None or budget.nbytes is None:
        raise ValueError(f"{_PEAK_HINT}, got {peak!r}: fit measures the step's peak in bytes (a fraction is a "
                         f"memory_budget's or a peak_budget's, an option of the compile)")
    if budget.nbytes == 0:  # it ran the step and a search first
        raise ValueError(f"{_PEAK_HINT}, got {peak!r}: no step peaks at 0 bytes")
    return budget.nbytes


def _at_least(measured: int, margin: float) -> int:
    """The least limit whose target (the limit less the margin, as fit computes it) takes ``measured``."""
    limit = int(measured / (1 - margin))  # at or under the least (its float may round either way)
    while int(limit * (1 - margin)) < measured:
        limit += 1
    return limit


def fit(step: Callable[..., object], *args, peak, margin: float = 0.02, cache: Optional[bool] = None, cache_dir=None,
        device=None, params=None, **kwargs) -> FitResult:
    """Plan the graphs that ``step(*args, **kwargs)`` runs (one whole training step of a model
    compiled with ``backend="remat"``: forward and backward, with the gradients set to None first so
    that the peak counts them) so that the step's *measured* peak is at most ``peak`` (a size, int
    bytes, or ``"auto"`` on CUDA), as fast as the shared budget grid allows. The search keeps
    ``margin`` (a fraction of the limit) free against the run-to-run spread of the measurement, and
    measures each candidate twice (the larger counts). The gradients set to None are those of the
    parameters the compiled graphs read, of every ``nn.Module`` among the arguments, and of
    ``params`` (a module or parameters: under FSDP2 the graphs read the unsharded parameters, and
    the sharded ones, which keep the gradients, are the model's); it ends with them None. Under a
    process group, call it on every rank: the ranks decide on the largest of their measured peaks
    and end with the same plan (remat_fx/ranks.py). ``cache``: keep and read the choice on disk
    (default: yes, unless ``REMAT_FX_PLAN_CACHE=0`` and no ``cache_dir`` is given). See the module
    doc."""
    limit = _limit(peak)
    if cache is not None and not isinstance(cache, bool):
        raise TypeError(f"remat_fx: remat.fit's cache must be True, False or None (the default: on unless "
                        f"REMAT_FX_PLAN_CACHE=0), got {cache!r}")
    if cache is None:  # the environment's switch turns off the default, not what the call asks for
        cache = cache_dir is not None or switched_on()
    if cache is False and cache_dir is not None:
        raise ValueError(f"remat_fx: remat.fit got cache=False and cache_dir={str(cache_dir)!r}: give one (cache_dir "
                         f"turns the cache on there)")
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not 0 <= margin < 1:
        raise ValueError(f"remat_fx: remat.fit's margin must be a fraction of the limit in [0, 1), got {margin!r}")
    if not callable(step):
        raise TypeError(f"remat_fx: remat.fit's step must be a function that runs one training step (forward and "
                        f"backward), got {type(step).__name__}: pass the function, not what it returns, e.g. "
                        f"remat.fit(lambda: model(x).backward(), peak=...)")
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"remat_fx: remat.fit's cache_dir must be a path (str or os.PathLike), got {cache_dir!r}")
    device = measured_device(device, "remat_fx: remat.fit")
    named = _parameters(args, kwargs, params)
    target = int(limit * (1 - margin))
    t0 = time.perf_counter()
    scope = _Scope(limit, None if not cache else pathlib.Path(cache_dir).expanduser() if cache_dir is not None
                   else cache_root(),
                   _auto_key(limit) if isinstance(peak, str) and peak == "auto" else limit)

    def run():
        step(*args, **kwargs)

    _ACTIVE.append(scope)
    STEP.leaves = {}
    before = STEP.finished()  # an earlier step's calls: the step must begin a backward of its own
    try:
        run()  # compiles (from the cache where it has the graph)
        # the step's parameters, whose gradients each measurement counts
        leaves = list({**STEP.leaves, **named}.values())
    finally:
        _ACTIVE.remove(scope)
        STEP.leaves = None
    calls = [g for g in STEP.finished() if g.plan is not None] if STEP.finished() is not before else []
    if not calls:
        raise ValueError("remat_fx: remat.fit's step ran no graph compiled with backend='remat' that needs "
                         "gradients: it must run a forward and backward of a model compiled with "
                         "torch.compile(model, backend='remat')")
    graphs = list(dict.fromkeys(calls))
    _say_if_compiled_before(graphs, scope)
    sig = _signature(calls)
    planned_before = STEP.planned.get(sig, _ABSENT)
    STEP.planned[sig] = "fit"  # the step coordinator leaves this step to the fit
    compiled = graphs[0].options.step_peak
    if compiled is not None and compiled != "auto" and compiled.nbytes is not None and compiled.nbytes < limit:
        # a review: the report printed the compile's limit beside a step over it, without a word
        warnings.warn(f"remat_fx: remat.fit(peak={fmt_bytes(limit)}) plans this step in place of its compile's "
                      f"peak_budget {fmt_bytes(compiled.nbytes)}, which is lower: the step may go over that one. "
                      f"Give remat.fit the limit the step must hold.", stacklevel=2)
    user = graphs[0].options.memory_budget
    result = FitResult(limit, None, 0, graphs=len(graphs), calls=len(calls),
                       compiled=user.fraction if user is not None and user.nbytes is None else None)
    # the cache is used only if every rank has the plans, and the same ones

    def measure():  # the largest of the ranks' (one figure on every rank: the same decisions)
        _drop_grads(leaves)
        return agreed(step_peak_bytes(run, device), max)

    # where the search fails (nothing fits, a measurement runs out of memory, a rank fails, an
    # interrupt), the step's graphs are lowered back as they were and the step is no longer the fit's
    # (a failed fit left them at the last budget it measured, budget 0's least peak whatever its time)
    restore_to = {g: g.options if g.cached is scope else g.active for g in graphs}

    def restore():  # each rank on its own, no collective: a rank may be failing alone
        if planned_before is _ABSENT:
            STEP.planned.pop(sig, None)
        else:
            STEP.planned[sig] = planned_before
        for g, options in restore_to.items():
            g.relower(options)
        STEP.lowered_again(graphs)

    try:
        # and one budget for all the step's graphs (the entries are per graph: a graph another step
        # shares was fitted with that step, maybe at another budget)
        fractions = tuple(_fraction_of(g) for g in graphs)
        mine = (all(g.cached is scope for g in graphs) and len(set(fractions)) == 1, fractions)
        if agreed(mine, lambda by_rank: all(c for c, _ in by_rank) and len({f for _, f in by_rank}) == 1):
            measured = max(measure(), measure())  # as the search measures (the margin, the larger of two)
            fraction = _fraction_of(graphs[0])
            if measured <= target:
                result.fraction, result.measured, result.cached = fraction, measured, True
                for g in graphs:
                    g.fit_limit = limit
                result.tried[fraction] = measured
                result.seconds = time.perf_counter() - t0
                log.info("%s", result)
                return result
            log.warning("remat_fx: the cached plan measures %s, over the limit %s less the margin %g (%s): "
                        "searching again", fmt_bytes(measured), fmt_bytes(limit), margin, fmt_bytes(target))

        def evaluate(f):
            together(lambda: [g.relower(shared_options(g.options, f)) for g in graphs],
                     f"lowering the step's graphs at memory_budget {f}")
            run()  # the backward compiles lazily, and the allocator settles
            measured = max(measure(), measure())
            result.tried[f] = measured
            log.info("remat_fx: fit: shared memory_budget %s measures %s (target %s)",
                     "none" if f is None else f"{f:g}", fmt_bytes(measured), fmt_bytes(target))
            return measured

        saved_limit = user.nbytes if user is not None else None
        grid = candidates(graphs[0].options)
        if saved_limit is not None:  # a byte memory_budget holds for the whole step too
            saved = estimate_curve(calls, fractions=grid)
            fits_all = agreed([f for f in grid if saved[f][1] <= saved_limit],  # on every rank
                              lambda by_rank: [f for f in grid if all(f in k for k in by_rank)])
            grid = fits_all or grid[-1:]
        curve = estimate_curve(calls, fractions=grid, stop=lambda peak, _: peak <= target)
        result.estimates = {f: peak for f, (peak, _) in curve.items()}
        fitting = [f for f, e in result.estimates.items() if e <= target]
        # where to start: the smallest budget any rank's estimate asks for
        start = agreed(grid.index(fitting[0] if fitting else list(result.estimates)[-1]), max)

        def estimate(i):  # the whole-step estimate at grid[i], planned for the first time here if needed
            if grid[i] not in result.estimates:
                more = estimate_curve(calls, fractions=grid[i:i + 1])
                result.estimates[grid[i]] = more[grid[i]][0]
            return result.estimates[grid[i]]

        chosen = _largest_fitting(grid, start, evaluate, estimate, target)
        if chosen is None:
            least = min(result.tried, key=result.tried.get)
            outside = result.tried[least] - result.estimates.get(least, result.tried[least])
            # a review: 63 MiB of an eager LM head and loss, which no plan of the graphs lowers, went unsaid
            beyond = "" if outside < max(2**20, result.tried[least] // 4) else (
                f" At that plan the compiled graphs are estimated at {fmt_bytes(result.estimates[least])}: about "
                f"{fmt_bytes(outside)} of the measured peak is outside them (eager code, such as an LM head and loss "
                f"or an embedding, and what the step keeps before it starts), which no plan of theirs lowers; "
                f"compile that code with the same options, or shrink it.")
            raise PeakInfeasible(
                f"remat_fx: remat.fit: no plan measured a step peak at or under {fmt_bytes(target)} ({target:,} "
                f"bytes: the limit {fmt_bytes(limit)} less the margin {margin:g}): "
                f"the least measured is {fmt_bytes(result.tried[least])} ({result.tried[least]:,} bytes), with every "
                f"graph at memory_budget {_named(least, result.compiled)}. Raise the limit to at least "
                f"{_at_least(result.tried[least], margin):,} bytes, or shrink the step (batch, sequence "
                f"length).{beyond} "
                f"The step's graphs are lowered back as they were before remat.fit's search (with the compile's "
                f"options where fit compiled them from its cache).")
        best = grid[chosen]
        if list(result.tried)[-1] != best:
            together(lambda: [g.relower(shared_options(g.options, best)) for g in graphs],
                     f"lowering the step's graphs at memory_budget {best}")
        for g in graphs:
            record(g.plan)
            g.fit_limit = limit
        STEP.lowered_again(graphs)
        result.fraction, result.measured = best, result.tried[best]
        if scope.directory is not None:
            _save(graphs, best, result.measured, scope)
        result.seconds = time.perf_counter() - t0
        log.info("%s", result)
        return result
    except BaseException as e:
        try:
            restore()
        except Exception as again:  # the search's error stands, with this one noted on it
            log.error("remat_fx: remat.fit could not lower the step's graphs back after %r: %r", e, again)
            if hasattr(e, "add_note"):  # Python 3.11
                e.add_note(f"remat_fx: lowering the step's graphs back as they were failed too: {again!r}")
        raise
    finally:
        # the last measurement's gradients are not the user's: a loop that zeroes them after its
        # optimizer's step applied them in its first step after the fit (by lr x those gradients)
        _drop_grads(leaves)


def _largest_fitting(grid, start: int, evaluate, estimate, target: int) -> Optional[int]:
    """The index of the largest budget of ``grid`` (largest first) whose measured peak,
    ``evaluate(budget)`` (a lowering and a measurement, on every rank), is at most ``target``; None
    if none measured fits. The search starts at ``grid[start]`` (the largest whose estimate fits) and
    carries what the measurement added to the estimate there (``estimate(index)``: the whole-step
    estimate) to the other budgets: the next budget measured is the largest that the estimate plus
    that error predicts to fit, and then the one above the largest that fits, to confirm it; past
    those it bisects the budgets above (the measured peak falls with the budget: the plans are
    monotone by construction) or, below, goes on to the next the estimate predicts, else to the
    smallest budget: if that one is over, so is every budget above it. Where the estimate is off by the same
    bytes everywhere, that is at most three measurements. On 400 made-up 14-budget curves
    (tests/test_step.py) it measured 1.9 budgets on average where the estimate was off by the same
    bytes everywhere and 2.2 where it was off by up to 60 more or less (peaks of 100-1000), against
    2.8 and 2.7 for the bisection above and the walk below it replaced; on benchmarks/step.py's
    two-graph step (Inductor, CPU) at limits 0.6, 0.5, 0.4 and 0.3 of its peak, 2 each against 2,
    3, 3 and 3 (the first step 13.6-19.3 s against 19.8-29.2 s), with the same budgets chosen. The
    predictions are agreed by the ranks (the largest index), so that every rank measures the same
    budgets."""
    measured = {}

    def fits(i) -> bool:
        if i not in measured:
            measured[i] = evaluate(grid[i])
        return measured[i] <= target

    def predicted(indices, known: int) -> Optional[int]:
        """The first of ``indices`` that the estimate, off by what it was at ``known``, says fits."""
        error = measured[known] - estimate(known)
        local = next((i for i in indices if estimate(i) + error <= target), len(grid))
        found = agreed(local, max)
        return None if found >= len(grid) else found

    def largest(lo: int, hi: int) -> int:
        """The largest that fits of grid[lo..hi], grid[hi] known to: the one above it first (over
        the target, the search ends there), then a bisection."""
        if lo < hi and fits(hi - 1):
            hi -= 1
            while lo < hi:
                mid = (lo + hi) // 2
                if fits(mid):
                    hi = mid
                else:
                    lo = mid + 1
        return hi

    if fits(start):
        lo, hi = 0, start  # grid[hi] fits; grid[:lo] measured over the target
        guess = predicted(range(start), start) if start else None
        if guess is not None:
            if fits(guess):
                hi = guess
            else:
                lo = guess + 1
        return largest(lo, hi)
    last = start  # the smallest budget measured over the target so far
    while last + 1 < len(grid):
        # where the estimate says none below fits, the smallest budget: if it is over, so is every
        # budget above it (a walk down measured each of them: 14 lowerings and measurements of a
        # step no plan fits, 54 s of a Hugging Face Llama's fit under Inductor)
        guess = predicted(range(last + 1, len(grid)), last)
        if guess is None:
            guess = len(grid) - 1
        if fits(guess):
            return largest(last + 1, guess)
        last = guess
    return None


def _parameters(args, kwargs, params) -> Dict[int, "weakref.ref"]:
    """{id: weak reference} of the parameters of every nn.Module among the step's arguments and of
    ``params`` (a module, or an iterable of tensors)."""
    found = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.nn.Module)]
    tensors = [p for m in found for p in m.parameters()]
    if params is not None:
        if isinstance(params, torch.nn.Module):
            tensors += list(params.parameters())
        else:
            if isinstance(params, dict):  # dict(model.named_parameters())
                params = list(params.values())
            given = [params] if isinstance(params, torch.Tensor) else list(params) \
                if isinstance(params, Iterable) else None
            if given is None or not all(isinstance(p, torch.Tensor) for p in given):
                raise TypeError(f"remat_fx: remat.fit's params must be an nn.Module or an iterable of tensors (the "
                                f"parameters whose gradients each measurement sets to None first), got "
                                f"{type(params).__name__}")
            tensors += given
    return {id(p): weakref.ref(p) for p in tensors}


def _drop_grads(leaves) -> None:
    """Set the gradients of the step's parameters to None before a measurement, so that the peak
    counts them whatever the step does: on CUDA the measurement is the allocator's peak over what
    was allocated before the step, and a step that frees the last step's gradients first (zero_grad
    with set_to_none) would otherwise measure their bytes less."""
    for ref in leaves:
        leaf = ref()
        if leaf is not None:
            leaf.grad = None


def _fraction_of(graph: CompiledGraph) -> Optional[float]:
    budget = graph.active.memory_budget
    return None if budget is None else budget.fraction
