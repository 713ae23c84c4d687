"""FSDP2 + PyTorch's activation_memory_budget against FSDP2 + backend="remat", per rank.

    torchrun --nproc_per_node 2 benchmarks/distributed.py [--budgets 1,0.5,0.3,0] [--steps 10]
             [--rounds 3] [--layers 4] [--d-model 128] [--seq 64] [--batch 4] [--lower inductor]
             [--mixed-precision]

The example GPT (examples/gpt.py, no annotations: the budget decides), every block
``fully_shard``-ed and compiled, the root ``fully_shard``-ed; 2 ranks, gloo on CPU. Both systems
use the eager FX lowering (the partitioned graphs run op by op, Inductor's decompositions), or
with ``--lower inductor`` Inductor's:

* torch: AOTAutograd with PyTorch's min-cut partitioner and
  ``torch._functorch.config.activation_memory_budget = b``;
* remat: ``backend="remat"``, ``memory_budget = b`` (1: no budget);
* and once per round, per-block checkpointing: ``torch.utils.checkpoint`` around each block (FSDP2
  outside it), PyTorch's partitioner, no budget.

Per rank and variant: the measured step peak (remat_fx.measure: the CPU profiler's allocation
events over one warmed-up forward+backward (and zero_grad), highest running total above the
start, frees of earlier memory not credited; the lowest
of 3 measurements in each of ``--rounds`` rounds: FSDP's all-gather buffers are allocated on gloo's
threads, and where they fall against the compute moves a measurement by up to one buffer) and the
step time. Each round builds and compiles every variant again (a Dynamo reset between variants
drops the earlier ones), in the opposite order to the round before, and times ``--steps`` steps
right after the compile; the table gives the median over rounds of each round's median step time,
and of each round's remat / torch ratio at a budget, with that ratio's range over the rounds (one
round's steps share a compile, an allocator state and a thread placement, which move its times
by more than the steps within it vary). Writes a markdown table to stdout (rank 0) and
benchmarks/out/distributed.md.

    torchrun --nproc_per_node 2 benchmarks/distributed.py --accumulation [--budgets 0]

measures instead remat's step peak per rank in each kind of step a training loop runs, with the
backwards' limits (remat_fx/step.py backward_limit) and with every rerun kept: the gradients made
by the step (zero_grad(set_to_none=True) before it) or there before it (a gradient accumulation's
later micro-batches), with gradient sync and without (``set_requires_gradient_sync(False)``), and
the step with gradient sync that ends an accumulation without it; the lowest of 3 x ``--rounds``
measurements of each, in turn, on one compile per variant. Writes
benchmarks/out/distributed_accumulation.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx  # noqa: E402,F401 (backend="remat")
from examples.gpt import GPTConfig, make_model, random_batch  # noqa: E402
from remat_fx import measure  # noqa: E402
from remat_fx.passes.capture import decompositions  # noqa: E402


def _eager_fn(gm, _inputs):
    return make_boxed_func(gm.forward)


def torch_backend():
    return aot_autograd(fw_compiler=_eager_fn, bw_compiler=_eager_fn, decompositions=decompositions(),
                        partition_fn=min_cut_rematerialization_partition, keep_inference_input_mutations=True)


def build(system: str, budget: float, cfg: GPTConfig, lower: str = "eager", mixed: bool = False):
    # "checkpoint": torch.utils.checkpoint around each block (the model's forward), PyTorch's partitioner
    # mixed: FSDP2's MixedPrecisionPolicy, parameters all-gathered in bf16, gradients reduced in fp32
    model = make_model(cfg, "torch" if system == "checkpoint" else "none", "recompute_all")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
        if system in ("torch", "checkpoint"):
            block.compile(backend=torch_backend() if lower == "eager" else "inductor")
        else:
            options = {"lower": lower} if budget >= 1 else {"lower": lower, "memory_budget": budget}
            block.compile(backend="remat", options=options)
    fully_shard(model, mp_policy=policy)
    return model


def accumulation(budgets, cfg: GPTConfig, idx, targets, repeats: int, lowering: str = "eager") -> None:
    """The peak of each kind of step, with the backwards' limits and with every rerun kept."""
    from remat_fx.passes import lower

    kinds = ("made, sync", "there, sync", "made, no sync", "there, no sync", "sync after no sync")
    limit = lower.backward_limit
    peaks: dict = {}
    cpu = torch.device("cpu")
    for b in budgets:
        for variant in ("limits", "every rerun"):
            torch._dynamo.reset()
            lower.backward_limit = limit if variant == "limits" else None
            model = build("remat", b, cfg, lowering)

            def step(sync: bool, model=model):
                model.set_requires_gradient_sync(sync)
                model(idx, targets).backward()

            with scope("remat", b):
                for _ in range(2):  # compiles, then warms up
                    model.zero_grad(set_to_none=True)
                    step(True)
                found = {k: [] for k in kinds}
                for _ in range(repeats):  # the lowest of them (see above)
                    model.zero_grad(set_to_none=True)
                    found["made, sync"].append(measure.step_peak_bytes(lambda: step(True), cpu))
                    found["there, sync"].append(measure.step_peak_bytes(lambda: step(True), cpu))
                    model.zero_grad(set_to_none=True)
                    found["made, no sync"].append(measure.step_peak_bytes(lambda: step(False), cpu))
                    found["there, no sync"].append(measure.step_peak_bytes(lambda: step(False), cpu))
                    found["sync after no sync"].append(measure.step_peak_bytes(lambda: step(True), cpu))
                peaks[b, variant] = {k: min(v) for k, v in found.items()}
            dist.barrier()
    lower.backward_limit = limit
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, peaks)
    if dist.get_rank() == 0:
        lines = [f"remat's step peak per kind of step, FSDP2, {len(every)} ranks (gloo, CPU), GPT {cfg.n_layer} "
                 f"layers, d_model {cfg.d_model}, seq {cfg.seq}, {lowering} lowering; torch {torch.__version__}; "
                 f"the higher of the "
                 f"ranks' lowest of {repeats}, above each step's start (which holds the gradients there)", "",
                 "| budget | reruns | " + " | ".join(kinds) + " |", "|---" * (2 + len(kinds)) + "|"]
        for b in budgets:
            for variant in ("limits", "every rerun"):
                got = [max(r[b, variant][k] for r in every) for k in kinds]
                lines.append(f"| {b:g} | {variant} | " + " | ".join(f"{g / 2**20:.2f} MiB" for g in got) + " |")
        text = "\n".join(lines)
        print(text, flush=True)
        out = ROOT / "benchmarks" / "out"
        out.mkdir(exist_ok=True)
        (out / "distributed_accumulation.md").write_text(text + "\n")


