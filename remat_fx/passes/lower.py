"""Lower: compile the partitioned graphs.

``inductor``: Inductor's ``compile_fx`` (C++ on CPU, Triton on CUDA), with our
partition plugged in as its custom partitioner, so Inductor's own joint-graph
passes, decompositions and fw/bw compilers all run as usual.
``eager``: AOTAutograd with the same decompositions, running the partitioned FX
graphs op by op.
"""
from __future__ import annotations

import bisect
import copy
import dataclasses
import functools
import hashlib
import logging
import re
from typing import Callable, Optional

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from remat_fx.memory_budget import fmt_bytes
from remat_fx.options import BackendOptions
from remat_fx.passes import lowered_peak
from remat_fx.passes.capture import decompositions
from remat_fx.passes.lazy_module import write_code
from remat_fx.passes.lowered_peak import reading_schedules
from remat_fx.passes.partition import partition
from remat_fx.passes.peak import PeakEstimate, PeakInfeasible, backward_inputs
from remat_fx.passes.plan import input_names, last_plan
from remat_fx.passes.rerun import shorten
from remat_fx.plan_cache import annotations_digest, source_digest

log = logging.getLogger("remat_fx")

class RematPartitioner(CustomPartitionerFn):
    """Our partition as Inductor's ``custom_partitioner_fn``. ``plan``: the plan it made (None
    until it runs: an inference graph has none); ``counted``: the backward's inputs the step's
    peak counts (saved activations, tangents), and ``limit``: the byte peak_budget its lowering
    is checked on, for passes/lowered_peak.py."""

    def __init__(self, options: BackendOptions, limit: Optional[int] = None,
                 compiled_backward: Optional[Callable] = None, annotations: str = ""):
        self.options = options
        self.annotations = annotations  # plan_cache.annotations_digest of the graph: in AOTAutograd's key
        self.plan = None
        self.counted: set = set()
        self.limit = limit
        self.compiled_backward = compiled_backward  # called with the plan once its backward is compiled

    def __getstate__(self):
        # Inductor pickles its config (this included) into the FX graph cache's entries: the plan
        # made here does not pickle, and an entry that fails to is not stored
        return {"options": self.options, "plan": None, "counted": set(), "limit": self.limit,
                "compiled_backward": None, "annotations": self.annotations}

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)
        fw, bw = partition(gm, joint_inputs, options=self.options, **kwargs)
        self.plan = last_plan()
        self.counted = backward_inputs(fw, bw, kwargs["num_fwd_outputs"])[0]
        return fw, bw

    def uuid(self):
        return hashlib.sha256(repr((self.options.key(), source_digest(), self.annotations)).encode()).hexdigest()


