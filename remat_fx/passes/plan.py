"""The Plan: what a compiled graph saves for backward, why, and what it recomputes.

``remat.last_plan()`` returns the plan of the last graph compiled by the backend.
``str(plan)`` is the compact view: the activations saved for backward, one line per stored tensor
under the name the user knows (its module path and op, grouped, with a count when several share a
name), parameters summed up in one line, and the budget's story (target, achieved, feasible range,
and why they differ). ``plan.format(full=True)`` is the full table: every saved tensor, parameters
and FX names included, like JAX's ``print_saved_residuals``.
"""
from __future__ import annotations

import contextlib
import pathlib
import re
from collections import Counter
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

from remat_fx.memory_budget import fmt_bytes
from remat_fx.naming import META_KIND, META_NAME, META_POLICY
from remat_fx.policy import CheckpointPolicy, resolve_policy
from remat_fx.passes.capture import JointGraph, op_name, storage_base
from remat_fx.passes.cost import concrete, flops
from remat_fx.passes.peak import PeakEstimate
from remat_fx.passes.rerun import RerunReport
from remat_fx.passes.tag import Tag, region_globs


@dataclass(frozen=True)
class SavedActivation:
    name: str  # remat name, module path + op, or FX name
    fx_name: str
    shape: tuple
    dtype: torch.dtype
    bytes: int  # per storage, counted once (0 for an alias of one already counted, and for parameters)
    reason: str
    owner: Optional[str] = None  # the remat op this activation is kept for (see Plan.bytes_by_owner)
    source: Optional[str] = None  # the user source line, where FX recorded it
    # the stored tensor it is (a view, or an alias, shares its base's storage): its name as the user
    # knows it (module path and op, "input x", or "le(layers.0.relu)" for an op the partitioner moved
    # into the forward for the backward), its FX name and shape
    label: str = ""
    storage: str = ""
    storage_shape: tuple = ()
    parameter: bool = False  # a parameter (held by the model anyway: 0 bytes)


