"""Peak memory benchmark: the incremental peak of one fwd+bwd step (CPU), for eager PyTorch,
eager per-block torch.utils.checkpoint, PyTorch's activation_memory_budget and remat's
memory_budget (both lowerings), and remat's peak_budget.

    python benchmarks/peak.py [--models gpt,hf] [--budgets 0,0.1,0.2,0.4,0.6,0.8,1] [--lowerings inductor,eager]
                              [--no-rerun-budgets 0,0.1] [--peak-fractions 0.6,0.5,0.4] [--steps 5]
                              [--pair-rounds 12]

Peak: torch.profiler's allocation events around one warmed-up fwd+bwd step, the highest running
total of what it allocates less what it frees of that (benchmarks/memory.py step_peak_bytes; it
sees Inductor's buffers as well as eager ops). remat's static estimate (plan.peak) is shown next
to it. ``remat (rerun off)`` rows: remat with option rerun=False (no value recomputed a second
time), at --no-rerun-budgets. ``peak_budget`` rows ask remat for
the fastest plan whose estimated peak is at most that fraction of remat's peak without a budget
(same lowering). Step time: median over --steps interleaved rounds / eager without checkpointing;
remat against PyTorch at the same budget also as the median [quartiles] of --pair-rounds
back-to-back step pairs (the round robin over ~20 variants spreads their steps seconds apart, and
7 rounds do not settle 5%: the same plan measured 0.96 against itself).
Writes benchmarks/out/peak.md, peak.csv and peak.png.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import List

import torch
import torch.utils.checkpoint as torch_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks.memory import fmt_bytes, step_peak_bytes  # noqa: E402
from benchmarks.pareto import budget_scope, build_model, compile_variant  # noqa: E402
from benchmarks.timing import (add_budget_args, add_model_args, floats, interleaved_step_times,  # noqa: E402
                               paired_time_ratios, parse_budget_args, write_outputs)


class _CheckpointBlock(torch.nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return torch_checkpoint.checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def _per_block_checkpoint(key, model):
    blocks = model.blocks if key == "gpt" else model.transformer.h
    for i, block in enumerate(blocks):
        blocks[i] = _CheckpointBlock(block)


def measure(key: str, args) -> List[dict]:
    rows, variants = [], {}

    def add(label, system, lower, budget, model, step, plan=None, compile_s=0.0):
        step()  # warm (compiled: already compiled)
        model.zero_grad(set_to_none=True)
        peak = step_peak_bytes(step)
        model.zero_grad(set_to_none=True)
        row = {"model": key, "label": label, "system": system, "lower": lower, "budget": budget, "peak": peak,
               "compile_s": compile_s}
        if plan is not None:
            row.update(est_peak=plan.peak.step, saved=plan.total_bytes, recompute_gflop=plan.recompute_flops / 1e9)
        rows.append(row)
        variants[label] = (model, step.loss)
        print(f"[{key}] {label:38s} peak {fmt_bytes(peak)}"
              + (f" (estimate {fmt_bytes(plan.peak.step)}, saved {fmt_bytes(plan.total_bytes)})" if plan else ""),
              flush=True)

    class Step:
        def __init__(self, fn):
            self.fn = fn

        def loss(self):
            return self.fn()

        def __call__(self):
            self.fn().backward()

    model, bind, fn = build_model(key, args)
    add("eager, no checkpointing", "eager", "-", None, model, Step(bind(fn)))
    model, bind, fn = build_model(key, args)
    _per_block_checkpoint(key, model)
    add("eager + torch.utils.checkpoint per block", "eager_ckpt", "-", None, model, Step(bind(fn)))
    for lower in args.lowerings:
        free_peak = None
        for system in ("torch", "remat"):
            for budget in args.budgets:
                model, bind, fn = build_model(key, args)
                compiled, _ = compile_variant(fn, system, lower, budget)
                step = Step(bind(compiled))
                t0 = time.perf_counter()
                with budget_scope(system, budget):
                    step()
                plan = remat.last_plan() if system == "remat" else None
                if plan is not None and budget == 1.0:
                    free_peak = plan.peak.step
                add(f"{lower}/{system}/budget {budget:g}", system, lower, budget, model, step, plan,
                    time.perf_counter() - t0)
        for budget in args.no_rerun_budgets:
            model, bind, fn = build_model(key, args)
            compiled, _ = compile_variant(fn, "remat", lower, budget, rerun=False)
            step = Step(bind(compiled))
            t0 = time.perf_counter()
            with budget_scope("remat", budget):
                step()
            add(f"{lower}/remat rerun off/budget {budget:g}", "remat_norerun", lower, budget, model, step,
                remat.last_plan(), time.perf_counter() - t0)
        for frac in args.peak_fractions if free_peak else ():
            cap = int(free_peak * frac)
            model, bind, fn = build_model(key, args)
            compiled = torch.compile(fn, backend="remat", options={"peak_budget": cap, "lower": lower}, fullgraph=True)
            step = Step(bind(compiled))
            t0 = time.perf_counter()
            try:
                with budget_scope("remat", 1.0):
                    step()
            except Exception as e:
                if "PeakInfeasible" not in repr(e):
                    raise
                print(f"[{key}] {lower} peak_budget {fmt_bytes(cap)}: below remat's lowest estimated peak")
                continue
            add(f"{lower}/remat/peak_budget {frac:g}", "remat_peak", lower, frac, model, step, remat.last_plan(),
                time.perf_counter() - t0)
    if not args.skip_time:
        torch._dynamo.config.error_on_recompile = True
        times = interleaved_step_times(variants, args.steps, args.warmup)
        torch._dynamo.config.error_on_recompile = False
        base = statistics.median(times["eager, no checkpointing"])
        for r in rows:
            r["time_x"] = statistics.median(times[r["label"]]) / base
        for r in rows:  # remat against PyTorch at its budget: paired steps, the finer comparison
            if r["system"] not in ("remat", "remat_norerun") or not args.pair_rounds:
                continue
            torch_label = f"{r['lower']}/torch/budget {r['budget']:g}"
            if torch_label in variants:
                ratios = paired_time_ratios(variants[torch_label], variants[r["label"]], args.pair_rounds)
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                r.update(time_vs_torch=statistics.median(ratios), time_vs_torch_q1=q[0], time_vs_torch_q3=q[2])
                print(f"[{key}] {r['label']:38s} time / PyTorch's (paired, {len(ratios)} pairs): "
                      f"{r['time_vs_torch']:.3f} [{q[0]:.3f}, {q[2]:.3f}]", flush=True)
    return rows


def table(rows: List[dict], key: str, timed: bool) -> List[str]:
    head = "| variant | peak | remat estimate | saved | recompute GFLOP | " + ("time | " if timed else "")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["model"] != key:
            continue
        est = fmt_bytes(r["est_peak"]) if "est_peak" in r else "-"
        saved = fmt_bytes(r["saved"]) if "saved" in r else "-"
        rec = f"{r['recompute_gflop']:.3f}" if "recompute_gflop" in r else "-"
        lines.append(f"| {r['label']} | {fmt_bytes(r['peak'])} | {est} | {saved} | {rec} | "
                     + (f"{r['time_x']:.3f} | " if timed else ""))
    return lines


def _vs_torch(r: dict, torch_row: dict) -> str:
    """remat's step time over PyTorch's at the same budget: the paired median [quartiles] when
    measured, else the ratio of the round robin's medians."""
    if "time_vs_torch" in r:
        return f"{r['time_vs_torch']:.3f} [{r['time_vs_torch_q1']:.3f}-{r['time_vs_torch_q3']:.3f}]"
    return f"{r['time_x'] / torch_row['time_x']:.3f}"


