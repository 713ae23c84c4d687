"""The first step of a job's second process: what a restart, the next run of a sweep or a rerun
after a crash pays, against PyTorch's own at the same budget.

Each variant runs in two fresh processes that share one Inductor cache folder and one remat cache
folder, both new for the variant: the first process compiles from nothing (Inductor's kernels,
its FX graph cache and AOTAutograd's cache are written; remat's plan cache and graph records too),
the second finds what the first wrote. Both PyTorch's and remat's second process hit AOTAutograd's
cache, which skips the tracing of the joint graph, the partition and the lowering; remat reads
each graph's plan from its record (docs/compiler.md#the-plan-cache). A first step is timed from the
``torch.compile`` call to the end of the first backward: PyTorch's backend imports Inductor inside
``torch.compile`` (1.8-3.6 s on this machine) and remat's at the first call, where its options say how
to lower; until 2026-11-29 the clock started after ``torch.compile``, which left PyTorch's import
out of its first step and counted remat's.

    python benchmarks/warm_start.py --budgets 0.3,0.1,7MiB,peak=24MiB --monotone default,grid

A second table splits each first process's first step: remat's planning, Inductor's lowering
(``compile_fx_inner``, forward and backward, from Dynamo's ``compile_times``) and, inside it, the
wait for the C++/Triton kernels to compile (``async_compile.wait``), with the kernels Inductor
generated (``torch._inductor.metrics.generated_kernel_count``: every layer's copy of a kernel
counted) and the kernels compiled (the distinct ones: the C++ libraries and Triton binaries the
process wrote to its new cache folder); the rest is Dynamo's and AOTAutograd's tracing and the step
itself. ``--first-only`` runs the first process alone (``--rounds 3``: every variant three times,
in turn, and a table of the medians, each ratio taken within its round: one run's ratio moved by
up to 0.2 between runs on this machine); ``--blocks-alike default,off,0.01`` gives remat's
variants without the option (its default, 'final'), with it off, and at 0.01
(docs/budgets.md#repeated-blocks-alike); ``--options '{"rerun": false}'``
gives remat's variants more options.

A budget is a fraction, a size ("7MiB", remat only: PyTorch's budget is a fraction) or a
peak_budget ("peak=24MiB", remat only); the rows of the last two are compared with the PyTorch
budget before them in the list. The model is benchmarks/gpu.py's
(an HF Llama built from config; defaults here: 8 layers, hidden 128, batch 4 x 256, CPU, one
thread).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One process: build the model, compile, time the first step, print a JSON line."""
    import torch

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(args.threads)
    import remat_fx as remat
    from benchmarks.gpu import build, monotone_option

    args.device = torch.device(args.device)
    model, ids = build(args)
    # from torch.compile(): PyTorch's backend imports Inductor there, remat's at the first call
    t0 = time.perf_counter()
    if args.backend == "torch":
        torch._functorch.config.activation_memory_budget = args.budget
        fn = torch.compile(model)
    else:
        knob, value = _knob(args.budget)
        options = {knob: value, **monotone_option(args.mode), **json.loads(args.options)}
        if args.alike != "default":
            options["blocks_alike"] = False if args.alike == "off" else \
                "final" if args.alike == "final" else float(args.alike)
        fn = torch.compile(model, backend="remat", options=options)
    fn(ids, labels=ids).loss.backward()
    first = time.perf_counter() - t0
    from torch._dynamo.utils import compile_times, counters
    from torch._inductor import metrics

    names, values = compile_times(repr="csv", aggregate=True)
    phase = dict(zip(names, map(float, values)))
    plan = remat.last_plan() if args.backend == "remat" else None
    print(json.dumps({"first_s": first, "planning_s": plan.partition_seconds if plan else None,
                      "partitions": plan.peak_evaluations if plan else None,
                      "from_cache": plan.from_cache if plan else None,
                      "fx_graph_cache_hits": counters["inductor"].get("fxgraph_cache_hit", 0),
                      "aot_autograd_cache_hits": counters["aot_autograd"].get("autograd_cache_hit", 0),
                      "inductor_s": phase.get("compile_fx_inner", 0.0),
                      "kernel_wait_s": phase.get("async_compile.wait", 0.0),
                      "kernels": metrics.generated_kernel_count, "compiled": _compiled_kernels()}))


def _compiled_kernels() -> int:
    """Kernel binaries in this process's Inductor cache folder (new for the variant: the first
    process's are the ones it compiled)."""
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not folder:
        return 0
    return sum(name.endswith((".so", ".cubin", ".hsaco")) for _, _, names in os.walk(folder) for name in names)


def _budget(text: str):
    """A fraction (0.3) or a size ("7MiB"), as memory_budget takes them, or "peak=" and a
    peak_budget ("peak=24MiB", remat only)."""
    try:
        return float(text)
    except ValueError:
        return text


def _knob(budget) -> tuple:
    """(the remat option, its value) of a budget as _budget reads it."""
    if isinstance(budget, str) and budget.startswith("peak="):
        return "peak_budget", budget[len("peak="):]
    return "memory_budget", budget