@dataclass
class BudgetReport:
    """How a memory budget was met (all sizes in bytes, as Plan.total_bytes counts them)."""

    budget: str  # as written: a fraction or a size
    target: int
    achieved: int
    minimum: int  # the fewest saved bytes any valid plan has (fraction 0)
    maximum: int  # the plan without a budget (fraction 1)
    solver: str  # "ilp", "greedy", or "none" (the plan without a budget already fits)
    solve_seconds: float
    estimated_cost_s: float  # estimated recompute time of the plan
    regions: Dict[str, "BudgetReport"] = field(default_factory=dict)  # remat.annotate(..., memory_budget=)
    # the peak tie-break (option peak_slack): the lower target solved for, and the estimated peak
    # and step time of the fastest plan it replaced
    lowered_to: Optional[int] = None
    lowered_for: str = "a lower estimated peak"  # or, taken for its time, "the same estimated peak at ..."
    fastest_peak: int = 0
    fastest_step_s: float = 0.0
    # the monotone envelope (option peak_slack): the estimated peak of the larger budget's plan this
    # one was held under, that budget (a fraction of the feasible range), and whether it was met
    held_under: Optional[int] = None
    held_by: str = ""
    held_met: bool = True
    # the grid targets its bound was made from (option monotone): 1, that budget's first plan; 2, that
    # plan held under the next target's; ...; None, every target up the grid (that budget's final plan)
    held_levels: Optional[int] = None
    alike: int = 0  # classes of ops alike across repeated blocks that the solver decided alike (passes/budget.py)
    # a fraction budget's step of several calls held under the larger budgets' on the step's estimate:
    # the plan of which budget, and the estimates (remat_fx/step.py hold_step)
    step_held: str = ""

    @property
    def at_minimum(self) -> bool:
        """The budget asks for the feasible minimum of saved bytes (budget 0)."""
        return self.target <= self.minimum

    @property
    def held_final(self) -> bool:
        """The bound was that budget's final plan (monotone="grid")."""
        return self.held_levels is None

    def __str__(self) -> str:
        """Target, achieved, the feasible range, and why achieved is below the target when the plan
        was solved at a lower one; the solver only when one ran."""
        low, high = fmt_bytes(self.minimum), fmt_bytes(self.maximum)
        text = f"budget {self.budget}: target {fmt_bytes(self.target)}"
        if self.minimum == self.maximum:
            text += f" (every plan saves {low})"
        elif _is_fraction(self.budget) and float(self.budget) in (0.0, 1.0):
            text += (f" (the feasible minimum; the maximum, the plan without a budget, is {high})"
                     if float(self.budget) == 0 else f" (the feasible maximum, the plan without a budget; the "
                                                     f"minimum is {low})")
        elif _is_fraction(self.budget):
            text += f" ({self.budget} of the way from the feasible minimum {low} to the maximum {high})"
        else:
            text += f" (feasible minimum {low} .. maximum {high})"
        text += f", achieved {fmt_bytes(self.achieved)}"
        fastest = (f"the fastest plan under {fmt_bytes(self.target)}: est. peak {fmt_bytes(self.fastest_peak)}, est. "
                   f"step {self.fastest_step_s * 1e3:.1f} ms")
        if self.held_under is not None:
            text += (f": held {'at or under' if self.held_met else 'as near as it could get to'} "
                     f"{fmt_bytes(self.held_under)}, the estimated peak of budget {self.held_by}'s "
                     + ("plan" if self.held_final else "first plan (before its own envelope)" if self.held_levels <= 1
                        else "plan held under the next grid target's" if self.held_levels == 2 else
                        f"plan held in turn under the {self.held_levels - 1} grid targets above it"))
            if self.lowered_to is not None and self.lowered_to < self.target:
                text += f", solved at a lower target, {fmt_bytes(self.lowered_to)}"
            text += f" (the monotone envelope; {fastest})"
        elif self.lowered_to is not None:
            text += (f": solved at a lower target, {fmt_bytes(self.lowered_to)}, for {self.lowered_for} "
                     f"({fastest})")
        if self.step_held:
            text += f"; in its step, {self.step_held}"
        if self.solver == "none":
            text += ": the plan without a budget fits, no solver ran"
        else:
            text += f"; {self.solver} solver, {self.solve_seconds * 1e3:.0f} ms"
            if self.alike:
                text += f", repeated blocks planned alike ({self.alike} ops tied)"
        return text + f"; est. recompute {self.estimated_cost_s * 1e3:.3f} ms"


def _is_fraction(budget: str) -> bool:
    try:
        return 0.0 <= float(budget) <= 1.0
    except ValueError:
        return False


