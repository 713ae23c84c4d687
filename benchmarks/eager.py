"""Eager-mode benchmark of remat.checkpoint on the example GPT (CPU).

    python benchmarks/eager.py [--steps 9] [--layers 4] [--d-model 256] [--seq 128] [--batch 8]

(a) Step time: median of ``--steps`` measured forward+backward steps (no
    optimizer step; gradients are set to None between steps, outside the timed
    region) after ``--warmup`` steps, for: no checkpointing,
    torch.utils.checkpoint(use_reentrant=False) per block, remat.checkpoint per
    block with every op RECOMPUTE, and remat.checkpoint with the matmuls SAVEd.
    The variants run round-robin (the order rotates every round) on models with
    identical weights and the same batch, so machine noise hits all of them
    alike.  The headline number is remat all-recompute / torch checkpoint (target
    <= 1.05), as a ratio of medians and as the median of per-round ratios.

(b) Activation bytes held from forward to backward, each variant on a fresh
    model, forward+backward run twice and the second reading kept:
    the mallinfo2 delta around the forward (benchmarks/memory.py), the
    ``remat.memory_report(loss).total_bytes`` for the remat rows, and the unique
    non-parameter storages ``torch.autograd.graph.saved_tensors_hooks`` see
    (which excludes what lives inside checkpoint regions and on remat's tape).

Prints a markdown report and writes it to ``benchmarks/out/eager.md`` (``--out``).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.memory import fmt_bytes  # noqa: E402
from benchmarks.timing import add_model_args, interleaved_step_times, write_report  # noqa: E402
from examples.gpt import VARIANTS, GPTConfig, make_model, measure_memory, random_batch  # noqa: E402

TORCH = "torch.utils.checkpoint per block"
REMAT_ALL = "remat all-recompute"
REMAT_SAVE = "remat save-matmuls"
NONE = "no checkpointing"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, steps=9)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "eager.md")
    p.add_argument("--skip-memory", action="store_true")
    return p.parse_args(argv)


def time_steps(cfg: GPTConfig, batch: int, steps: int, warmup: int) -> dict:
    """{label: [seconds per measured fwd+bwd step]}, variants interleaved round-robin."""
    idx, targets = random_batch(cfg, batch)
    variants = {}
    for label, ckpt, pol in VARIANTS:
        model = make_model(cfg, ckpt, pol)
        variants[label] = (model, lambda model=model: model(idx, targets))
    return interleaved_step_times(variants, steps, warmup)


def timing_table(times: dict) -> tuple:
    torch_med = statistics.median(times[TORCH])
    lines = ["| variant | median ms | min ms | max ms | vs torch checkpoint |",
             "|---|---:|---:|---:|---:|"]
    for label, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {label} | {med * 1e3:.1f} | {min(ts) * 1e3:.1f} | {max(ts) * 1e3:.1f} | "
                     f"{med / torch_med:.3f} |")
    ratio = statistics.median(times[REMAT_ALL]) / torch_med
    paired = statistics.median(a / b for a, b in zip(times[REMAT_ALL], times[TORCH]))
    return lines, ratio, paired


def memory_section(cfg: GPTConfig, batch: int) -> list:
    res = {label: measure_memory(cfg, batch, ckpt, pol) for label, ckpt, pol in VARIANTS}
    lines = ["| variant | mallinfo2 delta | memory_report total | saved_tensors_hooks |",
             "|---|---:|---:|---:|"]
    for label, r in res.items():
        lines.append(f"| {label} | {fmt_bytes(r['heap'])} | {fmt_bytes(r['report'])} | {fmt_bytes(r['hooks'])} |")
    region_inputs = cfg.n_layer * batch * cfg.seq * cfg.d_model * 4
    h, rep = (lambda k: res[k]["heap"]), (lambda k: res[k]["report"])
    lines += [
        "",
        f"Region inputs (what torch's checkpoint saves per block, {cfg.n_layer} blocks): "
        f"{fmt_bytes(region_inputs)}; memory_report counts them too (policy INPUT).",
        "",
        "Consistency checks:",
        "",
        f"- remat save-matmuls: mallinfo2 delta - memory_report total = "
        f"{fmt_bytes(h(REMAT_SAVE) - rep(REMAT_SAVE))} (bytes held outside the regions: embeddings "
        f"output, final LN, loss); torch checkpoint: mallinfo2 delta - region inputs = "
        f"{fmt_bytes(h(TORCH) - region_inputs)}.",
        f"- tape beyond region inputs: memory_report(save-matmuls) - memory_report(all-recompute) = "
        f"{fmt_bytes(rep(REMAT_SAVE) - rep(REMAT_ALL))}; mallinfo2(save-matmuls) - mallinfo2(torch checkpoint) "
        f"= {fmt_bytes(h(REMAT_SAVE) - h(TORCH))}.",
        f"- remat all-recompute vs torch checkpoint, mallinfo2: {fmt_bytes(h(REMAT_ALL) - h(TORCH))} apart.",
    ]
    return lines


def main(argv=None) -> str:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, d_model=args.d_model, n_head=args.heads, n_layer=args.layers)
    out = [
        "# remat_fx eager benchmark: GPT on CPU",
        "",
        f"config: layers {cfg.n_layer}, d_model {cfg.d_model}, heads {cfg.n_head}, seq {cfg.seq}, "
        f"vocab {cfg.vocab}, batch {args.batch}, float32; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), {platform.processor() or platform.machine()}",
        "",
    ]
    if not args.skip_memory:
        out += ["## Activation bytes held from forward to backward", "",
                "Fresh model per variant, forward+backward twice, second reading kept. "
                "saved_tensors_hooks: unique non-parameter storages autograd packs outside "
                "checkpoint regions (it cannot see inside a region nor remat's tape).", ""]
        out += memory_section(cfg, args.batch)
        out.append("")
        print("\n".join(out), flush=True)
    if not args.skip_time:
        times = time_steps(cfg, args.batch, args.steps, args.warmup)
        lines, ratio, paired = timing_table(times)
        sec = ["## Step time", "",
               f"forward+backward per step (no optimizer), {args.warmup} warm-up + {args.steps} measured "
               "steps per variant, variants interleaved round-robin.", ""]
        sec += lines
        sec += ["", f"**remat all-recompute / torch checkpoint: {ratio:.3f}** (ratio of medians; "
                    f"median of per-round ratios {paired:.3f}; target <= 1.05)", ""]
        print("\n".join(sec), flush=True)
        out += sec
    return write_report(args.out, out)


if __name__ == "__main__":
    main()