def run_twice(args, backend: str, budget: float, mode: str, alike: str = "default") -> list:
    """The first step of the two processes (one with ``--first-only``), as child() reports them."""
    with tempfile.TemporaryDirectory() as inductor, tempfile.TemporaryDirectory() as remat_dir:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor, REMAT_FX_CACHE_DIR=remat_dir,
                   REMAT_FX_PLAN_CACHE="1", OMP_NUM_THREADS=str(args.threads))
        cmd = [sys.executable, __file__, "--child", backend, "--budget", str(budget), "--mode", mode, "--alike", alike,
               "--options", args.options,
               *[f"--{k}={getattr(args, k)}" for k in ("layers", "hidden", "vocab", "batch", "seq", "device",
                                                       "threads")]]
        out = []
        for _ in range(1 if args.first_only else 2):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            if proc.returncode != 0:
                raise SystemExit(f"{backend} {budget} {mode}: {proc.stderr[-3000:]}")
            out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        return out


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """The model's arguments (benchmarks/gpu.py's build) with this machine's defaults: its Llama of
    8 layers, hidden 128, batch 4 x 256, on the CPU, one thread."""
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="0.3,0.1")
    ap.add_argument("--monotone", default="default,grid",
                    help="option monotone, comma-separated: default (left out: 'auto'), auto, a number of levels, grid")
    model_arguments(ap)
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--first-only", action="store_true", help="the first process alone (the phases table)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --first-only: run every variant this many times, in turn, and add a table of the "
                         "medians (a ratio is taken within its round)")
    ap.add_argument("--blocks-alike", default="default",
                    help="remat's variants with option blocks_alike: 'default' (not given), 'off', 'final' or "
                         "fractions, comma-separated (default,off,0.01)")
    ap.add_argument("--options", default="{}", help="more options for remat's variants, as JSON")
    ap.add_argument("--child", default=None, choices=["torch", "remat"], help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=_budget, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="default", help=argparse.SUPPRESS)
    ap.add_argument("--alike", default="default", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = "llama"
    if args.rounds < 1 or (args.rounds > 1 and not args.first_only):
        ap.error("--rounds takes a count of 1 or more, and more than 1 only with --first-only")
    if args.child:
        args.backend = args.child
        child(args)
        return
    rows = ["| variant | first process: first step s (planning s, partitions) | second process: first step s | "
            "second / PyTorch's second |", "|---|---:|---:|---:|"]
    phases = ["| variant | first step s | / PyTorch's | planning s | Inductor s | of which kernel compiles s | "
              "kernels generated | kernels compiled |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base = first = None  # PyTorch's second and first process at the last fraction budget
    rounds: dict = {}  # label -> [(first process's run, its first step / PyTorch's in the same round)]

    def split(label: str, run: dict) -> None:
        planning = "" if run["planning_s"] is None else f"{run['planning_s']:.1f}"
        ratio = "" if first is None else f"{run['first_s'] / first:.2f}"
        rounds.setdefault(label, []).append((run, None if first is None else run["first_s"] / first))
        phases.append(f"| {label} | {run['first_s']:.1f} | {ratio} | {planning} | "
                      f"{run['inductor_s']:.1f} | {run['kernel_wait_s']:.1f} | {run['kernels']} | {run['compiled']} |")
        print(phases[-1], flush=True)

    for budget in (_budget(b) for _ in range(args.rounds) for b in args.budgets.split(",")):
        if isinstance(budget, float):
            torch_runs = run_twice(args, "torch", budget, "")
            first = torch_runs[0]["first_s"]
            split(f"PyTorch budget {budget:g}", torch_runs[0])
            if not args.first_only:
                base = torch_runs[1]["first_s"]
                rows.append(f"| PyTorch budget {budget:g} | {first:.1f} | {base:.1f} (AOTAutograd "
                            f"cache hits {torch_runs[1]['aot_autograd_cache_hits']}) | 1.00 |")
                print(rows[-1], flush=True)
        for mode, alike in ((m, a) for m in args.monotone.split(",") for a in args.blocks_alike.split(",")):
            knob, value = _knob(budget)
            label = f"{knob} {value:g}" if isinstance(value, float) else f"{knob} {value}"
            label += f", monotone {mode}" + ("" if alike == "default" else f", blocks_alike {alike}") \
                + ("" if args.options == "{}" else f", {args.options}")
            runs = run_twice(args, "remat", budget, mode, alike)
            split(f"remat {label}", runs[0])
            if args.first_only:
                continue
            cold, warm = runs
            how = "AOTAutograd cache hit, plan from the record" if warm["aot_autograd_cache_hits"] else \
                f"planning {warm['planning_s']:.1f} s, {warm['partitions']} partitions" + \
                (", the plan cache's choice" if warm["from_cache"] else "")
            ratio = "" if base is None else f"{warm['first_s'] / base:.2f}"
            rows.append(f"| remat {label} | {cold['first_s']:.1f} "
                        f"({cold['planning_s']:.1f}, {cold['partitions']}) | {warm['first_s']:.1f} ({how}) | {ratio} |")
            print(rows[-1], flush=True)
    print("\n".join(([] if args.first_only else rows + [""]) + phases))
    if args.rounds > 1:
        print("\n" + "\n".join(median_table(rounds)))


def median_table(rounds: dict) -> list:
    """The medians over the rounds of each variant (in the order first run): first step, its ratio to
    PyTorch's of the same round (and each round's), planning and Inductor time, kernels compiled."""
    lines = [f"| variant | first step s (median of {max(len(v) for v in rounds.values())}) | / PyTorch's (each round) | "
             "planning s | Inductor s | kernels compiled |", "|---|---:|---:|---:|---:|---:|"]
    for label, runs in rounds.items():
        ratios = [r for _, r in runs if r is not None]
        ratio = "" if not ratios else f"{statistics.median(ratios):.2f} ({', '.join(f'{r:.2f}' for r in ratios)})"
        planning = [run["planning_s"] for run, _ in runs if run["planning_s"] is not None]
        lines.append(f"| {label} | {statistics.median(run['first_s'] for run, _ in runs):.1f} | {ratio} | "
                     + ("" if not planning else f"{statistics.median(planning):.1f}")
                     + f" | {statistics.median(run['inductor_s'] for run, _ in runs):.1f} | "
                     f"{statistics.median(run['compiled'] for run, _ in runs):g} |")
    return lines


if __name__ == "__main__":
    main()
