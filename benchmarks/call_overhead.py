"""What the remat backend adds to each call of a compiled graph at run time (CPU).

    python benchmarks/call_overhead.py [--budgets 1,0.3] [--steps 150] [--layers 4] [--d-model 128]

The example GPT (examples/gpt.py, no annotations), every block compiled alone, as under FSDP2:
PyTorch's Inductor (``activation_memory_budget = b``) against ``backend="remat"`` with
``memory_budget = b`` and the Inductor lowering. At budget 1 both run the same generated code
(the plan without a budget is lowered as PyTorch lowers it), so their step times differ by what
remat does around each call: the step's run-time record (remat_fx/step.py). ``--no-record``
times remat with that record off (each call runs the lowered graph alone) for the floor. Steps
of the two systems alternate, one thread; the ratio is of the medians. Writes a line per budget
to stdout.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx  # noqa: E402,F401 (backend="remat")
from examples.gpt import GPTConfig, make_model, random_batch  # noqa: E402
from remat_fx import step as remat_step  # noqa: E402


def build(system: str, budget: float, cfg: GPTConfig):
    model = make_model(cfg, "none", "recompute_all")
    for block in model.blocks:
        if system == "torch":
            block.compile(backend="inductor")
        else:
            block.compile(backend="remat", options={"lower": "inductor", "memory_budget": budget})
    return model


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="1,0.3")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--no-record", action="store_true", help="remat's calls without the step's run-time record")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.no_record:
        remat_step.CompiledGraph.__call__ = lambda self, *a: self.fn(*a)
    cfg = GPTConfig(vocab=512, seq=64, d_model=args.d_model, n_head=4, n_layer=args.layers)
    idx, targets = random_batch(cfg, 4)
    for budget in (float(b) for b in args.budgets.split(",")):
        patch = {"enable_autograd_cache": False}
        torch._dynamo.reset()
        models = {system: build(system, budget, cfg) for system in ("torch", "remat")}
        times = {system: [] for system in models}

        def step(system):
            model = models[system]
            model.zero_grad(set_to_none=True)
            extra = {"activation_memory_budget": budget} if system == "torch" else {}
            with torch._functorch.config.patch(**patch, **extra):
                model(idx, targets).backward()

        for system in models:  # compile, plan the step, settle
            for _ in range(3):
                step(system)
        for k in range(args.steps):
            for system in (("torch", "remat") if k % 2 else ("remat", "torch")):
                t0 = time.perf_counter()
                step(system)
                times[system].append(time.perf_counter() - t0)
        t, r = statistics.median(times["torch"]), statistics.median(times["remat"])
        print(f"budget {budget:g}: torch {t * 1e3:.2f} ms, remat {r * 1e3:.2f} ms, remat / torch {r / t:.3f}"
              f"{' (no run-time record)' if args.no_record else ''}", flush=True)


if __name__ == "__main__":
    main()