def summary(rows: List[dict], key: str, lowerings) -> List[str]:
    out = []
    ckpt = next(r["peak"] for r in rows if r["model"] == key and r["system"] == "eager_ckpt")
    for lower in lowerings:
        get = {(r["system"], r["budget"]): r for r in rows if r["model"] == key and r["lower"] == lower}
        budgets = sorted({b for (s, b) in get if s == "remat"}, reverse=True)
        peaks = [get[("remat", b)]["peak"] for b in budgets]
        cmp = [f"{b:g}: {get[('remat', b)]['peak'] / get[('torch', b)]['peak']:.3f}" for b in budgets
               if ("torch", b) in get]
        tcmp = [f"{b:g}: {_vs_torch(get[('remat', b)], get[('torch', b)])}" for b in budgets
                if ("torch", b) in get and "time_x" in get[("remat", b)]]
        off = [f"{b:g}: peak {get[('remat_norerun', b)]['peak'] / get[('torch', b)]['peak']:.3f}"
               + (f", time {_vs_torch(get[('remat_norerun', b)], get[('torch', b)])}"
                  if "time_x" in get[("remat_norerun", b)] else "")
               for b in budgets if ("remat_norerun", b) in get and ("torch", b) in get]
        out.append(f"- {lower}: remat memory_budget peaks as the budget shrinks: "
                   + ", ".join(fmt_bytes(p) for p in peaks)
                   + f" (monotone: {peaks == sorted(peaks, reverse=True)}); remat peak / PyTorch peak at the same "
                   f"budget: {', '.join(cmp)}")
        if tcmp:
            out.append(f"- {lower}: remat step time / PyTorch step time at the same budget (median of paired steps "
                       f"[quartiles]): {', '.join(tcmp)}")
        if off:
            out.append(f"- {lower}: remat with rerun=False / PyTorch at the same budget: {'; '.join(off)}")
        caps = sorted((r for r in rows if r["model"] == key and r["lower"] == lower and r["system"] == "remat_peak"),
                      key=lambda r: -r["budget"])
        if caps:
            out.append(f"- {lower}: remat peak_budget (fraction of its unbudgeted peak): "
                       + ", ".join(f"{r['budget']:g} -> {fmt_bytes(r['peak'])}" for r in caps)
                       + f"; lowest {fmt_bytes(min(r['peak'] for r in caps))} vs eager per-block checkpointing "
                       f"{fmt_bytes(ckpt)}")
        errs = [abs(r["est_peak"] - r["peak"]) / r["peak"] for r in rows
                if r["model"] == key and r["lower"] == lower and "est_peak" in r and r["peak"]]
        if errs:
            out.append(f"- {lower}: remat's static peak estimate vs measured: max error {max(errs) * 100:.1f}%, "
                       f"median {statistics.median(errs) * 100:.1f}%")
    return out


