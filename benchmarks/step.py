"""Whole-step benchmark: a training step of several compiled graphs (a graph break halfway
through the blocks), measured as a whole (CPU).

    python benchmarks/step.py [--lower inductor|eager] [--layers 8] [--d-model 128] [--seq 256] [--batch 16]
                              [--torch-budgets 1,0.3,0] [--limits 0.8,0.6,0.4] [--fractions 1,0.5,0] [--fit 0.6,0.4]
                              [--budgets 0.5,0.2,0] [--accumulate N] [--threads N]

Variants: eager; eager with torch.utils.checkpoint per block; PyTorch's torch.compile (Inductor)
with ``activation_memory_budget`` at --torch-budgets; remat without a budget; remat with a
byte ``peak_budget`` at --limits (fractions of remat's unbudgeted measured peak); remat with a
fraction ``peak_budget`` at --fractions; ``remat.fit`` (measured) at --fit limits; a fraction
``memory_budget`` at --budgets. With --accumulate N each step is a gradient accumulation of N
micro-batches (the gradients set to None once, before the first), measured as a whole. Peak: the
profiler's allocation events over one warmed-up step (remat_fx.measure.step_peak_bytes); estimate:
remat.step_report()'s whole-step estimate; time: median of --steps steps; first step: the
compiling step(s), replans and fit searches included. Writes benchmarks/out/step_<lower>.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint

os.environ.setdefault("REMAT_FX_PLAN_CACHE", "0")  # a first step times the search, not a replay of the last run's

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks import torch_budget as pytorch_budget  # noqa: E402
from remat_fx.measure import step_peak_bytes  # noqa: E402
from remat_fx.step import STEP  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln(x))))


class Model(torch.nn.Module):
    def __init__(self, d, n, checkpoint=False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.checkpoint = checkpoint

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i == len(self.blocks) // 2:
                torch._dynamo.graph_break()
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpoint else block(x)
        return x.square().mean()


def variant(args, options=None, checkpoint=False, torch_budget=None):
    torch._dynamo.reset()
    STEP.reset()
    torch.manual_seed(0)
    model = Model(args.d_model, args.layers, checkpoint)
    xs = [torch.randn(args.batch, args.seq, args.d_model, generator=torch.Generator().manual_seed(1 + i))
          for i in range(args.accumulate)]
    if torch_budget is not None:  # PyTorch's own budget, Inductor
        run = torch.compile(model, backend=pytorch_budget.backend(torch_budget))
    else:
        run = model if options is None else torch.compile(model, backend="remat", options=options)

    def step():
        model.zero_grad(set_to_none=True)
        for x in xs:  # one micro-batch, or a gradient accumulation's (--accumulate)
            run(x).backward()

    return step


def measure(label, step, args, first_s=None, fit=None):
    t0 = time.perf_counter()
    if first_s is None:
        step()
        step()  # a whole-step replan happens at the second step
    first = first_s if first_s is not None else time.perf_counter() - t0
    peak = step_peak_bytes(step)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    report = remat.step_report() if "remat" in label else None
    row = {"label": label, "peak": peak, "time_ms": statistics.median(times) * 1e3, "first_s": first,
           "estimate": report.peak.peak if report and report.calls else None,
           "graphs": len(report.graphs) if report and report.calls else None,
           "calls": len(report.calls) if report and report.calls else None, "fit": fit}
    est = "-" if row["estimate"] is None else f"{row['estimate'] / 2**20:.2f}"
    print(f"{label:42s} peak {peak / 2**20:8.2f} MiB  est {est}  {row['time_ms']:.1f} ms  first {first:.1f} s",
          flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lower", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--torch-budgets", default="1,0.3,0")
    ap.add_argument("--limits", default="0.8,0.6,0.4")
    ap.add_argument("--fractions", default="1,0.5,0")
    ap.add_argument("--fit", default="0.6,0.4")
    ap.add_argument("--budgets", default="", help="remat memory_budget fractions (the step held on its estimate "
                                                   "at the second step: docs/step.md)")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="micro-batches per step, their gradients accumulated (the step measured as a whole)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: PyTorch's default); 1 steadies timings on a shared machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    floats = (lambda s: [float(v) for v in s.split(",") if v.strip()])
    rows = [measure("eager, no checkpointing", variant(args), args),
            measure("eager, torch.utils.checkpoint per block", variant(args, checkpoint=True), args)]
    for b in floats(args.torch_budgets):
        rows.append(measure(f"PyTorch activation_memory_budget {b:g}", variant(args, torch_budget=b), args))
    free = measure("remat, no budget", variant(args, {"lower": args.lower}), args)
    rows.append(free)
    for f in floats(args.limits):
        limit = int(free["peak"] * f)
        row = measure(f"remat, peak_budget {limit / 2**20:.2f} MiB ({f:g} x)",
                      variant(args, {"lower": args.lower, "peak_budget": limit}), args)
        row["limit"] = limit
        rows.append(row)
    for f in floats(args.fractions):
        rows.append(measure(f"remat, peak_budget fraction {f:g}",
                            variant(args, {"lower": args.lower, "peak_budget": f}), args))
    for b in floats(args.budgets):
        row = measure(f"remat, memory_budget {b:g}", variant(args, {"lower": args.lower, "memory_budget": b}), args)
        held = remat.step_report().held
        if held is not None:
            taken = ", ".join(f"graph {i} at {f:g}" for i, f in sorted(held.taken.items())) or "kept"
            row["fit"] = f"held in {held.seconds:.1f} s: {taken}"
        rows.append(row)
    for f in floats(args.fit):
        limit = int(free["peak"] * f)
        step = variant(args, {"lower": args.lower})
        t0 = time.perf_counter()
        result = remat.fit(step, peak=limit, cache=False)
        row = measure(f"remat.fit {limit / 2**20:.2f} MiB ({f:g} x)", step, args, time.perf_counter() - t0,
                      f"budget {result.fraction}, {len(result.tried)} measured")
        row["limit"] = limit
        rows.append(row)
    accumulated = f", {args.accumulate} micro-batches accumulated per step" if args.accumulate > 1 else ""
    lines = [f"Whole step, {args.layers} blocks (graph break halfway), d {args.d_model}, seq {args.seq}, batch "
             f"{args.batch}{accumulated}, {args.lower} lowering, torch {torch.__version__}, CPU", "",
             "| variant | graphs / calls | measured peak MiB | whole-step estimate MiB | limit MiB | step ms | first step s "
             "| fit, or the step held |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        est = "" if r["estimate"] is None else f"{r['estimate'] / 2**20:.2f}"
        gc = "" if r["graphs"] is None else f"{r['graphs']} / {r['calls']}"
        lim = f"{r['limit'] / 2**20:.2f}" if r.get("limit") else ""
        lines.append(f"| {r['label']} | {gc} | {r['peak'] / 2**20:.2f} | {est} | {lim} | {r['time_ms']:.1f} | "
                     f"{r['first_s']:.1f} | {r['fit'] or ''} |")
    out = ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    name = f"step_{args.lower}" + (f"_accumulate{args.accumulate}" if args.accumulate > 1 else "")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
