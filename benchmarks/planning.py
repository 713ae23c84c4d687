"""Planning alone: where remat's partition spends its time, on the joint graph of an 8-layer
Hugging Face Llama (benchmarks/gpu.py's model by default), without lowering anything (CPU).

    python benchmarks/planning.py [--budgets 0.1,0.05,0] [--monotone default[,1,grid]]
                                  [--layers 8] [--hidden 128] [--intermediate 352] [--heads 1] [--vocab 1000]
                                  [--seq 256] [--batch 4] [--lower inductor|eager] [--repeat 1] [--out FILE]
                                  [--device cpu|cuda] [--autocast auto|bf16|none] [--as-cuda]

On a GPU, the joint graph of benchmarks/gpu.py's Llama (as its first step plans it: on CUDA, under
bf16 autocast), planned here on the host's CPU as the compile plans it (benchmarks/gpu_check.sh
runs it):

    python benchmarks/planning.py --device cuda --layers 8 --hidden 2048 --intermediate 5632 --heads 16 \
        --vocab 32000 --seq 2048 --batch 4 --budgets 0.1,0

The model's joint graph is captured once (on ``--device``, under bf16 autocast where ``--autocast``
says so: by default on CUDA only, as benchmarks/gpu.py runs it), as a compile under ``--lower`` gives it to remat's
partition (under Inductor, after Inductor's own graph passes; remat_fx/pareto.py ``_capture``); each
variant then runs remat's partition on it again with its options, as the compile does, with the plan
cache off, and nothing is lowered. (Until 2026-12-01 the graph was captured under the eager
lowering whatever ``--lower`` said: without Inductor's joint-graph passes, a graph Inductor never
plans, 1,867 backward nodes at budget 0 on the default Llama against the compile's 1,683.) A
first-step figure is planning plus Dynamo's and Inductor's work (docs/benchmarks.md, "First step",
``benchmarks/warm_start.py``); this splits the planning:

* ``min-cut``: PyTorch's ``min_cut_rematerialization_partition`` (one per candidate plan),
* ``solver``: the budget solver (``apply_budget``: the MILP, or a fallback),
* ``rerun``: the rerun searches (``rerun_for_peak``), and inside them ``simulate``: the liveness of
  each program the search tries (``rerun._Program.simulate``),
* ``estimate``: the step-peak estimates of candidate plans (``passes/peak.py estimate``),
* ``other``: the rest (tags, the peak searches' bookkeeping, the schedule, the cost model).

Without a GPU, ``--as-cuda`` plans the graph captured on the CPU as a CUDA compile would: every
value of the joint graph becomes a fake CUDA tensor of the same shape, strides, dtype and storage
bytes (``as_cuda``), so remat's CUDA rules (passes/peak.py: the incoming gradient held to the
backward's end, ``writes_apart``, ``fused_back``, the embedding's gradient written in place) and
the CUDA roofline of the cost model apply. The graph itself stays the CPU's (Inductor's CPU
joint-graph passes, the CPU's attention op; bf16 autocast by default, as benchmarks/gpu.py runs
its models, with the CPU's autocast policy): a stand-in for the planning of a GPU's graph, not
that graph.

Each figure is (calls, seconds), from a wrapper around the function, no profiler. With ``--repeat``
each variant is planned that many times and the fastest planning is kept (the others' counts are the
same: the search is deterministic). Each planning starts without the budget solver's kept answers
(passes/budget.py ``_SOLVED``, ``_MINIMA``), as a compile in a new process would. Prints a
markdown table and, for each ``--monotone`` mode, whether the estimated peak rises as its fraction
budgets fall (``verdict``; writes both to ``--out``).

Memory budgets only: a compile plans a ``peak_budget`` for the whole step (remat_fx/step.py gives
each graph the limit the step leaves it: the gradients, what other graphs hold), which a partition
of the joint graph alone would not see.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks.gpu import monotone_option  # noqa: E402
from benchmarks.llama_depth import add_shape_args, build  # noqa: E402
from remat_fx.memory_budget import fmt_bytes  # noqa: E402
from remat_fx.options import parse_options  # noqa: E402
from remat_fx.passes.cost import concrete  # noqa: E402
from remat_fx.passes import budget as _budget  # noqa: E402
from remat_fx.passes import partition as _partition  # noqa: E402
from remat_fx.passes import rerun as _rerun  # noqa: E402
from remat_fx.pareto import _capture, _tracing  # noqa: E402

PARTS = ("min-cut", "solver", "rerun", "simulate", "estimate")


class Timers:
    """(calls, seconds) of the functions ``install`` wraps, per part."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.calls = {p: 0 for p in PARTS}
        self.seconds = {p: 0.0 for p in PARTS}

    def wrap(self, part: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[part] += 1
                self.seconds[part] += time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def installed(timers: Timers):
    """The planning's parts wrapped where partition.py and rerun.py look them up, and the plan cache
    off (every variant searches: the cache would replay a plan), until the block ends. (PyTorch's
    partitioner makes lazy modules inside remat's partition, as under ``torch.compile``:
    passes/lazy_module.py ``lazy_modules``.)"""
    with contextlib.ExitStack() as stack:
        for owner, name, part in ((_partition, "min_cut_rematerialization_partition", "min-cut"),
                                  (_partition, "apply_budget", "solver"),
                                  (_partition, "rerun_for_peak", "rerun"),
                                  (_partition, "estimate_peak", "estimate"),
                                  (_rerun._Program, "simulate", "simulate")):
            stack.enter_context(mock.patch.object(owner, name, timers.wrap(part, getattr(owner, name))))
        stack.enter_context(mock.patch.dict(os.environ, {"REMAT_FX_PLAN_CACHE": "0"}))
        yield


def as_cuda(graphs):
    """The captured joint graphs, each value (node meta ``val``, rewritten in place, and the joint
    inputs) now a fake CUDA tensor in the graph's own fake mode: the same shape, strides, storage
    offset and dtype, and the same storage bytes, values that shared a storage sharing one again
    (fake CUDA tensors need no GPU)."""
    from torch._guards import detect_fake_mode
    from torch.multiprocessing.reductions import StorageWeakRef

    out = []
    for gm, joint_inputs, kwargs in graphs:
        mode = detect_fake_mode(joint_inputs)
        bases, made = {}, {}

        def convert(v):
            if isinstance(v, (tuple, list)):
                return type(v)(convert(x) for x in v)
            if not isinstance(v, torch.Tensor) or v.device.type != "cpu":
                return v
            if id(v) not in made:
                storage = v.untyped_storage()
                key = StorageWeakRef(storage)
                with mode:
                    if key not in bases:
                        bases[key] = torch.empty(concrete(storage.nbytes()), dtype=torch.uint8, device="cuda")
                    base = bases[key]
                    # a storage of an odd size (a dtype view's base): its whole elements, the same storage
                    whole = base.numel() - base.numel() % v.element_size()
                    t = base.as_strided((whole,), (1,)).view(v.dtype)  # (indexing a fake CUDA tensor needs CUDA)
                    t = t.as_strided(v.shape, v.stride(), v.storage_offset())
                    if v.requires_grad:
                        t.requires_grad_(True)
                made[id(v)] = (v, t)  # v kept: its id stays its own
            return made[id(v)][1]

        for node in gm.graph.nodes:
            if "val" in node.meta:
                node.meta["val"] = convert(node.meta["val"])
        out.append((gm, convert(joint_inputs), kwargs))
    return out


def verdict(monotone: str, peaks: dict) -> str:
    """Whether the estimated step peak rises as the memory budget falls, over the fraction budgets
    planned under one ``--monotone`` mode (``peaks``: budget as given -> its estimated peak, bytes);
    empty with fewer than two of them. Its first rise names the two budgets."""
    fractions = []
    for spec, peak in peaks.items():
        try:
            fractions.append((float(spec), spec, peak))
        except ValueError:  # a byte budget ("7MiB") is not on the fractions' scale
            continue
    if len(fractions) < 2:
        return ""
    fractions.sort(reverse=True)
    top = fractions[0]
    for budget in fractions[1:]:
        if budget[2] > top[2]:
            return (f"monotone={monotone}: the estimated peak **rises** as the budget falls: {budget[1]} at "
                    f"{fmt_bytes(budget[2])} over {top[1]}'s {fmt_bytes(top[2])} (+{budget[2] / top[2] - 1:.0%})")
        top = min(top, budget, key=lambda b: b[2])
    return (f"monotone={monotone}: the estimated peak does not rise as the budget falls "
            f"({fractions[0][1]} to {fractions[-1][1]})")


def variant_options(spec: str, monotone: str, lower: str) -> dict:
    """``0.1`` -> memory_budget 0.1 (a fraction, or a size: ``7MiB``)."""
    if spec.startswith("peak"):
        raise SystemExit(f"benchmarks/planning.py: {spec!r}: a peak_budget is planned for the whole step "
                         "(remat_fx/step.py), not by the partition of one joint graph; time it in a compile "
                         "(benchmarks/warm_start.py --budgets peak=...)")
    try:
        budget = float(spec)
    except ValueError:
        budget = spec
    return {"lower": lower, **monotone_option(monotone), "memory_budget": budget}


def plan_once(graphs, options: dict, timers: Timers) -> dict:
    """Partitions every captured joint graph under ``options``; the figures of the last graph's plan
    (the Llama's loss is in its one graph) and the parts' times summed over the graphs."""
    parsed = parse_options(options)
    timers.reset()
    # as a compile in a new process plans: the budget solver's answers kept from an earlier planning
    # of the same graph in this one (another variant, an earlier --repeat) are dropped
    _budget._SOLVED.clear()
    _budget._MINIMA.clear()
    t0 = time.perf_counter()
    for gm, joint_inputs, kwargs in graphs:
        with _tracing(joint_inputs):
            _partition.partition(gm, joint_inputs, options=parsed, **kwargs)
    total = time.perf_counter() - t0
    plan = remat.last_plan()
    return dict(total=total, calls=dict(timers.calls), seconds=dict(timers.seconds),
                saved=plan.total_bytes, peak=plan.peak.step,
                reruns=plan.rerun.reruns if plan.rerun is not None else 0)


def row(label: str, r: dict) -> str:
    s, c = r["seconds"], r["calls"]
    other = r["total"] - sum(s[p] for p in PARTS if p != "simulate")  # simulate is inside rerun
    parts = " | ".join(f"{c[p]} / {s[p]:.2f}" for p in PARTS)
    return (f"| {label} | {r['total']:.2f} | {parts} | {other:.2f} | {fmt_bytes(r['saved'])} | "
            f"{fmt_bytes(r['peak'])} | {r['reruns']} |")


HEAD = ("| variant | planning s | min-cut (calls / s) | solver | rerun | of which simulate | estimate | other s | "
        "saved | est. peak | reruns |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="0.1,0.05,0")
    p.add_argument("--monotone", default="default",
                   help="comma-separated: default (left out: auto), auto, a number of levels (1 = nearest), grid")
    p.add_argument("--lower", default="inductor", choices=("inductor", "eager"))
    add_shape_args(p, intermediate=352, heads=1)  # benchmarks/gpu.py's Llama
    p.add_argument("--repeat", type=int, default=1, help="plan each variant this many times, keep the fastest")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: PyTorch's default)")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cpu", help="where the model runs while its joint graph is captured")
    p.add_argument("--as-cuda", action="store_true",
                   help="plan the graph captured on the CPU as on CUDA (fake CUDA tensors: CUDA's rules and roofline)")
    p.add_argument("--autocast", default="auto", choices=("auto", "bf16", "none"),
                   help="bf16 autocast around the captured forward (auto: on CUDA and --as-cuda, as benchmarks/gpu.py)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    bf16 = args.autocast == "bf16" or (args.autocast == "auto" and (device.type == "cuda" or args.as_cuda))
    if args.as_cuda and device.type != "cpu":
        raise SystemExit(f"benchmarks/planning.py: --as-cuda plans a graph captured on the CPU as on CUDA; with "
                         f"--device {args.device} leave it out")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"benchmarks/planning.py: --device {args.device}, but torch {torch.__version__} sees no CUDA "
                         "device here; leave --device out to capture on the CPU")
    specs = list(dict.fromkeys(b for b in args.budgets.split(",") if b))  # each once, in the order given
    modes = args.monotone.split(",")
    for monotone in modes:  # every variant checked before the compile that captures the graph
        for spec in specs:
            parse_options(variant_options(spec, monotone, args.lower))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, loss, ids = build(args, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        # the joint graph the compile plans under that lowering
        graphs = _capture(loss, (ids,), {"lower": args.lower})
    if args.as_cuda:
        graphs = as_cuda(graphs)
    nodes = sum(len(gm.graph.nodes) for gm, _, _ in graphs)
    timers = Timers()
    rows, peaks = [], {}
    with installed(timers):
        for monotone in modes:
            for spec in specs:
                runs = [plan_once(graphs, variant_options(spec, monotone, args.lower), timers)
                        for _ in range(max(1, args.repeat))]
                best = min(runs, key=lambda r: r["total"])
                label = spec if monotone == "default" else f"{spec}, monotone={monotone}"
                rows.append(row(label, best))
                peaks.setdefault(monotone, {})[spec] = best["peak"]
                print(rows[-1], flush=True)
    text = (f"{args.layers}-layer Llama (hidden {args.hidden}, intermediate {args.intermediate}, {args.heads} head(s), "
            f"vocab {args.vocab}, batch {args.batch} x {args.seq}), {len(graphs)} joint graph(s) of {nodes} nodes, "
            f"lower={args.lower}, {device.type}{' planned as on CUDA' if args.as_cuda else ''}"
            f"{', bf16 autocast' if bf16 else ''}, torch {torch.__version__}\n\n"
            + HEAD + "\n" + "\n".join(rows) + "\n"
            + "".join(f"\n{line}" for line in (verdict(mode, found) for mode, found in peaks.items()) if line)
            + ("\n" if len(specs) > 1 else ""))
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
