"""remat_fx.pareto: sweep memory budgets over one model and see what each costs.

    points = remat_fx.pareto(model, (x,), budgets=[0, 0.25, 0.5, 1.0], out="pareto_out")

The model is traced once (torch.compile, each graph partitioned as the ``remat`` backend would
under the ``lower`` option, after Inductor's own graph passes under Inductor, and nothing lowered);
every budget then re-runs the budget solver and the min-cut on the same joint graph, so a sweep
costs one trace plus a fraction of a second per budget. Each point is the sum over the compiled
graphs, and keeps each graph's plan (``point.plans``). With ``out``, writes ``pareto.md``
(table), ``pareto.csv`` and ``pareto.png`` (saved bytes vs estimated recompute time; needs
matplotlib). Also a CLI: ``python -m remat_fx pareto --help``.
"""
from __future__ import annotations

import csv
import dataclasses
import numbers
import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import List, Sequence

import torch

from remat_fx.memory_budget import Budget, fmt_bytes, parse_budget
from remat_fx.options import parse_options
from remat_fx.passes import partition as _partition
from remat_fx.passes.lower import partition_only
from remat_fx.passes.plan import last_plan

DEFAULT_BUDGETS = tuple(round(0.1 * i, 1) for i in range(11))


@dataclass
class ParetoPoint:
    budget: str
    target: int  # bytes
    achieved: int  # saved bytes of the plan
    minimum: int
    maximum: int
    recompute_flops: int
    total_flops: int  # forward + backward (with the recompute), per step
    est_recompute_ms: float
    # the static estimate of the step's activation peak (bytes); with several graphs the sum of their
    # estimated peaks, as if each peaked at once (over the step's: remat.step_report() after a compile)
    est_peak: int
    solver: str
    solve_ms: float
    # the plan of each compiled graph at this budget (remat.last_plan()'s kind: str(plan) lists what is
    # saved); not in the table or csv
    plans: List = field(default_factory=list, repr=False, compare=False)

    def row(self) -> dict:
        """The point's figures (its csv row): every field but ``plans``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plans"}


def pareto(model_or_fn, example_inputs: Sequence, budgets: Sequence = DEFAULT_BUDGETS, *, options=None,
           out=None, progress: bool = True) -> List[ParetoPoint]:
    """Saved bytes and recompute cost of the ``remat`` plan at each budget (see module doc)."""
    if not isinstance(example_inputs, (tuple, list)):  # a tensor would be split into its rows
        raise TypeError(f"remat_fx.pareto: example_inputs must be a tuple or list of the model's arguments, got "
                        f"{type(example_inputs).__name__}; write (x,) for one argument")
    if isinstance(budgets, (str, numbers.Real, Budget)) or getattr(budgets, "ndim", None) == 0:
        budgets = [budgets]  # one budget: a sweep of one (a string is not its letters, nor a 0-d array its items)
    budgets = list(budgets)
    if not budgets or any(b is None for b in budgets):
        raise ValueError(f"remat_fx.pareto: budgets must be a non-empty list of fractions or sizes, got {budgets!r}")
    for b in budgets:
        parse_budget(b)  # every budget checked before the compile
    options = dict(options or {})
    for name, why in (("memory_budget", "the sweep sets it to each of budgets"),
                      ("peak_budget", "the sweep plans each memory budget, not a peak")):
        if options.get(name) is not None:
            raise ValueError(f"remat_fx.pareto: options[{name!r}]={options[name]!r} is not used: {why}; give the "
                             f"budgets to sweep as budgets=[...] and leave {name} out of options")
    if out is not None:  # its nearest existing folder or file, before the sweep
        there = pathlib.Path(out).expanduser().absolute()
        while not there.exists():
            there = there.parent
        if not there.is_dir():
            raise FileExistsError(f"remat_fx.pareto: out={str(out)!r} is or is inside the file {str(there)!r}; out "
                                  f"names a folder to write pareto.md, pareto.csv and pareto.png in")
    graphs = _capture(model_or_fn, tuple(example_inputs), options)
    sizes = [b for b in budgets if parse_budget(b).nbytes is not None]
    if sizes and len(graphs) > 1:
        raise ValueError(f"remat_fx.pareto: a byte budget ({sizes[0]!r}) is the whole step's: a compile divides it "
                         f"among the step's {len(graphs)} graphs (remat_fx/step.py), while pareto plans each graph "
                         "alone and would give each the whole of it. Give fractions of the feasible range here, or "
                         "compile at that size and read remat.step_report().")
    points: List[ParetoPoint] = []
    bar = _Progress(len(budgets) * len(graphs), enabled=progress)
    for b in budgets:
        parsed = parse_options({**options, "memory_budget": b})
        point = ParetoPoint(str(parse_budget(b)), 0, 0, 0, 0, 0, 0, 0.0, 0, "", 0.0)
        solvers = set()
        for gm, joint_inputs, kwargs in graphs:
            bar.step(f"budget {b}")
            with _tracing(joint_inputs):  # what the partitioner expects around it, as during the compile
                _partition.partition(gm, joint_inputs, options=parsed, **kwargs)
            plan = last_plan()
            if plan.rerun is not None:
                plan.rerun = plan.rerun.settled()  # no backward compiles here
            point.plans.append(plan)
            rep = plan.budget
            point.target += rep.target
            point.achieved += rep.achieved
            point.minimum += rep.minimum
            point.maximum += rep.maximum
            point.recompute_flops += plan.recompute_flops
            point.total_flops += plan.total_flops
            point.est_recompute_ms += plan.recompute_cost_s * 1e3
            point.est_peak += plan.peak.step
            point.solve_ms += rep.solve_seconds * 1e3
            solvers.add(rep.solver)
        point.solver = "+".join(sorted(solvers))
        points.append(point)
    bar.done()
    if out is not None:
        write(points, out)
    return points


def _capture(model_or_fn, example_inputs, options):
    """The joint graphs of one compile as remat's partition sees them under the options' lowering,
    nothing lowered: under Inductor (the default), after Inductor's own graph passes, each graph
    Dynamo makes partitioned once and then run as Dynamo made it (passes/lower.py partition_only);
    under the eager lowering, a compile with it."""
    torch._dynamo.reset()
    parsed = parse_options(options)
    if parsed.lower == "inductor":
        def backend(gm, inputs):
            partition_only(gm, inputs, parsed)
            return gm.forward

        compiled = torch.compile(model_or_fn, backend=backend)
    else:
        compiled = torch.compile(model_or_fn, backend="remat", options=options)
    with _partition.capture_joints() as graphs:
        compiled(*example_inputs)
    torch._dynamo.reset()
    if not graphs:
        raise ValueError("remat_fx.pareto: nothing was compiled for backward: the call made no graph that needs "
                         "gradients (do the inputs or parameters require grad?)")
    return graphs


def _tracing(joint_inputs):
    from torch._guards import TracingContext, detect_fake_mode, tracing

    return tracing(TracingContext(detect_fake_mode(joint_inputs)))


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.n, self.enabled, self.t0 = total, 0, enabled and total > 0, time.perf_counter()

    def step(self, what: str) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * self.n // self.total
        sys.stderr.write(f"\rpareto [{'#' * filled}{'.' * (width - filled)}] {self.n}/{self.total} {what:<16s}")
        sys.stderr.flush()
        self.n += 1

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\rpareto [{'#' * 30}] {self.total}/{self.total} in "
                             f"{time.perf_counter() - self.t0:.1f} s{' ' * 10}\n")


def table(points: List[ParetoPoint]) -> str:
    head = ("| budget | target | saved | est. step peak | recompute GFLOP | total GFLOP/step | est. recompute ms | "
            "solver | solve ms |\n|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {p.budget} | {fmt_bytes(p.target)} | {fmt_bytes(p.achieved)} | {fmt_bytes(p.est_peak)} | "
            f"{p.recompute_flops / 1e9:.3f} | {p.total_flops / 1e9:.3f} | {p.est_recompute_ms:.3f} | {p.solver} | "
            f"{p.solve_ms:.0f} |" for p in points]
    if points:
        rows.append(f"\nfeasible saved bytes: {fmt_bytes(points[0].minimum)} .. {fmt_bytes(points[0].maximum)}")
    return "\n".join([head, *rows])


def write(points: List[ParetoPoint], out) -> pathlib.Path:
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pareto.md").write_text(table(points) + "\n")
    with open(out / "pareto.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(points[0].row()))
        writer.writeheader()
        writer.writerows(p.row() for p in points)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("remat_fx.pareto: matplotlib not installed, no plot (pip install matplotlib)", file=sys.stderr)
        return out
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p.achieved / 2**20 for p in points]
    ys = [p.est_recompute_ms for p in points]
    ax.plot(xs, ys, "o-", label="remat plan")
    for p, x, y in zip(points, xs, ys):
        ax.annotate(p.budget, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("saved activation bytes (MiB)")
    ax.set_ylabel("estimated recompute time (ms)")
    ax.set_title("remat_fx: memory budget sweep")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "pareto.png", dpi=120)
    plt.close(fig)
    return out