def plot(rows: List[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    timed = any("time_x" in r for r in rows)
    fig, axes = plt.subplots(2 if timed else 1, len(models), figsize=(6 * len(models), 8 if timed else 4.2),
                             squeeze=False)
    for j, key in enumerate(models):
        ax, ax2 = axes[0][j], (axes[1][j] if timed else None)
        for lower in args.lowerings:
            for system, style in (("torch", "s--"), ("remat", "o-")):
                pts = sorted((r for r in rows if r["model"] == key and r["lower"] == lower and r["system"] == system),
                             key=lambda r: r["budget"])
                label = f"{'PyTorch' if system == 'torch' else 'remat'} ({lower})"
                ax.plot([r["budget"] for r in pts], [r["peak"] / 2**20 for r in pts], style, label=label)
                if timed and pts:
                    ax2.plot([r["time_x"] for r in pts], [r["peak"] / 2**20 for r in pts], style, label=label)
            off = [r for r in rows if r["model"] == key and r["lower"] == lower and r["system"] == "remat_norerun"]
            if off:
                ax.plot([r["budget"] for r in off], [r["peak"] / 2**20 for r in off], "x", ms=8,
                        label=f"remat rerun=False ({lower})")
                if timed:
                    ax2.plot([r["time_x"] for r in off], [r["peak"] / 2**20 for r in off], "x", ms=8,
                             label=f"remat rerun=False ({lower})")
            caps = [r for r in rows if r["model"] == key and r["lower"] == lower and r["system"] == "remat_peak"]
            if timed and caps:
                ax2.plot([r["time_x"] for r in caps], [r["peak"] / 2**20 for r in caps], "^",
                         label=f"remat peak_budget ({lower})")
        for r in rows:
            if r["model"] == key and r["system"] in ("eager", "eager_ckpt"):
                ax.axhline(r["peak"] / 2**20, ls=":", color="gray" if r["system"] == "eager" else "black",
                           label=r["label"])
        ax.set_xlabel("memory budget (fraction)")
        ax.set_ylabel("step peak (MiB)")
        ax.set_title(f"{key}: peak vs budget")
        ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
        if not timed:
            continue
        ax2.set_xlabel("step time / eager")
        ax2.set_ylabel("step peak (MiB)")
        ax2.set_title(f"{key}: peak vs step time")
        ax2.legend(fontsize=6)
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_budget_args(p, "0,0.1,0.2,0.4,0.6,0.8,1")
    p.add_argument("--peak-fractions", default="0.6,0.5,0.4")
    p.add_argument("--no-rerun-budgets", default="0,0.1", help="budgets also run with remat option rerun=False")
    add_model_args(p, steps=5)
    p.add_argument("--pair-rounds", type=int, default=12,
                   help="back-to-back step pairs timing each remat variant against PyTorch at its budget (0: off)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "peak.md")
    args = parse_budget_args(p, argv)
    args.peak_fractions = floats(args.peak_fractions)
    args.no_rerun_budgets = floats(args.no_rerun_budgets)
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    cmd = " ".join(["python benchmarks/peak.py", *(sys.argv[1:] if argv is None else argv)])
    rows = []
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    for key in keys:
        rows += measure(key, args)
    out = ["# Step peak memory: eager, per-block checkpointing, PyTorch's budget, remat (CPU)", "",
           f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.machine()}; command: `{cmd}`; "
           f"layers {args.layers}, d_model {args.d_model}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}, "
           f"batch {args.batch}, float32. Peak = incremental peak of one fwd+bwd (profiler allocation events).", ""]
    for key in keys:
        out += [f"## {key}", ""] + table(rows, key, not args.skip_time) + [""] + summary(rows, key, args.lowerings)
        out += [""]
    return write_outputs(args.out, rows, out, lambda png: plot(rows, args, png))


if __name__ == "__main__":
    main()
