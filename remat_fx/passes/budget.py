"""Budget: the fastest plan whose saved activation bytes fit a memory budget.

A 0-1 integer program over the forward nodes of the joint graph (solved exactly by scipy's
``milp``, i.e. HiGHS), per node v:

    s_v = 1   v's output is saved for backward          r_v = 1   v is recomputed in backward
    y_b = 1   storage b is held (a saved view pins its base's storage; parameters cost 0)

    minimise   sum_v cost_v r_v  (+ a tie-break on bytes, so that a smaller budget never saves more)
    such that  s_v + r_v >= 1            for every v backward reads
               r_v <= s_u + r_u          for every input u of v (a recompute needs its inputs)
               s_v <= y_base(v)
               sum_b bytes_b y_b <= target          (and one such row per annotated region budget)
               fixed by the tags: MUST_SAVE and random ops never recomputed, MUST_RECOMPUTE never
               saved, tuples never saved, primal inputs never recomputed.

The decisions become MUST_SAVE / MUST_RECOMPUTE tags and PyTorch's min-cut partition then
follows them; the partition's actual saved bytes are checked against the target.
A greedy fallback (best cost per byte first) answers when the ILP finds nothing in its time limit.
"""
from __future__ import annotations

import hashlib
import operator
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set, Tuple

import numpy as np
import torch
import torch.fx as fx

from remat_fx.memory_budget import Budget, fmt_bytes, parse_budget
from remat_fx.naming import META_BUDGET, META_BUDGET_REGION
from remat_fx.options import RematError
from remat_fx.passes.capture import JointGraph, is_multi_output, storage_base
from remat_fx.passes.cost import concrete
from remat_fx.passes.plan import input_label


@dataclass
class Problem:
    """The budget problem on plain ids (node names), independent of FX."""

    order: List[str]  # candidates in topological order
    inputs: Dict[str, Tuple[str, ...]]  # candidate -> its candidate inputs
    needed: Set[str]  # read by backward
    base: Dict[str, str]  # candidate -> the storage it pins when saved
    storage_bytes: Dict[str, int]
    cost: Dict[str, float]
    can_save: Set[str]
    can_recompute: Set[str]
    groups: Dict[str, Set[str]] = field(default_factory=dict)  # region budget name -> its storages
    # classes of nodes alike across repeated blocks (the k-th node of one name in layers.0, layers.1,
    # ...): the same decision for each member makes the blocks' backward kernels the same (_alike)
    ties: List[Tuple[str, ...]] = field(default_factory=list)

    def bytes_of(self, saved, group: Optional[str] = None) -> int:
        storages = {self.base[v] for v in saved}
        if group is not None:
            storages &= self.groups[group]
        return sum(self.storage_bytes[b] for b in storages)


@dataclass
class Solution:
    saved: Set[str]
    recomputed: Set[str]
    bytes: int
    cost: float
    method: str  # "ilp", "ilp (time limit)", "greedy"
    seconds: float
    alike: bool = False  # every class of problem.ties decided alike (repeated blocks planned the same)


_REST = "<outside budgeted regions>"


_INFEASIBLE = "infeasible"  # what _milp returns when HiGHS proves there is no plan


class BudgetInfeasible(RematError):
    """No plan meets the memory budget (or the budgets of several regions together)."""


# -- solving ------------------------------------------------------------------

def closure(problem: Problem, saved: Set[str]) -> Optional[Tuple[Set[str], Set[str]]]:
    """(saved, recomputed) when backward reads what ``saved`` leaves to recompute; nodes that
    cannot be recomputed are saved. None when a node that can be neither is needed."""
    found = _closure(problem, saved, None)
    if found is None:  # recomputing a savable node needed one that can be neither: save that node instead
        found = _closure(problem, saved, _completable(problem))
    return found


def _closure(problem: Problem, saved: Set[str], completable: Optional[Set[str]]):
    """As ``closure``, recomputing what can be (only what is ``completable``, when given)."""
    saved = set(saved)
    recomputed: Set[str] = set()
    stack = [v for v in problem.needed if v not in saved]
    while stack:
        v = stack.pop()
        if v in saved or v in recomputed:
            continue
        if v not in problem.can_recompute or (completable is not None and v not in completable):
            if v not in problem.can_save:
                return None
            saved.add(v)
            continue
        recomputed.add(v)
        stack.extend(u for u in problem.inputs[v] if u not in saved and u not in recomputed)
    return saved, recomputed


