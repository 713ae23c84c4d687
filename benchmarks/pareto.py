"""Memory-budget Pareto benchmark: PyTorch's ``activation_memory_budget`` against
``backend="remat"`` with ``memory_budget``, on CPU, at budgets 0, 0.1, ..., 1.0.

    python benchmarks/pareto.py [--models gpt,hf] [--budgets 0,0.1,...,1] [--lowerings inductor,eager]
                                [--layers 4] [--d-model 256] [--seq 128] [--batch 8] [--steps 5]

Models (no activation checkpointing annotations: the budget decides everything): the example GPT
(examples/gpt.py, checkpoint="none") and a transformers GPT-2 from a small config (no download).
Per model, budget and lowering, two systems:

  torch  PyTorch's min-cut partitioner with torch._functorch.config.activation_memory_budget = b
         (default knapsack solver "dp", default "flops" runtime estimator)
  remat  torch.compile(backend="remat", options={"memory_budget": b, "lower": ..., "rerun": False,
         "peak_slack": 0}) (the budget solver's fastest plan alone, without the values the default
         recomputes a second time and the 2% of time it may spend to lower the step's peak;
         benchmarks/peak.py measures that trade)

Lowerings: ``inductor`` (torch.compile's Inductor, PyTorch's partitioner plugged in as
Inductor's custom partitioner for "torch", the same hook remat uses) and ``eager`` (AOTAutograd
with Inductor's decompositions, the partitioned FX graphs run op by op, for both).
Measured for every (system, lowering, budget), each with its own compiled callable:

* saved: bytes held from forward to backward: unique non-parameter storages autograd packs
  (saved_tensors_hooks, benchmarks/memory.py SavedTensorBytes); cross-checked with the mallinfo2
  heap delta over the forward (heap) and, for remat, with the plan.
* GFLOP/step: FLOPs of the partitioned forward + backward graphs (torch.utils.flop_counter formulas
  on each node's shapes, the same function for both systems; CPU SDPA has no formula: 0).
* time: median fwd+bwd step time over --steps rounds, all variants of a model interleaved
  round-robin, relative to eager PyTorch without any checkpointing in the same rounds.
* solve: wall time of the partition call (torch: min-cut + knapsack; remat: capture, tags, ILP
  and min-cut), and remat's ILP alone.
* dropout: with dropout 0.1 everywhere, the largest gradient difference relative to the same
  system at budget 1.0 (no random op recomputed there) with the same seed.

Writes benchmarks/out/pareto.md, pareto.csv and pareto.png.
"""
from __future__ import annotations

import argparse
import functools
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomPartitionerFn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks.memory import fmt_bytes, measure_heap, measure_hooks  # noqa: E402
from benchmarks.timing import (add_budget_args, add_model_args, floats, interleaved_step_times,  # noqa: E402
                               parse_budget_args, write_outputs)
from examples import gpt as example_gpt  # noqa: E402
from remat_fx.passes.capture import decompositions  # noqa: E402
from remat_fx.passes.cost import flops  # noqa: E402


# -- models ------------------------------------------------------------------------------------
def build_model(key: str, args, dropout: float = 0.0):
    """(model, step) where step() returns the loss."""
    if key == "gpt":
        cfg = example_gpt.GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, n_head=args.heads,
                                    n_layer=args.layers, dropout=dropout)
        model = example_gpt.make_model(cfg, "none", "recompute_all")
        example_gpt._causal_mask(cfg.seq, torch.device("cpu"))  # the example's mask cache, made eagerly
        idx, targets = example_gpt.random_batch(cfg, args.batch)
        return model, (lambda fn: functools.partial(fn, idx, targets)), model
    import transformers

    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=args.heads,
                                  n_positions=args.seq, vocab_size=args.vocab, resid_pdrop=dropout,
                                  embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def loss(ids):
        logits = model(ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return model, (lambda fn: functools.partial(fn, ids)), loss


# -- PyTorch's partitioner, probed ----------------------------------------------------------------
class Probe:
    """What one partition produced: its wall time and the FLOPs of its two graphs."""

    def __init__(self):
        self.seconds, self.flops = 0.0, 0

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)
        t0 = time.perf_counter()
        fw, bw = min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)
        self.seconds += time.perf_counter() - t0
        self.flops += sum(flops(n) for g in (fw, bw) for n in g.graph.nodes if n.op == "call_function")
        return fw, bw


class InductorProbe(CustomPartitionerFn):
    def __init__(self, probe: Probe, budget: float):
        self.probe, self.budget = probe, budget

    def __call__(self, gm, joint_inputs, **kwargs):
        return self.probe(gm, joint_inputs, **kwargs)

    def uuid(self):
        return f"pareto-probe-{id(self)}-{self.budget}"


