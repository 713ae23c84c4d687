"""Shared benchmark plumbing: interleaved step timing and writing the markdown report."""
from __future__ import annotations

import argparse
import csv
import gc
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple


def interleaved_step_times(variants: Dict[str, Tuple[object, Callable]], steps: int,
                           warmup: int) -> Dict[str, List[float]]:
    """{label: [seconds per measured fwd+bwd step]} for ``variants`` = {label: (model, loss_fn)}.

    Variants run round-robin, the order rotated each round so none always runs first, so the
    machine's noise hits all of them alike; ``warmup`` rounds are not recorded.
    """
    labels = list(variants)
    times: Dict[str, List[float]] = {label: [] for label in labels}
    for rnd in range(warmup + steps):
        k = rnd % len(labels)
        for label in labels[k:] + labels[:k]:
            dt = _timed_step(variants[label])
            if rnd >= warmup:
                times[label].append(dt)
    return times


def _timed_step(variant: Tuple[object, Callable]) -> float:
    """Seconds of one fwd+bwd step of ``variant`` = (model, loss_fn), gradients cleared first."""
    model, loss_fn = variant
    model.zero_grad(set_to_none=True)
    gc.collect()
    t0 = time.perf_counter()
    loss = loss_fn()
    loss.backward()
    dt = time.perf_counter() - t0
    del loss
    return dt


def paired_time_ratios(a: Tuple[object, Callable], b: Tuple[object, Callable], rounds: int) -> List[float]:
    """[time of b / time of a] for ``rounds`` back-to-back pairs of fwd+bwd steps, the order
    alternating (ab, ba, ...): two variants compared this closely share the machine's noise, which
    the round robin over many variants spreads over seconds. One unrecorded pair first."""
    _timed_step(a), _timed_step(b)
    ratios = []
    for i in range(rounds):
        if i % 2:
            tb, ta = _timed_step(b), _timed_step(a)
        else:
            ta, tb = _timed_step(a), _timed_step(b)
        ratios.append(tb / ta)
    return ratios


def write_outputs(path: Path, rows: List[dict], lines: List[str], plot: Callable[[Path], None]) -> str:
    """``path``'s .csv (the rows), .png (``plot(png_path)``, skipped without matplotlib) and the
    report ``lines`` as ``path`` itself."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        w.writeheader()
        w.writerows(rows)
    try:
        plot(path.with_suffix(".png"))
    except ImportError:
        lines = lines + ["(no plot: pip install matplotlib)"]
    return write_report(path, lines)


def write_report(path: Path, lines: List[str]) -> str:
    text = "\n".join(lines)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    print(f"wrote {path}")
    return text


def add_model_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The flags every benchmark shares: model size, batch, step counts, threads."""
    p.add_argument("--steps", type=int, default=steps, help="measured steps per variant (>= 7 recommended)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured round-robin rounds first")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: PyTorch's)")
    p.add_argument("--skip-time", action="store_true")


def add_budget_args(p: argparse.ArgumentParser, budgets: str) -> None:
    """The flags the budget benchmarks share (pareto.py, peak.py)."""
    p.add_argument("--models", default="gpt,hf", help="comma list of: gpt (example GPT), hf (transformers GPT-2)")
    p.add_argument("--budgets", default=budgets, help="comma list of memory budget fractions")
    p.add_argument("--lowerings", default="inductor,eager")


def parse_budget_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """Parse, with --budgets/--lowerings as lists; set the threads and lift the recompile limits."""
    args = p.parse_args(argv)
    args.budgets = floats(args.budgets)
    args.lowerings = [x.strip() for x in args.lowerings.split(",") if x.strip()]
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    unlimited_recompiles()
    return args


def floats(text: str) -> List[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def unlimited_recompiles() -> None:
    """Every benchmark variant is a fresh model through the same forward code: one Dynamo cache
    entry each, far past the default recompile limit."""
    import torch

    cfg = torch._dynamo.config
    cfg.recompile_limit = cfg.cache_size_limit = 10_000
    cfg.accumulated_recompile_limit = cfg.accumulated_cache_size_limit = 100_000