@dataclass
class Plan:
    saved: List[SavedActivation] = field(default_factory=list)
    recompute_flops: int = 0
    recomputed: List[str] = field(default_factory=list)  # names of the forward nodes the backward recomputes
    recomputed_fx: List[str] = field(default_factory=list)  # the same, as FX node names
    lower: str = "inductor"
    forward_ops: Counter = field(default_factory=Counter)  # aten op name -> count, in the forward graph
    backward_ops: Counter = field(default_factory=Counter)
    recompute_cost_s: float = 0.0  # the cost model's estimate of the recompute's time
    step_cost_s: float = 0.0  # the cost model's estimate of the whole step (forward and backward graphs)
    cost_model: str = ""
    budget: Optional[BudgetReport] = None
    forward_flops: int = 0
    backward_flops: int = 0  # including the recompute
    partition_seconds: float = 0.0  # capture, tags, budget solve and min-cut
    peak: Optional["PeakEstimate"] = None  # static estimate of the step's activation peak (passes/peak.py)
    peak_budget: Optional[int] = None  # the option, when given (a fraction's: the bytes it was resolved to)
    peak_fraction: Optional[float] = None  # a fraction peak_budget, as given
    # a fraction peak_budget's range: (the least estimated peak, the peak without a budget) it was resolved in
    peak_span: Optional[Tuple[int, int]] = None
    peak_evaluations: int = 0  # plans the peak search estimated
    moved_just_in_time: int = 0  # recomputed nodes the schedule pass moved later
    rerun: Optional["RerunReport"] = None  # values recomputed a second time to lower the peak (passes/rerun.py)
    graph: Optional[int] = None  # which compiled graph (remat.step_report() lists a step's graphs by it)
    # a byte peak_budget under Inductor (passes/lower.py): the step peak of Inductor's schedule of the
    # lowered graphs (passes/lowered_peak.py), and the limit the plan was searched under when the
    # first plan's schedule peaked over the budget (None: the budget itself)
    lowered: Optional["PeakEstimate"] = None
    tightened_to: Optional[int] = None
    from_cache: bool = False  # made from the plan cache's record of an earlier search (remat_fx/plan_cache.py)

    @property
    def total_flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.saved)

    def bytes_by_owner(self) -> Dict[str, int]:
        """Saved bytes per remat op they are kept for (activations of unnamed ops are left out)."""
        out: Dict[str, int] = {}
        for s in self.saved:
            if s.owner is not None:
                out[s.owner] = out.get(s.owner, 0) + s.bytes
        return out

    def __str__(self) -> str:
        return self.format()

    def format(self, full: bool = False) -> str:
        """The compact view (``str(plan)``), or with ``full`` every saved tensor, one line each: its
        name (remat name, module path + op, or FX name), shape, dtype, bytes, why, and source line."""
        activations = [s for s in self.saved if not s.parameter]
        storages = {s.storage or s.fx_name for s in activations}
        params = len(self.saved) - len(activations)
        if full:
            head = (f"remat plan ({self.lower} lowering): {len(self.saved)} saved for backward, "
                    f"{self.total_bytes:,} bytes")
        else:
            head = (f"remat plan ({self.lower} lowering): {len(storages)} activation"
                    f"{'' if len(storages) == 1 else 's'} saved for backward, {fmt_bytes(self.total_bytes)}")
        lines = [head + (f"; recompute {self.recompute_flops:,} FLOPs ({len(self.recomputed)} forward nodes rerun in "
                         f"backward, est. {self.recompute_cost_s * 1e3:.3f} ms)" if self.recomputed else
                         "; nothing recomputed")]
        if self.budget is not None:
            lines.append(f"  {self.budget}")
            for name, region in self.budget.regions.items():
                lines.append(f"  region '{name}': {region}")
        if self.peak is not None:
            cap = "" if self.peak_budget is None else (
                f", peak_budget {fmt_bytes(self.peak_budget)} " if self.peak_fraction is None else
                f", peak_budget {self.peak_fraction:g}: {fmt_bytes(self.peak_budget)} "
                + ("" if self.peak_span is None else "(the least estimated peak) " if self.peak_fraction == 0 else
                   f"({self.peak_fraction:g} of the way from the least estimated peak, {fmt_bytes(self.peak_span[0])}, "
                   f"to the peak without a budget, {fmt_bytes(self.peak_span[1])}) "))
            cap += "" if self.peak_budget is None else f"({self.peak_evaluations} plans estimated)"
            if self.peak_fraction is not None and self.lower == "inductor" and self.lowered is None:
                # (a review measured a fraction's step 0.43 MiB over the bytes it was resolved to)
                cap += "; on remat's estimate, not checked against Inductor's schedule as a byte peak_budget is"
            cap += "; the search's choice read from the plan cache" if self.from_cache else ""
            lines.append(f"  estimated peak of this graph as a step alone {fmt_bytes(self.peak.step)} (forward "
                         f"{fmt_bytes(self.peak.forward)}, backward {fmt_bytes(self.peak.backward)}; its outputs held "
                         f"through its backward; the whole step's: remat.step_report()){cap}")
        if self.lowered is not None:
            lines.append(f"  lowered: Inductor's schedule peaks at {fmt_bytes(self.lowered.step)} (forward "
                         f"{fmt_bytes(self.lowered.forward)}, backward {fmt_bytes(self.lowered.backward)})"
                         + ("" if self.tightened_to is None else
                            f"; planned under {fmt_bytes(self.tightened_to)} so that it fits"))
        if self.rerun is not None and self.rerun.reruns:
            r = self.rerun
            lines.append(f"  rerun: {r.reruns} values recomputed a second time ({r.nodes} nodes, {r.flops:,} FLOPs, "
                         f"est. {r.cost_s * 1e3:.3f} ms"
                         + (", no time limit" if r.allowance_s is None else f" of {r.allowance_s * 1e3:.3f} ms allowed")
                         + "): "
                         f"estimated peak {fmt_bytes(r.peak_before)} -> {fmt_bytes(r.peak_after)}"
                         + ("" if r.shortened_from is None else
                            f"; the first {r.reruns} of the {r.shortened_from} found: the step peaks elsewhere"))
        elif self.rerun is not None and self.rerun.shortened_from:
            lines.append(f"  rerun: none of the {self.rerun.shortened_from} values found to recompute a second "
                         "time: the step peaks elsewhere")
        if full:
            for s in self.saved:
                shape = "x".join(map(str, s.shape)) or "scalar"
                where = f"  [{s.source}]" if s.source else ""
                lines.append(f"  {s.name:<40s} {shape:>16s} {str(s.dtype).replace('torch.', ''):>9s} "
                             f"{s.bytes:>12,d}  {s.reason}{where}")
            return "\n".join(lines)
        lines.extend(_compact_rows(activations))
        if params:
            lines.append(f"  {params} parameter{'' if params == 1 else 's'} (not activations) omitted; "
                         f"plan.format(full=True) lists every saved tensor")
        return "\n".join(lines)


