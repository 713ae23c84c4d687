"""Whole-step peak and time of Hugging Face models (built from config) on a GPU: PyTorch's
activation_memory_budget against remat's memory_budget, peak_budget fractions and remat.fit, with
eager and per-layer checkpointing, in one run.

    python benchmarks/gpu.py --model llama --layers 8 --hidden 2048 --batch 4 --seq 2048
    python benchmarks/gpu.py --model gpt2 --layers 12 --hidden 768 --batch 8 --seq 1024
    python benchmarks/gpu.py --device cpu --layers 2 --hidden 64 --batch 2 --seq 32 --steps 2   # smoke run

Peak: max_memory_allocated over one step minus memory_allocated before it (CUDA; the profiler's
allocation events on CPU), remat_fx.measure.step_peak_bytes, with the gradients set to None before
the measured step, so the peak counts them. Time: median of --steps synchronised steps. First step: the step that
compiles (with remat.fit, the whole fit), after a warm-up compile of each backend, with Inductor's
FX graph cache off and, unless --warm-kernels, each variant in a fresh Inductor cache (a new cache
folder and its in-memory caches cleared: every kernel is generated and compiled anew, as on a
first run, so that no variant reuses kernels another compiled before it); "kernels compiled": the
distinct kernel sources that step handed Inductor's compiler, where most of its time goes. bf16
autocast on CUDA (--autocast: also on CPU, or off).
The issue's targets are checked on the rows at the end.
Writes benchmarks/out/gpu_<model>_<device>.md and .csv.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("REMAT_FX_PLAN_CACHE", "0")  # a first step times the search, not a replay of the last run's

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import remat_fx as remat  # noqa: E402
from benchmarks import torch_budget  # noqa: E402
from remat_fx.measure import step_peak_bytes  # noqa: E402
from remat_fx.step import STEP  # noqa: E402


def build(args):
    import transformers

    torch.manual_seed(0)
    if args.model == "llama":
        cfg = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                       num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 128, 1),
                                       num_key_value_heads=max(args.hidden // 128, 1), vocab_size=args.vocab,
                                       max_position_embeddings=args.seq, use_cache=False)
        with torch.device(args.device):  # initialised on the device: seconds, not minutes, at 8 x 2048
            model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=max(args.hidden // 64, 1),
                                      n_positions=args.seq, vocab_size=args.vocab, use_cache=False,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        with torch.device(args.device):
            model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=args.device,
                        generator=torch.Generator(device=args.device).manual_seed(0))
    return model, ids


def make_step(model, fn, ids, device, autocast):
    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(ids, labels=ids).loss
        loss.backward()
    return step


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(label, args, compile_fn=None, checkpointing=False, fit=None):
    torch._dynamo.reset()
    STEP.reset()
    model, ids = build(args)
    if checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers 5.x's name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # deprecated in transformers 5, removed in 6
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fn = model if compile_fn is None else compile_fn(model)
    step = make_step(model, fn, ids, args.device, args.bf16)
    row = {"variant": label}
    compiled = set()  # kernel sources the first step compiles
    with torch._functorch.config.patch(enable_autograd_cache=False), _kernel_cache(args.warm_kernels):
        sync(args.device)
        t0 = time.perf_counter()
        with _kernels_compiled(compiled):
            if fit is not None:
                try:
                    result = remat.fit(step, peak=fit, cache=False)
                except remat.PeakInfeasible as e:  # the message names the least measured peak
                    print(f"{label:40s} {e}", flush=True)
                    return {"variant": label, "peak": 0, "ms": 0.0, "first_s": time.perf_counter() - t0,
                            "kernels": len(compiled),
                            "fit": "infeasible: " + str(e).split(": ", 2)[-1].split(". Raise")[0]}
                row["fit"] = f"budget {result.fraction}, {len(result.tried)} measured"
            else:
                step()
            sync(args.device)
        row["first_s"] = time.perf_counter() - t0
        row["kernels"] = len(compiled)
        sync(args.device)
        t0 = time.perf_counter()
        step()  # a step of several graphs is planned as a whole at the second step (and a budget's held)
        sync(args.device)
        row["second_s"] = time.perf_counter() - t0
        # the gradients set to None before the measured step, so that its peak counts them: on CUDA
        # the measurement is the allocator's peak less what was allocated before the step, and the
        # step's own zero_grad would free the last step's gradients inside it (2,068 MiB less on the
        # 8-layer Llama of the docs)
        model.zero_grad(set_to_none=True)
        row["peak"] = step_peak_bytes(step, args.device)
        times = []
        for _ in range(args.steps):
            sync(args.device)
            t = time.perf_counter()
            step()
            sync(args.device)
            times.append(time.perf_counter() - t)
    row["ms"] = statistics.median(times) * 1e3
    report = remat.step_report()
    if compile_fn is not None and report.calls:
        row["estimate"] = report.peak.peak
        row["graphs"] = f"{len(report.graphs)} / {len(report.calls)}"
        plans = report.graphs.values()  # where a first step's time goes: planning, and the reruns Inductor lowers
        row["plan_s"] = sum(p.partition_seconds for p in plans)
        row["reruns"] = sum(p.rerun.reruns for p in plans if p.rerun is not None)
    print(f"{label:40s} peak {row['peak'] / 2**20:10.1f} MiB  {row['ms']:8.1f} ms  first {row['first_s']:.1f} s"
          f"  second {row['second_s']:.1f} s"
          f"  kernels {row['kernels']}"
          + (f"  est {row['estimate'] / 2**20:.1f} MiB  planning {row['plan_s']:.1f} s  reruns {row['reruns']}"
             if "estimate" in row else "") + f"  {row.get('fit', '')}",
          flush=True)
    del model, fn, step
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


@contextlib.contextmanager
def _kernels_compiled(into: set):
    """Adds to ``into`` the source of each kernel Inductor hands its compiler meanwhile (C++ on CPU,
    Triton on CUDA; Inductor's private AsyncCompile, checked on torch 2.11, 2.13 and 2.14). In a
    fresh cache each distinct source is compiled once, and most of a first step's time goes to them:
    on the 8-layer Llama of docs/benchmarks.md, budget 0, 60 C++ kernels for remat against 35 for
    PyTorch, 37 against 21 s of compiler time."""
    from torch._inductor import async_compile

    cls = getattr(async_compile, "AsyncCompile", None)
    real = {}
    for name, at in (("cpp", 0), ("cpp_pybinding", 1), ("triton", 1)):
        method = getattr(cls, name, None)
        if method is None:
            continue
        real[name] = method

        def counted(self, *a, _method=method, _at=at, **kw):
            source = a[_at] if len(a) > _at else kw.get("source_code")
            if isinstance(source, str):
                into.add(source)
            return _method(self, *a, **kw)

        setattr(cls, name, counted)
    try:
        yield
    finally:
        for name, method in real.items():
            setattr(cls, name, method)


def _kernel_cache(warm):
    """A fresh Inductor cache for one variant (torch's own context manager), or the process's."""
    if warm:
        return contextlib.nullcontext()
    from torch._inductor import utils
    fresh = getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache  # renamed in torch 2.8
    return fresh()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama", choices=["llama", "gpt2"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budgets", default="1,0.5,0.3,0.2,0.1,0")
    ap.add_argument("--torch-budgets", default=None, help="PyTorch's budgets (default: --budgets; '' for none)")
    ap.add_argument("--monotone", default="default",
                    help="remat's option monotone for its --budgets rows, comma-separated: default (left out: "
                         "'auto'), auto, a number of levels (1 = nearest), grid")
    ap.add_argument("--peak-fractions", default="0.5,0")
    ap.add_argument("--fit", default="0.6,0.4", help="remat.fit limits as fractions of eager's peak")
    ap.add_argument("--lower", default="inductor", choices=["inductor", "eager"])
    ap.add_argument("--warm-kernels", action="store_true",
                    help="let variants reuse the kernels of earlier ones (default: each in a fresh Inductor cache)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads (0: PyTorch's default); 1 steadies CPU timings on a shared machine")
    ap.add_argument("--autocast", default="auto", choices=["auto", "bf16", "none"],
                    help="bf16 autocast around the forward (auto: on CUDA only)")
    ap.add_argument("--out", default="", help="folder for the .md and .csv (default benchmarks/out)")
    ap.add_argument("--deadline", type=float, default=0,
                    help="start no variant after this many seconds (0: no limit); the table keeps what ran")
    args = ap.parse_args()
    args.device = torch.device(args.device)
    args.bf16 = args.autocast == "bf16" or (args.autocast == "auto" and args.device.type == "cuda")
    if args.threads:
        torch.set_num_threads(args.threads)
    warm_up(args.device)
    floats = (lambda s: [float(v) for v in s.split(",") if v.strip()])
    head = (f"{args.model}, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq}, "
            f"{args.device.type}{' ' + torch.cuda.get_device_name() if args.device.type == 'cuda' else ''}, "
            f"torch {torch.__version__}, {args.lower} lowering{', bf16 autocast' if args.bf16 else ''}")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "out"
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []

    def measure(label, *a, **kw):
        """One variant; its row is written out at once (a run cut short keeps what it measured). A
        variant that raises is a row naming the error; after --deadline seconds none is started."""
        if args.deadline and time.perf_counter() - started > args.deadline:
            print(f"{label:40s} not run: past --deadline {args.deadline:g} s", flush=True)
            return None
        try:
            row = run_variant(label, args, *a, **kw)
        except Exception as e:  # noqa: BLE001 (reported in the table, the run goes on)
            import traceback
            traceback.print_exc()
            row = {"variant": label, "peak": 0, "ms": 0.0, "first_s": 0.0,
                   "fit": f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
            torch._dynamo.reset()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        write(out, args, head, rows)
        return row

    measure("eager")
    measure("eager, per-layer checkpointing", checkpointing=True)
    eager_peak = rows[0]["peak"] if rows and rows[0]["peak"] else 0
    # PyTorch's and remat's compile at the same budget side by side: a run cut short keeps pairs
    torch_budgets = floats(args.budgets if args.torch_budgets is None else args.torch_budgets)
    for b in floats(args.budgets):
        if b in torch_budgets:
            measure(f"PyTorch budget {b:g}", lambda m, b=b: torch.compile(m, backend=torch_budget.backend(b)))
        for mode in (v.strip() for v in args.monotone.split(",") if v.strip()):
            measure(f"remat memory_budget {b:g}" + ("" if mode == "default" else f", monotone {mode}"),
                    lambda m, b=b, mode=mode: torch.compile(m, backend="remat", options={
                        "memory_budget": b, "lower": args.lower, **monotone_option(mode)}))
    for f in floats(args.peak_fractions):
        measure(f"remat peak_budget {f:g}", lambda m, f=f: torch.compile(
            m, backend="remat", options={"peak_budget": f, "lower": args.lower}))
    for f in floats(args.fit) if eager_peak else ():  # limits are fractions of eager's peak
        limit = int(eager_peak * f)
        measure(f"remat.fit {limit / 2**20:.0f} MiB ({f:g} x eager)", lambda m: torch.compile(
            m, backend="remat", options={"lower": args.lower}), fit=limit)
    print((out / f"gpu_{args.model}_{args.device.type}.md").read_text())


def write(out, args, head, rows):
    """The table so far, and the issue's targets checked on it, as .md and .csv under out."""
    lines = [head, "", "| variant | peak MiB | step ms | first step s | of it planning s | second step s | kernels "
                       "compiled | reruns | whole-step estimate MiB | graphs / calls | fit |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        est = f"{r['estimate'] / 2**20:.1f}" if "estimate" in r else ""
        plan_s = f"{r['plan_s']:.1f}" if "plan_s" in r else ""
        second = f"{r['second_s']:.1f}" if "second_s" in r else ""
        lines.append(f"| {r['variant']} | {r['peak'] / 2**20:.1f} | {r['ms']:.1f} | {r['first_s']:.1f} | {plan_s} | "
                     f"{second} | {r.get('kernels', '')} | {r.get('reruns', '')} | {est} | {r.get('graphs', '')} | "
                     f"{r.get('fit', '')} |")
    with open(out / f"gpu_{args.model}_{args.device.type}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    lines += [""] + verdicts(rows)
    (out / f"gpu_{args.model}_{args.device.type}.md").write_text("\n".join(lines) + "\n")


def warm_up(device):
    """One small compile with each backend first, so that no variant's first step pays the process's
    one-time costs (Inductor's imports and compile workers, the profiler's start-up); the FX graph
    cache is off, so every variant's first step compiles its graphs."""
    torch._inductor.config.fx_graph_cache = False
    x = torch.randn(8, 8, device=device, requires_grad=True)
    for backend, options in (("inductor", None), ("remat", {"memory_budget": 0.5})):
        torch._dynamo.reset()
        torch.compile(lambda t: (t.sin() @ t).cos().sum(), backend=backend, options=options)(x).backward()
    step_peak_bytes(lambda: (x * 2).sum().backward(), device)
    torch._dynamo.reset()


def monotone_option(mode: str) -> dict:
    """A --monotone word as backend options: "default" leaves the option out ("auto" since 2026-12-06,
    2 levels before), a number is that many levels, "nearest" (1), "auto" and "grid" are passed as
    they are."""
    mode = mode.strip()
    return {} if mode == "default" else {"monotone": int(mode) if mode.isdigit() else mode}


def verdicts(rows):
    """The issue's targets, checked on this run's rows."""
    def pick(prefix):
        return [r for r in rows if r["variant"].startswith(prefix) and r.get("peak")]

    def budget(r):  # "remat memory_budget 0.1" or "remat memory_budget 0.1, monotone grid"
        return float(r["variant"].split()[2].rstrip(","))

    torch_rows, remat_rows = pick("PyTorch budget"), pick("remat ")
    by_mode: dict = {}  # "" (option monotone left out) or "monotone grid", "monotone 1" -> its budget rows, 1 -> 0
    for r in sorted(pick("remat memory_budget"), key=lambda r: -budget(r)):
        by_mode.setdefault(r["variant"].partition(", ")[2], []).append(r)
    out = []
    for mode, rows_of in sorted(by_mode.items()):
        peaks = [r["peak"] for r in rows_of]
        out.append(f"- remat memory_budget{', ' + mode if mode else ''}, measured peak non-increasing as the budget "
                   "falls: " + ("yes" if all(b <= a * 1.01 for a, b in zip(peaks, peaks[1:])) else "NO")
                   + " (1% spread allowed)")
    budget_rows = by_mode.get("", [])
    if not remat_rows or not torch_rows:
        return out
    least = min(r["peak"] for r in remat_rows)
    ckpt = pick("eager, per-layer")
    out.append(f"- least remat peak {least / 2**20:.1f} MiB; least PyTorch {min(r['peak'] for r in torch_rows) / 2**20:.1f}"
               + (f"; per-layer checkpointing {ckpt[0]['peak'] / 2**20:.1f}" if ckpt else ""))
    for t in torch_rows:
        match = [r for r in remat_rows if r["peak"] <= t["peak"] and r["ms"] <= 1.02 * t["ms"]]
        best = min(match, key=lambda r: r["ms"]) if match else None
        out.append(f"- {t['variant']} ({t['peak'] / 2**20:.1f} MiB, {t['ms']:.1f} ms): "
                   + (f"{best['variant']} ({best['peak'] / 2**20:.1f} MiB, {best['ms']:.1f} ms)" if best
                      else "no remat point at or below its peak within 2% of its time"))
        same = [r for r in budget_rows if budget(r) == float(t["variant"].split()[-1])]
        if same:
            out[-1] += f"; first step at the same budget {same[0]['first_s'] / t['first_s']:.2f}x PyTorch's"
    return out


if __name__ == "__main__":
    main()