def _completable(problem: Problem) -> Set[str]:
    """The nodes whose recompute can be carried through: recomputable, each input savable or itself
    completable."""
    found: Set[str] = set()
    for v in problem.order:
        if v in problem.can_recompute and all(u in found or u in problem.can_save for u in problem.inputs[v]):
            found.add(v)
    return found


def _blocked(problem: Problem) -> List[str]:
    """The nodes the backward reads, directly or through what recomputing it needs, that can be
    neither saved nor recomputed (what makes ``closure`` fail with nothing saved)."""
    seen: Set[str] = set()
    found: Set[str] = set()
    stack = list(problem.needed)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in problem.can_save:
            continue
        if v not in problem.can_recompute:
            found.add(v)
            continue
        stack.extend(problem.inputs[v])
    return sorted(found)


def _cost(problem: Problem, recomputed) -> float:
    return sum(problem.cost[v] for v in recomputed)


def solve(problem: Problem, target: Optional[int], group_targets: Dict[str, int], *, method: str = "ilp",
          time_limit: float = 10.0, alike: Optional[float] = None) -> Solution:
    """The fastest plan under the targets; with ``alike`` (option blocks_alike), the fastest deciding
    each class of ``problem.ties`` alike where it adds at most that fraction of the forward's
    estimated time (``_alike``)."""
    t0 = time.perf_counter()
    if method == "ilp":
        found = _milp(problem, target, group_targets, time_limit=time_limit)
        if found == _INFEASIBLE:
            raise BudgetInfeasible(_together(problem, target, group_targets))
        if found is not None:
            saved, recomputed = closure(problem, found[0])
            alike = None if alike is None else \
                _alike(problem, target, group_targets, _cost(problem, recomputed), alike, time_limit)
            if alike is not None:
                saved, recomputed = alike
            return Solution(saved, recomputed, problem.bytes_of(saved),
                            _cost(problem, recomputed), "ilp" if found[1] == 0 else "ilp (time limit, best found)",
                            time.perf_counter() - t0, alike is not None)
    saved, recomputed = _greedy(problem, target, group_targets, time_limit)
    return Solution(saved, recomputed, problem.bytes_of(saved), _cost(problem, recomputed),
                    "greedy",
                    time.perf_counter() - t0)


def _alike(problem: Problem, target, group_targets, cost: float, slack: float, time_limit: float):
    """(saved, recomputed) of the fastest plan deciding each class of ``problem.ties`` alike, if it
    recomputes at most ``slack`` of the forward's estimated time more than the fastest plan
    (``cost``), else None. Inductor compiles a kernel once for all blocks whose code is the same: a
    block that saves what the others recompute has kernels of its own. On the 8-layer Llama of
    benchmarks/gpu.py, without reruns, the plan saving each block's down_proj output (8.05 MiB)
    compiled 25 kernels and spent 49.2 s in Inductor; the fastest plan under 7.06 MiB, which saves
    it in 6 of the 8 blocks, 38 and 53.9 s (docs/budgets.md#repeated-blocks-alike). The solver's choice among blocks of equal cost is
    otherwise arbitrary, and at many targets the plan alike costs the same."""
    if not problem.ties:
        return None
    found = _milp(problem, target, group_targets, time_limit=time_limit, ties=problem.ties)
    if found is None or found == _INFEASIBLE or found[1] != 0:
        return None
    saved, recomputed = closure(problem, found[0])
    if _cost(problem, recomputed) > cost + slack * sum(problem.cost.values()):
        return None
    return saved, recomputed


_MINIMA: "OrderedDict[tuple, Tuple[int, Set[str]]]" = OrderedDict()  # fingerprint -> minimum's answer
_MINIMA_KEPT = 32


def _keep(store: OrderedDict, key, value, kept: int) -> None:
    """``store[key] = value``, the oldest entries dropped past ``kept``."""
    store[key] = value
    while len(store) > kept:
        store.popitem(last=False)


def _fingerprint(problem: Problem, group: Optional[str], time_limit: float) -> tuple:
    """What the fewest-bytes answer depends on (not the recompute costs)."""
    return (tuple(problem.order), tuple(problem.inputs[v] for v in problem.order), frozenset(problem.needed),
            frozenset(problem.can_save), frozenset(problem.can_recompute), tuple(problem.base[v] for v in problem.order),
            tuple(sorted(problem.storage_bytes.items())), group,
            None if group is None else frozenset(problem.groups.get(group, ())), time_limit)


