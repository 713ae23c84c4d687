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

import copy
import functools
import hashlib
import json
import os
import tempfile
import pathlib
import pickle
import warnings
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from remat_fx.memory_budget import Budget
from remat_fx.naming import META_KEYS
from remat_fx.sizes import sizes_key

_PACKAGE = pathlib.Path(__file__).resolve().parent
_TAG_META = ("nn_module_stack", "custom", "recompute", "ac_graph_id")  # what passes/tag.py and naming read
# the search's notes on the chosen plan's budget report (passes/peak.py lower_peak, _envelope)
REPORT_NOTES = ("budget", "target", "lowered_to", "lowered_for", "fastest_peak", "fastest_step_s", "held_under",
                "held_by", "held_met", "held_levels")
_FIELDS = {"budgets", "fastest_s", "cap", "quick", "alike", "peak_budget", "report", "saved", "peak"}


def cache_root() -> pathlib.Path:
    """remat_fx's cache folder: ``$REMAT_FX_CACHE_DIR``, else ``~/.cache/remat_fx``."""
    root = os.environ.get("REMAT_FX_CACHE_DIR")
    return pathlib.Path(root).expanduser() if root else pathlib.Path.home() / ".cache" / "remat_fx"


_UNWRITABLE: set = set()  # folders said to be unwritable (once each per process)


def unwritable(path: pathlib.Path, error: Exception) -> None:
    """A plan or record the cache could not write: said once per folder (it was silent, and no run
    of the job ever found a plan there). The compile goes on: its plan stands."""
    folder = str(path.parent)
    if folder in _UNWRITABLE:
        return
    _UNWRITABLE.add(folder)
    warnings.warn(f"remat_fx: the plan cache could not write in {folder} ({type(error).__name__}: {error}): the "
                  f"plans made here are not kept for the next run, which plans again. Set REMAT_FX_CACHE_DIR to a "
                  f"folder it can write, or REMAT_FX_PLAN_CACHE=0 to turn the cache off.", stacklevel=2)


@functools.lru_cache(maxsize=None)
def source_digest(package: pathlib.Path = _PACKAGE) -> str:
    """A digest of remat_fx's own source files (read once per process)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


_UMASK = os.umask(0)  # the process's, read at import (the only way is to set it)
os.umask(_UMASK)


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Writes ``path`` whole or not at all (a process reading it meanwhile sees the old file or the
    new one): through a file of the writer's own beside it (a name no other writer has: not the
    process id, which two threads, or two containers sharing the folder, have alike), renamed over
    it. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    tmp = pathlib.Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~_UMASK)  # as a file opened for writing is made (mkstemp's are the owner's alone)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # a full disk: no partial file left behind


_OFF, _ON = ("0", "false", "off", "no"), ("", "1", "true", "on", "yes")


def switched_on() -> bool:
    """The environment's switch, ``REMAT_FX_PLAN_CACHE``: 0 / false / off / no turn the cache off (any case),
    1 / true / on / yes or unset leave it on; anything else is refused (a typo would otherwise leave it on)."""
    value = os.environ.get("REMAT_FX_PLAN_CACHE", "1").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"remat_fx: REMAT_FX_PLAN_CACHE={os.environ['REMAT_FX_PLAN_CACHE']!r} is neither on "
                     f"({' / '.join(v for v in _ON if v)}) nor off ({' / '.join(_OFF)}); set it to 0 to turn the "
                     f"plan cache off")


def enabled(options) -> bool:
    return switched_on() and options.cost_model != "profile"


def _value(v) -> str:
    """A node's value as the key sees it: tensors by shape, stride, dtype and device."""
    def one(x):
        if isinstance(x, torch.Tensor):
            return ("T", tuple(map(str, x.shape)), tuple(map(str, x.stride())), str(x.dtype), x.device.type)
        return type(x).__name__ if not isinstance(x, (int, float, bool, str, type(None))) else repr(x)
    return repr(pytree.tree_map(one, v))


def annotations_digest(gm: fx.GraphModule) -> str:
    """A digest of the remat annotations on a Dynamo graph's nodes (remat.annotate's and the regions'
    names, policies, budgets and globs: node metadata, which ``gm.code`` does not show, so neither
    AOTAutograd's cache key nor the graph's record key saw a changed region budget)."""
    digest = hashlib.sha256()
    for node in gm.graph.nodes:
        custom = node.meta.get("custom")
        if custom:  # remat's own keys only: torch keeps objects there whose repr holds an address
            mine = sorted((k, repr(v)) for k, v in custom.items() if k in META_KEYS)
            if mine:
                digest.update(repr((node.name, mine)).encode())
    return digest.hexdigest()[:24]


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
            record["budgets"] = {k: Budget(fraction=f, nbytes=n) for k, f, n in record["budgets"]}
            if not _FIELDS <= record.keys():
                return None
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None  # unreadable or not an entry this code wrote: searched again and written anew
        return record

    def store(self, budgets, fastest_s, cap, quick, alike, plan) -> None:
        """Writes what the search chose: ``cut(budgets, fastest_s, cap, quick, alike)`` gave ``plan``."""
        report = plan.budget
        record = {"budgets": [[k, b.fraction, b.nbytes] for k, b in budgets.items()], "fastest_s": fastest_s,
                  "cap": cap, "quick": quick, "alike": alike, "peak_budget": plan.peak_budget,
                  "report": None if report is None else {k: getattr(report, k) for k in REPORT_NOTES},
                  "saved": plan.total_bytes, "peak": plan.peak.step, "torch": torch.__version__}
        try:
            write_atomic(self.path, json.dumps(record).encode())
        except OSError as e:  # a read-only or full disk: the next process searches again
            unwritable(self.path, e)


