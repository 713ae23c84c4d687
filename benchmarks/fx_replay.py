"""Replay a compiled graph that a GPU run printed, on this machine: remat's estimate of it on fake tensors.

A graph's ``print_readable()`` (benchmarks/gpu_snapshot.py writes those of each partition) is
rebuilt here as an FX graph with its own node names, its inputs fake tensors of the device it
ran on (CUDA fakes need no GPU), and every value's shape, dtype and strides propagated. remat's
liveness model (passes/peak.py, as under Inductor) then runs on the very graph Inductor compiled,
so a miss between the estimate and a GPU's measured peak can be worked on without the GPU.
A backward's saved inputs take their strides from its forward (``--forward``): saved views are
not contiguous. Rerun copies (``name_rerunN``) are marked as copies of ``name``.

    python benchmarks/fx_replay.py BACKWARD.py[.gz] [--forward FORWARD.py[.gz]] [--device cuda]
                                   [--search [--repeat N]]

With the forward, the figures are remat's own estimate of the pair (the plan's ``peak``).
``--search`` (with ``--forward``) then times remat's rerun search on the backward, toward the
lowest peak it finds with the cost model left out (passes/rerun.py ``rerun_for_peak``): its reruns,
the peak before and after, the programs it simulated and its seconds (the fastest of ``--repeat``
runs), the planning work a CUDA compile does on a graph of that size, here without the GPU. The
search runs with Python's cyclic collector off, as a compile's planning does (passes/partition.py
``_no_gc``; until 2026-12-06 it ran with it on, and took about twice as long: 2.05 s against 1.08 s
on the H200's budget-0 backward, the same search).
"""
from __future__ import annotations

import argparse
import gzip
import operator
import re
import sys
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.fx as fx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from remat_fx.passes import peak  # noqa: E402

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64,
           "i64": torch.int64, "i32": torch.int32, "i8": torch.int8, "u8": torch.uint8, "b8": torch.bool}
_PARAM = re.compile(r"(\w+): \"(\w+)\[([^\]]*)\]\"")
_LINE = re.compile(r"(\w+)(?:: \"[^\"]*\")? = (.*)")
_CALL = re.compile(r"(torch\.ops\.[\w.]+)\((.*)\)$")
_ITEM = re.compile(r"(\w+)\[(\d+)\]$")


def read(path: str) -> str:
    data = Path(path).read_bytes()
    return (gzip.decompress(data) if path.endswith(".gz") else data).decode()


