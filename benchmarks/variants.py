"""Step time and measured peak of remat variants side by side, in one process: each variant is
``name=<options as JSON>``, compiled on benchmarks/gpu.py's Llama (defaults here: 8 layers, hidden
128, batch 4 x 256, CPU, one thread), then the variants' steps are interleaved (--rounds rounds,
the first dropped) so that a slower minute of the machine falls on all of them alike.

    python benchmarks/variants.py 'off={"peak_budget": "24MiB"}' \\
        'alike={"peak_budget": "24MiB", "blocks_alike": 0.01}'

A variant's JSON may also hold ``"_blocks_first": false``, which is not an option: the rerun search
for the lowest peak without its second search, the one that reruns whole blocks first
(remat_fx/passes/rerun.py ``_BLOCKS_FIRST``), set while that variant's graphs are planned:

    python benchmarks/variants.py 'values={"memory_budget": 0, "_blocks_first": false}' \\
        'both={"memory_budget": 0}'

Per variant: the plan's estimated step peak and step time (cost model), the median step time
and the measured step peak (CPU: the profiler's allocation events, remat_fx.measure.step_peak_bytes;
CUDA: the allocator's maximum over the step).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.warm_start import model_arguments  # noqa: E402


def variant_backend(options: dict):
    """The remat backend with ``options``, one callable per variant. Dynamo keeps each backend's
    compiled code apart, where ``backend="remat"`` with equal options would share it; and no
    ``torch._dynamo.reset()`` is needed between variants (after one, each earlier variant compiles
    again at its next call, the module switches as the later variant left them: a variant without
    the blocks-first search then ran with it). ``_blocks_first`` is set around this variant's
    planning only."""
    from remat_fx.backend import backend
    from remat_fx.passes import rerun

    options = dict(options)
    blocks_first = options.pop("_blocks_first", True)

    def compile_variant(gm, example_inputs):
        before, rerun._BLOCKS_FIRST = rerun._BLOCKS_FIRST, blocks_first
        try:
            return backend(gm, example_inputs, options)
        finally:
            rerun._BLOCKS_FIRST = before

    return compile_variant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="name=<remat options as JSON>")
    model_arguments(ap)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp())
    os.environ.setdefault("REMAT_FX_PLAN_CACHE", "0")
    import torch

    import remat_fx as remat
    from benchmarks.gpu import build
    from remat_fx.measure import step_peak_bytes

    torch.set_num_threads(args.threads)
    args.model, args.device = "llama", torch.device(args.device)
    model, ids = build(args)
    variants = {}
    for text in args.variants:
        name, _, options = text.partition("=")
        variants[name] = json.loads(options)

    def step(fn):
        model.zero_grad(set_to_none=True)
        fn(ids, labels=ids).loss.backward()

    def synced(fn):
        step(fn)
        if args.device.type == "cuda":
            torch.cuda.synchronize()

    fns, plans = {}, {}
    for name, options in variants.items():
        fns[name] = torch.compile(model, backend=variant_backend(options))
        synced(fns[name])
        plans[name] = remat.last_plan()
    times = {name: [] for name in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            synced(fn)
            times[name].append(time.perf_counter() - t0)
    rows = ["| variant | est. peak MiB | measured peak MiB | est. step ms | step ms (median) |",
            "|---|---:|---:|---:|---:|"]
    for name, fn in fns.items():
        model.zero_grad(set_to_none=True)
        peak = step_peak_bytes(lambda fn=fn: fn(ids, labels=ids).loss.backward(), args.device)
        plan = plans[name]
        rows.append(f"| {name} | {plan.peak.step / 2**20:.2f} | {peak / 2**20:.2f} | {plan.step_cost_s * 1e3:.1f} | "
                    f"{statistics.median(times[name][1:]) * 1e3:.1f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