def _run_eagerly(gm, example_inputs):
    """Run the FX graph op by op, taking its inputs as a boxed list it clears after unpacking, so
    each input (a saved activation, in backward) is freed after its last use, as Inductor's code does."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()
    write_code(gm)  # now, not at its first call (passes/lazy_module.py)

    def run(args):
        return gm.forward(args)

    run._boxed_call = True
    return run


class _KeepRerunsLate:
    """Inductor's fusion choices, except that no two kernels fuse across a rerun (passes/rerun.py: a
    value recomputed a second time just before its late use): not when they lie well apart with a
    rerun's copies between them or in the later one, nor at any distance across the copies of a
    rerun the earlier one is not part of. A fused kernel runs once all it reads is ready and
    allocates every member's output when it starts: fused across a rerun, either the rerun is
    computed early and held, as the first copy was, or a reader of the first copy runs after the
    rerun, and both copies are alive at once (measured, example GPT at budget 0: 28.05 MiB against an
    estimate of 24.04, 25.04 with the first rule; an 8-layer Llama at budget 0, with the first rule
    only: the gradients of an MLP's gate and up projections computed in one kernel from the copies
    of two reruns, 15.02 MiB against an estimate of 12.39). A rerun's own copies still fuse with
    each other and with their readers. With ``keep_order`` (under a budget, as _keeps_peak), nor do
    two kernels where the later one reads a kernel that runs between them (_pulls_forward).
    Everything else is asked of the choices in effect. Reads Inductor's scheduler nodes
    (``min_order``, ``max_order``, ``get_nodes``, ``read_writes``, origins' ``meta``) and the
    scheduler's ``nodes``, ``name_to_buf`` (``defining_op``) and ``name_to_fused_node``; checked on
    torch 2.13.0 and 2.14.1 (tests/test_peak.py)."""

    _NEAR = 8  # scheduler positions: a fusion this close moves nothing far

    def __init__(self, prior, keep_order: bool = False):
        self._prior = prior
        self._reruns = {}  # id(scheduler) -> sorted (scheduler position, rerun number) of the copies
        self._keep_order = keep_order

    def __getattr__(self, name):
        return getattr(self._prior, name)

    def can_fuse(self, scheduler, node1, node2, shared_data_score):
        early, late = sorted((node1, node2), key=lambda n: n.min_order)
        copies = self._reruns.get(id(scheduler))
        if copies is None:  # the positions of single nodes never change while fusing
            copies = self._reruns[id(scheduler)] = sorted(
                (snode.min_order, number) for group in scheduler.nodes for snode in group.get_nodes()
                for number in _reruns_of(snode))
        i = bisect.bisect_right(copies, (early.max_order, float("inf")))
        if i < len(copies) and copies[i][0] <= late.max_order:  # copies after early, up to late's end
            if late.min_order - early.max_order > self._NEAR:
                return False
            mine = {number for snode in early.get_nodes() for number in _reruns_of(snode)}
            while i < len(copies) and copies[i][0] < late.min_order:
                if copies[i][1] not in mine:
                    return False  # early's readers of a first copy would run after another rerun
                i += 1
        if self._keep_order and _pulls_forward(scheduler, early, late):
            return False
        return self._prior.can_fuse(scheduler, node1, node2, shared_data_score)


def _pulls_forward(scheduler, early, late) -> bool:
    """Whether ``late`` reads a kernel that runs after ``early`` (and is neither): fused, the kernel
    starts where ``early`` did, so what it reads moves ahead of everything between, and its outputs
    and theirs are alive across those kernels. Measured on an 8-layer Llama at budget 0: an
    elementwise kernel of a rerun (an MLP's SiLU(gate) x up, read by the down projection's weight
    gradient) fused with the next elementwise kernel, which reads the down projection's input
    gradient; that 1 MiB matmul moved ahead of the weight gradient's, and both outputs were alive
    beside it: the step measured 13.52 MiB against an FX estimate of 12.39, 12.65 with the rule
    (budget 0.15: 15.34 against 13.98, 13.99 with it; 0.3: 24.62 against 23.53, 23.53), at the same
    step time and 1-10% more kernels."""
    name_to_buf = getattr(scheduler, "name_to_buf", None)
    fused = getattr(scheduler, "name_to_fused_node", None)
    if name_to_buf is None or fused is None:
        return False
    for dep in late.read_writes.reads:
        buf = name_to_buf.get(dep.name)
        op = getattr(buf, "defining_op", None)
        if op is None:
            continue  # a graph input
        group = fused.get(op.get_name(), op)
        if group is not early and group is not late and group.max_order > early.max_order:
            return True
    return False


def _reruns_of(snode) -> set:
    """The numbers of the reruns whose copies a scheduler node computes."""
    from remat_fx.passes.rerun import RERUN

    found = set()
    for node in snode.get_nodes():
        for origin in getattr(getattr(node, "node", None), "origins", None) or ():
            number = origin.meta.get(RERUN)
            if number:
                found.add(number)
    return found


class _OverLimit(Exception):
    """A backward's schedule peaks over the byte peak_budget: its compile is cut short before
    Inductor compiles its kernels (on CPU; Triton kernels may already be queued)."""

    def __init__(self, lowered: PeakEstimate, plan):
        super().__init__(lowered)
        self.lowered, self.plan = lowered, plan


def _compile_keeping_reruns_late(*args, schedules: Optional[dict] = None,
                                 partitioner: Optional["RematPartitioner"] = None, cached: bool = False, **kwargs):
    """Inductor's compile of one graph (forward, or the backward: compiled lazily, at its first
    call), with the fusion choices of _KeepRerunsLate, and without Inductor's buffer reuse nor its
    reordering for peak memory where the budget made the plan (_keeps_peak)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    keep_peak = _keeps_peak(partitioner)  # as planned: the reruns the step drops leave the limit's estimate
    if kwargs.get("is_backward") and args:
        args = (_shortened(args[0], partitioner), *args[1:])
    with V.set_choices_handler(_KeepRerunsLate(V.choices, keep_peak)), \
            config.patch(allow_buffer_reuse=config.allow_buffer_reuse and not keep_peak,
                         reorder_for_peak_memory=config.reorder_for_peak_memory and not keep_peak):
        if schedules is None:
            compiled = compile_fx_inner(*args, **kwargs)
            if kwargs.get("is_backward") and partitioner is not None and partitioner.plan is not None \
                    and partitioner.compiled_backward is not None:
                partitioner.compiled_backward(partitioner.plan)  # the plan as its backward was compiled
            return compiled
        sink: list = []
        phase = "backward" if kwargs.get("is_backward") else "forward"
        check = None
        if phase == "backward" and partitioner is not None and partitioner.limit is not None:
            check = functools.partial(_check_backward, schedules, partitioner, cached)
        try:
            with reading_schedules(sink, check, fx_graph_cache=cached):
                compiled = compile_fx_inner(*args, **kwargs)
        except Exception as e:  # Inductor wraps what is raised inside it (InductorError)
            if isinstance(getattr(e, "inner_exception", None), (_OverLimit, _Unscheduled)):
                raise e.inner_exception from None
            raise
        schedules[phase] = sink[-1] if sink else None
        return compiled