def entry(joint_gm: fx.GraphModule, num_fwd_outputs: int, static_lifetime_input_indices, options) -> Entry:
    """The cache entry of a joint graph partitioned with these arguments and options."""
    digest = hashlib.sha256()
    digest.update(repr((torch.__version__, source_digest(), options.key(), num_fwd_outputs,
                        tuple(static_lifetime_input_indices or ()), sizes_key())).encode())
    for node in joint_gm.graph.nodes:
        digest.update(repr((node.op, node.name, str(node.target), str(node.args), str(node.kwargs))).encode())
        digest.update(_value(node.meta.get("val")).encode())
        digest.update(_meta(node).encode())
    return Entry(cache_root() / "plans" / f"plan-{digest.hexdigest()[:32]}.json")


# AOTAutograd's cache, for the graphs whose plan nothing re-plans (remat_fx/step.py): a hit loads
# the compiled forward and backward without tracing the joint graph or partitioning it, and so
# without a plan; the plan comes from the graph's record, written when it was compiled (its plan,
# the gradient bytes of its backward and its joint graph's primal inputs, for the step's view).


def graph_record(graph_key: str, options, global_state) -> pathlib.Path:
    """Where the record of a Dynamo graph compiled with ``options`` under ``global_state`` lives.
    Keyed by what AOTAutograd's own key reads that a user changes between runs: the graph and its
    inputs (``graph_key``), the options, grad mode and autocast, torch's and remat_fx's code, and
    the functorch and Inductor configs."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    text = repr((graph_key, options.key(), global_state, torch.__version__, source_digest(),
                 sorted((k, v) for k, v in functorch_config.get_config_copy().items() if _plain(v)),
                 sorted((k, v) for k, v in inductor_config.get_config_copy().items() if _plain(v))))
    return cache_root() / "plans" / f"graph-{hashlib.sha256(text.encode()).hexdigest()[:32]}.pkl"


def _plain(v) -> bool:
    return isinstance(v, (int, float, bool, str, type(None))) or \
        (isinstance(v, (list, tuple)) and all(isinstance(x, (int, float, bool, str)) for x in v))


def aot_cache_hits() -> int:
    """AOTAutograd's cache hits so far in this process (Dynamo's counters: checked on torch 2.13
    and 2.14, tests/test_plan_cache.py)."""
    from torch._dynamo.utils import counters

    return counters["aot_autograd"]["autograd_cache_hit"]


def save_record(path: pathlib.Path, plan, grads: int, primals: Optional[List[str]]) -> None:
    """Writes a graph's record: its plan as it is now (None: nothing saved for a backward)."""
    if plan is not None:
        plan = _portable(plan)
    try:
        write_atomic(path, pickle.dumps({"plan": plan, "grads": grads, "primals": primals}))
    except OSError as e:  # the next process traces and partitions the graph again
        unwritable(path, e)
    except (pickle.PicklingError, TypeError, AttributeError):
        pass  # the next process traces and partitions the graph again


def load_record(path: pathlib.Path) -> Optional[dict]:
    try:
        record = pickle.loads(path.read_bytes())
    except Exception:  # noqa: BLE001 - missing, truncated, or written by other code: no record
        return None
    return record if isinstance(record, dict) and {"plan", "grads", "primals"} <= record.keys() else None


def _portable(plan):
    """A copy of ``plan`` without what holds the graph (the rerun search's programs)."""
    plan = copy.copy(plan)
    if plan.rerun is not None and getattr(plan.rerun, "_steps", None) is not None:
        plan.rerun = copy.copy(plan.rerun)
        plan.rerun._steps = None
    return plan


# A step's own plan (remat_fx/step.py): what a step of several calls was planned as a whole to
# (plan_step: the shared memory budget of a whole-step limit or a fraction peak_budget; hold_step:
# the larger budgets' plans a fraction memory_budget's graphs took to hold the step's estimate).
# The next process compiles each graph of the step straight with what the step gave it, its first
# step included, and takes the step's decision without estimating it again. One small JSON file
# per graph, keyed by the graph (its Dynamo graph and inputs), the options, the global state it runs
# under, the resolved byte limit of peak_budget="auto", torch's and remat_fx's code; each holds the
# whole step's record (its calls, by graph key, and what each graph took).


def step_record(graph_key: str, options, global_state, limit: Optional[int]) -> pathlib.Path:
    """Where the step record of a Dynamo graph compiled with ``options`` lives."""
    text = repr((graph_key, options.key(), global_state, limit, torch.__version__, source_digest()))
    return cache_root() / "plans" / f"step-{hashlib.sha256(text.encode()).hexdigest()[:32]}.json"


_STEP_FIELDS = {"kind", "calls", "choice", "plans", "notes", "step"}


def save_step(paths: List[pathlib.Path], record: dict) -> None:
    """Writes a step's record under each of its graphs' ``paths``."""
    data = json.dumps(dict(record, torch=torch.__version__)).encode()
    for path in paths:
        try:
            write_atomic(path, data)
        except OSError as e:  # the next process plans its step again
            unwritable(path, e)
            return


def load_step(path: pathlib.Path) -> Optional[dict]:
    """A step record, or None (missing, unreadable, or not one this code wrote)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(record, dict) and _STEP_FIELDS <= record.keys() and isinstance(record["calls"], list)
            and all(isinstance(record[k], dict) for k in ("choice", "plans", "notes", "step"))):
        return None
    return record
