"""Step peak at depth: an 8-layer Hugging Face Llama (built from a LlamaConfig, no download) under
remat's memory_budget, against eager PyTorch and eager per-layer torch.utils.checkpoint (CPU).

    python benchmarks/llama_depth.py [--budgets 1,0.5,0.3,0.2,0.1,0] [--torch-budgets 1,0.3,0] [--lower inductor|eager]
                                     [--peak-budgets 40MiB,0.5]
                                     [--layers 8] [--hidden 128] [--intermediate 256] [--heads 4] [--vocab 1000]
                                     [--seq 256] [--batch 4] [--steps 5] [--grads] [--plans]

Per variant: the step's incremental peak (benchmarks/memory.py step_peak_bytes, one warmed-up
fwd+bwd step), remat's estimate (plan.peak.step), with a byte --peak-budgets the peak of Inductor's
schedule it was checked on (plan.lowered), the rerun report, the partition and compile time
and the median step time over --steps interleaved rounds. ``--grads`` checks every variant's
gradients against eager's (rtol 1e-4). The 4-layer benchmark models of benchmarks/peak.py keep the
recompute chains short; at 8 layers the peak at small budgets is set by how well the backward's
reruns recover per-layer checkpointing's shape.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils.checkpoint as torch_checkpoint

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks import torch_budget  # noqa: E402
from benchmarks.memory import step_peak_bytes  # noqa: E402
from benchmarks.timing import interleaved_step_times, unlimited_recompiles  # noqa: E402

MiB = 2 ** 20


class _CheckpointLayer(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        return torch_checkpoint.checkpoint(self.layer, *args, use_reentrant=False, **kwargs)


def build(args, checkpoint=False, device=None):
    """(model, loss function, batch); ``device``: where the model is made and the batch put (default:
    the CPU; on CUDA it is initialised there: seconds, not minutes, at benchmarks/gpu.py's 8 x 2048)."""
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                                   num_hidden_layers=args.layers, num_attention_heads=getattr(args, "heads", 4),
                                   num_key_value_heads=getattr(args, "heads", 4),
                                   vocab_size=args.vocab, max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = transformers.LlamaForCausalLM(cfg)
    model.train()
    if checkpoint:
        layers = model.model.layers
        for i, layer in enumerate(layers):
            layers[i] = _CheckpointLayer(layer)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(
        device or "cpu")

    def loss(ids):
        return model(ids, labels=ids).loss

    return model, loss, ids


def add_shape_args(p: argparse.ArgumentParser, intermediate: int = 256, heads: int = 4) -> None:
    """The Llama's shape options (``build``): 8 layers, hidden 128, vocab 1000, batch 4 x 256 by
    default (the issue's CPU Llama; benchmarks/gpu.py's has intermediate 352 and one head)."""
    for name, default in (("layers", 8), ("hidden", 128), ("intermediate", intermediate), ("heads", heads),
                          ("vocab", 1000), ("seq", 256), ("batch", 4)):
        p.add_argument(f"--{name}", type=int, default=default)


def grads_of(model):
    return {k.replace("layer.", "").replace("_orig_mod.", ""): p.grad.detach().clone()
            for k, p in model.named_parameters()}


def _number_or_size(text: str):
    """A peak_budget as given: a number (a fraction, or bytes) or a size string (``42MiB``)."""
    try:
        return float(text)
    except ValueError:
        return text


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budgets", default="1,0.5,0.3,0.2,0.1,0")
    p.add_argument("--peak-budgets", default="",
                   help="remat peak_budget values (sizes like 42MiB, or fractions), each a variant without a "
                        "memory_budget")
    p.add_argument("--torch-budgets", default="",
                   help="PyTorch's activation_memory_budget values to compare (torch.compile, Inductor), e.g. 1,0.3,0")
    p.add_argument("--lower", default="inductor", choices=("inductor", "eager"))
    add_shape_args(p)
    p.add_argument("--steps", type=int, default=5, help="interleaved timing rounds (0: no timing)")
    p.add_argument("--grads", action="store_true", help="check gradients against eager (rtol 1e-4)")
    p.add_argument("--plans", action="store_true", help="print each remat plan's peak/rerun/budget lines")
    p.add_argument("--no-eager", action="store_true", help="skip the eager variants")
    p.add_argument("--option", action="append", default=[], help="more remat options, key=value (python literal)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch.set_num_threads before anything compiles (0: PyTorch's default); 1 keeps timings "
                        "stable on a shared machine, where OpenMP threads contend")
    args = p.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",") if b]
    extra = {}
    for kv in args.option:
        k, v = kv.split("=", 1)
        import ast
        extra[k] = ast.literal_eval(v)
    if args.threads:
        torch.set_num_threads(args.threads)
    unlimited_recompiles()  # every variant compiles the same loss function

    rows, variants, ref = [], {}, None

    def add(label, model, loss, ids, plan=None, compile_s=0.0):
        nonlocal ref
        model.zero_grad(set_to_none=True)
        loss(ids).backward()  # warm (compiles a compiled variant)
        g = grads_of(model)
        model.zero_grad(set_to_none=True)
        peak = step_peak_bytes(lambda: loss(ids).backward())
        model.zero_grad(set_to_none=True)
        row = dict(label=label, peak=peak / MiB, compile_s=compile_s)
        if plan is not None:
            row.update(est=plan.peak.step / MiB, saved=plan.total_bytes / MiB, part_s=plan.partition_seconds,
                       lowered=None if plan.lowered is None else plan.lowered.step / MiB,
                       reruns=plan.rerun.reruns if plan.rerun else 0,
                       rerun_ms=plan.rerun.cost_s * 1e3 if plan.rerun else 0.0,
                       allow=(None if plan.rerun is None or plan.rerun.allowance_s is None
                              else plan.rerun.allowance_s * 1e3),
                       step_ms=plan.step_cost_s * 1e3)
        if args.grads:
            if ref is None:
                ref = g
            else:
                for k, v in ref.items():
                    torch.testing.assert_close(g[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{label} {k}: {m}")
                row["grads"] = "ok"
        rows.append(row)
        variants[label] = (model, lambda: loss(ids))
        print(f"{label:24s} peak {peak / MiB:7.2f} MiB" + (
            f"  est {row['est']:7.2f}" + ("" if row["lowered"] is None else f"  lowered {row['lowered']:7.2f}")
            + f"  saved {row['saved']:6.2f}  reruns {row['reruns']:3d} "
            f"({row['rerun_ms']:.2f} ms of {'any' if row['allow'] is None else format(row['allow'], '.2f')})"
            f"  partition {row['part_s']:.1f} s  compile {compile_s:.1f} s" if plan is not None else
            f"  compile {compile_s:.1f} s" if compile_s else ""),
            flush=True)
        if args.plans and plan is not None:
            print("\n".join(str(plan).splitlines()[:5]), flush=True)

    if not args.no_eager:
        model, loss, ids = build(args)
        add("eager", model, loss, ids)
        model, loss, ids = build(args, checkpoint=True)
        add("eager per-layer ckpt", model, loss, ids)
    for b in [float(v) for v in args.torch_budgets.split(",") if v]:
        torch._dynamo.reset()
        model, loss, ids = build(args)
        compiled = torch.compile(loss, backend=torch_budget.backend(b), fullgraph=True)  # PyTorch's own budget
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        compiled(ids).backward()
        add(f"PyTorch {b:g}", model, compiled, ids, None, time.perf_counter() - t0)
    peak_budgets = [_number_or_size(v) for v in args.peak_budgets.split(",") if v]
    for label, knob in [(f"{b:g}", {"memory_budget": b}) for b in budgets] + \
            [(f"peak_budget {v}", {"peak_budget": v}) for v in peak_budgets]:
        torch._dynamo.reset()
        model, loss, ids = build(args)
        compiled = torch.compile(loss, backend="remat", fullgraph=True,
                                 options={**knob, "lower": args.lower, **extra})
        t0 = time.perf_counter()
        with torch._functorch.config.patch(enable_autograd_cache=False):
            model.zero_grad(set_to_none=True)
            compiled(ids).backward()
        compile_s = time.perf_counter() - t0
        add(f"remat {args.lower} {label}", model, compiled, ids, remat.last_plan(), compile_s)
    if args.steps:
        times = interleaved_step_times(variants, args.steps, 1)
        base = statistics.median(times[rows[0]["label"]])
        for r in rows:
            r["time_ms"] = statistics.median(times[r["label"]]) * 1e3
            r["time_x"] = r["time_ms"] / (base * 1e3)
    print()
    print("| variant | peak MiB | est MiB | lowered MiB | saved MiB | reruns | step ms | x first | partition s | compile s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(k, fmt):
            v = r.get(k)
            return "" if v is None else format(v, fmt)
        print(f"| {r['label']} | {r['peak']:.2f} | {f('est', '.2f')} | {f('lowered', '.2f')} | {f('saved', '.2f')} | "
              f"{f('reruns', 'd')} | "
              f"{f('time_ms', '.1f')} | {f('time_x', '.3f')} | {f('part_s', '.1f')} | {f('compile_s', '.1f')} |")
    return rows


if __name__ == "__main__":
    main()
