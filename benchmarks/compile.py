"""Compiler-mode benchmark: backend="remat" against eager, torch.utils.checkpoint, Inductor and
PyTorch selective activation checkpointing (SAC), on CPU.

    python benchmarks/compile.py [--models gpt,hf] [--layers 4] [--d-model 256] [--seq 128] [--batch 8]
                                 [--steps 15] [--warmup 2]

Two models: (a) the example GPT (examples/gpt.py) and (b) a transformers GPT-2 built from a small
config (no download; loss = cross_entropy on the logits, computed here).  Six rows per model:

  1. eager, no activation checkpointing (AC)
  2. eager, torch.utils.checkpoint(use_reentrant=False) per block
  3. torch.compile(backend="inductor"), no AC
  4. torch.compile(backend="inductor") + PyTorch SAC per block saving the matmuls
     (create_selective_checkpoint_contexts with a list of aten matmul ops, see MATMUL_OPS)
  5. torch.compile(backend="remat", options={"lower": "inductor"}) with the same policy, named:
     example GPT: remat.checkpoint per block + the ``save_matmuls`` preset (SAVE qkv/proj/up/down);
     GPT-2: remat.checkpoint per block + options={"save": HF_SAVE_GLOBS}
  6. as 5 with options={"lower": "eager"} (the partitioned FX graphs run op by op), for reference

Every variant gets a fresh model (same seed, same weights) and one compiled callable
(``fullgraph=True``) that is kept for all measurements; its first call compiles.  Then:

* bytes held from forward to backward, on the 2nd step (the 1st compiles / warms up):
  ``heap``: mallinfo2 delta around the forward (benchmarks/memory.py ``held_after``, gc before both
  readings); ``hooks``: unique non-parameter storages packed by saved_tensors_hooks, in a separate
  step (``SavedTensorBytes``); ``plan``: ``remat.last_plan().total_bytes`` for the remat rows.
  Under torch.compile everything the compiled graph keeps for backward goes through
  ``ctx.save_for_backward`` of AOTAutograd's Function, so hooks and heap agree there; in eager,
  hooks see only the region inputs of a checkpointed block.
* FLOPs per fwd+bwd step: ``torch.profiler`` (``with_flops``, ``record_shapes``) around one step,
  summing the matmul events (aten::mm/addmm/bmm/baddbmm); Inductor on CPU calls these as extern
  kernels, so the profiler sees them in compiled code too (checked: row 3 == row 1).  The profiler
  gives no FLOPs for CPU SDPA (aten::_scaled_dot_product_flash_attention_for_cpu[_backward]), and
  neither does FlopCounterMode, so those are added from the recorded input shapes with
  torch.utils.flop_counter's sdpa formulas (full T x T, the causal mask is not discounted).
  Eager rows are cross-checked with FlopCounterMode (which must not wrap a compiled call: a
  TorchDispatchMode makes Dynamo skip the frame, measuring eager).  Element-wise FLOPs are left
  out everywhere (Inductor fuses them into C++ kernels the profiler cannot count).
* step time: median of ``--steps`` fwd+bwd steps per variant after ``--warmup`` more, all six
  variants interleaved round-robin (rotating order) with ``torch._dynamo.config.error_on_recompile``
  on, so a silent recompile (or a fallback to eager) would fail loudly.

Writes ``benchmarks/out/compile.md`` (``--out``).
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

os.environ.setdefault("REMAT_FX_PLAN_CACHE", "0")  # a first step times the search, not a replay of the last run's

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks.memory import fmt_bytes, measure_heap, measure_hooks  # noqa: E402
from benchmarks.timing import add_model_args, interleaved_step_times, write_report  # noqa: E402
from examples import gpt as example_gpt  # noqa: E402

aten = torch.ops.aten

# Which aten matmuls SAC saves, per model (what the traced forward graphs contain, checked with
# remat.last_plan().forward_ops):
#   example GPT: addmm x4 per block (the qkv/proj/up/down Linears), bmm x2 per block (QK^T and PV
#     inside the attn.core Function), one mm (the tied LM head, outside the blocks).  The example's
#     "save_matmuls" preset SAVEs the four Linears and RECOMPUTEs attn.core, so the same policy in
#     SAC terms is {mm, addmm}: bmm is left out on purpose (saving it would also keep attention
#     scores, which remat's row recomputes).
#   GPT-2: addmm x4 per block (Conv1D c_attn, attn.c_proj, c_fc, mlp.c_proj), attention through
#     SDPA (_scaled_dot_product_flash_attention_for_cpu, not a matmul op, recomputed), no bmm;
#     one mm (LM head, outside the blocks).  The list {mm, addmm, bmm} = the four addmm.
MATMUL_OPS = {
    "gpt": [aten.mm.default, aten.addmm.default],
    "hf": [aten.mm.default, aten.addmm.default, aten.bmm.default],
}
# GPT-2's matmul nodes are named <module path>.<aten op>: transformer.h.0.block.attn.c_attn.addmm,
# ...attn.c_proj.addmm, ...mlp.c_fc.addmm, ...mlp.c_proj.addmm
HF_SAVE_GLOBS = ["*.c_attn.addmm", "*.c_proj.addmm", "*.c_fc.addmm"]

MATMUL_EVENTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
SDPA_FWD = "aten::_scaled_dot_product_flash_attention_for_cpu"
SDPA_BWD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward"

ROWS = [
    ("eager", "eager, no AC"),
    ("eager_ckpt", "eager + torch.utils.checkpoint per block"),
    ("inductor", "torch.compile (inductor), no AC"),
    ("inductor_sac", "torch.compile (inductor) + PyTorch SAC, save matmuls"),
    ("remat", "backend=\"remat\" (lower=inductor), save matmuls"),
    ("remat_eager", "backend=\"remat\" (lower=eager), save matmuls"),
]
COMPILED = {"inductor", "inductor_sac", "remat", "remat_eager"}


# -----------------------------------------------------------------------------
# block wrappers
# -----------------------------------------------------------------------------
def sac_context_fn(ops):
    return functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, list(ops))


class TorchCheckpointBlock(nn.Module):
    """Runs ``block`` under torch.utils.checkpoint (non-reentrant), optionally selective."""

    def __init__(self, block: nn.Module, context_fn: Optional[Callable] = None):
        super().__init__()
        self.block = block
        self.context_fn = context_fn

    def forward(self, *args, **kwargs):
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        return torch_checkpoint.checkpoint(self.block, *args, use_reentrant=False, **extra, **kwargs)


class RematBlock(nn.Module):
    """Runs ``block`` as one remat.checkpoint region (as tests/test_hf_gpt2.py does)."""

    def __init__(self, block: nn.Module, name: str):
        super().__init__()
        self.block, self.name = block, name

    def forward(self, *args, **kwargs):
        return remat.checkpoint(self.name)(self.block)(*args, **kwargs)


# -----------------------------------------------------------------------------
# the two models: build(kind) -> (model, step) where step() returns the loss
# -----------------------------------------------------------------------------
class Bench:
    key: str
    title: str

    def build(self, kind: str):
        raise NotImplementedError


class ExampleGPT(Bench):
    key, title = "gpt", "example GPT (examples/gpt.py)"

    def __init__(self, args):
        self.cfg = example_gpt.GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model,
                                         n_head=args.heads, n_layer=args.layers)
        self.batch = args.batch
        self.idx, self.targets = example_gpt.random_batch(self.cfg, args.batch)
        # The example caches its causal mask in a module-level dict on first use; done inside a
        # traced checkpoint region that write is a side effect Dynamo rejects (see the report), so
        # the mask is made eagerly here, before anything is compiled.
        example_gpt._causal_mask(self.cfg.seq, self.idx.device)

    def config_line(self):
        c = self.cfg
        return (f"layers {c.n_layer}, d_model {c.d_model}, heads {c.n_head}, seq {c.seq}, vocab {c.vocab}, "
                f"batch {self.batch}, float32, dropout 0, tied LM head")

    def build(self, kind):
        ckpt = {"eager_ckpt": "torch", "remat": "remat", "remat_eager": "remat"}.get(kind, "none")
        model = example_gpt.make_model(self.cfg, ckpt, "save_matmuls" if ckpt == "remat" else "recompute_all")
        if kind == "inductor_sac":
            ctx = sac_context_fn(MATMUL_OPS[self.key])
            for i, block in enumerate(model.blocks):
                model.blocks[i] = TorchCheckpointBlock(block, ctx)
        fn = _compile(model, kind, {})
        return model, functools.partial(fn, self.idx, self.targets)


class HFGPT2(Bench):
    key, title = "hf", "transformers GPT-2 (GPT2LMHeadModel, small config)"

    def __init__(self, args):
        import transformers

        self.transformers = transformers
        self.cfg = transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.d_model, n_head=args.heads, n_positions=args.seq,
            vocab_size=args.vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
            bos_token_id=0, eos_token_id=0)
        self.batch = args.batch
        self.attn_impl = None
        self.ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

    def config_line(self):
        c = self.cfg
        return (f"n_layer {c.n_layer}, n_embd {c.n_embd}, n_head {c.n_head}, n_positions {c.n_positions}, "
                f"vocab {c.vocab_size}, batch {self.batch}, float32, dropout 0, use_cache=False, "
                f"attention {self.attn_impl or '(set when built)'}, transformers {self.transformers.__version__}")

    def build(self, kind):
        torch.manual_seed(0)
        model = self.transformers.GPT2LMHeadModel(self.cfg)
        model.train()
        self.attn_impl = model.config._attn_implementation
        blocks = model.transformer.h
        for i, block in enumerate(blocks):
            if kind == "eager_ckpt":
                blocks[i] = TorchCheckpointBlock(block)
            elif kind == "inductor_sac":
                blocks[i] = TorchCheckpointBlock(block, sac_context_fn(MATMUL_OPS[self.key]))
            elif kind in ("remat", "remat_eager"):
                blocks[i] = RematBlock(block, f"h.{i}")

        def loss(ids):
            logits = model(ids).logits
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

        fn = _compile(loss, kind, {"save": HF_SAVE_GLOBS})
        return model, functools.partial(fn, self.ids)


def _compile(fn, kind: str, remat_options: dict):
    if kind in ("eager", "eager_ckpt"):
        return fn
    if kind in ("inductor", "inductor_sac"):
        return torch.compile(fn, backend="inductor", fullgraph=True)
    lower = "inductor" if kind == "remat" else "eager"
    return torch.compile(fn, backend="remat", options={**remat_options, "lower": lower}, fullgraph=True)


# -----------------------------------------------------------------------------
# measurements
# -----------------------------------------------------------------------------
def run_step(model, step):
    model.zero_grad(set_to_none=True)
    loss = step()
    loss.backward()
    return loss.detach()


def _sdpa_flops(evt) -> int:
    shapes = evt.input_shapes
    try:
        if evt.name == SDPA_FWD:
            q, k, v = shapes[:3]
            return int(sdpa_flop_count(q, k, v))
        if evt.name == SDPA_BWD:  # (grad_out, query, key, value, out, logsumexp, ...)
            g, q, k, v = shapes[:4]
            return int(sdpa_backward_flop_count(g, q, k, v))
    except (ValueError, IndexError, TypeError):
        pass
    return 0


def profiled_flops(model, step) -> dict:
    """FLOPs of one fwd+bwd step as the profiler sees them: matmul events plus SDPA by formula."""
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True, record_shapes=True) as prof:
        step().backward()
    model.zero_grad(set_to_none=True)
    by_op: Dict[str, int] = {}
    counts: Dict[str, int] = {}
    for evt in prof.key_averages():
        if evt.key in MATMUL_EVENTS:
            by_op[evt.key] = by_op.get(evt.key, 0) + int(evt.flops)
            counts[evt.key] = counts.get(evt.key, 0) + evt.count
    sdpa = 0
    for evt in prof.events():
        if evt.name in (SDPA_FWD, SDPA_BWD):
            sdpa += _sdpa_flops(evt)
            counts[evt.name] = counts.get(evt.name, 0) + 1
    if sdpa:
        by_op["sdpa (formula)"] = sdpa
    return {"total": sum(by_op.values()), "by_op": by_op, "counts": counts}


def flop_counter_flops(model, step) -> int:
    """FlopCounterMode (eager rows only; it has no formula for the CPU SDPA ops)."""
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as fc:
        step().backward()
    model.zero_grad(set_to_none=True)
    return int(fc.get_total_flops())


# -----------------------------------------------------------------------------
# one model
# -----------------------------------------------------------------------------
def bench_model(bench: Bench, args) -> List[str]:
    print(f"\n=== {bench.title}: {bench.config_line()}", flush=True)
    torch._dynamo.reset()
    torch._dynamo.config.error_on_recompile = False
    variants, res, plans, compile_s = {}, {}, {}, {}
    for kind, label in ROWS:
        model, step = bench.build(kind)
        t0 = time.perf_counter()
        if kind in ("remat", "remat_eager"):
            # remat's partitioner records the Plan only when it runs; an AOTAutograd cache hit (a
            # rerun of this script) skips it and last_plan() would be None or stale (see the
            # report), so that cache is off for the remat rows' compile
            with torch._functorch.config.patch(enable_autograd_cache=False):
                before = remat.last_plan()
                run_step(model, step)
                plans[kind] = remat.last_plan()
            if plans[kind] is None or plans[kind] is before or plans[kind].lower != ("inductor" if kind == "remat" else "eager"):
                raise RuntimeError(f"no remat plan was recorded for row {kind}")
        else:
            run_step(model, step)  # compiles (forward at the call, backward at the first backward)
        compile_s[kind] = time.perf_counter() - t0
        variants[kind] = (model, step)
        print(f"  built {label}: first step {compile_s[kind]:.1f}s", flush=True)
    # from here on a recompile (e.g. a guard failing and Dynamo retracing) is an error
    torch._dynamo.config.error_on_recompile = True
    # heap readings of every variant first (2nd step of each; a 3rd as a check), before any
    # profiler or hook runs, so nothing those leave behind can be freed inside a reading
    heaps = {kind: [measure_heap(*variants[kind])] for kind, _ in ROWS}
    for kind, _ in ROWS:
        heaps[kind].append(measure_heap(*variants[kind]))
    for kind, label in ROWS:
        model, step = variants[kind]
        r = {"heap": heaps[kind][0], "heap_check": heaps[kind][1], "hooks": measure_hooks(model, step)}
        r["flops"] = profiled_flops(model, step)
        r["flop_counter"] = flop_counter_flops(model, step) if kind not in COMPILED else None
        res[kind] = r
        print(f"  {label}: heap {fmt_bytes(r['heap'])} (3rd step {fmt_bytes(r['heap_check'])}), hooks {fmt_bytes(r['hooks'])}, "
              f"FLOPs {r['flops']['total'] / 1e9:.3f} G {r['flops']['by_op']}", flush=True)
    print(f"\n  remat plan (row 5, lower=inductor), printed once:\n{plans['remat']}\n", flush=True)
    times = None
    if not args.skip_time:
        times = interleaved_step_times(variants, args.steps, args.warmup)
    torch._dynamo.config.error_on_recompile = False
    lines = report_model(bench, res, plans, times, compile_s, args)
    print("\n".join(lines), flush=True)
    del variants
    torch._dynamo.reset()
    gc.collect()
    return lines


def _by_reason(plan) -> str:
    out: Dict[str, int] = {}
    for sv in plan.saved:
        if sv.reason == "parameter":
            continue
        key = re.sub(r"'[^']*'", "'…'", sv.reason.split(" (")[0])
        out[key] = out.get(key, 0) + sv.bytes
    return "; ".join(f"{k}: {fmt_bytes(v)}" for k, v in sorted(out.items(), key=lambda kv: -kv[1]))


def _by_owner(plan) -> str:
    out: Dict[str, int] = {}
    for owner, nbytes in plan.bytes_by_owner().items():
        key = re.sub(r"\.\d+\.", ".*.", owner)
        out[key] = out.get(key, 0) + nbytes
    return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in out.items())


def _heap_cell(r) -> str:
    a, b = r["heap"], r["heap_check"]
    if abs(a - b) <= max(64 * 1024, abs(a) // 200):
        return fmt_bytes(a)
    return f"{fmt_bytes(a)} (3rd step: {fmt_bytes(b)})"


def _g(flops: Optional[int]) -> str:
    return "-" if flops is None else f"{flops / 1e9:.3f}"


def report_model(bench: Bench, res, plans, times, compile_s, args) -> List[str]:
    med = {k: statistics.median(v) for k, v in times.items()} if times else {}
    base = med.get("eager")
    lines = [f"## {bench.title}", "", f"config: {bench.config_line()}", "",
             "| # | variant | held: saved_tensors_hooks | held: heap Δ after forward | remat Plan total_bytes "
             "| GFLOPs / step (profiler) | GFLOPs (FlopCounterMode) | median step ms | vs row 1 | vs row 4 | first step s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for i, (kind, label) in enumerate(ROWS, 1):
        r = res[kind]
        plan = plans.get(kind)
        t = med.get(kind)
        vs1 = f"{t / base:.3f}" if t is not None else "-"
        vs4 = f"**{t / med['inductor_sac']:.3f}**" if t is not None and kind == "remat" else "-"
        lines.append(
            f"| {i} | {label} | {fmt_bytes(r['hooks'])} | {_heap_cell(r)} | "
            f"{fmt_bytes(plan.total_bytes) if plan else '-'} | {_g(r['flops']['total'])} | {_g(r['flop_counter'])} | "
            f"{f'{t * 1e3:.1f}' if t is not None else '-'} | {vs1} | {vs4} | {compile_s[kind]:.1f} |")
    lines.append("")
    # FLOPs detail
    lines.append("FLOPs by op (profiler; SDPA by formula from recorded shapes), and event counts:")
    lines.append("")
    for i, (kind, label) in enumerate(ROWS, 1):
        f = res[kind]["flops"]
        def n(k):
            if k in f["counts"]:
                return f"{f['counts'][k]}x"
            return f"{f['counts'].get(SDPA_FWD, 0)} fwd + {f['counts'].get(SDPA_BWD, 0)} bwd calls"
        parts = ", ".join(f"{k} {v / 1e9:.3f} G ({n(k)})" for k, v in f["by_op"].items())
        lines.append(f"- row {i}: {parts}")
    for kind in ("remat", "remat_eager"):
        p = plans[kind]
        lines.append(f"- Plan ({p.lower}): recompute_flops {p.recompute_flops / 1e9:.3f} G "
                     f"({len(p.recomputed)} forward nodes rerun in backward); forward matmuls "
                     f"{ {k: p.forward_ops[k] for k in ('mm', 'addmm', 'bmm', 'baddbmm') if p.forward_ops[k]} }, "
                     f"backward matmuls { {k: p.backward_ops[k] for k in ('mm', 'addmm', 'bmm', 'baddbmm') if p.backward_ops[k]} }")
    lines.append(f"- Plan (row 5) bytes by reason: {_by_reason(plans['remat'])}")
    owners = _by_owner(plans["remat"])
    if owners:
        lines.append(f"- Plan (row 5) bytes by remat op they are kept for, summed over blocks: {owners}")
    lines.append("")
    # checks and verdicts
    fl = {k: res[k]["flops"]["total"] for k, _ in ROWS}
    lines.append("Checks:")
    lines.append("")
    lines.append(f"- the profiler sees Inductor's extern matmuls: row 3 / row 1 FLOPs = {fl['inductor'] / fl['eager']:.4f} "
                 f"(both without recompute, expected 1); row 1 profiler vs FlopCounterMode: "
                 f"{fl['eager'] / res['eager']['flop_counter']:.4f} (1 unless SDPA, which FlopCounterMode "
                 "cannot count on CPU, is in the model)")
    lines.append(f"- recompute FLOPs vs row 1: row 2 +{(fl['eager_ckpt'] - fl['eager']) / 1e9:.3f} G, "
                 f"row 4 +{(fl['inductor_sac'] - fl['eager']) / 1e9:.3f} G, row 5 +{(fl['remat'] - fl['eager']) / 1e9:.3f} G, "
                 f"row 6 +{(fl['remat_eager'] - fl['eager']) / 1e9:.3f} G")
    p5 = plans["remat"]
    lines.append(f"- Plan total_bytes (row 5) - hooks (row 5) = {p5.total_bytes - res['remat']['hooks']:+,d} B "
                 "(the Plan also counts graph inputs, hooks count every non-parameter storage saved)")
    lines.append("")
    h4, h5 = res["inductor_sac"]["hooks"], res["remat"]["hooks"]
    m4, m5 = res["inductor_sac"]["heap"], res["remat"]["heap"]
    lines.append("Verdicts (row 5 remat vs row 4 PyTorch SAC, same policy):")
    lines.append("")
    lines.append(f"- bytes by saved_tensors_hooks: remat {fmt_bytes(h5)} vs SAC {fmt_bytes(h4)} "
                 f"(Δ {h5 - h4:+,d} B): **{'PASS' if h5 <= h4 else 'FAIL'}** (target: no more than SAC)")
    tol = max(64 * 1024, m4 // 100)
    lines.append(f"- bytes by heap Δ: remat {fmt_bytes(m5)} vs SAC {fmt_bytes(m4)} (Δ {m5 - m4:+,d} B): "
                 f"**{'PASS' if m5 <= m4 + tol else 'FAIL'}** (target: no more than SAC; {tol // 1024} KiB = "
                 "max(64 KiB, 1%) allowed for allocator noise)")
    if times:
        ratio = med["remat"] / med["inductor_sac"]
        paired = statistics.median(a / b for a, b in zip(times["remat"], times["inductor_sac"]))
        lines.append(f"- step time: remat / SAC = {ratio:.3f} (ratio of medians; median of per-round ratios "
                     f"{paired:.3f}): **{'PASS' if ratio <= 1.05 else 'FAIL'}** (target <= 1.05)")
        lines.append("")
        lines.append(f"Step times: {args.warmup} warm-up + {args.steps} measured fwd+bwd steps per variant "
                     "(no optimizer), six variants interleaved round-robin; min/max ms: "
                     + ", ".join(f"row {i} {min(times[k]) * 1e3:.0f}/{max(times[k]) * 1e3:.0f}"
                                 for i, (k, _) in enumerate(ROWS, 1)))
    lines.append("")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt,hf", help="comma list of: gpt (example GPT), hf (transformers GPT-2)")
    add_model_args(p, steps=15)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "compile.md")
    return p.parse_args(argv)


NOTES = """\
How to read the tables:

- held (saved_tensors_hooks): unique non-parameter storages packed while the forward runs
  (benchmarks/memory.py SavedTensorBytes), in a separate step.  Under torch.compile everything the
  compiled graph keeps for backward is packed through AOTAutograd's ctx.save_for_backward, so this
  column is complete for rows 3-6; in eager it misses what lives inside a checkpoint region (row 2
  shows just the block inputs and what lies outside the blocks).
- held (heap Δ): mallinfo2 bytes allocated after the forward minus before it (gc before both),
  2nd step of the variant (the 1st compiled it), all variants read before any hook/profiler
  step; a 3rd-step reading is shown too where it differs by more than max(64 KiB, 0.5%).
  Includes the loss and anything cached.
- remat Plan total_bytes: remat.last_plan() of the compiled graph (per storage, parameters 0).
- GFLOPs / step (profiler): torch.profiler(with_flops=True) around one fwd+bwd step, sum of the
  aten::mm/addmm/bmm/baddbmm events (what Inductor's CPU code calls as extern kernels), plus SDPA
  (GPT-2) from the recorded shapes of aten::_scaled_dot_product_flash_attention_for_cpu[_backward]
  with torch.utils.flop_counter.sdpa_flop_count / sdpa_backward_flop_count (the profiler reports no
  FLOPs for them).  Element-wise FLOPs are not counted.  Same method for all six rows.
- GFLOPs (FlopCounterMode): eager rows only, as a cross-check (a dispatch mode around a compiled
  call would make Dynamo skip the frame).  It has no formula for the CPU SDPA ops, so on GPT-2 it
  is lower than the profiler column by the SDPA FLOPs.
- median step ms: fwd+bwd, no optimizer; "vs row 1" = / eager no AC; "vs row 4" = remat / SAC.
- first step s: the variant's first fwd+bwd, i.e. compile time for rows 3-6.  Inductor's on-disk
  caches make reruns faster; rows 5-6 compile with the AOTAutograd cache off (so that remat's
  partitioner runs and records its Plan), so their figure is not comparable with rows 3-4.
- No recompiles: torch._dynamo.config.error_on_recompile is on from the end of the first steps
  to the end of the timing, so every measured step ran the code compiled at the first step.
"""


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out = ["# remat_fx compiler-mode benchmark (CPU)", "",
           f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
           f"{platform.processor() or platform.machine()}; command: "
           f"`{' '.join(['python benchmarks/compile.py', *(sys.argv[1:] if argv is None else argv)])}`", "",
           "SAC policy (row 4): torch.utils.checkpoint(block, use_reentrant=False, context_fn=partial("
           "create_selective_checkpoint_contexts, OPS)); OPS: example GPT "
           f"{[str(o) for o in MATMUL_OPS['gpt']]} (its Linears are addmm; the attention bmm are left out "
           "because the example's save_matmuls recomputes attn.core), GPT-2 "
           f"{[str(o) for o in MATMUL_OPS['hf']]} (= its four Conv1D addmm per block; no bmm, attention is SDPA). "
           "remat (rows 5-6): example GPT checkpoint=\"remat\" + policy \"save_matmuls\"; GPT-2 "
           f"remat.checkpoint per block + options={{'save': {HF_SAVE_GLOBS}}}.", ""]
    benches = {"gpt": ExampleGPT, "hf": HFGPT2}
    for key in [k.strip() for k in args.models.split(",") if k.strip()]:
        out += bench_model(benches[key](args), args)
    out += [NOTES]
    return write_report(args.out, out)


if __name__ == "__main__":
    main()
