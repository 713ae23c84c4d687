"""Partition: split the tagged joint graph into forward and backward with PyTorch's min-cut.

``min_cut_rematerialization_partition`` honours the tags written by the tag pass:
MUST_SAVE nodes are banned from recomputation, MUST/PREFER_RECOMPUTE nodes are
recomputed in backward. This pass runs capture -> tag -> min-cut -> plan and checks
that the result follows every MUST tag. With a memory budget, the budget pass then
turns the plan into one that fits (passes/budget.py) and the min-cut runs again on its tags.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import logging
import operator
import time
from typing import List, Optional, Set

import torch
import torch.fx as fx
from torch._functorch.compile_utils import fx_graph_cse
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

from remat_fx import plan_cache
from remat_fx.fresh_stack import on_fresh_stack
from remat_fx.memory_budget import fmt_bytes
from remat_fx.options import BackendOptions, RematError, monotone_extends, monotone_levels
from remat_fx.passes.budget import apply_budget, budgets_of
from remat_fx.passes.capture import is_random, read_joint
from remat_fx.passes.cost import CostModel, node_device
from remat_fx.passes.engine_order import our_reordering
from remat_fx.passes.extract_once import extracted_once
from remat_fx.passes.lazy_module import lazy, lazy_modules
from remat_fx.passes.max_flow import boykov_kolmogorov_flow
from remat_fx.passes.peak import FINAL_ALIKE, backward_inputs, fit_peak, forward_simulation, lower_peak, \
    monotone_peak
from remat_fx.passes.peak import estimate as estimate_peak
from remat_fx.passes.rerun import Searched, rerun_for_peak
from remat_fx.passes.plan import build_plan, record
from remat_fx.passes.schedule import schedule_recompute
from remat_fx.passes.tag import tag_joint

log = logging.getLogger("remat_fx")
_PROGRESS_S = 5.0  # planning longer than this logs each candidate plan it estimates (INFO)

_ORIGINAL = "remat_fx.original_recompute"
_SINKS: List[list] = []


@contextlib.contextmanager
def capture_joints():
    """Collects (joint graph, joint inputs, partition kwargs) of every partition run inside, so the
    partition can be re-run on them with other options (remat_fx.pareto)."""
    graphs: list = []
    _SINKS.append(graphs)
    try:
        yield graphs
    finally:
        # by identity: a capture inside another (remat_fx/step.py's, inside remat.pareto's) holds
        # the same graphs, and list.remove would take the first equal one, the outer's
        del _SINKS[next(i for i, sink in enumerate(_SINKS) if sink is graphs)]


def partition(joint_gm: fx.GraphModule, joint_inputs, *, options: BackendOptions, num_fwd_outputs: int,
              static_lifetime_input_indices=None, **kwargs):
    with _no_gc():  # on a new thread's frame stack: remat_fx/fresh_stack.py
        return on_fresh_stack(_partition, joint_gm, joint_inputs, options, num_fwd_outputs,
                              static_lifetime_input_indices, kwargs)


@contextlib.contextmanager
def _no_gc():
    """Python's cyclic collector off while planning: the plan search makes millions of short-lived
    objects (the rerun search's programs, min-cut graphs) inside a compile that holds a large heap,
    and each full collection walks all of it (measured: a rerun search 1.2-1.7 s with it on, 1.0 s
    off, on an 8-layer Llama's backward). Cycles made meanwhile are collected after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _partition(joint_gm, joint_inputs, options, num_fwd_outputs, static_lifetime_input_indices, kwargs):
    t0 = time.perf_counter()
    for sink in _SINKS:
        sink.append((joint_gm, joint_inputs, dict(kwargs, num_fwd_outputs=num_fwd_outputs,
                                                  static_lifetime_input_indices=static_lifetime_input_indices)))
    _prepare(joint_gm)
    joint = read_joint(joint_gm, num_fwd_outputs)
    tags = tag_joint(joint, options)
    placeholders = [n for n in joint_gm.graph.nodes if n.op == "placeholder"]
    params: Set[str] = {placeholders[i].name for i in static_lifetime_input_indices or () if i < len(placeholders)}
    cost = CostModel(options.cost_model, options.lower, node_device(placeholders), options.roofline)

    def min_cut():
        fw, bw = min_cut_rematerialization_partition(
            joint_gm, joint_inputs, compiler="inductor", num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices, **kwargs)
        return lazy(fw), lazy(bw)  # their code is written when called (passes/lazy_module.py)

    parts: dict = {}  # the partition of a set of tags, scheduled, before reruns: made once
    rerun_searches = Searched()  # the rerun searches' programs: a backward searched again starts from them

    def partitioned(key, make):
        """(fw, bw, plan) of the partition ``make()`` returns, scheduled and timed, made once per
        ``key`` (its tags): the peak searches finish one partition more than once (with and without
        reruns, under other time allowances). The plan is a copy each time; the graphs are shared,
        as the reruns leave them as they were."""
        if key not in parts:
            fw, bw, plan = make()
            if options.schedule:
                plan.moved_just_in_time = schedule_recompute(bw, set(plan.recomputed_fx))
            forward_s = sum(cost(n) for n in fw.graph.nodes if n.op == "call_function")
            plan.step_cost_s = forward_s + sum(cost(n) for n in bw.graph.nodes if n.op == "call_function")
            parts[key] = (fw, bw, plan)
        fw, bw, plan = parts[key]
        return fw, bw, copy.copy(plan)

    @functools.lru_cache(maxsize=None)
    def checkpointed_s() -> float:
        """The cost model's step of per-layer checkpointing, the time budget 0 may take (made once):
        the plan without a budget and the forward once more (a bound: the blocks' forward, and the head's)."""
        _, _, unbudgeted = partitioned(None, lambda: (fw0, bw0, copy.copy(plan0)))
        return unbudgeted.step_cost_s + sum(cost(n) for n in fw0.graph.nodes if n.op == "call_function")

    forward_peaks: dict = {}  # id of a forward -> (it, its simulated peak): a partition's forward is shared

    def forward_peak(fw) -> int:
        """The forward's estimated peak (passes/peak.py simulate), simulated once per forward: the
        peak searches finish one partition several times (with and without reruns, under other time
        allowances and caps), and each rerun search and estimate reads its forward's peak."""
        if id(fw) not in forward_peaks:
            # the forward kept with its peak: its id stays its own; with each input's span (step_costs)
            forward_peaks[id(fw)] = (fw, *forward_simulation(fw, inline=options.lower == "inductor"))
        return forward_peaks[id(fw)][1]

    def finish(fw, bw, plan, budgeted, fastest_s, cap=None, quick=False):
        if not quick and (options.rerun is True or (options.rerun == "auto" and budgeted)):
            bw = _rerun(fw, bw, plan, num_fwd_outputs, cost, options.peak_budget if cap is None else cap,
                        None if cap is not None else
                        _rerun_allowance(plan, fastest_s, options, checkpointed_s),
                        options.peak_budget is None,  # the envelope's cap may be shortened, a byte peak_budget's not
                        cap is not None and plan.budget is not None and plan.budget.at_minimum, rerun_searches,
                        forward_peak(fw))
        plan.peak = estimate_peak(fw, bw, num_fwd_outputs, inline=options.lower == "inductor",
                                  forward_peak=forward_peak(fw), forward_inputs=forward_peaks[id(fw)][2])
        return fw, bw, plan

    # our budget, not PyTorch's (its global knob would otherwise re-decide the min-cut's plan)
    with torch._functorch.config.patch(activation_memory_budget=1.0, cse=False), _rng_ops_that_draw(), \
            our_reordering(), extracted_once(), lazy_modules(), \
            boykov_kolmogorov_flow():
        fw0, bw0 = min_cut()
        plan0 = build_plan(joint, tags, fw0, bw0, num_fwd_outputs, params, options.lower, cost)
        budgets = budgets_of(joint, options)

        cuts: dict = {}  # one partition call solves a target once (the peak searches revisit them)
        asked: dict = {}  # id of each answer -> (its arguments, the answer): the plan cache records the chosen one's
        by_tags: dict = {}  # and finishes one set of tags once per allowance, cap and quick

        def cut(budgets, fastest_s=None, cap=None, quick=False, alike=None):
            """(fw, bw, plan, tags) meeting ``budgets`` ({} = the plan without a budget); ``fastest_s``:
            the estimated step time of the fastest plan under the user's budget, without reruns (None:
            this is that plan), from which the time allowed to lower the peak is counted; ``cap``: an
            estimated step peak the reruns are to reach instead, whatever their time (the monotone
            envelope's bound); ``quick``: the partition without reruns (no rerun search), whose
            estimated peak the tie-break's walk compares (passes/peak.py lower_peak); ``alike``: the
            budget solved with repeated blocks alike, allowed that recompute (option blocks_alike's
            fraction; passes/peak.py _final_alike). Each call gets its own copy of the plan and its budget report, which
            the peak searches annotate (lower_peak, the envelope, fit_peak's cap): another level of the
            envelope asking for the same partition sees it as made, not as an earlier caller noted it."""
            key = (_budget_key(budgets), fastest_s, cap, quick, alike)
            if key not in cuts:
                cuts[key] = solve(budgets, fastest_s, cap, quick, alike)
                elapsed = time.perf_counter() - t0
                if elapsed > _PROGRESS_S:
                    plan = cuts[key][2]
                    note = (" (without reruns: the tie-break's walk)" if quick else
                            "" if alike is None else
                            " (repeated blocks alike)" if plan.budget and plan.budget.alike else
                            " (asked for repeated blocks alike: none within the slack)")
                    log.info("remat_fx: planning a graph of %d nodes, %.1f s so far: plan %d, memory_budget %s, "
                             "saves %s, estimated peak %s, estimated step %.1f ms (%d reruns)%s",
                             len(joint_gm.graph.nodes), elapsed, len(cuts),
                             ", ".join(str(v) for v in budgets.values()) or "none",
                             fmt_bytes(plan.total_bytes), fmt_bytes(plan.peak.step), plan.step_cost_s * 1e3,
                             plan.rerun.reruns if plan.rerun is not None else 0, note)
            fw, bw, plan, found_tags = cuts[key]
            plan = copy.copy(plan)
            if plan.budget is not None:
                plan.budget = copy.copy(plan.budget)
            mine = (fw, bw, plan, found_tags)
            asked[id(mine)] = ((budgets, fastest_s, cap, quick, alike), mine)  # kept: its id stays its own
            return mine

        answers: dict = {}  # the budget solver's answer to one target, asked again with and without reruns

        def solved(budgets, alike=None):
            """apply_budget's (tags, report, tags it wrote on the joint graph's nodes) for ``budgets``
            (with repeated blocks alike, allowed ``alike``), solved once; a fresh report each time (the
            searches annotate theirs)."""
            key = (_budget_key(budgets), alike)
            if key not in answers:
                solver_options = options if alike is None else dataclasses.replace(options, blocks_alike=alike)
                new_tags, report = apply_budget(joint, tags, plan0, budgets, params, cost, solver_options)
                answers[key] = (new_tags, report, {n: n.meta.get("recompute") for n in joint_gm.graph.nodes})
            new_tags, report, written = answers[key]
            return new_tags, copy.copy(report), written

        def solve(budgets, fastest_s, cap, quick, alike):
            if not budgets:
                _write_tags(joint_gm, tags)
                fw, bw, plan = partitioned(None, lambda: (fw0, bw0, copy.copy(plan0)))
                return (*finish(fw, bw, plan, _peak_budgeted(options), fastest_s, cap, quick), tags)
            new_tags, report, written = solved(budgets, alike)
            # the solver often gives several targets the same tags (the peak searches' targets
            # between two plans' saved bytes): the same tags make the same partition and reruns
            chosen = frozenset((n.name, t.policy) for n, t in new_tags.items())
            same = (chosen, fastest_s, cap, quick, report.solver == "none", report.at_minimum)
            if same in by_tags:
                fw, bw, done, recompute_s = by_tags[same]
                plan = copy.copy(done)
                report.achieved, report.estimated_cost_s = plan.total_bytes, recompute_s
                _check_achieved(report, plan, joint, params)
                plan.budget = report
                return fw, bw, plan, new_tags
            if report.solver == "none":
                _write_tags(joint_gm, tags)
                # its own report, the shared plan untouched
                fw, bw, plan = partitioned(None, lambda: (fw0, bw0, copy.copy(plan0)))
            else:
                def make():
                    for node, policy in written.items():  # the min-cut reads the solver's tags there
                        if policy is None:
                            node.meta.pop("recompute", None)
                        else:
                            node.meta["recompute"] = policy
                    fw, bw = min_cut()
                    return fw, bw, build_plan(joint, new_tags, fw, bw, num_fwd_outputs, params, options.lower, cost)
                fw, bw, plan = partitioned(chosen, make)
            report.achieved = plan.total_bytes
            report.estimated_cost_s = plan.recompute_cost_s
            _check_achieved(report, plan, joint, params)
            plan.budget = report
            fw, bw, plan = finish(fw, bw, plan, True, fastest_s, cap, quick)
            by_tags[same] = (fw, bw, plan, report.estimated_cost_s)
            return fw, bw, plan, new_tags

        searched = bool(budgets) or _peak_budgeted(options)  # without a budget there is no search to keep
        entry = plan_cache.entry(joint_gm, num_fwd_outputs, static_lifetime_input_indices, options) \
            if searched and plan_cache.enabled(options) else None
        found = None if entry is None else _replay(cut, entry)
        if found is None and _peak_budgeted(options):
            found = fit_peak(cut, lambda b: solved(b)[1], budgets, options.peak_budget, options.peak_fraction,
                             alike=FINAL_ALIKE if options.blocks_alike == "final" and options.lower == "inductor"
                             else None)
        elif found is None:
            chosen = lower_peak(cut, budgets, cut(budgets), options.peak_slack)
            at_minimum = chosen[2].budget is not None and chosen[2].budget.at_minimum
            found = chosen if options.peak_slack <= 0 or options.least_peak or \
                (at_minimum and options.rerun is False) else \
                monotone_peak(cut, budgets, chosen, options.peak_slack, monotone_levels(options.monotone),
                              monotone_extends(options.monotone))
        if options.peak_fraction is not None:  # (a replay from the plan cache has the bytes, not the range)
            found[2].peak_fraction = options.peak_fraction
        found[2].peak_evaluations = len(cuts)  # the partitions the search made (1: the plan cache's replay)
        fw, bw, plan, tags = found
        if entry is not None and not plan.from_cache and id(found) in asked:
            entry.store(*asked[id(found)][0], plan)
    check_follows_tags(joint.names, tags, bw)
    plan.partition_seconds = time.perf_counter() - t0
    record(plan)
    if options.report:
        print(plan)
    return fw, bw


def _replay(cut, entry):
    """The plan the cache recorded for this graph, made by the one ``cut`` call the search chose,
    with the search's notes on its report; None when there is no entry or the call no longer gives
    the plan recorded (its saved bytes and estimated peak): the search then runs as without it."""
    record = entry.load()
    if record is None:
        return None
    try:
        found = cut(record["budgets"], record["fastest_s"], record["cap"], record["quick"], record["alike"])
        plan = found[2]
        if (plan.total_bytes, plan.peak.step) != (record["saved"], record["peak"]):
            log.info("remat_fx: the plan cache's plan for this graph now saves %s with an estimated peak of %s, "
                     "not %s and %s: searching again", fmt_bytes(plan.total_bytes), fmt_bytes(plan.peak.step),
                     fmt_bytes(record["saved"]), fmt_bytes(record["peak"]))
            return None
        notes = record["report"]
        if notes is not None and plan.budget is not None:
            if not (isinstance(notes, dict) and set(notes) <= set(plan_cache.REPORT_NOTES)):
                raise ValueError(f"report notes {notes!r}")
            for k, v in notes.items():
                setattr(plan.budget, k, v)
        plan.peak_budget = record["peak_budget"]
    except RematError:
        return None  # a budget this graph can no longer meet: the search says why
    except Exception as e:  # noqa: BLE001 - an entry of the right fields and the wrong values (another
        # version's, or edited): searched again and written anew, as an unreadable one is
        log.info("remat_fx: the plan cache's entry %s could not be used (%s: %s): searching again", entry.path,
                 type(e).__name__, e)
        return None
    plan.from_cache = True
    return found


_MIN_GAIN = 0.02  # reruns that lower the estimated peak by less are not worth their time
# Under Inductor the liveness model (passes/peak.py) is still a few % off the measured peak (the
# 8-layer example GPT at budget 0: 2.8%; at 4 layers 5.9%); reruns must promise clearly more.
# (0.30 before the model followed Inductor's realize-on-reuse, addmm and in-place rules and its
# buffer reuse was turned off, when it was up to 35% off and smaller modelled gains were measured
# to raise the transformers GPT-2's peak; 0.15 until it read a reduction as one buffer: a one-layer
# Llama's reruns at budget 0.15 modelled an 11.8% drop that did not show, the RMSNorm output they
# left alive being one the model inlined.)
# 0.08 until the model stopped writing a kernel's output over a tangent or a saved forward output
# (neither donated) and read through views of inlined ops: its estimate is then within 0.2% of
# Inductor's schedule on the 8-layer Llama and GPT-2 of benchmarks/gpu.py at budgets 1 to 0.1
# (budget 0: 3.5% under), and a 16-layer Llama's budget 0.3 needs reruns modelled at 7%
# (Inductor's schedule, the measured peak here: 46.56 MiB with them, 49.48 without).
_MIN_GAIN_INDUCTOR = 0.05


def _peak_budgeted(options: BackendOptions) -> bool:
    return options.peak_budget is not None or options.peak_fraction is not None


def _rerun_allowance(plan, fastest_s, options, checkpointed_s) -> Optional[float]:
    """Seconds of recompute the reruns may add (cost model), None for the lowest peak found.
    A peak_budget asks for a peak: a byte one for the fastest plan meeting it (fit_peak), whatever
    its reruns cost; a fraction one for a point of the range whose low end is the least peak.
    A memory budget at its feasible minimum (budget 0) asks for little memory, and the time target
    gives way there up to per-layer checkpointing's step (``checkpointed_s()``, the cost model's;
    the whole-step issue's decision): the plan saves nothing, so it recomputes the forward once, and
    each block again to hold only block boundaries. The envelope (passes/peak.py monotone_peak) then
    holds it under budget 0.05's plan, whatever that costs. The least peak (None) is for
    ``peak_slack`` 0 and option least_peak. Otherwise the step may become at most peak_slack slower
    than the fastest plan under the budget (its time without reruns), together with the peak
    tie-break's choice of a slower plan (passes/peak.py lower_peak)."""
    report = plan.budget
    if _peak_budgeted(options):
        return None
    if report is not None and report.at_minimum:
        if options.least_peak or options.peak_slack <= 0:
            return None
        return max(0.0, checkpointed_s() - plan.step_cost_s)
    base = plan.step_cost_s if fastest_s is None else fastest_s
    return max(0.0, base * (1 + options.peak_slack) - plan.step_cost_s)


def _rerun(fw, bw, plan, num_fwd_outputs, cost, cap, allowance, shortenable, blocks_first, searched, forward_peak):
    """The backward with values recomputed a second time where that lowers the step's peak;
    ``shortenable``: its last reruns may be dropped where the step peaks elsewhere (passes/lower.py);
    ``searched``: the planning's record of the rerun searches made (passes/rerun.py rerun_for_peak);
    ``forward_peak``: the forward's simulated peak (the step's cannot fall below it)."""
    inputs = backward_inputs(fw, bw, num_fwd_outputs)
    inline = cost.lower == "inductor"  # liveness as Inductor runs it (pointwise ops inside their user)
    bw, report = rerun_for_peak(bw, inputs.counted, inputs.shared, inputs.held, forward_peak, cost,
                                allowance, cap, _MIN_GAIN_INDUCTOR if inline else _MIN_GAIN, inline, donated=inputs.donated,
                                shortenable=shortenable, blocks_first=blocks_first, searched=searched)
    plan.rerun = report
    plan.backward_flops += report.flops
    plan.recompute_flops += report.flops
    plan.recompute_cost_s += report.cost_s
    plan.step_cost_s += report.cost_s
    return bw


def _budget_key(budgets) -> tuple:
    return tuple(sorted((str(k), repr(v)) for k, v in budgets.items()))


def _write_tags(gm: fx.GraphModule, tags) -> None:
    for node in gm.graph.nodes:
        original = node.meta.get(_ORIGINAL)
        if original is None:
            node.meta.pop("recompute", None)
        else:
            node.meta["recompute"] = original
    for node, tag in tags.items():
        node.meta["recompute"] = tag.policy


@contextlib.contextmanager
def _rng_ops_that_draw():
    """PyTorch's partitioner saves an RNG state (5 KiB on CPU) for every recomputed op tagged
    nondeterministic_seeded, even attention called with dropout_p=0, which draws nothing. Random
    ops are never recomputed here (the tag pass saves them), so there is no state to keep: the
    partitioner's check is narrowed to ops that draw, for the length of our partition call."""
    from torch._functorch import partitioners

    real = partitioners.has_recomputable_rng_ops

    def drawing(gm):
        return any(partitioners.must_recompute(n) and is_random(n) for n in gm.graph.nodes if n.op == "call_function")

    partitioners.has_recomputable_rng_ops = drawing
    try:
        yield
    finally:
        partitioners.has_recomputable_rng_ops = real


def _prepare(gm: fx.GraphModule) -> None:
    """Dead code out and common subexpressions merged once, here, so that the min-cut (run with
    its own CSE off) keeps our node objects; the tags of earlier runs on this graph undone."""
    gm.graph.eliminate_dead_code()
    if torch._functorch.config.cse:
        gm.graph = fx_graph_cse(gm.graph)
    for node in gm.graph.nodes:
        if _ORIGINAL in node.meta:
            original = node.meta[_ORIGINAL]
            if original is None:
                node.meta.pop("recompute", None)
            else:
                node.meta["recompute"] = original
        else:
            node.meta[_ORIGINAL] = node.meta.get("recompute")
    gm.recompile()


def _check_achieved(report, plan, joint, params) -> None:
    from remat_fx.passes.budget import region_bytes

    if report.achieved > report.target:
        raise RuntimeError(f"remat_fx: the partition saves {report.achieved:,} bytes, over the memory budget's "
                           f"target {report.target:,} that the solver met ({report.solver}). Please report this "
                           f"with the model.\n{plan}")
    for name, region in report.regions.items():
        region.achieved = region_bytes(joint, plan, name, params)
        if region.achieved > region.target:
            raise RuntimeError(f"remat_fx: the partition saves {region.achieved:,} bytes in region '{name}', over "
                               f"its memory budget's target {region.target:,}. Please report this with the model.")


def check_follows_tags(names, tags, bw: fx.GraphModule) -> None:
    """No MUST_SAVE node may be recomputed in the backward graph (nodes keep their names).
    Views and getitems are exempt: the partitioner may save a base and redo the free view."""
    rerun = {n.name for n in bw.graph.nodes
             if n.op == "call_function" and not _is_view(n) and n.target is not operator.getitem}
    for node, tag in tags.items():
        if tag.policy is TorchPolicy.MUST_SAVE and node.name in rerun:
            raise RuntimeError(
                f"remat_fx: the partition recomputes '{names.get(node, node.name)}' ({node.name}), "
                f"which is tagged MUST_SAVE ({tag.reason}). Please report this with the model."
            )


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view
