"""Is a compiled backward's incoming gradient freed at its last reader? Measured, per device.

A small model (a wide MLP and a head, the loss compiled apart, so that the head's output gradient
is the model graph's incoming gradient and the backward's peak comes after its last reader) runs a
step with and without a hook that holds that gradient to the backward's end, and prints each
step's measured peak next to remat's whole-step estimate. Where the two measurements are equal,
something else already holds the gradient to the end (the autograd engine, on CUDA): the estimate
keeps it there too (remat_fx/passes/peak.py ``held_to_end``; docs/benchmarks.md, "NVIDIA H100,
GPT-2 again").

    python benchmarks/held_gradient.py --device cpu --lower eager
    python benchmarks/held_gradient.py --device cuda --lower inductor --bf16
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from remat_fx.measure import step_peak_bytes  # noqa: E402
from remat_fx.step import STEP  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self, d: int, wide: int, vocab: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, wide * d), torch.nn.Linear(wide * d, d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(x + self.down(torch.relu(self.up(x))))


def measure(args, hold: bool) -> str:
    torch._dynamo.reset()
    STEP.reset()
    torch.manual_seed(0)
    model = Model(args.d, args.wide, args.vocab).to(args.device)
    x = torch.randn(8, 64, args.d, device=args.device)
    options = {"memory_budget": 1.0, "lower": args.lower}
    fn = torch.compile(model, backend="remat", options=options)
    loss_fn = torch.compile(lambda out: out.float().logsumexp(-1).mean(), backend="remat",
                            options={"lower": args.lower})
    held = []

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(args.device.type, dtype=torch.bfloat16, enabled=args.bf16):
            out = fn(x)
            if hold:
                out.register_hook(held.append)
            loss = loss_fn(out)
        del out
        loss.backward()
        held.clear()

    step()
    step()  # the whole step is planned at the second
    model.zero_grad(set_to_none=True)
    peak = step_peak_bytes(step, args.device)
    estimate = remat.step_report().peak.peak
    size = 8 * 64 * args.vocab * (2 if args.bf16 else 4)
    return (f"{args.device.type} {args.lower}{' bf16' if args.bf16 else ''}, gradient "
            f"{'held by a hook' if hold else 'not held':15s}: measured {peak:,} B, estimate {estimate:,} B, "
            f"measured - estimate {(peak - estimate) / 2**20:+.3f} MiB (the gradient: {size / 2**20:.1f} MiB)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lower", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--wide", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=1024)
    args = ap.parse_args()
    args.device = torch.device(args.device)
    for hold in (False, True):
        print(measure(args, hold), flush=True)


if __name__ == "__main__":
    main()