_VIEW_NOTE = re.compile(r" \((a view of|alias of) [^()]*\)$")


def _compact_rows(activations: Sequence[SavedActivation]) -> List[str]:
    """One line per name the user knows, stored tensors of the same name together (``x3``), grouped
    by module path in forward order."""
    groups: Dict[str, List[SavedActivation]] = {}
    for s in activations:
        groups.setdefault(s.label or s.name, []).append(s)
    modules: Dict[str, int] = {}
    for label in groups:
        modules.setdefault(_module_of(label), len(modules))
    cells = []
    for label in sorted(groups, key=lambda lb: modules[_module_of(lb)]):  # stable: forward order within
        members = groups[label]
        storages = list(dict.fromkeys(s.storage or s.fx_name for s in members))
        shapes = dict.fromkeys("x".join(map(str, s.storage_shape or s.shape)) or "scalar" for s in members)
        shape = ", ".join(list(shapes)[:3]) + (", ..." if len(shapes) > 3 else "")
        reasons = list(dict.fromkeys(_VIEW_NOTE.sub("", s.reason) for s in members))
        dtypes = "/".join(sorted({str(s.dtype).replace("torch.", "") for s in members}))
        name = label if len(storages) == 1 else f"{label} x{len(storages)}"
        cells.append((name, shape, dtypes, fmt_bytes(sum(s.bytes for s in members)), "; ".join(reasons)))
    widths = [max((len(c[i]) for c in cells), default=0) for i in range(4)]
    return [f"  {n:<{widths[0]}s}  {sh:>{widths[1]}s} {dt:>{widths[2]}s} {b:>{widths[3]}s}  {why}"
            for n, sh, dt, b, why in cells]


