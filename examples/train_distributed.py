"""The example GPT trained a few steps with FSDP2 + backend="remat" + a memory budget.

    torchrun --nproc_per_node 2 examples/train_distributed.py
    torchrun --nproc_per_node 2 examples/train_distributed.py --budget 0 --steps 4
    torchrun --nproc_per_node 2 examples/train_distributed.py --mixed-precision   # bf16 params, fp32 reduce

CPU: gloo, one process per rank. CUDA (when available): nccl, one GPU per rank, unchanged.
Each block is ``fully_shard``-ed and compiled with ``backend="remat"`` (torchtitan's layout:
FSDP2 per block, compile per block); the root is ``fully_shard``-ed too (embeddings, final
LayerNorm, tied head). Rank 0 prints each step's loss and time (on CUDA its measured peak), then
every rank's step plan (``remat.step_report()``: saved bytes, the estimated peak). See
docs/distributed.md.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import remat_fx as remat
from gpt import GPTConfig, make_model, random_batch  # examples/gpt.py (this script's folder is on sys.path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--budget", default="0.3",
                   help="memory_budget: a fraction in [0, 1], a size ('2MiB'), or 'none' (default 0.3)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--lower", choices=("eager", "inductor"), default=None,
                   help="remat's lowering (default: inductor on CUDA, eager on CPU, where Inductor's first "
                        "compile takes minutes)")
    p.add_argument("--mixed-precision", action="store_true",
                   help="FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32), torchtitan's "
                        "default: parameters all-gathered in bf16, so activations are bf16; gradients reduced in fp32")
    return p.parse_args(argv)


def budget_option(text: str) -> dict:
    if text.lower() == "none":
        return {}
    try:
        return {"memory_budget": float(text)}
    except ValueError:
        return {"memory_budget": text}


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    lower = args.lower or ("inductor" if cuda else "eager")
    options = dict(budget_option(args.budget), lower=lower)

    cfg = GPTConfig(vocab=512, seq=args.seq, d_model=args.d_model, n_head=4, n_layer=args.layers)
    with torch.device(device):
        model = make_model(cfg, "none", "recompute_all")  # no annotations: the budget decides
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if args.mixed_precision else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
        block.compile(backend="remat", options=options)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, targets = (t.to(device) for t in random_batch(cfg, args.batch, seed=rank))  # each rank its own data

    if rank == 0:
        print(f"{world} ranks ({'nccl, CUDA' if cuda else 'gloo, CPU'}), GPT {args.layers} layers, d_model "
              f"{args.d_model}, seq {args.seq}, batch {args.batch} per rank"
              f"{', bf16 mixed precision' if args.mixed_precision else ''}; options {options}", flush=True)
    for step in range(args.steps):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - t0
        mean = loss.detach().float()  # a copy, in fp32 (the loss is bf16 under --mixed-precision)
        dist.all_reduce(mean)
        peak = f", measured peak {torch.cuda.max_memory_allocated(device) / 2**20:.2f} MiB" if cuda else ""
        if rank == 0:
            print(f"step {step}: loss {mean.item() / world:.4f} (mean over ranks), {seconds:.2f} s{peak}", flush=True)

    report = remat.step_report()
    budgets = sorted({str(plan.budget.budget) for _, plan, _ in report.calls if plan.budget is not None})
    calls, graphs = len(report.calls), len(report.graphs)
    plural = lambda n, word: f"{n} {word}{'s' * (n != 1)}"  # noqa: E731
    line = (f"rank {rank}: {plural(calls, 'call')} of {plural(graphs, 'compiled graph')}, saved for backward "
            f"{report.saved_bytes / 2**10:.1f} KiB, estimated step peak {report.peak.peak / 2**20:.2f} MiB; "
            f"memory_budget {', '.join(budgets) or 'none'}")
    lines = [None] * world  # rank 0 prints every rank's line, in rank order
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