def minimum(problem: Problem, group: Optional[str] = None, time_limit: float = 10.0,
            group_targets: Optional[Dict[str, int]] = None) -> Tuple[int, Set[str]]:
    """The fewest saved bytes of any valid plan (in ``group``'s storages, when given), among those
    that meet ``group_targets`` (regions' budgets: bytes saved in each), if given. Remembered for
    the same problem: one compile's peak searches solve a graph at several budgets, each of which
    needs this same minimum."""
    targets = dict(group_targets or {})
    key = _fingerprint(problem, group, time_limit) + \
        (tuple(sorted((g, t, frozenset(problem.groups.get(g, ()))) for g, t in targets.items())),)
    if key in _MINIMA:
        _MINIMA.move_to_end(key)
        nbytes, saved = _MINIMA[key]
        return nbytes, set(saved)
    nbytes, saved = _minimum(problem, group, time_limit, targets)
    _keep(_MINIMA, key, (nbytes, frozenset(saved)), _MINIMA_KEPT)
    return nbytes, saved


def _minimum(problem: Problem, group: Optional[str], time_limit: float,
             group_targets: Dict[str, int]) -> Tuple[int, Set[str]]:
    found = _milp(problem, None, group_targets, objective=("bytes", group), time_limit=time_limit)
    if found == _INFEASIBLE and group_targets:  # each region's target is feasible alone (apply_budget)
        raise BudgetInfeasible(_together(problem, None, group_targets))
    if found == _INFEASIBLE:
        found = None
    if found is None and closure(problem, set()) is None:
        blocked = _blocked(problem)
        raise BudgetInfeasible(f"remat_fx: no plan meets a memory budget here: backward needs {blocked[:5]} "
                               f"(read, or to recompute what it reads), which can be neither saved nor "
                               f"recomputed (a tuple-returning op tagged MUST_SAVE?). Tag its outputs instead, "
                               f"or drop the budget.")
    if found is None:  # no answer in time: everything recomputable recomputed is valid and near it
        saved, _ = closure(problem, set())
    else:
        saved, _ = closure(problem, found[0])
    return problem.bytes_of(saved, group), saved