# (plan) -> the estimated backward peak (Plan.peak.backward's measure) this graph's backward may
# reach without setting the step's estimated peak, or None: set by remat_fx/step.py, which knows the
# step, and asked when the backward is compiled (AOTAutograd compiles it at its first call, once
# the step's forwards and the later graphs' backwards have run)
backward_limit: Optional[Callable[[object], Optional[int]]] = None
_LIMIT_MARGIN = 0.02  # of the limit: the estimate under Inductor is a few % off the measured peak


def _shortened(bw: fx.GraphModule, partitioner: Optional["RematPartitioner"]) -> fx.GraphModule:
    """The backward with only the reruns (passes/rerun.py) the step needs: those that bring it to
    ``backward_limit``, less a margin (the rest lower a peak the step does not reach here); ``bw``
    itself when all are needed, or the step is unknown, or a peak_budget chose them."""
    plan = None if partitioner is None else partitioner.plan
    if plan is None or plan.rerun is None or not plan.rerun.shortenable:
        return bw
    limit = None
    if backward_limit is not None and partitioner.options.peak_budget is None \
            and partitioner.options.peak_fraction is None:
        limit = backward_limit(plan)
    found = shorten(plan.rerun, bw, None if limit is None else int(limit * (1 - _LIMIT_MARGIN)))
    if found is None:
        return bw
    new, short, higher = found
    if new is not bw:  # what compile_fx_backward noted on the graph it was given
        for old, node in zip(bw.graph.find_nodes(op="placeholder"), new.graph.find_nodes(op="placeholder")):
            node.meta = dict(old.meta)
        next(iter(reversed(new.graph.nodes))).meta = dict(next(iter(reversed(bw.graph.nodes))).meta)
    full = plan.rerun
    dropped_flops, dropped_s = full.flops - short.flops, full.cost_s - short.cost_s
    plan.rerun = short
    plan.backward_flops -= dropped_flops
    plan.recompute_flops -= dropped_flops
    plan.recompute_cost_s -= dropped_s
    plan.step_cost_s -= dropped_s
    plan.peak = dataclasses.replace(plan.peak, backward=plan.peak.backward + higher)
    log.info("remat_fx: graph's backward compiled with %d of its %d reruns: the step's estimated peak is "
             "elsewhere (the backward may reach %s), estimated backward peak %s", short.reruns, full.reruns,
             fmt_bytes(limit), fmt_bytes(plan.peak.backward))
    return new


def _keeps_peak(partitioner: Optional["RematPartitioner"]) -> bool:
    """Whether Inductor's buffer reuse and its reordering for peak memory are turned off: with a
    memory or peak budget, since reuse keeps a dead buffer alive for a later one of its size
    whenever that stays under Inductor's own estimate of the peak, not ours (measured on the example
    GPT at budget 0: a 3 MiB buffer held across the backward's peak, 27.1 -> 31.0 MiB), and the
    reordering moves kernels away from the order the schedule pass gave them by that estimate
    (``reorder_for_peak_memory``; measured on one block of the example GPT at budget 0.3: it moved
    the attention's recompute into the MLP's backward, 2,233,864 -> 2,630,152 bytes, where Inductor's
    estimate said 2,365,952, and PyTorch's own plan measured 2,374,664); a byte peak_budget's
    lowerings are checked against a schedule without either (passes/lowered_peak.py). Not when the
    plan is the one the graph has without a budget (the budget fits it, e.g. memory_budget=1, and
    nothing is rerun): that plan is lowered exactly as PyTorch lowers it (measured on the GPT-2 of
    docs/benchmarks.md, H100: at memory_budget 1 with reuse off, 1,179,648 bytes over PyTorch's peak)."""
    if partitioner is None:
        return False
    options, plan = partitioner.options, partitioner.plan
    if options.peak_budget is not None or options.peak_fraction is not None:
        return True
    if options.memory_budget is None:
        return False
    return plan is None or not ((plan.budget is None or plan.budget.solver == "none")
                                and (plan.rerun is None or not plan.rerun.reruns))


