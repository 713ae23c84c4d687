"""Command line: ``python -m remat_fx pareto TARGET [--budgets ...] [--out DIR]``.

TARGET names a function returning ``(model_or_fn, example_inputs)``: ``package.module:function``
or ``path/to/file.py:function``, e.g. ``python -m remat_fx pareto examples/gpt.py:pareto_example``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import pathlib
import sys


def _load(target: str):
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise SystemExit(f"remat_fx pareto: TARGET must be 'module:function' or 'file.py:function', got {target!r}")
    if where.endswith(".py"):
        path = pathlib.Path(where).resolve()
        if not path.exists():
            raise SystemExit(f"remat_fx pareto: no such file {where!r}")
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        spec.loader.exec_module(module)
    else:
        sys.path.insert(0, str(pathlib.Path.cwd()))
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise SystemExit(f"remat_fx pareto: {where!r} has no function {name!r}")
    made = fn()
    if not (isinstance(made, tuple) and len(made) == 2):
        raise SystemExit(f"remat_fx pareto: {target}() must return (model_or_fn, example_inputs), got {type(made)}")
    return made


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remat_fx", description="remat_fx tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pareto", help="sweep memory budgets: saved bytes vs recompute cost (table, csv, plot)")
    p.add_argument("target", help="module:function or file.py:function returning (model_or_fn, example_inputs)")
    p.add_argument("--budgets", default="0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1",
                   help="comma list of fractions and/or sizes ('0,0.5,64MiB,1')")
    p.add_argument("--out", default="pareto_out", help="folder for pareto.md, pareto.csv, pareto.png")
    p.add_argument("--lower", default="inductor", choices=["inductor", "eager"], help="lowering the cost model assumes")
    p.add_argument("--cost-model", default="auto", choices=["auto", "roofline", "flops", "profile"])
    p.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    from remat_fx.pareto import pareto, table

    budgets = []
    for item in args.budgets.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            budgets.append(float(item) if "." in item or item in ("0", "1") else int(item))
        except ValueError:
            budgets.append(item)  # a size string: checked by pareto()
    model, inputs = _load(args.target)
    points = pareto(model, inputs, budgets, options={"lower": args.lower, "cost_model": args.cost_model},
                    out=args.out, progress=not args.no_progress)
    print(table(points))
    plot = (pathlib.Path(args.out) / "pareto.png").exists()
    print(f"wrote {args.out}/pareto.md, pareto.csv" + (", pareto.png" if plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