def _milp(problem: Problem, target, group_targets, *, objective=("cost", None), time_limit=10.0, ties=()):
    """(saved set, HiGHS status) of the best plan found, _INFEASIBLE, or None (nothing in time); a
    program HiGHS proved optimal or infeasible is answered again from ``_SOLVED``.

    The 0-1 program in the 'available / recomputed' form: a_v = s_v + r_v. Its rows other than
    the budgets are difference constraints (a network matrix), so the LP relaxation is integral
    but for the budget rows and branch-and-bound closes fast; a storage held by a saved view whose
    base cannot be saved adds a variable and a row per node of it (``held``), in few graphs."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    nodes = problem.order
    n = len(nodes)
    index = {v: i for i, v in enumerate(nodes)}
    # a storage a view of which may be saved (a view that must be saved, of a base that cannot be:
    # build_problem) is held when any of its nodes is saved: its bytes go on a variable of its own,
    # h_b >= s_v for each of its nodes, counted once, as Problem.bytes_of counts them
    held = sorted({problem.base[v] for v in nodes if problem.base[v] != v and v in problem.can_save})
    A, R, H = 0, n, 2 * n  # variable blocks: a_v (available in backward), r_v (recomputed), h_b (held)
    hindex = {b: H + k for k, b in enumerate(held)}
    nvar = 2 * n + len(held)
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(entries, lb, ub):
        r = len(lo)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)

    lower, upper = np.zeros(nvar), np.ones(nvar)
    for v in nodes:
        i = index[v]
        if v in problem.needed:
            lower[A + i] = 1
        row([(R + i, 1), (A + i, -1)], -np.inf, 0)  # s_v = a_v - r_v >= 0
        if v not in problem.can_save:
            row([(A + i, 1), (R + i, -1)], -np.inf, 0)  # s_v = 0
        if v not in problem.can_recompute:
            upper[R + i] = 0
        for u in problem.inputs[v]:
            row([(R + i, 1), (A + index[u], -1)], -np.inf, 0)  # a recompute needs its inputs
        if problem.base[v] in hindex:
            row([(A + i, 1), (R + i, -1), (hindex[problem.base[v]], -1)], -np.inf, 0)  # s_v <= h_b
    # saved bytes = sum over storage owners of m_v s_v (views are never saved: their base is), and over
    # the held storages of m_b h_b
    weight = np.array([problem.storage_bytes[v] if problem.base[v] == v and v not in hindex else 0 for v in nodes],
                      dtype=float)
    hweight = np.array([problem.storage_bytes[b] for b in held], dtype=float)

    def bytes_coefficients(group):  # on a_v, on r_v (s_v = a_v - r_v), and on h_b
        if group is None:
            return weight, -weight, hweight
        ws = np.where([v in problem.groups[group] for v in nodes], weight, 0.0)
        hs = np.where([b in problem.groups[group] for b in held], hweight, 0.0) if held else hweight
        return ws, -ws, hs

    def bytes_row(group, bound):
        ca, cr, ch = bytes_coefficients(group)
        row([(A + i, ca[i]) for i in range(n) if ca[i]] + [(R + i, cr[i]) for i in range(n) if cr[i]] +
            [(H + k, ch[k]) for k in range(len(held)) if ch[k]], -np.inf, bound)

    for tie in ties:  # the same decision for each node of a class (repeated blocks)
        first = index[tie[0]]
        for v in tie[1:]:
            row([(A + index[v], 1), (A + first, -1)], 0, 0)
            row([(R + index[v], 1), (R + first, -1)], 0, 0)
    if target is not None:
        bytes_row(None, target)
    for group, gtarget in group_targets.items():
        bytes_row(group, gtarget)

    c = np.zeros(nvar)
    total_bytes = max(weight.sum() + hweight.sum(), 1.0)
    ca, cr, ch = bytes_coefficients(None)
    kind, group = objective
    if kind == "cost":
        costs = np.array([problem.cost[v] for v in nodes], dtype=float)
        scale = costs.sum() or 1.0
        c[A:A + n] = 1e-2 * ca / total_bytes  # tie-break: of equally fast plans, the one saving least
        c[R:R + n] = 1e4 * costs / scale + 1e-2 * cr / total_bytes
        c[H:] = 1e-2 * ch / total_bytes
    else:
        c[A:A + n], c[R:R + n], c[H:] = 1e4 * ca / total_bytes, 1e4 * cr / total_bytes, 1e4 * ch / total_bytes
        if group is not None:  # the group's bytes first, then the fewest bytes elsewhere
            ga, gr, gh = bytes_coefficients(group)
            c[A:A + n] = 1e4 * (ga + 1e-3 * (ca - ga)) / total_bytes
            c[R:R + n] = 1e4 * (gr + 1e-3 * (cr - gr)) / total_bytes
            c[H:] = 1e4 * (gh + 1e-3 * (ch - gh)) / total_bytes
    A_ = coo_array((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    lo_, hi_ = np.array(lo, dtype=float), np.array(hi, dtype=float)
    key = _program_key(c, A_, lo_, hi_, lower, upper, time_limit)
    if key in _SOLVED:
        _SOLVED.move_to_end(key)
        status, x = _SOLVED[key]
    else:
        res = milp(c, constraints=[LinearConstraint(A_, lo_, hi_)], integrality=np.ones(nvar),
                   bounds=Bounds(lower, upper),
                   options={"time_limit": time_limit, "mip_rel_gap": 1e-9, "presolve": True})
        status, x = res.status, (None if res.x is None else np.round(res.x).astype(np.int8))
        if status in (0, 2):  # proven optimal or infeasible: the same answer whenever asked (not a time limit's)
            _keep(_SOLVED, key, (status, x), _SOLVED_KEPT)
    if status == 2:
        return _INFEASIBLE
    if x is None or status not in (0, 1):
        return None
    saved = {v for v in nodes if x[A + index[v]] - x[R + index[v]] > 0}
    return saved, status


_SOLVED: "OrderedDict[bytes, tuple]" = OrderedDict()  # the 0-1 program's digest -> (HiGHS status, solution)
_SOLVED_KEPT = 256


def _program_key(c, A, lo, hi, lower, upper, time_limit) -> bytes:
    """A digest of the whole 0-1 program as HiGHS gets it (objective, matrix, bounds, time limit)."""
    h = hashlib.blake2b(digest_size=20)
    for a in (c, A.data, A.indices, A.indptr, lo, hi, lower, upper):
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    h.update(repr((A.shape, time_limit)).encode())
    return h.digest()


def _together(problem: Problem, target, group_targets) -> str:
    parts = ([f"at most {fmt_bytes(target)} in all"] if target is not None else []) + [
        f"at most {fmt_bytes(t)} in {'the rest of the graph' if g == _REST else repr(g)}"
        for g, t in group_targets.items()]
    fix = "Raise one of them."
    if _REST in group_targets:  # the rest is not a budget the user wrote
        fix = ("Without an overall memory_budget the rest of the graph saves at most what it saves without a "
               "budget (a region's budget is not paid for elsewhere): raise a region's budget, or give an overall "
               "memory_budget (e.g. 1) to let the rest save what the regions' budgets need.")
    return (f"remat_fx: the memory budgets cannot all be met at once ({'; '.join(parts)}): each is feasible alone, "
            f"but the plans that meet one keep too much for another. {fix}")


def _greedy(problem: Problem, target, group_targets, time_limit) -> Tuple[Set[str], Set[str]]:
    """Start from the fewest saved bytes (a network LP, fast); save what costs most to recompute
    per byte, while it fits."""
    saved, recomputed = closure(problem, minimum(problem, time_limit=time_limit)[1])
    if not _fits(problem, saved, target, group_targets):
        raise BudgetInfeasible(_together(problem, target, group_targets))
    pinned = {problem.base[v] for v in saved}

    def ratio(v):
        b = problem.base[v]
        extra = 0 if b in pinned else problem.storage_bytes[b]
        return problem.cost[v] / (extra + 1)

    for v in sorted(recomputed & problem.can_save, key=ratio, reverse=True):
        if v not in recomputed or problem.cost[v] <= 0:
            continue
        trial = closure(problem, saved | {v})
        if _fits(problem, trial[0], target, group_targets):
            saved, recomputed = trial
    return saved, recomputed


def _fits(problem: Problem, saved, target, group_targets) -> bool:
    if target is not None and problem.bytes_of(saved) > target:
        return False
    return all(problem.bytes_of(saved, g) <= t for g, t in group_targets.items())


# -- the joint graph as a Problem --------------------------------------------

def _is_sym(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) and not is_multi_output(node)


def _recomputable_op(node: fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False  # higher-order ops (effects, user kernels): left to the tags and the partitioner
    return target.namespace not in ("_c10d_functional", "c10d_functional")


def primal_inputs(gm: fx.GraphModule) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and not str(n.target).startswith(("tangents", "bwd_"))]


def build_problem(joint: JointGraph, tags, params: Set[str], cost_model) -> Tuple[Problem, Dict[str, fx.Node]]:
    """The candidates are the forward nodes and the primal inputs; tags fix what they say."""
    from torch.utils.checkpoint import CheckpointPolicy as P

    gm = joint.gm
    primals = set(primal_inputs(gm))
    candidates = [n for n in gm.graph.nodes if (n in joint.forward or n in primals) and not _is_sym(n)]
    cset = set(candidates)
    by_id = {n.name: n for n in candidates}
    problem = Problem(order=[n.name for n in candidates], inputs={}, needed=set(), base={}, storage_bytes={},
                      cost={}, can_save=set(), can_recompute=set())
    grad_outputs = set()
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    fx.node.map_arg(output.args[0][joint.num_fwd_outputs:], grad_outputs.add)
    for node in candidates:
        name = node.name
        problem.inputs[name] = tuple(u.name for u in node.all_input_nodes if u in cset)
        if node in grad_outputs or any(u not in joint.forward and u.op == "call_function" for u in node.users):
            problem.needed.add(name)
        base = storage_base(node)
        problem.base[name] = base.name
        if base.name not in problem.storage_bytes:
            val = base.meta.get("val")
            nbytes = concrete(val.untyped_storage().nbytes()) if isinstance(val, torch.Tensor) else 0
            problem.storage_bytes[base.name] = 0 if base.name in params else nbytes
        tag = tags.get(node)
        policy = tag.policy if tag is not None else None
        if node.op == "placeholder":
            problem.can_save.add(name)
            problem.cost[name] = 0.0
            continue
        problem.cost[name] = float(cost_model(node))
        if not is_multi_output(node) and policy is not P.MUST_RECOMPUTE:
            problem.can_save.add(name)
        if policy is not P.MUST_SAVE and (_recomputable_op(node) or policy is P.MUST_RECOMPUTE):
            problem.can_recompute.add(name)
        region = joint.custom(node).get(META_BUDGET_REGION)
        if region is not None:
            problem.groups.setdefault(region, set()).add(base.name)
    # a saved view pins its base's storage: save the base and redo the (free) view instead, so
    # every storage has one owner; a view that must be saved makes its base unrecomputable
    for name in problem.order:
        base = problem.base[name]
        if base == name:
            continue
        if name not in problem.can_recompute and name in problem.needed:
            if base not in problem.can_save:  # a base that cannot be saved either (MUST_RECOMPUTE): the
                continue                      # saved view keeps its storage, as the min-cut's plan does
            problem.can_recompute.add(name)
            problem.can_recompute.discard(base)
            _view_chain_recomputable(problem, name)
        elif name in problem.can_save:
            problem.can_recompute.add(name)
            _view_chain_recomputable(problem, name)
        problem.can_save.discard(name)
        problem.cost[name] = 0.0
    return problem, by_id


_BLOCK = re.compile(r"(?<![^.])(\d+)(?=\.)")  # a block's index in a module path: model.layers.3.mlp, 3.mlp


def _repeats(problem: Problem, joint: JointGraph, by_id) -> List[Tuple[str, ...]]:
    """Classes of forward ops alike across repeated blocks: the k-th op (in graph order) named
    ``model.layers.<i>.mlp.down_proj.mm`` for each ``i``, kept where its members are the same to the
    solver (bytes, cost, what may be saved or recomputed, read by backward, view or not, region)."""
    members: Dict[tuple, List[str]] = {}
    for name in problem.order:
        node = by_id[name]
        label = joint.names.get(node)
        if node.op != "call_function" or not label:
            continue
        blocks = tuple(_BLOCK.findall(label))
        if blocks:
            members.setdefault((_BLOCK.sub("#", label), blocks), []).append(name)
    classes: Dict[tuple, List[str]] = {}
    for (label, _), names in members.items():
        for k, name in enumerate(names):
            classes.setdefault((label, k), []).append(name)
    regions = {b: g for g, storages in problem.groups.items() for b in storages}

    def alike(v):
        base = problem.base[v]
        return (by_id[v].target, problem.storage_bytes.get(base), base == v, v in problem.needed,
                v in problem.can_save, v in problem.can_recompute, problem.cost[v], regions.get(base))

    return [tuple(names) for names in classes.values() if len(names) > 1 and len({alike(v) for v in names}) == 1]


def _view_chain_recomputable(problem: Problem, name: str) -> None:
    """The views between view ``name`` and its base are redone with it (free): one that could be
    neither saved nor recomputed (an op returning several views, e.g. chunk, tagged MUST_SAVE by a
    glob: its outputs are what is saved, and they are views of the base) is made recomputable."""
    base = problem.base[name]
    stack = [u for u in problem.inputs[name] if u != base and problem.base[u] == base]
    while stack:
        u = stack.pop()
        if u in problem.can_recompute or u in problem.can_save:
            continue
        problem.can_recompute.add(u)
        problem.cost[u] = 0.0
        stack.extend(w for w in problem.inputs[u] if w != base and problem.base[w] == base)


def region_budgets(joint: JointGraph) -> Dict[str, object]:
    """Annotated region name -> the budget written on it (remat.annotate(..., memory_budget=...))."""
    out: Dict[str, object] = {}
    for node in joint.forward:
        custom = joint.custom(node)
        region = custom.get(META_BUDGET_REGION)
        if region is not None:
            out[region] = custom.get(META_BUDGET)
    return out


# -- the budget pass ----------------------------------------------------------

def budgets_of(joint: JointGraph, options) -> Dict[Optional[str], Budget]:
    """{None: the graph's budget, region name: that region's budget}, those that are set."""
    out: Dict[Optional[str], Budget] = {}
    if options.memory_budget is not None:
        out[None] = options.memory_budget
    for region, value in region_budgets(joint).items():
        out[region] = parse_budget(value, f"remat.annotate('{region}', memory_budget=...)")
    return out


def region_bytes(joint: JointGraph, plan, region: str, params: Set[str]) -> int:
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    total = 0
    for s in plan.saved:
        node = nodes.get(s.fx_name)
        if node is not None and joint.custom(storage_base(node)).get(META_BUDGET_REGION) == region:
            total += s.bytes
    return total


def apply_budget(joint: JointGraph, tags, plan, budgets: Dict[Optional[str], Budget], params: Set[str],
                 cost_model, options):
    """New tags meeting the budgets (user MUST tags kept) and the BudgetReport (achieved filled in later)."""
    from remat_fx.passes.plan import BudgetReport

    t0 = time.perf_counter()
    problem, by_id = build_problem(joint, tags, params, cost_model)
    limit = options.solver_time_limit
    nodes = {n.name: n for n in joint.gm.graph.nodes}
    # what the plan without a budget holds, by storage (it may save views that are not candidates)
    saved_now = {storage_base(nodes[s.fx_name]).name for s in plan.saved if s.fx_name in nodes} & set(problem.order)
    maximum = plan.total_bytes
    min_bytes, min_saved = minimum(problem, time_limit=limit)
    group_targets: Dict[str, int] = {}
    regions: Dict[str, BudgetReport] = {}
    for region, budget in budgets.items():
        if region is None:
            continue
        # what the plan without a budget saves there, as its report counts it (region_bytes): with what it
        # saves of a backward formula that reads forward values only (no candidate: not in saved_now)
        gmax = max(problem.bytes_of(saved_now, region), region_bytes(joint, plan, region, params))
        gmin, gsaved = minimum(problem, region, time_limit=limit)
        gmax = max(gmax, gmin)
        gtarget = budget.target(gmin, gmax)
        if gtarget < gmin:
            raise _infeasible(f"remat.annotate('{region}', memory_budget={budget})", gtarget, gmin, gsaved,
                              problem, by_id, joint, tags, region)
        regions[region] = BudgetReport(str(budget), gtarget, 0, gmin, gmax, "none", 0.0, 0.0)
        group_targets[region] = gtarget  # a row even when it does not bind: freed bytes may not flow in
    budget = budgets.get(None)
    if group_targets:
        # the fewest bytes in all that the regions' targets leave: a region held under its own minimum can
        # make the rest save more (what it would have recomputed from), so the overall budget's fraction 0
        # is that, and fraction 1 at least that; the searches' lower targets (passes/peak.py) go no lower
        min_bytes, min_saved = minimum(problem, time_limit=limit, group_targets=group_targets)
    if not group_targets and plan.total_bytes < min_bytes:
        # the plan without a budget saves less than the problem's least: the min-cut may save a value a
        # backward formula makes of forward ones (gelu's 1 + erf(x / sqrt 2)), which the problem does not
        # model, in place of what it reads. Where every forward value is tagged SAVE (save=["*"]) nothing
        # else is left to drop, and the problem's least was over that plan: memory_budget="216KiB" was
        # refused as below a feasible minimum of 312 KiB, which the plan without a budget met (a review)
        min_bytes, min_saved = plan.total_bytes, saved_now
    maximum = max(maximum, min_bytes)
    if budget is not None:
        target = budget.target(min_bytes, maximum)
        if target < min_bytes:
            raise _infeasible(f"memory_budget={budget}", target, min_bytes, min_saved, problem, by_id, joint, tags)
        report = BudgetReport(str(budget), target, 0, min_bytes, maximum, "none", 0.0, 0.0, regions)
    else:
        target = maximum
        report = BudgetReport("none (regions only)", maximum, 0, min_bytes, maximum, "none", 0.0, 0.0, regions)
        if group_targets:  # what a region budget frees is not spent outside the budgeted regions
            inside = set().union(*problem.groups.values())
            problem.groups[_REST] = {problem.base[v] for v in problem.order} - inside
            group_targets[_REST] = problem.bytes_of(saved_now, _REST)
    if target >= maximum and all(regions[r].target >= regions[r].maximum for r in regions):
        report.solve_seconds = time.perf_counter() - t0
        return tags, report  # the plan without a budget fits: keep it
    alike = options.blocks_alike if isinstance(options.blocks_alike, float) else None  # "final": passes/peak.py
    if alike is not None:  # the classes only when asked: a walk over the graph's names
        problem.ties = _repeats(problem, joint, by_id)
    sol = solve(problem, min(target, maximum), group_targets, method=options.solver, time_limit=limit,
                alike=alike)
    report.solver = sol.method
    report.alike = len(problem.ties) if sol.alike else 0
    for region in group_targets:
        if region in regions:
            regions[region].solver = sol.method
    new = _budget_tags(joint, tags, problem, by_id, sol)
    report.solve_seconds = time.perf_counter() - t0
    return new, report


def _budget_tags(joint: JointGraph, tags, problem: Problem, by_id, sol: Solution):
    from torch.utils.checkpoint import CheckpointPolicy as P

    from remat_fx.passes.tag import Tag

    new = dict(tags)
    for name in problem.order:
        node = by_id[name]
        if node.op != "call_function":
            continue
        old = tags.get(node)
        if old is not None and old.policy in (P.MUST_SAVE, P.MUST_RECOMPUTE):
            continue  # the user's word (or a random op's) stands
        over = f" (over {old.policy.name}: {old.reason})" if old is not None else ""
        if name in sol.saved:
            new[node] = Tag(P.MUST_SAVE, f"memory budget: saved{over}")
        elif name in sol.recomputed:
            new[node] = Tag(P.MUST_RECOMPUTE, f"memory budget: recomputed{over}")
        else:
            new[node] = Tag(P.MUST_SAVE, f"memory budget: not read by backward{over}")
    for node in joint.gm.graph.nodes:
        node.meta.pop("recompute", None)
    for node, tag in new.items():
        node.meta["recompute"] = tag.policy
    # backward-formula nodes that read only forward values (no tangent) are computed in backward
    # from what the plan keeps, as the solver assumed, not in forward and saved
    tangent_closure: Set[fx.Node] = set()
    for node in joint.gm.graph.nodes:
        if (node.op == "placeholder" and str(node.target).startswith("tangents")) or \
                any(u in tangent_closure for u in node.all_input_nodes):
            tangent_closure.add(node)
    for node in joint.gm.graph.nodes:
        if node.op == "call_function" and node not in joint.forward and node not in tangent_closure:
            node.meta["recompute"] = P.MUST_RECOMPUTE
    return new


def _why_kept(node, problem: Problem, by_id, joint, tags, label) -> str:
    """Why the fewest-bytes plan keeps a node that could be recomputed: what the recompute needs."""
    stack, seen = list(problem.inputs[node.name]), set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v not in problem.can_recompute:
            u = by_id[v]
            tag = tags.get(u)
            why = tag.reason if tag is not None else ("graph input" if u.op == "placeholder" else "not recomputable")
            return f"recomputing it needs {label(u)} ({why}), {fmt_bytes(problem.storage_bytes[problem.base[v]])}"
        stack.extend(problem.inputs[v])
    return "read by backward and cannot be recomputed"


def _infeasible(what: str, target: int, minimum_bytes: int, saved: Set[str], problem: Problem, by_id, joint,
                tags, region: Optional[str] = None) -> BudgetInfeasible:
    storages: Dict[str, List[str]] = {}
    for v in saved:
        storages.setdefault(problem.base[v], []).append(v)
    if region is not None:
        storages = {b: vs for b, vs in storages.items() if b in problem.groups.get(region, ())}
    biggest = sorted(storages, key=lambda b: -problem.storage_bytes[b])[:5]

    def label(n):
        # a graph input as the plan names it (``input x``), not as AOTAutograd does (``primals_3``)
        name = input_label(joint, n) if n.op == "placeholder" else joint.names.get(n, n.name)
        return name if name == n.name else f"{name} ({n.name})"

    lines = []
    for b in biggest:
        if not problem.storage_bytes[b]:
            continue
        node = by_id[sorted(storages[b])[0]]
        tag = tags.get(node)
        if node.op == "placeholder":
            why = "graph input"
        elif tag is not None and tag.saves:
            why = tag.reason
        else:
            why = _why_kept(node, problem, by_id, joint, tags, label)
        lines.append(f"    {label(node)}: {fmt_bytes(problem.storage_bytes[b])} ({why})")
    return BudgetInfeasible(
        f"remat_fx: {what} asks for at most {fmt_bytes(target)} ({target:,} bytes) of saved activations, below "
        f"the feasible minimum {fmt_bytes(minimum_bytes)} ({minimum_bytes:,} bytes) for this graph"
        f"{' in that region' if region else ''}. Even with everything recomputable recomputed, these stay "
        "saved (largest first):\n" + "\n".join(lines) + f"\n  Raise the budget to at least {minimum_bytes:,} "
        f"bytes, or allow more recompute (MUST_SAVE tags from save globs and SAVE ops count against it).")