class _Unscheduled(Exception):
    """A backward compiled with its caches on whose forward came from Inductor's FX graph cache,
    not scheduled: its compile is cut short, so that AOTAutograd's cache does not keep a lowering
    that was not checked against the limit (_lower_within_peak lowers it again without the caches)."""


def _check_backward(schedules: dict, partitioner: "RematPartitioner", cached: bool, backward) -> None:
    """Raises _OverLimit when the step peaks over the byte peak_budget with this backward schedule."""
    if cached and schedules.get("forward") is None:
        raise _Unscheduled()
    lowered = _lowered_estimate(partitioner.plan, dict(schedules, backward=backward, counted=partitioner.counted))
    if lowered is not None and lowered.step > partitioner.limit:
        raise _OverLimit(lowered, partitioner.plan)


def _input_names(gm) -> list:
    """The user's names of a Dynamo graph's inputs (``x``, ``args[1]``; parameters by attribute path)."""
    names = []
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node, "_dynamo_source", None)
        name = getattr(source, "name", None)
        name = name() if callable(name) else name
        if not isinstance(name, str):
            names.append(node.name)
            continue
        name = re.sub(r"^[LG]\[['\"]([^'\"]+)['\"]\]", r"\1", name)
        names.append(re.sub(r"\.?_(?:modules|parameters|buffers)\[['\"]([^'\"]+)['\"]\]", r".\1", name))
    return names


def lower(gm, example_inputs, options: BackendOptions, aot_cache: Optional[Callable] = None,
          aot_lookup: bool = True):
    """The compiled graph. ``aot_cache``: under Inductor, AOTAutograd's cache is used (unless not
    ``aot_lookup``; a hit loads the compiled graphs without partitioning them: no plan is made) and
    ``aot_cache(plan)`` is called once the backward is compiled (remat_fx/step.py keeps the plan
    for the next process's hit; under a byte peak_budget it keeps the plan of the lowering that met
    the limit once lower returns)."""
    with input_names(_input_names(gm)):
        return _lower(gm, example_inputs, options, aot_cache, aot_lookup)


def _lower(gm, example_inputs, options: BackendOptions, aot_cache: Optional[Callable] = None,
           aot_lookup: bool = True):
    if options.lower == "inductor":
        if options.peak_budget is not None and lowered_peak.available():
            return _lower_within_peak(gm, example_inputs, options, aot_cache, aot_lookup)
        return _inductor(gm, example_inputs, options, aot_cache=aot_cache, aot_lookup=aot_lookup)[0]
    partitioner = RematPartitioner(options)

    def backward(bw, example_inputs):  # compiled at its first call (the step is known: _shortened)
        return _run_eagerly(_shortened(bw, partitioner), example_inputs)

    backend = aot_autograd(
        fw_compiler=_run_eagerly, bw_compiler=backward, decompositions=decompositions(),
        partition_fn=partitioner, keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)