def _module_of(label: str) -> str:
    """The module path a compact row is filed under: the label less its op (``le(x.relu)``: x's)."""
    inner = re.fullmatch(r"\w+\((.*)\)", label)
    if inner:
        label = inner.group(1)
    if label.startswith("input "):
        return ""
    return label.rsplit(".", 1)[0] if "." in label else ""


_PLANS: List[Plan] = []


def last_plan() -> Optional[Plan]:
    """The plan of the graph the ``remat`` backend compiled last for training (None before any). A
    graph without a backward (compiled under ``torch.no_grad``, or with nothing that needs a
    gradient) saves nothing and has no plan: it leaves the last plan as it was."""
    return _PLANS[-1] if _PLANS else None


def record(plan: Plan) -> None:
    _PLANS.append(plan)
    del _PLANS[:-16]


@contextlib.contextmanager
def unrecorded():
    """Plans recorded inside (estimates of a graph under other options, no lowering) are not kept:
    ``last_plan()`` stays the plan of the graph compiled last."""
    kept = list(_PLANS)
    try:
        yield
    finally:
        _PLANS[:] = kept


def _source(node: fx.Node) -> Optional[str]:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    user = [ln for ln in lines if not any(part in ln for part in _LIBRARY_PATHS)]
    pick = user or lines
    return pick[-1].replace("File ", "") if pick else None


_LIBRARY_PATHS = (str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(torch.__file__).parent))


_INPUT_NAMES: ContextVar[Optional[List[str]]] = ContextVar("remat_fx_input_names", default=None)


@contextlib.contextmanager
def input_names(names: Optional[List[str]]):
    """The names of the compiled graph's inputs, in order (the lowering knows them from Dynamo's
    graph), for the plans built inside: a saved input shows as ``input x``, not ``primals_3``."""
    token = _INPUT_NAMES.set(names)
    try:
        yield
    finally:
        _INPUT_NAMES.reset(token)


def input_label(joint: JointGraph, node: fx.Node) -> str:
    placeholders = [n.name for n in joint.gm.graph.nodes if n.op == "placeholder"]
    desc = getattr(node.meta.get("desc"), "idx", None)
    index = desc if isinstance(desc, int) else placeholders.index(node.name) if node.name in placeholders else None
    names = _INPUT_NAMES.get()
    if index is not None and names is not None and index < len(names):
        return f"input {names[index]}"
    return f"input {index}" if index is not None else f"input {node.name}"


def _label(joint: JointGraph, by_name: Dict[str, fx.Node], base: fx.Node) -> str:
    """The name the user knows a stored tensor by (``base``: a node of the forward graph)."""
    if base.op == "placeholder":
        return input_label(joint, base)
    node = by_name.get(base.name)
    if node is not None:
        return joint.names[node]
    # an op of the backward's formulas the partitioner computes in the forward (relu's mask ``le``):
    # named after the nearest forward value it is computed from
    seen, queue = {base}, list(base.all_input_nodes)
    while queue:
        source = queue.pop(0)
        if source in seen:
            continue
        seen.add(source)
        if source.op == "placeholder":
            return f"{op_name(base)}({input_label(joint, source)})"
        if source.name in by_name:
            return f"{op_name(base)}({joint.names[by_name[source.name]]})"
        queue.extend(source.all_input_nodes)
    return base.name