def scope(system: str, budget: float):
    patch = {"enable_autograd_cache": False}
    if system == "torch":
        patch["activation_memory_budget"] = float(budget)
    return torch._functorch.config.patch(**patch)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="1,0.5,0.3,0")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lower", default="eager", choices=["eager", "inductor"],
                   help="both systems' lowering: the partitioned graphs run op by op, or Inductor's C++")
    p.add_argument("--mixed-precision", action="store_true",
                   help="FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on every unit")
    p.add_argument("--accumulation", action="store_true",
                   help="remat's peak in each kind of step, with the backwards' limits and every rerun kept")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(vocab=512, seq=args.seq, d_model=args.d_model, n_head=4, n_layer=args.layers)
    idx, targets = random_batch(cfg, args.batch, seed=rank)
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.accumulation:
        accumulation(budgets, cfg, idx, targets, 3 * args.rounds, args.lower)
        dist.destroy_process_group()
        return
    variants = [(system, b) for b in budgets for system in ("torch", "remat")] + [("checkpoint", 1.0)]

    peaks: dict = {}
    times: dict = {v: [] for v in variants}  # one median per round
    for round_ in range(args.rounds):
        for system, b in (variants if round_ % 2 == 0 else variants[::-1]):
            torch._dynamo.reset()  # each variant compiles its own graphs (a reset drops every earlier one)
            model = build(system, b, cfg, args.lower, args.mixed_precision)

            def step(model=model):
                model(idx, targets).backward()
                model.zero_grad(set_to_none=True)

            with scope(system, b):
                step()  # compiles
                step()
                cpu = torch.device("cpu")
                peak = min(measure.step_peak_bytes(step, cpu) for _ in range(3))  # the lowest of 3: see above
                peaks[system, b] = min(peak, peaks.get((system, b), peak))
                steps = []
                for _ in range(args.steps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    step()
                    steps.append(time.perf_counter() - t0)
                times[system, b].append(statistics.median(steps))
            dist.barrier()
    mine = {v: (peaks[v], times[v]) for v in variants}
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        lines = [f"FSDP2, {world} ranks (gloo, CPU, {torch.get_num_threads()} thread(s) each), GPT {args.layers} "
                 f"layers, d_model {args.d_model}, seq {args.seq}, batch {args.batch} per rank, {args.lower} lowering"
                 f"{', bf16 mixed-precision policy' if args.mixed_precision else ''}; "
                 f"torch {torch.__version__}; {args.rounds} round(s) of {args.steps} steps per variant "
                 f"(rank 0's times: median over rounds of each round's median)", "",
                 "| budget | " + " | ".join(f"rank {r} peak torch | rank {r} peak remat" for r in range(world))
                 + " | time torch | time remat | remat / torch time | ratio range over rounds |",
                 "|---" * (1 + 2 * world + 4) + "|"]
        for b in budgets:
            cells = []
            for r in range(world):
                cells += [f"{every[r]['torch', b][0] / 2**20:.2f} MiB", f"{every[r]['remat', b][0] / 2**20:.2f} MiB"]
            tt, tr = every[0]["torch", b][1], every[0]["remat", b][1]
            ratios = [r / t for t, r in zip(tt, tr)]
            lines.append(f"| {b:g} | " + " | ".join(cells)
                         + f" | {statistics.median(tt) * 1e3:.1f} ms | {statistics.median(tr) * 1e3:.1f} ms"
                         f" | {statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} |")
        tc = every[0]["checkpoint", 1.0][1]
        lines += ["", "Per-block checkpointing (torch.utils.checkpoint around each block, FSDP2 outside it, "
                  "PyTorch's partitioner, no budget): " + ", ".join(
                      f"rank {r} peak {every[r]['checkpoint', 1.0][0] / 2**20:.2f} MiB" for r in range(world))
                  + f", time {statistics.median(tc) * 1e3:.1f} ms; remat's time / its, by budget: " + ", ".join(
                      f"{b:g}: {statistics.median([r / c for c, r in zip(tc, every[0]['remat', b][1])]):.2f}"
                      for b in budgets)]
        text = "\n".join(lines)
        print(text, flush=True)
        out = ROOT / "benchmarks" / "out"
        out.mkdir(exist_ok=True)
        (out / "distributed.md").write_text(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