def _inductor(gm, example_inputs, options: BackendOptions, schedules: Optional[dict] = None,
              limit: Optional[int] = None, aot_cache: Optional[Callable] = None, aot_lookup: bool = True):
    """(compiled, its partition's plan or None) with Inductor; ``schedules``: filled with the
    forward's and the backward's Schedule (passes/lowered_peak.py), both compiled now; ``limit``: a
    byte peak_budget over which the compile ends at the backward's schedule (_OverLimit);
    ``aot_cache``: as in :func:`lower`."""
    from torch._inductor.compile_fx import compile_fx

    partitioner = RematPartitioner(options, limit, aot_cache, annotations_digest(gm))
    # AOTAutograd's cache skips our partition on a hit, and with it the Plan: only where the
    # step keeps the plan for it (aot_cache); Inductor's own FX graph and kernel caches still apply.
    # A lowering whose schedules are read keeps Inductor's FX graph cache on with it (AOTAutograd's
    # entries are made of its entries): a graph it loads has no schedule (_lower_within_peak)
    cached = aot_cache is not None and aot_lookup
    patches = {"enable_autograd_cache": cached}
    if schedules is not None:
        patches["force_non_lazy_backward_lowering"] = True
    with torch._functorch.config.patch(**patches):
        compiled = compile_fx(gm, example_inputs,
                              inner_compile=functools.partial(_compile_keeping_reruns_late, schedules=schedules,
                                                              partitioner=partitioner, cached=cached),
                              config_patches={"custom_partitioner_fn": partitioner})
    if schedules is not None:
        schedules["counted"] = partitioner.counted
    return compiled, partitioner.plan


class _Partitioned(Exception):
    """Raised where Inductor would compile the first graph of a partition (partition_only)."""


def _stop(*args, **kwargs):
    raise _Partitioned


def partition_only(gm, example_inputs, options: BackendOptions) -> None:
    """Inductor's compile of ``gm`` (a graph Dynamo made) up to remat's partition of its joint graph,
    and nothing lowered: the partition sees the joint graph as a compile under Inductor gives it,
    after Inductor's pre-grad and joint-graph passes (which the eager lowering does not run: on
    benchmarks/gpu.py's 8-layer Llama the backward of budget 0's plan has 1,683 nodes here against
    1,867 from the eager lowering's joint graph), and passes/partition.py ``capture_joints`` records
    it for remat_fx.pareto and benchmarks/planning.py to plan again. ``gm`` is left as it was;
    AOTAutograd's cache is not read (a hit would skip the partition)."""
    from torch._inductor.compile_fx import compile_fx

    with input_names(_input_names(gm)), torch._functorch.config.patch(enable_autograd_cache=False):
        try:
            compile_fx(copy_dynamo_graph(gm), example_inputs, inner_compile=_stop,
                       config_patches={"custom_partitioner_fn": RematPartitioner(options)})
        except Exception as e:  # AOTAutograd or Inductor may wrap it
            seen, found = set(), e
            while found is not None and not isinstance(found, _Partitioned) and id(found) not in seen:
                seen.add(id(found))
                found = getattr(found, "inner_exception", None) or found.__cause__ or found.__context__
            if not isinstance(found, _Partitioned):
                raise


_LOWERINGS = 4  # Inductor compiles of one graph under a byte peak_budget, at most
_STEP = 0.02  # the least the limit is lowered by after a miss, as a fraction of it (doubling each time)


def _lower_within_peak(gm, example_inputs, options: BackendOptions, aot_cache: Optional[Callable] = None,
                       aot_lookup: bool = True):
    """A byte ``peak_budget`` under Inductor, checked against the lowered graphs: the plan is the
    fastest whose FX estimate fits the limit (passes/peak.py fit_peak); when Inductor's schedule of
    it (passes/lowered_peak.py) peaks over the limit, the graph is planned again under that plan's
    estimate less the overshoot (less at least ``_STEP`` of the limit, doubling at each miss: a
    small overshoot alone would leave the next plan's estimate close to this one's) and lowered
    again, up to ``_LOWERINGS`` compiles, each from a copy of the graph as Dynamo made it
    (Inductor's passes rewrite the graph they are given). Past that, or when no plan fits the
    lowered limit, ``PeakInfeasible`` names what the lowered plans peaked at. A graph without a
    backward (inference) is compiled once, as it is. ``aot_cache`` (as in :func:`lower`): each
    lowering looks in AOTAutograd's cache, where an earlier process left the one that met the limit
    (a hit makes no partition: returned as it is); a lowering of which Inductor's FX graph cache
    gave a graph, not scheduled then, is made again without the caches."""
    limit = options.peak_budget
    pristine = copy_dynamo_graph(gm)
    cap, step, tried = limit, _STEP * limit, []
    for attempt in range(_LOWERINGS):
        compiled = lowered = None
        schedules: dict = {}
        try:
            compiled, plan, schedules = _lower_scheduled(gm if attempt == 0 else copy_dynamo_graph(pristine), pristine,
                                                         example_inputs, dataclasses.replace(options, peak_budget=cap),
                                                         limit, aot_cache, aot_lookup)
        except _OverLimit as over:  # its backward's kernels were not compiled
            plan, lowered = over.plan, over.lowered
        except PeakInfeasible as e:
            if not tried:
                raise
            least = str(e).split(". Raise")[0].split(": the lowest is ")[-1]
            raise PeakInfeasible(_over_text(limit, tried) + f" Under {fmt_bytes(cap)}, which would make room for "
                                 f"that, no plan's estimate fits (the lowest is {least}). Raise peak_budget, or use "
                                 f"remat.fit(step, peak=...) to fit the measured peak.") from None
        if plan is None:
            return compiled  # no partition ran: nothing saved for a backward
        if compiled is not None:
            lowered = _lowered_estimate(plan, schedules)
            plan.lowered, plan.peak_budget, plan.tightened_to = lowered, limit, (cap if cap != limit else None)
            if lowered is None or lowered.step <= limit:
                if tried:
                    log.info("remat_fx: peak_budget %s met after %d lowerings (planned under %s): Inductor's "
                             "schedule peaks at %s", fmt_bytes(limit), len(tried) + 1, fmt_bytes(cap),
                             "?" if lowered is None else fmt_bytes(lowered.step))
                return compiled
        est, low = plan.peak.step, lowered.step
        tried.append((est, low, cap))
        cap, step = min(cap, est) - max(low - limit, step), 2 * step
        if cap <= 0 or attempt == _LOWERINGS - 1:
            break
        log.info("remat_fx: a plan estimated at %s for peak_budget %s peaks at %s in Inductor's schedule; "
                 "planning again under %s", fmt_bytes(est), fmt_bytes(limit), fmt_bytes(low), fmt_bytes(cap))
    raise PeakInfeasible(_over_text(limit, tried) + " Raise peak_budget to at least the lowest of those, or use "
                         "remat.fit(step, peak=...) to fit the measured peak.")


