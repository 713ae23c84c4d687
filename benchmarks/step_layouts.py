"""Whole-step byte limits in the layouts users write their steps in (CPU, the eager lowering).

Each layout runs ``--steps`` steps under a byte ``peak_budget`` and prints, per step, the measured
peak (``remat_fx.measure.step_peak_bytes``: the profiler's allocations over one forward and backward,
the gradients set to None first), the step's estimate (``remat.step_report()``) and whether remat
said the loss is outside the compiled graphs:

- ``hf-kept``: a Hugging Face Llama (8 layers, hidden 64, vocab 2,000, batch 4 x 128) compiled whole,
  ``out = model(input_ids=ids, labels=ids); out.loss.backward()`` (the ModelOutput keeps the logits);
- ``hf-dropped``: the same with ``model(...).loss.backward()`` (nothing keeps them);
- ``blocks-eager-head``: 8 transformer blocks compiled one by one (hidden 128, batch 4 x 128), the
  embedding, head (vocab 12,000) and cross-entropy eager (torchtitan's layout);
- ``blocks-compiled-head``: the same with the head and loss compiled under the same options.

    python benchmarks/step_layouts.py                       # all four, their default limits
    python benchmarks/step_layouts.py --layouts hf-kept --limit 38MiB
"""
from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("REMAT_FX_PLAN_CACHE", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import remat_fx as remat  # noqa: E402
from remat_fx.measure import step_peak_bytes  # noqa: E402
from remat_fx.step import STEP  # noqa: E402

MiB = 2**20
LIMITS = {"hf-kept": "38MiB", "hf-dropped": "38MiB", "blocks-eager-head": "90MiB", "blocks-compiled-head": "90MiB"}


def hf_step(limit: str, keep: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=256, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    cfg._attn_implementation = "sdpa"
    hf = LlamaForCausalLM(cfg).train()
    model = torch.compile(hf, backend="remat", options={"lower": "eager", "peak_budget": limit})
    ids = torch.randint(0, 2000, (4, 128), generator=torch.Generator().manual_seed(1))

    def step():
        hf.zero_grad(set_to_none=True)
        if keep:
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        else:
            model(input_ids=ids, labels=ids).loss.backward()
    return step


class Block(torch.nn.Module):
    def __init__(self, d=128, heads=4):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d, bias=False)
        self.up, self.down = torch.nn.Linear(d, 4 * d, bias=False), torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(self.n1(x)).split(d, -1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.n2(x))))


def blocks_step(limit: str, compiled_head: bool):
    torch.manual_seed(0)
    vocab, options = 12000, {"lower": "eager", "peak_budget": limit}
    emb, norm, head = torch.nn.Embedding(vocab, 128), torch.nn.LayerNorm(128), torch.nn.Linear(128, vocab, bias=False)
    blocks = torch.nn.ModuleList(Block() for _ in range(8))
    for block in blocks:
        block.compile(backend="remat", options=options)
    modules = torch.nn.ModuleList([emb, norm, head, blocks])
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, vocab, (4, 128), generator=g), torch.randint(0, vocab, (4, 128), generator=g)

    def tail(h):
        return F.cross_entropy(head(norm(h)).view(-1, vocab), targets.view(-1))

    run_tail = torch.compile(tail, backend="remat", options=options) if compiled_head else tail

    def step():
        modules.zero_grad(set_to_none=True)
        h = emb(tokens)
        for block in blocks:
            h = block(h)
        run_tail(h).backward()
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(LIMITS))
    parser.add_argument("--limit", default=None, help="one peak_budget for every layout (default: each its own)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| layout | peak_budget | step | measured MiB | estimate MiB | loss outside the graphs said |")
    print("|---|---|---:|---:|---:|---|")
    for layout in args.layouts.split(","):
        limit = args.limit or LIMITS[layout]
        torch._dynamo.reset()
        STEP.reset()
        step = hf_step(limit, keep=layout == "hf-kept") if layout.startswith("hf") else \
            blocks_step(limit, compiled_head=layout == "blocks-compiled-head")
        for n in range(1, args.steps + 1):
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                measured = step_peak_bytes(step)
            told = any("loss is not an output" in str(w.message) for w in said)
            estimate = remat.step_report().peak.peak
            print(f"| {layout} | {limit} | {n} | {measured / MiB:.2f} | {estimate / MiB:.2f} | "
                  f"{'yes' if told else '-'} |", flush=True)


if __name__ == "__main__":
    main()