def _eager_fn(gm, _inputs):
    return make_boxed_func(gm.forward)


def compile_variant(fn, system: str, lower: str, budget, **options):
    """(compiled fn, probe-or-None); compiles lazily at the first call, which must run inside
    ``budget_scope``. ``options``: more remat options."""
    if system == "remat":
        return torch.compile(fn, backend="remat", options={"memory_budget": budget, "lower": lower, **options},
                             fullgraph=True), None
    probe = Probe()
    if lower == "eager":
        backend = aot_autograd(fw_compiler=_eager_fn, bw_compiler=_eager_fn, decompositions=decompositions(),
                               partition_fn=probe, keep_inference_input_mutations=True)
        return torch.compile(fn, backend=backend, fullgraph=True), probe

    def inductor(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches={"custom_partitioner_fn": InductorProbe(probe, budget)})

    return torch.compile(fn, backend=inductor, fullgraph=True), probe


def budget_scope(system: str, budget):
    # the AOTAutograd cache would skip the partition on a hit (no probe, no plan)
    patch = {"enable_autograd_cache": False}
    if system == "torch":
        patch["activation_memory_budget"] = float(budget)
    return torch._functorch.config.patch(**patch)


# -- one model ----------------------------------------------------------------------------------
def measure(key: str, args) -> List[dict]:
    rows: List[dict] = []
    variants: Dict[str, tuple] = {}
    model, bind, fn = build_model(key, args)
    variants["eager"] = (model, bind(fn))
    total = len(args.lowerings) * 3 * len(args.budgets)
    n = 0
    for lower in args.lowerings:
        torch_saved = {}
        for system in ("torch", "remat", "remat@torch"):
            for budget in args.budgets:
                n += 1
                # remat@torch: remat with a byte budget equal to what PyTorch saved at this budget
                value = int(torch_saved[budget]) if system == "remat@torch" else budget
                model, bind, fn = build_model(key, args)
                compiled, probe = compile_variant(fn, "torch" if system == "torch" else "remat", lower, value,
                                                  **({} if system == "torch" else {"rerun": False, "peak_slack": 0}))
                step = bind(compiled)
                t0 = time.perf_counter()
                try:
                    with budget_scope(system, budget):
                        step().backward()  # compiles
                except Exception as e:  # a byte budget below remat's feasible minimum
                    if "BudgetInfeasible" not in repr(e):
                        raise
                    print(f"[{key}] {n}/{total} {lower:8s} {system}: {int(value):,} bytes is below remat's minimum")
                    continue
                compile_s = time.perf_counter() - t0
                plan = remat.last_plan() if system != "torch" else None
                heap, saved = measure_heap(model, step), measure_hooks(model, step)
                row = {"model": key, "lower": lower, "system": system, "budget": budget,
                       "saved": saved, "heap": heap, "compile_s": compile_s}
                if system == "torch":
                    torch_saved[budget] = saved
                if plan is not None:
                    rep = plan.budget
                    row.update(plan_bytes=plan.total_bytes, target=rep.target, minimum=rep.minimum,
                               maximum=rep.maximum, gflop=plan.total_flops / 1e9, solve_ms=rep.solve_seconds * 1e3,
                               partition_ms=plan.partition_seconds * 1e3, solver=rep.solver)
                else:
                    row.update(gflop=probe.flops / 1e9, partition_ms=probe.seconds * 1e3)
                rows.append(row)
                variants[f"{lower}/{system}/{budget}"] = (model, step)
                print(f"[{key}] {n}/{total} {lower:8s} {system:11s} budget {budget:<4}: saved "
                      f"{fmt_bytes(row['saved'])} (heap {fmt_bytes(heap)}), {row['gflop']:.3f} GFLOP, partition "
                      f"{row['partition_ms']:.0f} ms, compile {compile_s:.1f} s", flush=True)
    # torch's nominal target, by its own definition (linear between its budget-0 and budget-1 bytes)
    for lower in args.lowerings:
        pts = {r["budget"]: r["saved"] for r in rows if r["lower"] == lower and r["system"] == "torch"}
        if 0.0 in pts and 1.0 in pts:
            for r in rows:
                if r["lower"] == lower and r["system"] == "torch":
                    r["target"] = pts[0.0] + r["budget"] * (pts[1.0] - pts[0.0])
    if not args.skip_time:
        torch._dynamo.config.error_on_recompile = True
        times = interleaved_step_times({k: (m, s) for k, (m, s) in variants.items()}, args.steps, args.warmup)
        torch._dynamo.config.error_on_recompile = False
        base = statistics.median(times["eager"])
        for r in rows:
            r["time_x"] = statistics.median(times[f"{r['lower']}/{r['system']}/{r['budget']}"]) / base
            r["step_ms"] = statistics.median(times[f"{r['lower']}/{r['system']}/{r['budget']}"]) * 1e3
        print(f"[{key}] eager no-AC step {base * 1e3:.1f} ms")
    return rows