def _lower_scheduled(gm, pristine, example_inputs, options: BackendOptions, limit: int,
                     aot_cache: Optional[Callable], aot_lookup: bool):
    """(compiled, plan, schedules) of one lowering under a byte peak_budget, with Inductor's
    schedules of both graphs read. With the caches on (``aot_cache``), a hit in AOTAutograd's is
    returned as it is (no plan); a lowering with a graph from the FX graph cache (not scheduled
    again; a backward whose forward came from it stops at its check, _Unscheduled) or a schedule
    not read is made again from ``pristine`` with the caches off."""
    if aot_cache is not None and aot_lookup:
        schedules: dict = {}
        try:
            compiled, plan = _inductor(gm, example_inputs, options, schedules, limit, aot_cache, aot_lookup)
            if plan is None or (schedules.get("forward") is not None and schedules.get("backward") is not None):
                return compiled, plan, schedules
        except _Unscheduled:
            pass
        gm = copy_dynamo_graph(pristine)
    schedules = {}
    compiled, plan = _inductor(gm, example_inputs, options, schedules, limit)
    return compiled, plan, schedules


def copy_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a graph Dynamo made, with what AOTAutograd reads of Dynamo's private metadata to
    tell parameters from activations (``gm.meta``, ``gm._param_name_to_source``, each placeholder's
    ``_dynamo_source``; torch 2.13/2.14). Without them a graph lowered again counts the parameters
    as saved activations and their gradients as nothing."""
    copied = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    copied.meta = dict(gm.meta)
    for name in ("_param_name_to_source", "_source_to_user_stacks"):
        if hasattr(gm, name):
            setattr(copied, name, getattr(gm, name))
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), copied.graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copied


def _over_text(limit: int, tried) -> str:
    return (f"remat_fx: peak_budget {fmt_bytes(limit)} ({limit:,} bytes) is not met once the graph is lowered: "
            + "; ".join(f"a plan estimated at {fmt_bytes(est)} (searched under {fmt_bytes(cap)}) peaks at "
                        f"{fmt_bytes(low)} ({low:,} bytes) in Inductor's schedule" for est, low, cap in tried) + ".")


def _lowered_estimate(plan, schedules: dict) -> Optional[PeakEstimate]:
    """The plan's step peak from Inductor's schedules of its two graphs (None if either is missing)."""
    fw, bw = schedules.get("forward"), schedules.get("backward")
    if fw is None or bw is None or plan is None or plan.peak is None:
        return None
    return PeakEstimate(forward=fw.peak(), backward=plan.peak.held + bw.peak(schedules["counted"]),
                        saved=plan.peak.saved, held=plan.peak.held)
