"""The plan cache: what a budget's search chose for a joint graph, kept on disk, so that the next
process compiling the same graph with the same options makes that one plan instead of searching.

A memory budget's search (the peak tie-break and the monotone envelope, passes/peak.py) or a
peak_budget's partitions one graph many times: 5-9 times per compile on the 8-layer Llama of
benchmarks/gpu.py with the default options, 27-57 with ``monotone="grid"``. What it chooses is one
call of the partition's ``cut`` (its budgets, the time allowance of its reruns and their peak cap)
and the notes the search wrote on the plan's budget report. An entry holds those, and the plan's
saved bytes and estimated peak: a process finding it makes that one call, and checks that it
gives the plan recorded; where it does not (a cost model that measures op times, another machine),
it searches as without the cache and writes the entry again.

Entries are keyed by the joint graph (each node's op, target, arguments, value shape, stride and
dtype, and the node meta the tag pass reads: module paths, annotations, checkpoint tags), the
partition's arguments, the options, torch's version and remat_fx's own source (a change to any
of its files leaves every earlier entry unread). Folder: ``$REMAT_FX_CACHE_DIR/plans`` (default
``~/.cache/remat_fx/plans``); ``REMAT_FX_PLAN_CACHE=0`` turns the cache off. The measured cost
model (``cost_model="profile"``) is not cached: its search ran on times the next process would
measure again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from remat_fx.memory_budget import Budget

_PACKAGE = pathlib.Path(__file__).resolve().parent
_TAG_META = ("nn_module_stack", "custom", "recompute", "ac_graph_id")  # what passes/tag.py and naming read
# the search's notes on the chosen plan's budget report (passes/peak.py lower_peak, _envelope)
REPORT_NOTES = ("budget", "target", "lowered_to", "fastest_peak", "fastest_step_s", "held_under", "held_by",
                "held_met", "held_final")


def cache_root() -> pathlib.Path:
    """remat_fx's cache folder: ``$REMAT_FX_CACHE_DIR``, else ``~/.cache/remat_fx``."""
    root = os.environ.get("REMAT_FX_CACHE_DIR")
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "remat_fx"


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """A digest of remat_fx's own source files (read once per process)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def enabled(options) -> bool:
    return os.environ.get("REMAT_FX_PLAN_CACHE", "1") != "0" and options.cost_model != "profile"


def _value(v) -> str:
    """A node's value as the key sees it: tensors by shape, stride, dtype and device."""
    def one(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(map(str, x.shape)), tuple(map(str, x.stride())), str(x.dtype), x.device.type)
        return type(x).__name__ if not isinstance(x, (int, float, bool, str, type(None))) else repr(x)
    return repr(pytree.tree_map(one, v))


def _meta(node: fx.Node) -> str:
    out = []
    for k in _TAG_META:
        v = node.meta.get(k)
        if k == "nn_module_stack" and v is not None:
            v = [(path, str(getattr(cls, "__qualname__", cls))) for path, cls in v.values()]
        out.append(repr(v))
    return "|".join(out)


@dataclass
class Entry:
    """One joint graph's place in the cache."""

    path: pathlib.Path

    def load(self) -> Optional[dict]:
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        record["budgets"] = {k: Budget(fraction=f, nbytes=n) for k, f, n in record["budgets"]}
        return record

    def store(self, budgets, fastest_s, cap, quick, plan) -> None:
        """Writes what the search chose: ``cut(budgets, fastest_s, cap, quick)`` gave ``plan``."""
        report = plan.budget
        record = {"budgets": [[k, b.fraction, b.nbytes] for k, b in budgets.items()], "fastest_s": fastest_s,
                  "cap": cap, "quick": quick, "peak_budget": plan.peak_budget,
                  "report": None if report is None else {k: getattr(report, k) for k in REPORT_NOTES},
                  "saved": plan.total_bytes, "peak": plan.peak.step, "torch": torch.__version__}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only or full disk: the next process searches again


def entry(joint_gm: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices, options) -> Entry:
    """The cache entry of a joint graph partitioned with these arguments and options."""
    digest = hashlib.sha256()
    digest.update(repr((torch.__version__, source_digest(), options.key(), num_fwd_outputs,
                        tuple(static_lifetime_input_indices or ()))).encode())
    for node in joint_gm.graph.nodes:
        digest.update(repr((node.op, node.name, str(node.target), str(node.args), str(node.kwargs))).encode())
        digest.update(_value(node.meta.get("val")).encode())
        digest.update(_meta(node).encode())
    return Entry(cache_root() / "plans" / f"plan-{digest.hexdigest()[:32]}.json")
