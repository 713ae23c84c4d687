"""A job's second process on a step of several graphs: what a restart pays where the step was
planned as a whole (a whole-step limit, a fraction peak_budget: remat_fx/step.py plan_step).

Each variant runs in two fresh processes sharing new Inductor and remat cache folders, on
benchmarks/step.py's model (blocks with a graph break halfway: a step of two graphs), Inductor, one
thread. Each of the first three steps is timed (the first from ``torch.compile``; the step's own
plan runs at the second step's first forward), with the first step's measured peak
(remat_fx.measure.step_peak_bytes: the profiler's memory timeline, around the first step, its
compiles included) and estimate (the plans each call ran), then the measured peak of a later step
and its estimate. In the second process the step's record in the plan cache gives each graph its plan at
its first call (docs/step.md#a-jobs-next-process-the-steps-record). The last column counts the
lowerings of the step's graphs in the process (a graph lowered again counts again).

    python benchmarks/step_restart.py --variants '{"peak_budget": 0.5}' '{"peak_budget": "80MiB"}' \\
        '{"memory_budget": "30MiB"}'
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    import remat_fx as remat
    from benchmarks.step import Model
    from remat_fx.measure import step_peak_bytes
    from remat_fx.step import STEP, CompiledGraph

    lowered = []  # each lowering of a graph in this process (a compile, or a lowering again)
    lower = CompiledGraph._lower
    CompiledGraph._lower = lambda self, *a, **k: lowered.append(self.index) or lower(self, *a, **k)

    torch.manual_seed(0)
    model = Model(args.d_model, args.layers)
    x = torch.randn(args.batch, args.seq, args.d_model, generator=torch.Generator().manual_seed(1))
    t0 = time.perf_counter()
    run = torch.compile(model, backend="remat", options=json.loads(args.child))

    def step():
        model.zero_grad(set_to_none=True)
        run(x).backward()

    times, first, first_peak = [], None, None
    for _ in range(3):
        if first_peak is None:
            first_peak = step_peak_bytes(step)
        else:
            step()
        times.append(time.perf_counter() - t0)
        first = first or remat.step_report().peak.peak  # the first step's estimate: the plans it ran
        t0 = time.perf_counter()
    peak = step_peak_bytes(step)
    plan = STEP.step_plan
    print(json.dumps({"steps_s": times, "peak": peak, "first_estimate": first, "first_peak": first_peak,
                      "estimate": remat.step_report().peak.peak,
                      "shared": None if plan is None else plan.fraction,
                      "from_cache": None if plan is None else plan.from_cache,
                      "lowerings": len(lowered)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=['{"peak_budget": 0.5}', '{"memory_budget": "30MiB"}'],
                    help="remat options of each variant, as JSON")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    rows = ["| options | process | steps 1 / 2 / 3 s | first step: measured peak MiB (estimate) | later step: measured "
            "peak MiB (estimate) | shared budget | step's plan | lowerings |", "|---|---:|---|---|---|---:|---|---:|"]
    for options in args.variants:
        with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{folder}/inductor", REMAT_FX_CACHE_DIR=f"{folder}/remat",
                       REMAT_FX_PLAN_CACHE="1", OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--child", options, "--layers", str(args.layers), "--d-model",
                   str(args.d_model), "--seq", str(args.seq), "--batch", str(args.batch)]
            for process in (1, 2):
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=folder)
                if out.returncode != 0:
                    raise SystemExit(f"{options}: {out.stderr[-3000:]}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                how = "-" if r["from_cache"] is None else "read from the plan cache" if r["from_cache"] else "searched"
                mib = {k: f"{r[k] / 2**20:.2f}" for k in ("first_peak", "first_estimate", "peak", "estimate")}
                rows.append(f"| `{options}` | {process} | {' / '.join(f'{t:.2f}' for t in r['steps_s'])} | "
                            f"{mib['first_peak']} ({mib['first_estimate']}) | {mib['peak']} ({mib['estimate']}) | "
                            f"{r['shared']} | {how} | {r['lowerings']} |")
                print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
