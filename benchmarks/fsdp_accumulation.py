"""A gradient accumulation under FSDP2 with a byte ``peak_budget``: measured against the step's estimate.

    torchrun --nproc_per_node 2 benchmarks/fsdp_accumulation.py [--peak 13MiB] [--sync every|last]
             [--micro 2] [--windows 4] [--layers 8]

A GPT of ``--layers`` blocks (d_model 128, 4 heads, seq 64, batch 4 per rank, vocab 512), every
block ``fully_shard``-ed and compiled with ``backend="remat"`` (the eager lowering), the head and
its cross-entropy compiled apart under the same options, the root ``fully_shard``-ed (its
embeddings run eagerly); gloo on CPU. Each window is ``zero_grad(set_to_none=True)`` and
``--micro`` micro-batches of ``(loss / micro).backward()``, with FSDP2's gradient sync at every
micro-batch (``--sync every``, torchtitan's) or at the last only (``--sync last``:
``set_requires_gradient_sync(False)`` before). Rank 0 prints, per window from the second, each
rank's measured peak over the whole window (``remat_fx.measure.step_peak_bytes``: the CPU
profiler's allocation events, from the window's start) and the step report's estimate, and at the
end the report. A limit no plan meets raises ``PeakInfeasible`` on every rank, which is printed.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import remat_fx as remat
from remat_fx.measure import step_peak_bytes
from remat_fx.memory_budget import fmt_bytes

V, T, D, H, B = 512, 64, 128, 4, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(D, dim=-1))
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.loss(x, targets)

    def loss(self, x, targets):
        return F.cross_entropy(self.head(self.ln(x)).view(-1, V), targets.view(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peak", default="13MiB", help="peak_budget (a size)")
    p.add_argument("--sync", choices=("every", "last"), default="last")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    args = p.parse_args()
    os.environ.setdefault("REMAT_FX_PLAN_CACHE", "0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(args.layers)
    options = {"lower": "eager", "peak_budget": args.peak}
    for block in model.blocks:
        fully_shard(block)
        block.compile(backend="remat", options=options)
    model.loss = torch.compile(model.loss, backend="remat", options=options)
    fully_shard(model)

    def window(n):
        model.zero_grad(set_to_none=True)
        for m in range(args.micro):
            g = torch.Generator().manual_seed(1000 * n + 10 * m + rank)
            idx, targets = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
            model.set_requires_gradient_sync(args.sync == "every" or m == args.micro - 1)
            loss = model(idx, targets)
            loss = loss / args.micro
            loss.backward()

    rows = []
    try:
        for n in range(args.windows):
            if n == 0:
                window(n)
                continue
            measured = step_peak_bytes(lambda: window(n))
            rows.append((n, measured, remat.step_report().peak.peak))
    except remat.PeakInfeasible as e:
        if rank == 0:
            print(f"PeakInfeasible: {e}")
        dist.destroy_process_group()
        return
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        sync = "every micro-batch" if args.sync == "every" else "the last micro-batch only"
        print(f"peak_budget {args.peak}, gradient sync at {sync}, {args.micro} micro-batches, {args.layers} blocks, "
              f"{world} ranks")
        print("| window | " + " | ".join(f"rank {r} measured / estimate" for r in range(world)) + " |")
        print("|---:|" + "---:|" * world)
        for k, (n, _, _) in enumerate(rows):
            print(f"| {n} | " + " | ".join(f"{fmt_bytes(everyone[r][k][1])} / {fmt_bytes(everyone[r][k][2])}"
                                           for r in range(world)) + " |")
        print(remat.step_report())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