def rebuild(printed: str, device: str = "cuda", given: Optional[Dict[str, torch.Tensor]] = None) -> fx.GraphModule:
    """The graph ``printed`` (a GraphModule's print_readable) with fake values on ``device``; ``given``:
    fake tensors for some of its inputs by name (a forward's saved outputs)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    lines = printed.split("\n")
    head = next(i for i, line in enumerate(lines) if line.strip().startswith("def forward(self"))
    params = _PARAM.findall(lines[head])
    graph = fx.Graph()
    env: Dict[str, fx.Node] = {name: graph.placeholder(name) for name, _, _ in params}
    scope = {"torch": torch, "device": torch.device, "inf": float("inf"), "nan": float("nan")}
    out = None
    for line in lines[head + 1:]:
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("return"):
            out = eval(text[len("return"):].strip(), scope, dict(env))  # noqa: S307 (a graph remat printed)
            break
        match = _LINE.match(text)
        if match is None:
            continue
        name, rhs = match.groups()
        rhs = rhs.split(";  ")[0]
        if rhs == "None":
            continue
        item = _ITEM.match(rhs)
        if item:
            node = graph.call_function(operator.getitem, (env[item.group(1)], int(item.group(2))))
        else:
            call = _CALL.match(rhs)
            if call is None:
                raise ValueError(f"fx_replay: cannot read the line {text!r}")
            taken = {}
            eval("__take(" + call.group(2) + ")", scope,  # noqa: S307
                 {**env, "__take": lambda *a, **k: taken.update(args=a, kwargs=k)})
            node = graph.call_function(eval(call.group(1), scope), taken["args"], taken["kwargs"])  # noqa: S307
        node.name = name
        env[name] = node
    graph.output(out)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = [given[name] if given and name in given else
                  torch.empty([int(d) for d in shape.split(",") if d.strip()], dtype=_DTYPES[dtype], device=device)
                  for name, dtype, shape in params]
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*inputs)
    for node in gm.graph.nodes:
        copy = re.match(r"(\w+)_rerun\d+$", node.name)
        if copy and copy.group(1) in env:
            node.meta[peak.RERUN_OF] = copy.group(1)
    return gm


def estimate(printed_bw: str, printed_fw: str, device: str = "cuda"):
    """remat's estimate (passes/peak.py ``estimate``, as under Inductor) of the pair, and the backward:
    the forward's outputs before the first the backward takes in are the user's."""
    fw = rebuild(printed_fw, device)
    outputs = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    given = {n.name: n.meta["val"] for n in outputs if isinstance(n, fx.Node)}
    bw = rebuild(printed_bw, device, given)
    taken = {n.name for n in bw.graph.nodes if n.op == "placeholder"}
    users = next(i for i, n in enumerate(outputs) if isinstance(n, fx.Node) and n.name in taken)
    return peak.estimate(fw, bw, users, inline=True), bw, peak.backward_inputs(fw, bw, users)


def search(bw: fx.GraphModule, inputs, repeat: int = 1) -> str:
    """One line: the rerun search on ``bw`` (``inputs``: its peak.backward_inputs), timed."""
    import time

    from remat_fx.passes import rerun
    from remat_fx.passes.partition import _no_gc

    best = None
    for _ in range(max(1, repeat)):
        simulated, real = [0], rerun._Program.simulate

        def counted(self):
            simulated[0] += 1
            return real(self)

        rerun._Program.simulate = counted
        try:
            with _no_gc():  # as the planning runs it
                t0 = time.perf_counter()
                _, report = rerun.rerun_for_peak(bw, inputs.counted, inputs.shared, 0, 0, lambda node: 1e-6,
                                                 inline=True, donated=inputs.donated)
                seconds = time.perf_counter() - t0
        finally:
            rerun._Program.simulate = real
        if best is None or seconds < best[0]:
            best = (seconds, report, simulated[0])
    seconds, report, simulated = best
    return (f"rerun search (lowest peak, cost model left out): {report.reruns} reruns, the backward's peak "
            f"{report.peak_before / 2**20:.1f} -> {report.peak_after / 2**20:.1f} MiB, {simulated} programs "
            f"simulated, {seconds:.2f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("backward")
    ap.add_argument("--forward", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--search", action="store_true", help="time the rerun search on the backward (needs --forward)")
    ap.add_argument("--repeat", type=int, default=1, help="with --search: runs, the fastest kept")
    args = ap.parse_args()
    if args.search and not args.forward:
        ap.error("--search needs --forward: the backward's saved inputs take their sizes and strides from it")
    if args.forward:
        est, gm, inputs = estimate(read(args.backward), read(args.forward), args.device)
        print(f"remat's estimate of the pair: forward {est.forward / 2**20:.1f} MiB, backward {est.backward / 2**20:.1f} "
              f"MiB (with the forward's other outputs, {est.held / 2**20:.1f} MiB, held through it: a step that drops "
              "them, as benchmarks/gpu.py's does, peaks at the backward's own)")
        top, at, alive = peak.alive_at_peak(gm, inputs.counted, inputs.shared, inline=True, donated=inputs.donated)
    else:  # every input but the parameters and the batch counted, each its own storage
        gm = rebuild(read(args.backward), args.device)
        counted = {n.name for n in gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("primals")}
        top, at, alive = peak.alive_at_peak(gm, counted, inline=True)
    print(f"{len(gm.graph.nodes)} nodes; the backward's own peak {top / 2**20:.1f} MiB at {at.name} ({at.target}); "
          "alive there:")
    for nbytes, key in alive[:args.top]:
        print(f"  {nbytes / 2**20:9.1f} MiB  {getattr(key, 'name', key)}")
    if args.search:
        print(search(gm, inputs, args.repeat))


if __name__ == "__main__":
    main()