def dropout_errors(key: str, args) -> List[dict]:
    """Max |grad - grad at budget 1.0| / max |grad at budget 1.0|, same system, same seed."""
    out = []
    for system in ("torch", "remat"):
        grads = {}
        for budget in sorted(set(args.dropout_budgets) | {1.0}, reverse=True):
            model, bind, fn = build_model(key, args, dropout=0.1)
            compiled, _ = compile_variant(fn, system, "eager", budget)
            with budget_scope(system, budget):
                torch.manual_seed(123)
                bind(compiled)().backward()
            grads[budget] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        ref = grads[1.0]
        for budget in args.dropout_budgets:
            err = ((grads[budget] - ref).abs().max() / ref.abs().max()).item()
            out.append({"model": key, "system": system, "budget": budget, "rel_err": err})
            print(f"[{key}] dropout 0.1, {system} budget {budget}: max rel grad error {err:.2e}", flush=True)
    return out


# -- report -------------------------------------------------------------------------------------
def _table(rows: List[dict], key: str, lower: str, args) -> List[str]:
    get = {(r["system"], r["budget"]): r for r in rows if r["model"] == key and r["lower"] == lower}
    timed = not args.skip_time
    head = ("| budget | torch saved | torch target | remat saved | remat target | torch GFLOP | remat GFLOP | "
            + ("torch time | remat time | " if timed else "") + "torch partition ms | remat partition ms (ILP) | "
            + "remat @ torch's bytes: saved, GFLOP" + (", time" if timed else "") + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for b in args.budgets:
        t, r = get.get(("torch", b)), get.get(("remat", b))
        if t is None or r is None:
            continue
        over = t.get("target")
        tt = f"{fmt_bytes(over)} ({(t['saved'] / over - 1) * 100:+.1f}%)" if over else "-"
        cells = [f"{b:g}", fmt_bytes(t["saved"]), tt, fmt_bytes(r["saved"]), fmt_bytes(r["target"]),
                 f"{t['gflop']:.3f}", f"{r['gflop']:.3f}"]
        if timed:
            cells += [f"{t['time_x']:.3f}", f"{r['time_x']:.3f}"]
        cells += [f"{t['partition_ms']:.0f}", f"{r['partition_ms']:.0f} ({r['solve_ms']:.0f}, {r['solver']})"]
        m = get.get(("remat@torch", b))
        cells.append("below remat's minimum" if m is None else
                     f"{fmt_bytes(m['saved'])}, {m['gflop']:.3f}" + (f", {m['time_x']:.3f}" if timed else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def compare(rows: List[dict], key: str, lower: str) -> List[str]:
    """At equal or lower saved bytes: remat's FLOPs and time against PyTorch's, point by point."""
    pts = [r for r in rows if r["model"] == key and r["lower"] == lower]
    torch_pts = sorted((r for r in pts if r["system"] == "torch"), key=lambda r: r["saved"])
    remat_pts = [r for r in pts if r["system"] == "remat"]
    frontier = [r for r in pts if r["system"] != "torch"]
    lines = []
    matched = {r["budget"]: r for r in pts if r["system"] == "remat@torch"}
    fr = [(t["budget"], matched[t["budget"]]["gflop"] / t["gflop"]) for t in torch_pts if t["budget"] in matched]
    if fr:
        lines.append(f"- {lower} lowering, remat with a byte budget = PyTorch's saved bytes, FLOPs / PyTorch's: "
                     + ", ".join(f"{b:g}: {x:.4f}" for b, x in sorted(fr)) + f" (max {max(x for _, x in fr):.4f})")
    tr = [(t["budget"], matched[t["budget"]]["time_x"] / t["time_x"]) for t in torch_pts
          if t["budget"] in matched and "time_x" in t]
    if tr:
        lines.append(f"- {lower} lowering, same, median step time / PyTorch's: "
                     + ", ".join(f"{b:g}: {x:.3f}" for b, x in sorted(tr))
                     + f" (median {statistics.median(x for _, x in tr):.3f})")
    flop_ratios, time_ratios = [], []
    for t in torch_pts:
        cands = [r for r in frontier if r["saved"] <= t["saved"]]
        if not cands:
            continue
        best = min(cands, key=lambda r: r["gflop"])
        flop_ratios.append((t["budget"], best["budget"], best["gflop"] / t["gflop"] if t["gflop"] else 1.0))
        if "time_x" in best:
            fastest = min(cands, key=lambda r: r["time_x"])
            time_ratios.append((t["budget"], fastest["budget"], fastest["time_x"] / t["time_x"]))
    if flop_ratios:
        worst = max(flop_ratios, key=lambda x: x[2])
        lines.append(f"- {lower} lowering, FLOPs: for each PyTorch point, remat's fewest FLOPs (any run) at equal or "
                     f"lower saved bytes / PyTorch's: max {worst[2]:.4f} (PyTorch budget {worst[0]:g} vs remat {worst[1]:g}), "
                     f"median {statistics.median(x[2] for x in flop_ratios):.4f}")
    if time_ratios:
        lines.append(f"- {lower} lowering, step time: remat's fastest at equal or lower saved bytes / PyTorch's: "
                     + ", ".join(f"{tb:g}: {x:.3f}" for tb, _, x in time_ratios)
                     + f" (median {statistics.median(x for *_, x in time_ratios):.3f})")
    mono = [r["saved"] for r in sorted(remat_pts, key=lambda r: -r["budget"])]
    adher = all(r["saved"] <= r["target"] for r in remat_pts)
    lines.append(f"- {lower} lowering, remat: saved bytes monotone as the budget shrinks: "
                 f"{mono == sorted(mono, reverse=True)}; never above its target: {adher}; "
                 f"PyTorch above its own linear target at budgets "
                 + (", ".join(f"{r['budget']:g} ({(r['saved'] / r['target'] - 1) * 100:+.1f}%)" for r in torch_pts
                              if r.get("target") and r["saved"] > r["target"] * 1.0005) or "none"))
    return lines


def plot(rows: List[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(args.lowerings), len(models), figsize=(6 * len(models), 4.2 * len(args.lowerings)),
                             squeeze=False)
    for i, lower in enumerate(args.lowerings):
        for j, key in enumerate(models):
            ax = axes[i][j]
            for system, style in (("torch", "s--"), ("remat", "o-"), ("remat@torch", "x:")):
                pts = sorted((r for r in rows if r["model"] == key and r["lower"] == lower and r["system"] == system),
                             key=lambda r: r["budget"])
                xs, ys = [r["saved"] / 2**20 for r in pts], [r["gflop"] for r in pts]
                label = {"torch": "PyTorch activation_memory_budget", "remat": 'backend="remat" memory_budget',
                         "remat@torch": "remat, byte budget = PyTorch's saved bytes"}[system]
                ax.plot(xs, ys, style, label=label)
                for r, x, y in zip(pts, xs, ys):
                    ax.annotate(f"{r['budget']:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6)
            ax.set_title(f"{key}, {lower} lowering")
            ax.set_xlabel("saved activation bytes (MiB)")
            ax.set_ylabel("GFLOP per fwd+bwd step")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_budget_args(p, ",".join(f"{0.1 * i:.1f}" for i in range(11)))
    p.add_argument("--dropout-budgets", default="0,0.5")
    add_model_args(p, steps=5)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "pareto.md")
    args = parse_budget_args(p, argv)
    args.dropout_budgets = floats(args.dropout_budgets)
    return args


def main(argv=None) -> str:
    args = parse_args(argv)
    cmd = " ".join(["python benchmarks/pareto.py", *(sys.argv[1:] if argv is None else argv)])
    rows, drops = [], []
    text = ""
    for key in [k.strip() for k in args.models.split(",") if k.strip()]:
        rows += measure(key, args)
        if args.dropout_budgets:
            drops += dropout_errors(key, args)
        text = report(rows, drops, args, cmd)  # after each model, so a long run leaves what it has
    return text


def report(rows, drops, args, cmd) -> str:
    out = ["# Memory budget: PyTorch activation_memory_budget vs backend=\"remat\" (CPU)", "",
           f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.machine()}; command: `{cmd}`; "
           f"layers {args.layers}, d_model {args.d_model}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}, "
           f"batch {args.batch}, float32. Time = median fwd+bwd step / eager without checkpointing.", ""]
    for key in sorted({r["model"] for r in rows}):
        for lower in args.lowerings:
            out += [f"## {key}, {lower} lowering", ""] + _table(rows, key, lower, args) + [""]
        out += [f"### {key}: at equal or lower saved bytes", ""]
        for lower in args.lowerings:
            out += compare(rows, key, lower)
        out += [""]
    if drops:
        out += ["## Dropout 0.1: gradient error against the same system at budget 1.0 (same seed)", "",
                "| model | system | budget | max rel grad error |", "|---|---|---|---|"]
        out += [f"| {d['model']} | {d['system']} | {d['budget']:g} | {d['rel_err']:.2e} |" for d in drops]
        out += [""]
    return write_outputs(args.out, rows, out, lambda png: plot(rows, args, png))


if __name__ == "__main__":
    main()