def build_plan(joint: JointGraph, tags: Dict[fx.Node, Tag], fw: fx.GraphModule, bw: fx.GraphModule,
               num_fwd_outputs: int, params: Set[str], lower: str, cost_model=None) -> Plan:
    by_name = {n.name: n for n in joint.forward}
    tags = {n.name: t for n, t in tags.items()}
    plan = Plan(lower=lower)
    out_node = next(n for n in fw.graph.nodes if n.op == "output")
    counted: Dict[str, str] = {}  # base node name -> the name its bytes were charged to
    labels: Dict[str, str] = {}  # base node name -> its label
    for saved in out_node.args[0][num_fwd_outputs:]:
        if not isinstance(saved, fx.Node):
            continue
        val = saved.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue  # symbolic sizes, RNG seeds
        base = storage_base(saved)  # a saved view pins its base's storage: charge the base, once
        node = by_name.get(saved.name, saved)
        base_node = by_name.get(base.name, base)
        name = joint.names.get(node, saved.name)
        tag = tags.get(saved.name) or tags.get(base.name)
        owner = None if base.op == "placeholder" else _owner(joint, base_node, tags.get(base.name))
        if base.name in params:
            nbytes, reason = 0, "parameter"
        else:
            base_val = base.meta.get("val", val)
            nbytes = 0 if base.name in counted else concrete(base_val.untyped_storage().nbytes())
            reason = _reason(tag, base_node)
            if base.name in counted:
                reason += f" (alias of {counted[base.name]})"
            elif base is not saved:
                reason += f" (a view of {joint.names.get(base_node, base.name)})"
            counted.setdefault(base.name, name)
        if base.name not in labels:
            labels[base.name] = _label(joint, by_name, base)
        base_val = base.meta.get("val", val)
        plan.saved.append(SavedActivation(name, saved.name, tuple(concrete(d) for d in val.shape), val.dtype,
                                          nbytes, reason, owner, _source(node), label=labels[base.name],
                                          storage=base.name,
                                          storage_shape=tuple(concrete(d) for d in getattr(base_val, "shape", ())),
                                          parameter=base.name in params))
    plan.forward_ops = Counter(op_name(n) for n in fw.graph.nodes if n.op == "call_function")
    plan.backward_ops = Counter(op_name(n) for n in bw.graph.nodes if n.op == "call_function")
    fwd_names = {n.name for n in joint.forward}
    for node in bw.graph.nodes:
        if node.op == "call_function" and node.name in fwd_names:
            plan.recomputed.append(joint.names.get(by_name[node.name], node.name))
            plan.recomputed_fx.append(node.name)
            plan.recompute_flops += flops(node)
            if cost_model is not None:
                plan.recompute_cost_s += cost_model(by_name[node.name])
    plan.forward_flops = sum(flops(n) for n in fw.graph.nodes if n.op == "call_function")
    plan.backward_flops = sum(flops(n) for n in bw.graph.nodes if n.op == "call_function")
    plan.cost_model = cost_model.describe() if cost_model is not None else ""
    return plan


def _reason(tag: Optional[Tag], node: fx.Node) -> str:
    if node.op == "placeholder":
        return "graph input"
    if tag is None:
        return "min-cut choice"
    if tag.saves:
        return tag.reason
    if node.meta.get("recompute") is TorchPolicy.MUST_SAVE:  # set by the partitioner's cleanup
        return "region boundary: an input of the next checkpoint region"
    return f"min-cut choice over {tag.policy.name} ({tag.reason})"


def _owner(joint: JointGraph, node: fx.Node, tag: Optional[Tag]) -> Optional[str]:
    """The remat op an activation is kept for, as eager mode's tape files it: a SAVE op's own
    nodes (its outputs and what its backward reads from inside it) under that op, and a SAVE
    ``remat.annotate`` block's under the block's name (a budgeted block's, which eager mode only
    names, under none)."""
    if tag is None or not tag.saves or tag.reason.startswith("output of checkpoint region"):
        return None  # region outputs belong to their consumers (eager: the next region's INPUT)
    custom = joint.custom(node)
    kind = custom.get(META_KIND)
    if custom.get(META_NAME) is None:
        return None
    if kind in ("op", "native"):
        return custom[META_NAME]
    if kind == "annotate":  # a block the user said to keep, by its policy or its region's glob, as the tape resolves it
        written = custom.get(META_POLICY)
        policy = resolve_policy(custom[META_NAME], None if written is None else CheckpointPolicy[written],
                                region_globs(custom))
        if policy.skips_recompute:
            return custom[META_NAME]
    return None
