"""What is alive at a step's measured peak on CUDA, next to remat's whole-step estimate.

Compiles the Hugging Face model of benchmarks/gpu.py with backend="remat" at each memory budget,
runs two steps (the second plans the step as a whole), then records the CUDA caching allocator's
history over one more step (``torch.cuda.memory._record_memory_history``) and prints, for the
moment the step's allocations peak: ``remat.step_report()``, every block then alive that the step
allocated, grouped by the line of Inductor's generated code (and the model's line) that allocated
it, and the events just before the peak; then, per compiled graph, what remat's estimate has alive
at its backward's estimated peak, and the peak of Inductor's own schedule of it. This is how the
CUDA-only buffers the estimate did not model were found (docs/benchmarks.md, "NVIDIA H100, GPT-2
again", and the loss's gradient of "NVIDIA H200, 8-layer Llama, at a14ce11").

    python benchmarks/gpu_snapshot.py --model gpt2 --layers 12 --hidden 768 --vocab 50257 --batch 8 --seq 1024 \\
        --budgets 0.1,0

Writes benchmarks/out/snapshot_<model>_<budget>.txt (CUDA only), and each partition's forward and
backward as printed (``fx_<model>_<budget>_<i>_fw.py`` / ``_bw.py``): benchmarks/fx_replay.py runs
remat's estimate on them on any machine.
"""
from __future__ import annotations

import argparse
import collections
import linecache
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks import gpu  # noqa: E402
from remat_fx.step import STEP  # noqa: E402


def _where(frames) -> str:
    """The first two Python frames outside torch's own package, with their source lines."""
    keep = []
    for f in frames:
        name = f.get("filename", "")
        if "site-packages/torch/" in name and "torchinductor" not in name:
            continue
        text = linecache.getline(name, f.get("line", 0)).strip()
        keep.append(f"{Path(name).name}:{f.get('line')} | {text[:110]}")
        if len(keep) == 2:
            break
    return " <- ".join(keep) or "?"


def estimate_at_peak(fw, bw, num_fwd_outputs: int, inline: bool, top: int = 12) -> str:
    """The storages alive at the backward's estimated peak (passes/peak.py's liveness of ``bw``)."""
    from remat_fx.passes import peak

    inputs = peak.backward_inputs(fw, bw, num_fwd_outputs)
    nbytes, node, alive = peak.alive_at_peak(bw, inputs.counted, inputs.shared, inline, inputs.donated)
    lines = [f"  backward of {len(bw.graph.nodes)} nodes: estimated peak {nbytes / 2**20:.1f} MiB at {node.name} "
             f"({node.target}); alive there:"]
    for size, k in alive[:top]:
        val = k.meta.get("val") if isinstance(k, torch.fx.Node) else None
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ""
        lines.append(f"    {size / 2**20:9.1f} MiB  {getattr(k, 'name', k)} {getattr(k, 'target', '')} {shape}")
    return "\n".join(lines)


def snapshot(args, budget: float) -> str:
    from remat_fx.passes import lower, lowered_peak

    torch._dynamo.reset()
    STEP.reset()
    partitions = []  # (fw, bw, num_fwd_outputs, inline) of each graph, as its partition made them
    partitioner = lower.RematPartitioner.__call__

    def keep(self, gm, joint_inputs, **kwargs):
        fw, bw = partitioner(self, gm, joint_inputs, **kwargs)
        partitions.append((fw, bw, kwargs["num_fwd_outputs"], self.options.lower == "inductor"))
        return fw, bw

    lower.RematPartitioner.__call__ = keep
    schedules = []  # Inductor's own schedule of each graph compiled (passes/lowered_peak.py)
    try:
        with lowered_peak.reading_schedules(schedules):
            text = _snapshot(args, budget, partitions)
    finally:
        lower.RematPartitioner.__call__ = partitioner
    folder = getattr(args, "out_dir", None)
    for i, (fw, bw, _, _) in enumerate(partitions if folder is not None else ()):  # for benchmarks/fx_replay.py
        for part, gm in (("fw", fw), ("bw", bw)):
            (folder / f"fx_{args.model}_{budget:g}_{i}_{part}.py").write_text(gm.print_readable(print_output=False))
    lines = ["Inductor's schedule of each graph compiled (passes/lowered_peak.py), its inputs counted but the "
             "parameters and the batch:"]
    for i, schedule in enumerate(schedules):
        if schedule is None:
            lines.append(f"  graph {i}: not read")
            continue
        counted = {name for name in schedule.inputs if not name.startswith(("primals", "arg"))}
        lines.append(f"  graph {i}: {schedule.kernels} kernels, peak {schedule.peak(counted) / 2**20:.1f} MiB")
    return text + "\n" + "\n".join(lines)


def _snapshot(args, budget: float, partitions: list) -> str:
    model, ids = gpu.build(args)
    step = gpu.make_step(model, torch.compile(model, backend="remat", options={"memory_budget": budget}), ids,
                         args.device, args.bf16)
    step()
    step()
    model.zero_grad(set_to_none=True)  # the measured step's gradients count, as in gpu.py
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    measured = torch.cuda.max_memory_allocated() - before
    lines = [f"memory_budget {budget:g}: measured step peak {measured:,} B ({measured / 2**20:.1f} MiB)",
             str(remat.step_report())]
    live, now, peak, at = {}, 0, -1, -1
    for i, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            now += event["size"]
        elif event["action"] == "free_completed":
            now -= live.pop(event["addr"])["size"] if event["addr"] in live else event["size"]
        if now > peak:
            peak, at = now, i
    live = {}
    for event in trace[:at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    by_line, count = collections.Counter(), collections.Counter()
    for event in live.values():
        where = _where(event.get("frames", []))
        by_line[where] += event["size"]
        count[where] += 1
    lines.append(f"the step's allocations peak at {peak / 2**20:.1f} MiB (event {at} of {len(trace)}); alive then, "
                 f"allocated in the step: {len(live)} blocks")
    lines += [f"{b / 2**20:9.1f} MiB x{count[w]:3d}  {w}" for w, b in by_line.most_common(60)]
    lines.append("the events before the peak:")
    lines += [f"  {e['action']:14s} {e['size'] / 2**20:8.1f} MiB  {_where(e.get('frames', []))}"
              for e in trace[max(0, at - 30):at + 1]]
    lines.append("remat's estimate, per graph (its backward as the partition made it, before a step's shortening):")
    lines += [estimate_at_peak(*p) for p in partitions]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2", choices=["llama", "gpt2"])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--budgets", default="0.1,0")
    ap.add_argument("--autocast", default="bf16", choices=["bf16", "none"])
    ap.add_argument("--out", default="", help="folder for the .txt files (default benchmarks/out)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_snapshot.py reads the CUDA caching allocator's history: it needs a GPU")
    args.device, args.bf16 = torch.device("cuda"), args.autocast == "bf16"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    args.out_dir = out
    gpu.warm_up(args.device)
    torch._inductor.config.fx_graph_cache = False
    for budget in (float(v) for v in args.budgets.split(",") if v.strip()):
        text = snapshot(args, budget)
        (out / f"snapshot_{args.model}_{budget:g}.txt").write_text(text + "\n")
        print(text, flush=True)


if __name__ == "__main__":
    main()
