"""The Plan: what a compiled graph saves for backward, why, and what it recomputes.

``remat.last_plan()`` returns the plan of the last graph compiled by the backend;
``str(plan)`` prints one line per saved activation, like JAX's
``print_saved_residuals``.
"""
from __future__ import annotations

import pathlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

from remat_fx.memory_budget import fmt_bytes
from remat_fx.naming import META_KIND, META_NAME
from remat_fx.passes.capture import JointGraph, op_name, storage_base
from remat_fx.passes.cost import concrete, flops
from remat_fx.passes.peak import PeakEstimate
from remat_fx.passes.rerun import RerunReport
from remat_fx.passes.tag import Tag


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
    fastest_peak: int = 0
    fastest_step_s: float = 0.0

    def __str__(self) -> str:
        text = (f"budget {self.budget}: target {fmt_bytes(self.target)}, achieved {fmt_bytes(self.achieved)} "
                f"(feasible {fmt_bytes(self.minimum)} .. {fmt_bytes(self.maximum)}); {self.solver} in "
                f"{self.solve_seconds * 1e3:.0f} ms, est. recompute {self.estimated_cost_s * 1e3:.3f} ms")
        if self.lowered_to is not None:
            text += (f"; solved at {fmt_bytes(self.lowered_to)} for a lower estimated peak (the fastest plan's: "
                     f"{fmt_bytes(self.fastest_peak)}, est. step {self.fastest_step_s * 1e3:.1f} ms)")
        return text


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
    peak_budget: Optional[int] = None  # the option, when given
    peak_evaluations: int = 0  # plans the peak search estimated
    moved_just_in_time: int = 0  # recomputed nodes the schedule pass moved later
    rerun: Optional["RerunReport"] = None  # values recomputed a second time to lower the peak (passes/rerun.py)
    graph: Optional[int] = None  # which compiled graph (remat.step_report() lists a step's graphs by it)

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
        lines = [f"remat plan ({self.lower} lowering): {len(self.saved)} saved for backward, "
                 f"{self.total_bytes:,} bytes; recompute {self.recompute_flops:,} FLOPs "
                 f"({len(self.recomputed)} forward nodes rerun in backward, est. {self.recompute_cost_s * 1e3:.3f} ms)"]
        if self.peak is not None:
            cap = "" if self.peak_budget is None else (f", peak_budget {fmt_bytes(self.peak_budget)} "
                                                       f"({self.peak_evaluations} plans estimated)")
            lines.append(f"  estimated step peak {fmt_bytes(self.peak.step)} (forward {fmt_bytes(self.peak.forward)}, "
                         f"backward {fmt_bytes(self.peak.backward)}){cap}")
        if self.rerun is not None and self.rerun.reruns:
            r = self.rerun
            lines.append(f"  rerun: {r.reruns} values recomputed a second time ({r.nodes} nodes, {r.flops:,} FLOPs, "
                         f"est. {r.cost_s * 1e3:.3f} ms of "
                         + ("any" if r.allowance_s is None else f"{r.allowance_s * 1e3:.3f} ms") + " allowed): "
                         f"estimated peak {fmt_bytes(r.peak_before)} -> {fmt_bytes(r.peak_after)}")
        if self.budget is not None:
            lines.append(f"  {self.budget}")
            for name, region in self.budget.regions.items():
                lines.append(f"  region '{name}': {region}")
        for s in self.saved:
            shape = "x".join(map(str, s.shape)) or "scalar"
            where = f"  [{s.source}]" if s.source else ""
            lines.append(f"  {s.name:<40s} {shape:>16s} {str(s.dtype).replace('torch.', ''):>9s} "
                         f"{s.bytes:>12,d}  {s.reason}{where}")
        return "\n".join(lines)


_PLANS: List[Plan] = []


def last_plan() -> Optional[Plan]:
    """The plan of the graph the ``remat`` backend compiled last (None before any)."""
    return _PLANS[-1] if _PLANS else None


def record(plan: Plan) -> None:
    _PLANS.append(plan)
    del _PLANS[:-16]


def _source(node: fx.Node) -> Optional[str]:
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip().startswith("File ")]
    user = [ln for ln in lines if not any(part in ln for part in _LIBRARY_PATHS)]
    pick = user or lines
    return pick[-1].replace("File ", "") if pick else None


_LIBRARY_PATHS = (str(pathlib.Path(__file__).resolve().parents[1]), str(pathlib.Path(torch.__file__).parent))


def build_plan(joint: JointGraph, tags: Dict[fx.Node, Tag], fw: fx.GraphModule, bw: fx.GraphModule,
               num_fwd_outputs: int, params: Set[str], lower: str, cost_model=None) -> Plan:
    by_name = {n.name: n for n in joint.forward}
    tags = {n.name: t for n, t in tags.items()}
    plan = Plan(lower=lower)
    out_node = next(n for n in fw.graph.nodes if n.op == "output")
    counted: Dict[str, str] = {}  # base node name -> the name its bytes were charged to
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
        plan.saved.append(SavedActivation(name, saved.name, tuple(concrete(d) for d in val.shape), val.dtype,
                                          nbytes, reason, owner, _source(node)))
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
    nodes (its outputs and what its backward reads from inside it) under that op."""
    if tag is None or not tag.saves or tag.reason.startswith("output of checkpoint region"):
        return None  # region outputs belong to their consumers (eager: the next region's INPUT)
    custom = joint.custom(node)
    if custom.get(META_NAME) is not None and custom.get(META_KIND) in ("op", "native"):
        return custom[META_NAME]
    return None
