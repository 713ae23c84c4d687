"""python -m remat_fx.fuzz --cases 1000 --seed 0 --out DIR

Runs cases ``seed .. seed + cases - 1`` (case k is ``generate(k)``: a seed names one program), shows
a progress line, shrinks every failure and writes it to DIR as a runnable script
(``case_<seed>.py``, and the unshrunk ``case_<seed>_original.py``), and prints a summary table.
``--against pytorch`` runs the same programs, without remat, under PyTorch's own
``activation_memory_budget`` instead (docs/fuzz.md).
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing
import os
import sys
import time

from remat_fx.fuzz.worker import run_one


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m remat_fx.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="first case's seed (cases are seed .. seed+cases-1)")
    ap.add_argument("--out", default="fuzz_out", help="where failing cases are written")
    ap.add_argument("--mode", choices=["eager", "compile"], default=None, help="only this mode (default: both)")
    ap.add_argument("--inductor-share", type=float, default=0.05, help="share of compiled cases lowered by Inductor")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--no-shrink", dest="shrink", action="store_false")
    ap.add_argument("--shrink-seconds", type=float, default=300.0)
    ap.add_argument("--against", choices=["remat", "pytorch"], default="remat",
                    help="pytorch: the same programs under torch._functorch.config.activation_memory_budget")
    ap.add_argument("--pytorch-backend", default="inductor", help="with --against pytorch: the torch.compile backend")
    args = ap.parse_args(argv)

    os.makedirs(args.out, exist_ok=True)
    jobs = [(s, args) for s in range(args.seed, args.seed + args.cases)]
    counts: collections.Counter = collections.Counter()
    by_mode: collections.Counter = collections.Counter()
    t0 = time.perf_counter()
    log = open(os.path.join(args.out, "log.txt"), "a")
    log.write(f"# {' '.join(sys.argv)}\n")

    def report(seed, result, original, shrunk, summary):
        counts[result.kind] += 1
        by_mode[summary.split()[2]] += 1
        log.write(f"{seed} {result.kind} {result.seconds:.1f}s {summary} :: {result.detail}\n")
        log.flush()
        if not result.ok:
            if original is not None:
                with open(os.path.join(args.out, f"case_{seed}_original.py"), "w") as f:
                    f.write(original)
            if shrunk is not None:
                with open(os.path.join(args.out, f"case_{seed}.py"), "w") as f:
                    f.write(shrunk)
            print(f"\rcase {seed}: {result}" + " " * 10, flush=True)
        done = sum(counts.values())
        failed = done - counts["pass"] - counts["expected_error"]
        elapsed = time.perf_counter() - t0
        sys.stdout.write(f"\r[{done:>5d}/{args.cases}] pass {counts['pass']} expected-error "
                         f"{counts['expected_error']} fail {failed}  {elapsed:,.0f} s")
        sys.stdout.flush()

    if args.jobs > 1:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(args.jobs, maxtasksperchild=20) as pool:
            for out in pool.imap_unordered(run_one, jobs):
                report(*out)
    else:
        for job in jobs:
            report(*run_one(job))
    elapsed = time.perf_counter() - t0
    failed = sum(n for k, n in counts.items() if k not in ("pass", "expected_error"))
    print()
    rows = [("cases", args.cases), ("seeds", f"{args.seed}..{args.seed + args.cases - 1}"),
            ("against", args.against + (f" ({args.pytorch_backend})" if args.against == "pytorch" else "")),
            ("modes", ", ".join(f"{m} {n}" for m, n in sorted(by_mode.items()))),
            ("passes", counts["pass"]), ("expected errors", counts["expected_error"]), ("failures", failed)]
    rows += [(f"  {k}", n) for k, n in sorted(counts.items()) if k not in ("pass", "expected_error")]
    rows += [("time", f"{elapsed:,.0f} s ({args.jobs} jobs)"), ("failing cases", args.out)]
    width = max(len(k) for k, _ in rows)
    table = "\n".join(f"| {k:<{width}s} | {v} |" for k, v in rows)
    print(table)
    log.write(table + "\n")
    log.close()
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
