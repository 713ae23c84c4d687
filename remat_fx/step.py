"""The step: every graph the ``remat`` backend compiled, seen as one training step.

A training step is often several compiled graphs: a graph break splits the blocks, Hugging Face
compiles the loss apart, DDP splits at its buckets, and one graph may run once per layer. A
forward's saved tensors stay alive through every later forward of the step until its own
backward, so a limit on one graph's memory is not a limit on the step's. This module

* wraps every compiled graph in a :class:`CompiledGraph` that records its calls, so the calls of
  the last step are known (a step ends when a backward starts; the next forward starts a new one);
* estimates the peak of the whole step from the per-graph estimates (:func:`step_peak`): the
  forwards in call order, each on top of what the earlier calls left for their backward, then the
  backwards in reverse order, each on top of what the earlier calls still hold and the parameter
  gradients the later ones made;
* plans a whole-step ``peak_budget``: while the first step compiles, each graph gets what the calls
  before it in the step leave of the limit, and a graph called again is lowered at its least peak
  for the rest of the step where the step would go over with as many calls again
  (:func:`_hold_first_step`); once the step has run, if its estimate is over the limit (the first
  graphs took too much), every graph of the step is planned again with one shared memory budget,
  the largest on a grid whose whole-step estimate fits (:func:`plan_step`);
* reports it: :func:`step_report`.

The measured fit (``remat.fit``, remat_fx/measured_fit.py) uses the same pieces with measured peaks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from remat_fx import plan_cache
from remat_fx.memory_budget import Budget, fmt_bytes
from remat_fx.options import BackendOptions
from remat_fx.runtime.torch_compat import current_graph_task, saved_tensors_hooked, storage_key, storage_ref
from remat_fx.sizes import sizes_at
from remat_fx.passes import partition as _partition
from remat_fx.passes.budget import BudgetInfeasible
from remat_fx.passes import lower as _lower_module
from remat_fx.passes.lower import copy_dynamo_graph as _copy_dynamo_graph
from remat_fx.passes.lower import lower
from remat_fx.passes.peak import PeakEstimate, PeakInfeasible
from remat_fx.passes.plan import Plan, last_plan
from remat_fx.passes.plan import record as record_plan
from remat_fx.passes.plan import unrecorded

log = logging.getLogger("remat_fx")
_SLOW_S = 2.0  # compiles longer than this are logged (logger "remat_fx", level INFO)

# shared memory budgets tried for a whole step, largest (fastest) first; None: no budget
GRID: Tuple[Optional[float], ...] = (None, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0)


@dataclass(frozen=True)
class CallCost:
    """What one call of a compiled graph adds to the step (bytes, from its plan's estimate)."""

    saved: int  # what its forward leaves for its backward (not counting its inputs)
    held: int  # its other outputs (alive until its backward, at the latest)
    forward: int  # its forward's peak above the forward's start
    backward: int  # its backward's peak above the backward's start (saved and held included)
    grads: int  # the parameter gradients its backward leaves behind


def grads_once(costs: Sequence[CallCost], calls: Sequence["CompiledGraph"], ios) -> List[CallCost]:
    """``costs`` with each call's parameter gradients counted at the first backward (in backward order)
    of the calls on the same parameters only: the later ones add to them in place. A cell called
    200 times in a loop was counted 200 times over (the step estimated 6.7x its measured peak, and a
    peak_budget of 3x it was refused: a review). Calls of other graphs sharing some parameters (tied
    weights) are still counted apart: over, not under."""
    if ios is None or len(ios) != len(costs):
        return list(costs)
    out, seen = list(costs), set()
    for i in reversed(range(len(costs))):
        leaves = getattr(ios[i], "leaves", None)
        if not leaves or not out[i].grads:
            continue
        if leaves in seen:  # (of the same graph, or of another on the same parameters: a first call's)
            out[i] = dataclasses.replace(out[i], grads=0)
        seen.add(leaves)
    return out


def step_costs(calls: Sequence["CompiledGraph"], ios, plan_of: Optional[Callable[["CompiledGraph"], Plan]] = None
               ) -> List[CallCost]:
    """What each of ``calls`` adds to the step under its plan (``plan_of``, by default the one it
    ran: :func:`ran_plans`), with the inputs that eager code made during the step (``CallIO.external``: an embedding
    before the first graph, a head between the blocks' graphs and the loss graph; no graph's
    estimate counts them): one its plan keeps for its backward, alive from its forward until then,
    others up to their last use in its forward; each parameter gradient counted once
    (:func:`grads_once`)."""
    plans = ran_plans(calls, ios) if plan_of is None else [plan_of(g) for g in calls]
    costs = [call_cost(plan, g.grads) for g, plan in zip(calls, plans)]
    if ios is not None and len(ios) == len(costs):
        # each storage once, at the first call that reads it (an encoder's output, or an x0 that every
        # block reads, was counted once per call: 1.24x the measured step over 6 calls, a review), and
        # only where a call that reads it keeps it for its backward: from the first reader's forward
        # until its backward begins (the last of theirs: over, not under, where a later call keeps
        # it), which frees each input after its last use there (the backward's estimate counts none of
        # its inputs; counted through it, the logits a loss graph keeps and reads first were 18% over
        # the measured step). One that no call keeps is freed by its graph after its last use there
        # (AOTAutograd's boxed calls), maybe before the graph's peak: up to there (counted through the
        # forward, an eager head's logits that the loss graph read first and did not keep were 4% over)
        first: Dict[int, Tuple[int, int, int]] = {}  # storage key -> (the first call reading it, input, bytes)
        kept, kept_first = set(), set()
        for i, (g, io) in enumerate(zip(calls, ios)):
            external = getattr(io, "external", ())
            if not external:
                continue
            kept_inputs = g.saved_input_indices(plans[i], io.nargs)  # None: taken as kept
            for m, nbytes, key in external:
                first.setdefault(key, (i, m, nbytes))
                if kept_inputs is None or m in kept_inputs:
                    kept.add(key)
                    if kept_inputs is not None and first[key][0] == i:
                        kept_first.add(key)
        for key, (i, m, nbytes) in first.items():
            if key in kept:
                backward = costs[i].backward
                if key in kept_first:
                    # the first reader keeps it: alive in its backward up to the backward's last use of it (a
                    # frozen prefix's output saved by the next graph's first block, whose backward runs last:
                    # 256 KiB under the measured step at that backward, and a byte limit missed, a review)
                    name = calls[i].primals[m] if calls[i].primals is not None and m < len(calls[i].primals) \
                        else None
                    span = next((x for x in plans[i].peak.backward_inputs if x[0] == name), None)
                    if span is not None:
                        backward = max(backward, span[1] + nbytes)
                costs[i] = dataclasses.replace(costs[i], forward=costs[i].forward + nbytes,
                                               saved=costs[i].saved + nbytes, backward=backward)
                continue
            # kept by none: alive in its first reader's forward up to its last use there
            g, peak = calls[i], plans[i].peak
            name = g.primals[m] if g.primals is not None and m < len(g.primals) else None
            span = next((x for x in peak.inputs if x[0] == name), None)
            if span is not None:
                costs[i] = dataclasses.replace(costs[i], forward=max(costs[i].forward, span[1] + nbytes, span[2]))
        # an output the plan also saves (logits a loss in the same graph reads) is freed by the backward at its
        # last use there, unless the caller still holds it when the backward begins (a Hugging Face ModelOutput
        # kept through out.loss.backward(): 41.88 MiB measured against an estimate of 37.98, and a peak_budget
        # of 38 MiB missed at every step, a review): then through the whole backward. Told apart by bytes among
        # the call's output storages alive then (two of one size: over, not under)
        for i, io in enumerate(ios):
            both = plans[i].peak.saved_outputs if plans[i].peak is not None else ()
            alive = getattr(io, "objects", None)
            if not both or alive is None:
                continue
            held = [n for n, live in zip(io.sizes, alive) if live]
            backward = costs[i].backward
            for nbytes, _, rest in both:
                if nbytes in held:
                    held.remove(nbytes)
                    backward = max(backward, rest + nbytes)
            costs[i] = dataclasses.replace(costs[i], backward=backward)
    return grads_once(costs, calls, ios)


def ran_plans(calls: Sequence["CompiledGraph"], ios) -> List[Plan]:
    """The plan each of ``calls`` ran under: its graph's, or where its run-time record has it, the one
    it ran (a graph lowered again in the middle of its first step runs another from there:
    :func:`_hold_first_step`)."""
    if ios is not None and len(ios) == len(calls):
        return [_ran(g, io) for g, io in zip(calls, ios)]
    return [g.plan for g in calls]


def _ran(graph: "CompiledGraph", io) -> Plan:
    """The plan ``graph`` ran the call recorded by ``io`` under (a settled call's light record has none:
    its graph's)."""
    return getattr(io, "plan", None) or graph.plan


def call_cost(plan: Plan, grads: int) -> CallCost:
    p = plan.peak
    return CallCost(saved=p.saved, held=p.held, forward=p.forward, backward=p.backward, grads=grads)


@dataclass(frozen=True)
class Sharding:
    """What a sharding engine (FSDP2's ``fully_shard`` with ``reshard_after_forward``) adds to a step,
    seen at run time: per call, the bytes of the parameters it was given that were freed after its
    forward (the engine gathers them for the forward, frees them, and gathers them again for the
    backward), and the ranks their gradients are reduce-scattered over."""

    gathered: Tuple[int, ...]
    world: int
    # every call's parameters were all freed after its forward, each before the next call began (none
    # kept unsharded through the step, as reshard_after_forward=False and the root module keep theirs,
    # and no FSDP unit split over several graphs): the model counts nothing else
    complete: bool = True
    # the gradients reduce-scattered after each backward (False: kept whole and nothing reduce-scattered,
    # as without gradient sync; backward_limit takes the least limit over kinds_of_step)
    scatter: bool = True


# where a step finds the parameter gradients (step_peak's ``gradients``)
GRADIENTS = ("made", "there", "there whole", "held", "held shards")


def kinds_of_step(sharding: Optional[Sharding]) -> List[Tuple[Optional[Sharding], str]]:
    """The kinds of step one compiled backward may serve, as (sharding, gradients) for
    :func:`step_peak`: the parameter gradients made by the step (``zero_grad(set_to_none=True)``
    before it) or there before it (a gradient accumulation's later steps, ``set_to_none=False``,
    DDP's ``gradient_as_bucket_view``); under FSDP2 each with gradient sync (reduce-scattered) and
    without (``set_requires_gradient_sync(False)``: kept whole, nothing reduce-scattered), and the step
    with gradient sync that ends an accumulation without it (the whole gradients there, then
    reduce-scattered)."""
    if sharding is None:
        return [(None, "made"), (None, "there")]
    whole = dataclasses.replace(sharding, scatter=False)
    scattered = dataclasses.replace(sharding, scatter=True)
    return [(scattered, "made"), (whole, "made"), (scattered, "there"), (whole, "there"),
            (scattered, "there whole")]


@dataclass(frozen=True)
class StepPeak:
    peak: int  # bytes above the step's start
    call: int  # index of the call at whose forward or backward it is reached
    phase: str  # "forward" or "backward"
    at: Tuple[int, ...]  # the step's estimated bytes at each call's forward, then each backward (reverse)


def step_peak(costs: Sequence[CallCost], released: Optional[Sequence[int]] = None,
              later: Optional[Sequence[int]] = None, sharding: Optional[Sharding] = None,
              gradients: str = "made") -> StepPeak:
    """The estimated peak of a step whose forwards run in the order of ``costs`` and whose
    backwards run in reverse. ``released[i]``: bytes of call i's held outputs that are freed before
    the backwards (:func:`released_bytes`; by default none: each is held until its call's backward);
    ``later[i]``: bytes of the others freed during the later calls' backwards, before call i's (a
    loss graph that saved the logits it read frees them with its backward); they leave the estimate
    at call i's backward, not at the freeing call's (exact for a model graph and its loss graph;
    over by them at the backwards of calls in between).

    ``sharding`` (FSDP2, :class:`Sharding`; its schedule after torch 2.13's source, measured by
    phase with gloo): a call's gathered parameters are alive during its forward and its backward;
    over more than one rank a call's forward also holds its all-gather's output; during any backward
    below a sharded call the next sharded call's parameters (in backward order) are being gathered
    already (FSDP2's backward prefetch) and, with ``sharding.scatter``, the previous sharded call's
    gradients wait in their reduce-scatter's input; once reduce-scattered a call's gradients of
    gathered parameters stay as one ``world``-th of their bytes (the rank's shard), not whole
    (without ``scatter``, no gradient sync: kept whole, nothing waits).

    ``gradients`` (:data:`GRADIENTS`): where the parameter gradients are when the step begins.
    ``"made"``: None, each backward allocates its own. ``"there"``: there (a gradient accumulation's
    later steps, their storage counted in the step's start), each backward's added in place and
    leaving nothing behind; with ``sharding.scatter`` they still wait whole in their
    reduce-scatter's input, whose output is added to the shard. ``"there whole"`` (with
    ``sharding.scatter``; the step with gradient sync that ends an accumulation without it): whole
    gradients of gathered parameters are there, added to in place, then copied into the
    reduce-scatter's input and freed, and the shard is made: each sharded backward gives back the
    whole less the shard. ``"held"``: as ``"there"``, with the gradients' bytes (what ``"made"`` leaves
    once the step has run; under FSDP2 whole, as the graphs find them: :func:`grads_found`) counted from
    the step's start, at every point: a whole-step byte limit's view of a step that finds them there
    (:func:`accumulating`), which holds it from the memory before them (at or above ``"made"`` at every
    point). ``"held shards"``: as ``"held"``, the gradients counted as FSDP2's shards (found on the
    sharded parameters: gradient sync at every micro-batch)."""
    if gradients not in GRADIENTS:
        raise ValueError(f"gradients must be one of {GRADIENTS}, got {gradients!r}")
    n = len(costs)
    released = [0] * n if released is None or len(released) != n else released
    later = [0] * n if later is None or len(later) != n else later
    gathered = [0] * n if sharding is None or len(sharding.gathered) != n else list(sharding.gathered)
    world = 1 if sharding is None or not sharding.scatter else max(sharding.world, 1)
    scattered = [min(c.grads, g) for c, g in zip(costs, gathered)]  # gradients reduce-scattered after the backward
    at: List[int] = []
    best = (0, 0, "forward")
    base = grads_found(costs, sharding, whole=gradients == "held") if gradients.startswith("held") else 0
    for i, c in enumerate(costs):
        output = gathered[i] if sharding is not None and sharding.world > 1 else 0  # the all-gather's output
        at.append(base + c.forward + gathered[i] + output)
        if at[-1] > best[0]:
            best = (at[-1], i, "forward")
        base += c.saved + c.held
    base -= sum(released)
    grads = 0
    for i in reversed(range(n)):
        c = costs[i]
        base -= c.saved + c.held - released[i]
        prefetched = waiting = 0
        if any(gathered[i:]):  # below a sharded call (or one itself) in backward order
            prefetched = next((gathered[j] for j in range(i - 1, -1, -1) if gathered[j]), 0)
            if sharding.scatter:
                waiting = next((scattered[j] for j in range(i + 1, n) if gathered[j]), 0)
        at.append(base + grads + c.backward - released[i] - later[i] + gathered[i] + prefetched + waiting)
        if at[-1] > best[0]:
            best = (at[-1], i, "backward")
        if gradients == "made":
            grads += c.grads - scattered[i] + scattered[i] // world
        elif gradients == "there whole":
            grads += scattered[i] // world - scattered[i]
    return StepPeak(best[0], best[1], best[2], tuple(at))


def grads_left(costs: Sequence[CallCost], sharding: Optional[Sharding] = None) -> int:
    """Bytes of the parameter gradients a step of ``costs`` leaves behind (as step_peak's ``"made"``
    makes them: under FSDP2 with gradient sync, the gathered parameters' as their shards)."""
    gathered = [0] * len(costs) if sharding is None or len(sharding.gathered) != len(costs) else sharding.gathered
    world = 1 if sharding is None or not sharding.scatter else max(sharding.world, 1)
    return sum(c.grads - min(c.grads, g) + min(c.grads, g) // world for c, g in zip(costs, gathered))


def grads_found(costs: Sequence[CallCost], sharding: Optional[Sharding] = None, whole: bool = True) -> int:
    """Bytes of the parameter gradients a step of ``costs`` that finds them there holds from its start
    (step_peak's ``"held"``): under FSDP2 whole, not as their shards. The graphs find them on the
    unsharded parameters they are given, where FSDP2 keeps them whole without gradient sync
    (``set_requires_gradient_sync(False)``, an accumulation's micro-batches but the last); the shards it
    reduce-scatters into are on the sharded parameters, which no graph is given. (Counted as shards, a
    review measured 13.64 MiB against an estimate of 10.17 under a 10 MiB peak_budget: 8 blocks'
    gradients of 774.5 KiB each, whole, on 2 ranks.) Not ``whole``: found as the shards on the sharded
    parameters (gradient sync at every micro-batch: remat_fx/fsdp2.py)."""
    if sharding is not None and whole:
        sharding = dataclasses.replace(sharding, scatter=False)
    return grads_left(costs, sharding)


def _grad_bytes(joint) -> int:
    """Bytes of the parameter gradients one backward of this joint graph returns."""
    gm, _, kwargs = joint
    params = set(kwargs.get("static_lifetime_input_indices") or ())
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    grads = out[kwargs["num_fwd_outputs"]:]
    total = 0
    for i, g in enumerate(grads):
        if i in params and isinstance(g, fx.Node) and isinstance(g.meta.get("val"), torch.Tensor):
            total += int(g.meta["val"].untyped_storage().nbytes())
    return total


def graph_key(gm: fx.GraphModule, example_inputs) -> str:
    """A key of the graph that is the same in every process running the same model: its code
    and its inputs' shapes, strides and dtypes, the torch version, and its remat annotations."""
    digest = hashlib.sha256(gm.code.encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            digest.update(repr((tuple(x.shape), tuple(x.stride()), str(x.dtype), x.device.type,
                                x.requires_grad)).encode())
        else:
            digest.update(repr(type(x).__name__).encode())
    digest.update(torch.__version__.encode())
    digest.update(plan_cache.annotations_digest(gm).encode())  # remat.annotate's budgets: not in the code
    return digest.hexdigest()[:24]


@dataclass(frozen=True)
class _GlobalState:
    """Grad mode and autocast (per device type) when a graph was first compiled."""

    grad: bool
    autocast: Tuple[Tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool

    @classmethod
    def now(cls) -> "_GlobalState":
        devices = ["cpu", "cuda"]
        accelerator = torch.accelerator.current_accelerator()  # what Dynamo saves besides the CPU
        if accelerator is not None and accelerator.type not in devices:
            devices.append(accelerator.type)
        return cls(torch.is_grad_enabled(),
                   tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in devices),
                   torch.is_autocast_cache_enabled())

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for device, enabled, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self.autocast_cache))
            yield


def _symbolic(value) -> bool:
    """A fake tensor whose sizes or strides are symbols (Dynamo's dynamic shapes)."""
    return isinstance(value, FakeTensor) and any(isinstance(d, torch.SymInt) for d in (*value.shape, *value.stride()))


_SIZES_SAID: set = set()  # (step, sizes over, limit) warned of: once a step, not once per graph of it


def _planned_sizes(gm: fx.GraphModule) -> List[Tuple[int, Optional[int], str, int, object]]:
    """(input, dim or None for a size input, name, size planned at, its symbolic expression) for each
    size of ``gm``'s inputs that is a symbol with a hint (Dynamo's dynamic shapes; the hint is the
    compiling call's value): a tensor's dims, and a size input (Dynamo passes a tensor's symbolic size
    as an int too) only where no tensor dim is that symbol."""
    tensors, sizes, seen = [], [], set()
    for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            sizes.append((i, None, node.name, value))
        elif isinstance(value, torch.Tensor):
            tensors += [(i, d, f"{node.name}.shape[{d}]", size) for d, size in enumerate(value.shape)
                        if isinstance(size, torch.SymInt)]
    found = []
    for i, dim, name, size in tensors + sizes:
        hint = size.node.hint
        if hint is None or (dim is None and size.node.expr in seen):
            continue
        seen.add(size.node.expr)
        found.append((i, dim, name, int(hint), size.node.expr))
    return found


class CompiledGraph:
    """The callable the backend hands Dynamo for one graph: the lowered graph, its plan, and
    what the step coordinator needs to plan it again (the Dynamo graph and its example inputs,
    the joint graph its partition saw)."""

    _count = 0

    def __init__(self, gm: fx.GraphModule, example_inputs, options: BackendOptions, key: str):
        CompiledGraph._count += 1
        self.index = CompiledGraph._count - 1
        from torch._guards import TracingContext

        self.gm, self.example_inputs, self.options, self.key = gm, example_inputs, options, key
        # what a later lowering starts from: the graph as Dynamo made it (Inductor's passes rewrite the
        # graph they are given) and the fake mode Dynamo traced it in
        self.pristine = _copy_dynamo_graph(gm)
        # Dynamo made it with dynamic sizes (a placeholder of symbolic size): lowered again from its
        # symbolic inputs (_fakes), or not at all (relower)
        held = [n.meta.get("example_value") for n in self.pristine.graph.find_nodes(op="placeholder")]
        self.dynamic = any(_symbolic(v) or isinstance(v, torch.SymInt) for v in held)
        # a tensor input of symbolic sizes, of whatever class (_kept)
        self.symbolic_tensors = any(isinstance(d, torch.SymInt) for v in held if isinstance(v, torch.Tensor)
                                    for d in (*v.shape, *v.stride()))
        # the sizes it is planned at, where they are symbols: (input, dim or None for a size input, name,
        # size); a call over them is over what a byte limit was planned for (_over_planned_sizes)
        self.planned_sizes = _planned_sizes(self.pristine) if self.dynamic else []
        self.size_warned = False
        # where it was called at larger sizes than its compile's under a whole-step byte limit: the sizes
        # its plans are made at from then on (symbol -> size; remat_fx/sizes.py), not its compile's
        self.planned_at: Dict[object, int] = {}
        self.sizes_run: Dict[object, int] = {}  # symbol -> the largest size its calls ran it at, as checked
        self.entered = False  # a call of it has entered a step (_Step.enter)
        # its parameters (a graph compiled on a fitted graph's parameters after remat.fit: _compile_graph)
        self.param_ids = frozenset(id(x) for x in example_inputs if isinstance(x, torch.nn.Parameter))
        self.fit_limit: Optional[int] = None  # the peak a remat.fit that chose its plan measured it under
        context = TracingContext.try_get()
        self.fake_mode = context.fake_mode if context is not None else None
        # the global state AOTAutograd traces under (Dynamo guards on it: the graph only runs under
        # it): a later lowering, from remat.fit or the whole-step plan, outside the user's
        # torch.autocast, must trace under it too, or it lowers the graph in float32
        self.global_state = _GlobalState.now()
        self.fn: Optional[Callable] = None
        self.plan: Optional[Plan] = None  # None: an inference graph (nothing saved for backward)
        self.joint = None  # (joint graph, joint inputs, partition kwargs); None after an AOTAutograd cache hit
        self.primals: Optional[List[str]] = None  # the joint graph's primal inputs, by name
        self.grads = 0
        self.active: Optional[BackendOptions] = None  # what it was lowered with
        self.over = False  # planned with less than the step's limit left for it
        # its parameters' gradients were there when a call of it began, under a whole-step byte peak_budget,
        # which counts them as the step's from then on (_gradients_there, accumulating); found since its
        # steps were last planned
        self.accumulates = False
        # found there as FSDP2's shards only (on the sharded parameters: gradient sync at every micro-batch),
        # not whole on the unsharded ones it is given (remat_fx/fsdp2.py; grads_found)
        self.shards_found = False
        self.gradients_found = False
        self.gradients_looked = -1  # the step where a call of it last found its parameters' gradients absent
        self.stepped = False  # a step that called it has begun its backward
        # lowered at its least peak for the rest of its first step (_hold_first_step), from the lowering
        # of its first call (kept: taken back where the step, once known, fits with it)
        self.provisional = False
        self.first: Optional[dict] = None
        self.first_looks = (-1, 0)  # (the step, its calls in it so far) as _hold_first_step counts them
        self.first_compile = True  # compiled on its frame's first compile (not a recompile on new shapes)
        self.cached = None  # the remat.fit call (its scope) whose cache gave the plan it was compiled with
        self.step_record: Optional[dict] = None  # the plan cache's record of its step it was compiled from
        self.auto_read: Optional[int] = None  # peak_budget="auto" as its compile read it (its step record's key)
        self.seconds = 0.0  # compile time
        self.version = 0  # compiles so far (a whole-step plan or remat.fit may lower it again)
        self.steps = 0  # steps that called it (their backward began) since it was last compiled
        # its calls need no run-time record of their own (_Step.settle): a step of the same calls,
        # with this lowering, was recorded whole and its backward compiled
        self.settled = False

    def compile(self, options: BackendOptions, aot: bool = True) -> None:
        t0 = time.perf_counter()
        record = self._aot_record(options) if aot else None
        with sizes_at(self.planned_at):
            fn = self._lower(options, record)
            if fn is None:  # a hit in AOTAutograd's cache without the plan's record: traced and partitioned again
                log.info("remat_fx: graph %d was found in AOTAutograd's cache but its plan was not (%s): compiled "
                         "again without that cache", self.index, record)
                self.gm = _copy_dynamo_graph(self.pristine)
                fn = self._lower(options, record, lookup=False)  # the record written again
        self.fn, self.active = fn, options
        self.provisional, self.first = False, None
        self.version += 1
        self.steps = 0
        self.settled = False
        self.example_inputs = self._fakes(self.example_inputs)
        seconds = time.perf_counter() - t0
        self.seconds += seconds
        if seconds > _SLOW_S and self.plan is not None:
            budget = self.plan.budget
            log.info("remat_fx: graph %d compiled in %.1f s: partition %.1f s (%s%d plans estimated), %d saved, "
                     "estimated peak %s", self.index, seconds, self.plan.partition_seconds,
                     "" if budget is None else f"{budget.solver} solver, ", max(self.plan.peak_evaluations, 1),
                     len(self.plan.saved), fmt_bytes(self.plan.peak.step))

    def _aot_record(self, options: BackendOptions):
        """Where this graph's plan is kept for AOTAutograd's cache, or None where that cache stays
        off: remat.fit's search (it lowers each graph under many options, measured, not kept), the
        eager lowering, the plan cache off. Byte budgets are cached: the budget a later graph of
        the step is compiled with (what the graphs before it left) is in its options, so in the
        key; where the step is planned again as a whole, the estimates trace a graph loaded from
        the cache again (estimate). Under a byte peak_budget the lowering that met the limit in
        Inductor's schedule is the one cached (passes/lower.py _lower_within_peak)."""
        from remat_fx import measured_fit as _fit

        if not plan_cache.enabled(options) or options.lower != "inductor" or _fit.searching() or self.planned_at:
            return None  # (planned at other sizes than its compile's: a plan the cache's key does not tell apart)
        return plan_cache.graph_record(self.key, options, self.global_state)

    def _lower(self, options: BackendOptions, record, lookup: bool = True):
        """The compiled graph, its plan, joint graph and gradient bytes set; None after a hit in
        AOTAutograd's cache (``record`` given, ``lookup``) whose plan the record does not have."""
        keep = None
        if record is not None:
            def keep(plan):  # the plan as its backward was compiled, for the next process's hit
                plan_cache.save_record(record, plan, self.grads, self.primals)
        hits = plan_cache.aot_cache_hits()
        with _partition.capture_joints() as joints:
            fn = lower(self.gm, self.example_inputs, options, aot_cache=keep, aot_lookup=lookup)
        # a hit is the lowering returned: the last (a byte peak_budget's lowerings, passes/lower.py
        # _lower_within_peak, stop at a hit), though one before it partitioned (and went over the limit)
        hit = record is not None and plan_cache.aot_cache_hits() > hits
        if joints and not hit:
            self.joint = joints[-1]
            self.plan = last_plan()
            self.grads = _grad_bytes(self.joint)
            self.primals = [n.name for n in self.joint[0].graph.nodes
                            if n.op == "placeholder" and not n.name.startswith("tangents")]
            self.plan.graph = self.index
            if record is not None:
                plan_cache.save_record(record, self.plan, self.grads, self.primals)
        elif hit:
            saved = plan_cache.load_record(record)
            if saved is None:
                return None
            self.joint, self.plan, self.grads, self.primals = None, saved["plan"], saved["grads"], saved["primals"]
            if self.plan is not None:  # made by an earlier process: none planned here
                self.plan.graph, self.plan.from_cache = self.index, True
                self.plan.partition_seconds, self.plan.peak_evaluations = 0.0, 0
                record_plan(self.plan)
                if options.report:
                    print(self.plan)
        elif record is not None:  # nothing partitioned, nothing found: a graph without a backward
            plan_cache.save_record(record, None, 0, None)
        return fn

    def _fakes(self, inputs) -> list:
        """The example inputs as fake tensors: the real ones Dynamo passed would keep the first
        call's inputs alive for good (and with them the autograd graph of the graph before it)."""
        if self.fake_mode is None:
            from torch._guards import detect_fake_mode

            self.fake_mode = detect_fake_mode(inputs)
        if self.fake_mode is None:
            self.fake_mode = FakeTensorMode()
        # a graph Dynamo made with dynamic shapes (a recompile on a new batch size, dynamic=True) is
        # lowered again from Dynamo's own fake inputs, whose sizes are its symbols: from fakes of the
        # first call's sizes it was specialised to them, and Dynamo's guards, which take any size, ran
        # it on others (a smaller last batch, then a full one: "shape '[160, 32]' is invalid")
        tensors = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)]
        if self.dynamic and tensors:
            held = [n.meta.get("example_value") for n in self.pristine.graph.find_nodes(op="placeholder")]
            mode = getattr(held[tensors[0]], "fake_mode", None) if len(held) == len(inputs) else None
            if mode is not None and any(_symbolic(held[i]) for i in tensors) and \
                    all(isinstance(held[i], FakeTensor) and held[i].fake_mode is mode for i in tensors):
                self.fake_mode = mode  # theirs: the symbols are its shape environment's
                return [held[i] if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
                        for i, x in enumerate(inputs)]
        return [self.fake_mode.from_tensor(x, static_shapes=True)
                if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x for x in inputs]

    def relower(self, options: BackendOptions, aot: bool = True) -> None:
        """Lower again with other options (outside Dynamo: in the fake mode it traced with). A graph
        of dynamic shapes whose new lowering needed a guard on its sizes keeps the lowering it had:
        Dynamo has frozen its ShapeEnv, which drops the guard (``ignored_backward_guard``), and its
        own guards would run the new lowering at sizes it was not made for."""
        from torch._guards import TracingContext, detect_fake_mode, tracing

        if self._kept():
            # Dynamo's symbolic inputs could not all be taken (an input of a tensor subclass: FSDP2's
            # DTensor): lowered again from fixed sizes, Dynamo's guards would run it at other sizes
            warnings.warn(f"remat_fx: graph {self.index} has dynamic shapes, and remat cannot lower it again from "
                          f"its symbolic inputs (an input that is not a plain fake tensor: a tensor subclass such "
                          f"as FSDP2's DTensor): it keeps the lowering it had (memory_budget "
                          f"{self.active.memory_budget if self.active is not None else None}) rather than one made "
                          f"for its first call's sizes (memory_budget {options.memory_budget} not applied)",
                          stacklevel=2)
            return
        shape_env = getattr(self.fake_mode, "shape_env", None)
        ignored = shape_env.counter["ignored_backward_guard"] if shape_env is not None else 0
        kept = dict(self.__dict__)
        self.gm = _copy_dynamo_graph(self.pristine)
        with tracing(TracingContext(self.fake_mode or detect_fake_mode(self.example_inputs))), \
                self.global_state.restored():
            self.compile(options, aot)
        if shape_env is not None and shape_env.counter["ignored_backward_guard"] > ignored:
            now = self.active
            self.__dict__.clear()
            self.__dict__.update(kept)
            had = self.active.memory_budget if self.active is not None else None
            warnings.warn(f"remat_fx: graph {self.index} has dynamic shapes, and lowering it again (memory_budget "
                          f"{now.memory_budget}) needed a guard on its sizes that Dynamo can no longer add (its "
                          f"ShapeEnv is frozen once the graph is compiled): it keeps the lowering it had "
                          f"(memory_budget {had}), which runs at every size Dynamo lets through", stacklevel=2)

    def _kept(self, inputs=None) -> bool:
        """A graph of dynamic shapes without Dynamo's symbolic inputs to be lowered again from (its example
        inputs, or ``inputs``): it keeps the lowering it has (relower), and its plan is its estimate under
        any options (estimate)."""
        inputs = self.example_inputs if inputs is None else inputs
        if not self.dynamic or any(_symbolic(x) for x in inputs):
            return False
        # a graph whose tensors Dynamo made of fixed sizes, dynamic by a size it passes as an int (x.expand(n,
        # ...)), is lowered again from that symbolic int (it was kept, and a step calling it twice was refused
        # a limit its plans meet: a review); not one whose tensors are of symbolic sizes (a tensor subclass's:
        # lowered from fakes of fixed sizes, it would run wrong at others)
        return self.symbolic_tensors or not any(isinstance(x, torch.SymInt) for x in inputs)

    def estimate(self, options: BackendOptions) -> Plan:
        """The plan ``options`` would give, from the joint graph alone (no lowering)."""
        from remat_fx.pareto import _tracing

        if self._kept():  # not lowered again under other options: its plan stays
            return self.plan
        if self.joint is None:  # loaded from AOTAutograd's cache: traced and partitioned again
            self.relower(self.active, aot=False)
        gm, joint_inputs, kwargs = self.joint
        with _tracing(joint_inputs), unrecorded(), sizes_at(self.planned_at):  # remat.last_plan() unchanged
            _partition.partition(gm, joint_inputs, options=options, **kwargs)
            return last_plan()

    @property
    def cost(self) -> CallCost:
        return call_cost(self.plan, self.grads)

    def saved_input_indices(self, plan: Plan, nargs: int) -> Optional[set]:
        """Which of the graph's ``nargs`` inputs (by position) ``plan`` keeps for backward; None
        where the joint graph's inputs are not the call's one for one (AOTAutograd merged duplicate
        or aliased inputs, or flattened a tensor subclass)."""
        primals = self.primals
        if primals is None or len(primals) != nargs:
            return None
        where = {name: m for m, name in enumerate(primals)}
        return {where[s.storage] for s in plan.saved if s.storage in where}

    def __call__(self, *args):
        # not a call of the step when run on fake tensors (all of them are, or none: the first
        # tells): DDPOptimizer runs each compiled submodule once while compiling, to propagate
        # shapes to the next one
        # nor when run inside a backward: torch.utils.checkpoint around a compiled block recomputes it
        # there (a new step to the record: a whole-step plan lowered the graphs again in the middle of the
        # backward, and the recompute, under the new plan, saved other tensors than the forward: a review)
        training = (self.plan is not None and torch.is_grad_enabled() and current_graph_task() == -1
                    and not isinstance(next((a for a in args if isinstance(a, torch.Tensor)), None), FakeTensor))
        if training:
            there = False
            # looked at once a step where absent (a block graph called once per layer: not at every call);
            # (and while remat.fit runs the step: a fit of the whole accumulation has its plans measured with them)
            step = STEP.number + STEP.backward_began  # the step this call is in
            if self.gradients_looked != step and (step_limit_given(self.options) == "peak_budget"
                                                  or self.fit_limit is not None or STEP.leaves is not None) and (
                    not self.accumulates or (STEP.backward_began and self.options.step_peak == "auto")):
                there = self._gradients_there(args)
                if not there:
                    self.gradients_looked = step
            STEP.enter(self, there)
            if not self.stepped:
                _hold_first_step(self)
            if STEP.leaves is not None:  # remat.fit: the step's parameters (one graph may serve several blocks)
                STEP.leaves.update((id(a), weakref.ref(a)) for a in args
                                   if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad)
        out = self.fn(*args)
        if not training and self.plan is None and current_graph_task() == -1:
            # a frozen part's graph (under torch.no_grad() too: a frozen encoder's features): what it makes, a
            # later call of the step may read
            STEP.made_without_grad(out, args)
        if training:
            call = STEP.watch(self, out, args)
            if there and not self.accumulates and call is not None:
                STEP.found_there.append((self, call))  # counted once the step's backward begins with this call alive
            if self.planned_sizes and not self.size_warned:
                self._over_planned_sizes(args)
        return out

    def _gradients_there(self, args) -> bool:
        """Whether its parameters' gradients are there when it is called (a gradient accumulation's later
        micro-batches, or ``zero_grad(set_to_none=False)``). Checked before the step is entered, until
        it has been found so in a step that reached its backward (_gradients_counted), and under
        ``peak_budget="auto"`` at each step's first call (_Step.enter: the device's reading lacks them);
        where absent, not again in that step (5 us a call over 16 parameters)."""
        if any(isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad and a.grad is not None for a in args):
            self.shards_found = False
            return True
        if self.param_ids and _distributed():
            # under FSDP2 with gradient sync they are shards on the sharded parameters, which it is not given
            from remat_fx.fsdp2 import sharded_gradients_there

            if sharded_gradients_there(args):
                self.shards_found = True
                return True
        return False

    def _gradients_counted(self) -> None:
        """Its parameters' gradients were there when a call of it began, in a step whose backward has
        begun (not a forward without one: an eval forward with grad enabled between steps, under
        ``zero_grad`` at each step's start, found the last step's gradients and was taken for an
        accumulation, a review): a whole-step byte ``peak_budget`` counts them as the step's from then
        on (:func:`accumulating`), so that the limit holds from the memory before them (the whole
        accumulation, measured from ``zero_grad(set_to_none=True)``). Planned for the steps that made
        them, a later micro-batch ran over the limit by their bytes, at every step (a review: 4.79 MB
        against a 3.77 MB limit, the gradients 1.06). The steps that call it are planned again, from the
        next one's start: the first accumulation's later micro-batches go over the limit."""
        self.accumulates = True
        if STEP.leaves is not None:
            return  # remat.fit measures the step it is given, gradients and all
        if self.fit_limit is not None:
            # its plan is a fit's, measured on a step without them (a fit of the whole accumulation finds them
            # while it measures): said once per fit (a review measured 3.33 MiB at every window against a
            # fit of one micro-batch at 3 MiB, silently)
            said = ("gradients", self.options.key(), self.fit_limit)
            if said not in STEP.fit_said:
                STEP.fit_said.add(said)
                warnings.warn(f"remat_fx: graph {self.index} finds its parameters' gradients there when it is called "
                              f"(a gradient accumulation's later micro-batches, or zero_grad(set_to_none=False)), and "
                              f"its plan is the one remat.fit measured at peak {fmt_bytes(self.fit_limit)} on a step "
                              f"without them: the steps that hold them may go over it by their bytes. Fit the whole "
                              f"accumulation: give remat.fit a step function that runs all its micro-batches, from "
                              f"zero_grad(set_to_none=True).", stacklevel=4)
            return
        self.gradients_found = True
        for sig in [sig for sig in STEP.planned if self.index in sig]:  # its record stands: only planned again
            del STEP.planned[sig]
        log.info("remat_fx: graph %d found its parameters' gradients there when it was called (a gradient "
                 "accumulation, or zero_grad(set_to_none=False)): the step's peak_budget counts them from now on, "
                 "and the step is planned again", self.index)

    def _over_planned_sizes(self, args) -> None:
        """Where a graph of dynamic sizes, planned under a byte limit at the sizes of the call that
        compiled it, is called at larger ones: what it saves grows with them, so the limit was not
        planned for this call. Under a whole-step byte limit its plans are made for sizes up to the
        next power of two from then on (at the sizes run where no plan of the step meets the limit
        there: _at_sizes_run), and the step is planned again when the next one begins (a short batch
        made Dynamo compile graphs of dynamic sizes at its size, and every full batch after it went
        33% over the limit, while the step's report estimated it under: a review); it is said each
        time they grow past them (a sequence-length warmup plans the step again a few times, not at
        every new length). Under remat.fit's limit (its plans measured at its example's sizes) it is
        said once."""
        over, grown = [], {}
        for k, (i, dim, name, size, expr) in enumerate(self.planned_sizes):
            if i >= len(args):
                continue
            arg = args[i]
            now = arg if dim is None else (arg.shape[dim] if isinstance(arg, torch.Tensor) else None)
            if not isinstance(now, int):
                continue
            if now > self.sizes_run.get(expr, 0):
                self.sizes_run[expr] = now
            if now > size:
                over.append(f"{name}: {size} -> {now}")
                grown[k] = now
        if not over:
            return
        # the user's options (a whole-step plan lowers it with the step's limits taken off); byte limits only
        self.size_warned = True  # said, or nothing to say: the sizes are not checked again
        again = False
        if self.fit_limit is not None:
            limit = f"remat.fit peak {fmt_bytes(self.fit_limit)}"
        elif step_limit_given(self.options) is not None:
            limit = _step_limits(self.options, bytes_only=True)
            if not self._kept():  # lowered again from Dynamo's symbolic inputs: at any size
                self.plan_for([(i, dim, name, 1 << (grown[k] - 1).bit_length() if k in grown else size, expr)
                               for k, (i, dim, name, size, expr) in enumerate(self.planned_sizes)])
                up_to = [f"{self.planned_sizes[k][2]}: {self.planned_sizes[k][3]}" for k in grown]
                self.size_warned = False  # said again if they grow again
                self.over = True
                STEP.forget(self)
                again = True
        else:
            return
        said = (STEP.number, ", ".join(over), limit)
        if said in _SIZES_SAID:  # another graph of the step, over by the same sizes
            return
        _SIZES_SAID.clear()
        _SIZES_SAID.add(said)
        fix = ("ake the call that compiles it (or remat.fit's example) the largest batch and sequence the job runs, or "
               "pad batches to one size (a short last batch: drop it, DataLoader(drop_last=True), or pad it; after it "
               "Dynamo compiles a graph of dynamic sizes at its size).")
        fix = f"; from now on its plans are made for sizes up to {', '.join(up_to)} (the next power of two; at the " \
              f"sizes run where the limit cannot be met there), and the step is planned again when the next one " \
              f"begins. To hold it from the first call, m{fix}" if again else f". M{fix}"
        warnings.warn(f"remat_fx: graph {self.index} has dynamic sizes and was planned at those of the call that "
                      f"compiled it; it is now called at larger ones ({', '.join(over)}). What it saves for backward "
                      f"grows with its sizes, so the step's {limit} was not planned for this call and may not "
                      f"hold{fix}", stacklevel=2)

    def plan_for(self, sizes: List[Tuple[int, Optional[int], str, int, object]]) -> None:
        """Its plans made for ``sizes`` (``planned_sizes``' form) from now on: every symbol of its inputs
        at a size (a size of several, s0 * s1, at none is read at its hint)."""
        self.planned_sizes = sizes
        self.planned_at = {expr: size for _, _, _, size, expr in sizes if getattr(expr, "is_Symbol", False)}

    @property
    def grown(self) -> bool:
        """Called at larger sizes than its plan's, and to be planned for them (_over_planned_sizes)."""
        return bool(self.planned_at) and self.over

    def __repr__(self) -> str:
        return f"CompiledGraph({self.index}, {self.key})"


class CallIO:
    """What one call of a compiled graph gave out, seen at run time: its outputs' storages (each
    once, less those of its inputs: an output aliasing an input or a parameter adds nothing), which
    later call read each as an input, and which storages were still alive when the step's backward
    began. Weak references only: it keeps no tensor alive (the plan the call ran is kept)."""

    __slots__ = ("outputs", "storage_of", "expired", "sizes", "consumers", "alive", "alive_at_own", "nargs",
                 "params", "regathered", "world", "kept_into_next", "leaves", "external", "keys", "plan", "hooked",
                 "objects", "scalar")

    def __init__(self, out, args, params: bool = False):
        tensors = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        inputs = {storage_key(a) for a in args if isinstance(a, torch.Tensor)}
        # the leaves it takes the gradients of (its parameters): a call of the same graph on the same ones
        # (a cell called in a loop, one block run twice) adds to the gradients the first backward made
        # (by the tensor: parameters that are views of one flat buffer each have a gradient of their own)
        self.leaves = tuple(id(a) for a in args if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad)
        self.outputs = [weakref.ref(t) for t in tensors]  # to know them as a later call's inputs
        # it returned a floating scalar that needs a gradient: a loss (eager code may scale it, loss / n
        # in an accumulation, or a GradScaler's loss * scale, and drop the call's own: _Step.began)
        self.scalar = any(t.requires_grad and t.numel() == 1 and t.is_floating_point() for t in tensors)
        self.storage_of: List[Optional[int]] = []  # per output: index of its storage (None: an input's)
        self.expired: List[Callable[[], bool]] = []  # per storage: whether it is gone
        self.sizes: List[int] = []
        where: Dict[int, int] = {}
        for t in tensors:
            key = storage_key(t)
            if key is None or key in inputs:  # an input's (or no storage of its own: a tensor subclass)
                self.storage_of.append(None)
                continue
            if key not in where:
                where[key] = len(self.sizes)
                self.expired.append(storage_ref(t)[1])
                self.sizes.append(int(t.untyped_storage().nbytes()))
            self.storage_of.append(where[key])
        self.keys = list(where)  # per storage, its key
        # per storage: (the later call's CallIO, input index) while the step runs; (its position
        # among the step's calls, input index) once the backward began
        self.consumers: List[list] = [[] for _ in self.sizes]
        self.alive: Optional[List[bool]] = None  # per storage, when the backward began
        self.alive_at_own: Optional[List[bool]] = None  # per storage, when this call's backward began
        # per storage, when the backward began: whether an output tensor on it was still alive itself (the
        # caller holds it), not only its storage (which the autograd graph holds where the plan saves it)
        self.objects: Optional[List[bool]] = None
        self.nargs = len(args)
        # with ``params`` (under a process group): the parameters it was given (leaves that need a
        # gradient), a storage each, with their bytes
        self.params: List[Tuple[Callable, int]] = []
        seen = set()
        for a in args if params else ():
            if isinstance(a, torch.Tensor) and a.requires_grad and a.grad_fn is None:
                key = storage_key(a)
                nbytes = int(a.untyped_storage().nbytes()) if key is not None else 0
                if nbytes and key not in seen:
                    seen.add(key)
                    self.params.append((weakref.ref(a), nbytes))
        self.regathered: Optional[int] = None  # bytes of them seen freed before its backward began
        self.world = 0  # ranks of the process group it ran under (0: none)
        self.kept_into_next = False  # some of them still unfreed once the next call's forward ran
        # its inputs made by eager code during the step (_Step.watch): (input index, bytes, storage key)
        self.external: List[Tuple[int, int, int]] = []
        self.plan: Optional[Plan] = None  # the plan its graph ran it under (_Step.watch)
        self.hooked = False  # run under saved-tensor hooks (torch.utils.checkpoint: run again in its backward)

    @property
    def param_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.params)

    def freed_params(self) -> int:
        """Bytes of its parameters whose storage is freed now (FSDP2 resharded them)."""
        total = 0
        for ref, nbytes in self.params:
            t = ref()
            if t is not None and t.untyped_storage().nbytes() == 0:
                total += nbytes
        return total

    def gathered(self) -> int:
        """Bytes of its parameters that were freed after its forward, to be gathered again for its
        backward: as seen just before its backward began, or now while that is still to come."""
        return self.regathered if self.regathered is not None else self.freed_params()

    def live(self) -> List[bool]:
        """Per output storage, whether it is alive now."""
        return [not expired() for expired in self.expired]


class _Light:
    """The record of a call of a settled graph (CompiledGraph.settled): only that it ran. A step
    of such calls is the step recorded whole before it (_Step.full): taking the record costs ~0.1
    ms per call between a step's kernels on a CPU (measured: 3.4% of the step of 4 compiled blocks
    of the example GPT, d_model 128), a cost the step's later calls need not pay."""

    __slots__ = ("__weakref__",)
    outputs: tuple = ()
    params: tuple = ()
    external: tuple = ()
    alive = alive_at_own = None


def released_bytes(calls: Sequence["CompiledGraph"], ios: Optional[Sequence[Optional[CallIO]]],
                   plan_of: Optional[Callable[["CompiledGraph"], Plan]] = None
                   ) -> Optional[Tuple[List[int], List[int]]]:
    """Per call, (bytes of its held outputs freed before the step's backward began, bytes freed
    during the later calls' backwards), together at most its estimate's ``held``. Before: output
    storages that were gone by then (nothing held them: a loss graph read them and did not keep
    them, and the user's code dropped them), unless a later call's plan from ``plan_of`` keeps the
    input they were; those live until that call's backward (where the call's inputs cannot be
    matched with its joint graph's, they are taken as kept), as do storages alive when the backward
    began and gone when the call's own backward began (a later call's graph saved them). A storage
    alive at both stays held whatever the plans (the user's code may hold it: a model's output
    object kept through ``backward()``; or its own graph saved it). None without the run-time record."""
    if ios is None or len(ios) != len(calls) or any(io is None or io.alive is None for io in ios):
        return None
    plans = ran_plans(calls, ios) if plan_of is None else [plan_of(g) for g in calls]
    saved_inputs: Dict[int, Optional[set]] = {}
    early, late = [], []
    for i, (g, io) in enumerate(zip(calls, ios)):
        freed = later = 0
        for s, size in enumerate(io.sizes):
            if io.alive[s]:
                if io.alive_at_own is not None and not io.alive_at_own[s]:
                    later += size
                continue
            kept = False
            for j, m in io.consumers[s]:
                if j not in saved_inputs:
                    saved_inputs[j] = calls[j].saved_input_indices(plans[j], ios[j].nargs)
                kept = kept or saved_inputs[j] is None or m in saved_inputs[j]
            if kept:
                later += size
            else:
                freed += size
        held = plans[i].peak.held
        early.append(min(freed, held))
        late.append(min(later, held - early[-1]))
    return early, late


class _Pending:
    """Registered as a pre-hook on the autograd node of one call's outputs: alive while that call's
    autograd graph is (its saved tensors too), and told when its backward begins."""

    __slots__ = ("io", "__weakref__")

    def __init__(self, io: "CallIO"):
        self.io = io  # weak references only

    def __call__(self, grad_outputs):
        STEP.began()
        STEP.backward_of(self.io)
        if self.io.alive is not None and self.io.alive_at_own is None:  # which outputs the later backwards freed
            self.io.alive_at_own = self.io.live()


class _Regathered:
    """A gradient hook on one call's outputs: notes which of its parameters are freed when its
    backward begins (CallIO.regathered)."""

    __slots__ = ("io",)

    def __init__(self, io: "CallIO"):
        self.io = io

    def __call__(self, _grad):
        if self.io.regathered is None:
            self.io.regathered = self.io.freed_params()


def _distributed() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - a torch built without distributed
        return False
    return dist.is_available() and dist.is_initialized()


def sharding_of(ios: Optional[Sequence[Optional[CallIO]]]) -> Optional[Sharding]:
    """The step's :class:`Sharding` from its calls' run-time records, or None where no call's
    parameters were freed between its forward and its backward (no sharding engine: DDP, one
    process), or the calls ran under no process group, or the record is missing."""
    if not ios or any(io is None for io in ios) or not all(io.world for io in ios):
        return None
    gathered = tuple(io.gathered() for io in ios)
    if not any(gathered):
        return None
    complete = all(g == io.param_bytes and not (g and io.kept_into_next) for g, io in zip(gathered, ios))
    return Sharding(gathered, max(io.world for io in ios), complete)


def _graph_node(out):
    """The autograd node of a compiled graph's outputs (past views of them), or None."""
    for t in pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
            node = t.grad_fn
            for _ in range(3):  # an aliased output's view node sits on top of the graph's own node
                if "CompiledFunction" in node.name():
                    break
                parents = [n for n, _ in node.next_functions if n is not None]
                if not parents:
                    break
                node = parents[0]
            return node if "CompiledFunction" in node.name() else t.grad_fn
    return None


class _Step:
    """The calls of the step in progress and of the last one.

    A call belongs to the step in progress while its autograd graph is alive and no backward has
    begun: a forward whose outputs were dropped without a backward (an evaluation, a test) holds no
    memory and is not part of the next step."""

    _MAX_CALLS = 4096

    def __init__(self):
        self.calls: List[Tuple[CompiledGraph, Callable, CallIO]] = []  # (graph, weak ref. to its _Pending, its I/O)
        self.last: List[CompiledGraph] = []  # the calls of the last step
        self.last_io: List[CallIO] = []  # and what they took in and gave out (_Light: see full)
        self.last_versions: tuple = ()  # the lowering of each of them that ran
        self.full: Dict[tuple, List[CallIO]] = {}  # step signature -> its calls' record, from its settling step
        self.made: Dict[int, tuple] = {}  # id of an output of this step's calls -> (its CallIO, index, weakref)
        # this step's calls' output storages -> (the CallIO of the call that made it, the storage's index there)
        self.made_at: Dict[int, Tuple["CallIO", int]] = {}
        self.backward_began = False
        self.leaves: Optional[Dict[int, weakref.ref]] = None  # while remat.fit collects them: the inputs needing grad
        self.planned: Dict[tuple, object] = {}  # step signature -> shared fraction chosen (None: kept)
        self.step_plan: Optional[StepPlan] = None  # the last whole-step plan (plan_step)
        self.step_hold: Optional[StepHold] = None  # the last fraction memory_budget's step held (hold_step)
        self.number = 0  # steps begun since the last reset (enter)
        self.truncated = False  # a step of more calls than the record keeps was warned of
        # the last step's backwards: each call's position, the lowest begun, those begun (backward_of)
        self.positions: Dict[int, int] = {}
        self.lowest: Optional[int] = None
        self.begun: set = set()
        self.order_said = False  # backwards out of order, or twice, warned of (once a STEP)
        self.fit_said: set = set()  # (the compile's options, remat.fit's limit) whose recompile was warned of
        self.auto: Dict[int, int] = {}  # step number -> peak_budget="auto" as that step read it (auto_limit)
        # output storages of graphs without a backward (a frozen part's), called with grad enabled: storage key
        # -> whether it is gone (made_without_grad); kept across a step's start, which such a call may precede
        self.made_no_grad: Dict[int, Callable[[], bool]] = {}
        # (graph, its call's weak reference) where a call of this step found its parameters' gradients there
        # (CompiledGraph._gradients_counted once the step's backward begins with the call alive)
        self.found_there: list = []
        self.options_said: set = set()  # step signatures whose graphs' differing options were warned of
        # the last step's loss made by eager code from its calls' outputs: the position of its last forward
        # call (None: a compiled graph returned the loss); and the step signatures where that was said
        self.eager_loss: Optional[int] = None
        self.eager_loss_said: set = set()

    def enter(self, graph: CompiledGraph, gradients_there: bool = False) -> None:
        """``graph`` is called in a training step: the first forward after a backward begins a new one.
        ``gradients_there``: its parameters' gradients are there (CompiledGraph._gradients_there)."""
        if self.backward_began:  # the first forward after a backward: a new step
            # a graph never called before, compiled after every graph of the last step (a recompile after
            # torch._dynamo.reset() or under other options, a new batch size, another model): the last step
            # is planned, but a limit it cannot meet is not raised into this step's first forward (it raised
            # the old compile's limit error in the new model's first forward); it is raised where that step
            # runs again. (It was not planned at all until it ran again: a job alternating two step shapes,
            # or two models, ran each shape's second step at its first calls' plans, over the limit.)
            newer = not graph.entered and all(graph.index > g.index for g in self.last)
            self.calls, self.made, self.made_at, self.backward_began = [], {}, {}, False
            self.found_there = []
            self.number += 1
            self.auto = {k: v for k, v in self.auto.items() if k >= self.number}
            if self.number not in self.auto and any(g.options.step_peak == "auto" for g in self.last):
                # at the step's start, before its first forward; with the gradients the last step left there
                # (a gradient accumulation's later micro-batch), which the step's estimate counts as its own
                # (accumulating): the device's reading lacks them (counted twice, the limit was theirs less)
                there = gradients_held(self.last) if gradients_there and accumulating(self.last) else 0
                self.auto[self.number] = auto_limit() + there
            # nor while remat.fit runs the step to collect it (it plans the step itself: a step refused
            # before, which each later step is, must not refuse the fit that measures a way out of it)
            if self.leaves is None:
                try:
                    _after_step(self.last)  # the last step planned as a whole, against this step's reading
                except (PeakInfeasible, BudgetInfeasible) as e:
                    if not newer:
                        # this step has not begun: its next first forward refuses the last one again; it ran
                        # on otherwise, every other step over a limit no plan meets, silently (a review)
                        self.backward_began = True
                        raise
                    # kept for that step (STEP.planned), and raised once it has run again
                    log.warning("remat_fx: the last step (graphs %s) has no plan within its limit; this step "
                                "calls a graph new to the job, so it is raised once that step has run again (at the "
                                "first forward after it): %s",
                                ", ".join(str(g.index) for g in dict.fromkeys(self.last)),
                                str(e).splitlines()[0])
                except BaseException:
                    self.backward_began = True  # planned at the next first forward
                    raise
            self.settle()
        graph.entered = True
        if len(self.calls) >= self._MAX_CALLS and not self.truncated:
            self.truncated = True  # said once (a STEP.reset says it again)
            warnings.warn(f"remat_fx: this step calls graphs compiled with backend='remat' more than "
                          f"{self._MAX_CALLS:,} times: its record keeps the last {self._MAX_CALLS:,} calls, so "
                          f"remat.step_report() and a whole-step limit cover those only (the estimate is under the "
                          f"step's peak). Compile a larger piece of the loop (fewer, larger graphs), or measure the "
                          f"step with remat.fit.", stacklevel=3)
        self.calls = [c for c in self.calls[-self._MAX_CALLS:] if c[1]() is not None]
        if len(self.made) > 4 * self._MAX_CALLS:  # forwards without a backward: only the calls kept
            self.made = {id(r()): (io, k, r) for _, _, io in self.calls for k, r in enumerate(io.outputs)
                         if r() is not None}

    def watch(self, graph: CompiledGraph, out, args=()) -> Optional[Callable]:
        """Record a call of ``graph`` in the step; its weak reference (alive until its backward, or until
        its outputs are dropped without one), None where it has nothing to backward."""
        node = _graph_node(out)
        if node is None:
            return None
        if graph.settled and self.leaves is None:
            io = _Light()
            pending = _Pending(io)
            node.register_prehook(pending)
            self.calls.append((graph, weakref.ref(pending), io))
            return self.calls[-1][1]
        distributed = _distributed()
        io = CallIO(out, args, params=distributed)
        io.plan, io.hooked = graph.plan, saved_tensors_hooked()
        pending = _Pending(io)
        node.register_prehook(pending)
        if distributed:
            import torch.distributed as dist

            io.world = dist.get_world_size()
            previous = self.calls[-1][2] if self.calls else None
            if previous is not None and previous.params and previous.freed_params() < previous.param_bytes:
                previous.kept_into_next = True  # not freed between the two: one FSDP unit, or kept unsharded
            outputs = [t for t in pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None]
            if io.params and outputs:
                # which parameters a sharding engine freed after the forward: looked at when the first
                # gradient of the outputs arrives, before FSDP2's own hook on them (registered after
                # this one, when the module's forward returns) gathers them again
                torch.autograd.graph.register_multi_grad_hook(outputs, _Regathered(io), mode="any")
        external = set()
        for m, a in enumerate(args):  # which earlier call's output each input is (by identity)
            found = self.made.get(id(a))
            if found is not None and found[2]() is not a:
                found = None  # another tensor's id, that one gone
            if found is None and isinstance(a, torch.Tensor) and a.grad_fn is not None and self.made_at:
                # or on the same storage, alive: an alias made between the calls, as FSDP2's pre-forward hook
                # gives each block its input (a plan keeping it keeps the earlier output's storage: taken as
                # freed before the backward, a review's FSDP2 step measured 0.75 MiB over its estimate)
                at = self.made_at.get(storage_key(a))
                if at is not None and not at[0].expired[at[1]]():
                    at[0].consumers[at[1]].append((io, m))
                    continue
            if found is not None and found[0].storage_of[found[1]] is not None:
                found[0].consumers[found[0].storage_of[found[1]]].append((io, m))
            elif found is None and isinstance(a, torch.Tensor) and (
                    (a.grad_fn is not None and not (a._base is not None and a._base.is_leaf))
                    or self._without_grad(a)):
                # made by eager code in this step (an embedding before the first graph, a head between
                # the blocks' graphs and the loss's), not a view of an earlier call's output still alive
                # (a storage's address is used again once it is freed) nor of a parameter: its bytes
                # are the step's, which no graph's estimate counts
                key = storage_key(a)
                at = self.made_at.get(key)
                if key is not None and (at is None or at[0].expired[at[1]]()) and key not in external:
                    external.add(key)
                    io.external.append((m, int(a.untyped_storage().nbytes()), key))
        for k, ref in enumerate(io.outputs):
            self.made[id(ref())] = (io, k, ref)
        self.made_at.update((key, (io, s)) for s, key in enumerate(io.keys))
        self.calls.append((graph, weakref.ref(pending), io))
        return self.calls[-1][1]

    def made_without_grad(self, out, args=()) -> None:
        """The outputs of a call of a graph without a backward (the blocks of a frozen part, before a graph
        break: nothing in it needs a gradient; one called under ``torch.no_grad()``): tensors without a
        ``grad_fn`` that a later call of the step may read and keep, which no graph's estimate counts (a
        review: a frozen prefix's output, 64 KiB, under the measured step at every step, and a byte limit
        between the two missed). Read as made by eager code in the step (``watch``) while they are alive,
        until the step's backward begins. Not an output on an input's storage (a view of the batch: made
        before the step)."""
        self.made_no_grad = {k: gone for k, gone in self.made_no_grad.items() if not gone()}
        if len(self.made_no_grad) > 4 * self._MAX_CALLS:
            return
        inputs = {storage_key(a) for a in args if isinstance(a, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is None:
                key = storage_key(t)
                if key is not None and key not in inputs:
                    self.made_no_grad[key] = storage_ref(t)[1]

    def _without_grad(self, a: torch.Tensor) -> bool:
        """Whether ``a`` (no ``grad_fn``) is an alive output of a graph without a backward (made_without_grad)."""
        if a.grad_fn is not None or not self.made_no_grad:
            return False
        gone = self.made_no_grad.get(storage_key(a))
        return gone is not None and not gone()

    def began(self) -> None:
        """A backward began: the step's forwards are the calls alive now; which of their outputs
        are still alive is noted (released_bytes)."""
        if not self.backward_began:
            live = [c for c in self.calls if c[1]() is not None]
            ran = [_ran(g, io) for g, _, io in live]
            if any(p is not None and p.rerun is not None and p.rerun.shortenable for p in ran):
                # a backward still to compile may drop reruns by what this step frees (backward_limit);
                # on the step that compiles, Dynamo's tracing leaves reference cycles holding values it
                # traced (a Hugging Face model's output object, and in it the logits the loss graph
                # read), which the steps after do not have (measured, GPT-2: 31.25 MiB of logits)
                gc.collect()
            position = {id(io): n for n, (_, _, io) in enumerate(live)}
            scalar = None  # whether a call returned a scalar needing a gradient (the loss); None: no full record
            for _, _, io in live:  # consumers as positions among the step's calls
                if isinstance(io, _Light):
                    continue
                io.alive = io.live()
                io.objects = [False] * len(io.sizes)
                scalar = scalar or io.scalar
                for ref, s in zip(io.outputs, io.storage_of):
                    if s is not None and ref() is not None:
                        io.objects[s] = True
                io.consumers = [[(position[id(later)], m) for later, m in uses if id(later) in position]
                                for uses in io.consumers]
            self.backward_began, self.last, self.last_io = True, [c[0] for c in live], [c[2] for c in live]
            # a frozen part's outputs made before this backward are the next steps' inputs made before them
            # (features computed once and read at every step), not memory of theirs
            self.made_no_grad = {}
            counted = {g.index: g for g, call in self.found_there if call() is not None and not g.accumulates}
            self.found_there = []
            for _, g in sorted(counted.items()):
                g._gradients_counted()
            self.positions, self.lowest, self.begun = position, None, set()
            self.last_versions = tuple(g.version for g in self.last)
            if scalar is not None:  # (a settled step's light record: as its settling step found)
                self._note_eager_loss(scalar)
            for g in {id(g): g for g in self.last}.values():
                g.steps += 1
                g.stepped = True

    def _note_eager_loss(self, scalar: bool) -> None:
        """Whether the step's loss is an output of one of its calls (a graph returning a scalar that
        needs a gradient), or eager code made it from their outputs: an eager LM head and loss after
        blocks compiled one by one, or ``F.cross_entropy`` on a compiled model's logits. What that code
        holds (logits, their log-softmax and gradient; the gradients of parameters no graph reads) is
        not in the step's estimate: a review measured 103.16 MiB against an estimate of 35.59 under a
        peak_budget of 90 MiB, every step, silently. Said once per step's shape under a byte limit.
        ``scalar``: whether a call of the step returned such a scalar (CallIO.scalar, at its forward:
        eager code may have scaled it and dropped it, loss / n in an accumulation)."""
        self.eager_loss = None if scalar else len(self.last) - 1
        if scalar or self.leaves is not None:
            return
        limited = [g for g in self.last if step_limit_given(g.options) == "peak_budget"]
        sig = _signature(self.last)
        if not limited or sig in self.eager_loss_said or self.planned.get(sig) == "fit" or \
                any(g.fit_limit is not None for g in self.last):
            return  # (remat.fit measures the whole step, eager code included)
        self.eager_loss_said.add(sig)
        warnings.warn(f"remat_fx: this step's loss is not an output of a graph compiled with backend='remat': eager "
                      f"code made it from call {self.eager_loss}'s outputs. What that code holds (such as a "
                      f"cross-entropy's "
                      f"log-softmax and its gradient, an eager LM head's logits, the gradients of parameters no graph "
                      f"reads) is not in the step's estimate, so the measured peak can go over its "
                      f"{_step_limits(limited[0].options, bytes_only=True)}. Compile that code with the same options "
                      f"(the loss inside the compiled module or function), or fit the measured step with "
                      f"remat.fit(step, peak=...).", stacklevel=3)

    def backward_of(self, io) -> None:
        """The backward of the step's call ``io`` begins: where that is not in the reverse order of the
        forwards (two losses backed in forward order), or a second time (a second backward() through a
        retained graph), the step holds more than its estimate counts (its model takes each backward
        once, in reverse), and a byte limit is said not to hold for it, once (a review measured 21.0 MB
        against an estimate of 15.8, and 4.93 against 3.87, silently)."""
        at = self.positions.get(id(io))
        if at is None:
            return
        again = id(io) in self.begun
        out_of_order = self.lowest is not None and at > self.lowest
        self.begun.add(id(io))
        self.lowest = at if self.lowest is None else min(self.lowest, at)
        if not (again or out_of_order) or self.order_said:
            return
        limited = [g for g in self.last if step_limit_given(g.options) is not None or g.fit_limit is not None]
        if not limited:
            return
        self.order_said = True
        g = limited[0]
        limit = f"remat.fit peak {fmt_bytes(g.fit_limit)}" if g.fit_limit is not None else \
            _step_limits(g.options, bytes_only=True)
        what = ("a second backward through the step's graphs (retain_graph: two losses backed one after the other)"
                if again else "the backwards of this step in another order than the reverse of its forwards (two "
                "losses backed in the order their forwards ran)")
        warnings.warn(f"remat_fx: {what}: the step's estimate takes each call's backward once, in reverse order, so "
                      f"the step holds more than it counts and its {limit} may not hold. Back the sum of the losses "
                      f"once (torch.autograd.backward on both), or measure the step with remat.fit.", stacklevel=2)

    def settle(self) -> None:
        """After a step (with the step's own plan done, _after_step): its graphs are settled once it
        was recorded whole, no graph of it lowered again since, none of them called for the first
        time in it (on the step that compiles, Dynamo's tracing holds values the later steps free,
        e.g. a Hugging Face model's logits), no backward of it still to compile (passes/lower.py
        asks backward_limit then) and remat.fit not collecting; the step's record is kept for its
        signature. A step that mixes a settled graph with a new one, or whose record is gone
        (reset), unsettles its graphs: the next step is recorded whole. (A backward compiled in
        such a mixed step, e.g. a graph recompiled for new shapes, has no step limit and keeps
        all its reruns: backward_limit finds no record of the step.)"""
        calls, ios = self.last, self.last_io
        if not calls or len(ios) != len(calls):
            return
        sig = _signature(calls)
        kind = self.record_kind()
        if kind != "whole":
            if kind == "mixed" or sig not in self.full:
                for g in calls:
                    g.settled = False
            return
        if self.leaves is not None or self.last_versions != tuple(g.version for g in calls) or any(
                g.steps < 2 or g.plan is None or (g.plan.rerun is not None and g.plan.rerun.shortenable)
                for g in calls):
            return
        self.full[sig] = ios
        for g in calls:
            g.settled = True

    def lowered_again(self, graphs: Sequence[CompiledGraph]) -> None:
        """``graphs`` were lowered again after the last step ran (remat.fit's choice, or the plans it
        lowered back to after a failed search): that step's record takes the plans they have now, the
        ones the next step runs, so that step_report() describes them (it gave the plan of fit's last
        measurement, budget 0's least after a fit that found nothing: a review, 36% under the step's
        estimate once lowered back)."""
        now = {g.index: g for g in graphs}
        records = [(tuple(g.index for g in self.last), self.last_io), *self.full.items()]
        for sig, ios in records:
            for index, io in zip(sig, ios):
                if index in now and not isinstance(io, _Light):
                    io.plan = now[index].plan

    def auto_limit(self) -> int:
        """``auto_limit()`` read once per step, at its start: at its first graph's compile, or at its
        first forward's call (enter) where a graph of the last step asked for "auto", before the step
        has allocated anything. Read again later in the step, the device's free memory lacks what the
        step's earlier graphs hold, which the step's limit takes off again (graph_options: each later
        graph's limit is the step's less what the calls before it hold). The last step's own plan
        (_after_step, when this one begins) takes this step's reading: after the optimizer's step,
        whose state the first step's reading did not know of. A compile after a backward, before the
        next forward's call, is the next step's."""
        number = self.number + (1 if self.backward_began else 0)
        if number not in self.auto:
            self.auto[number] = auto_limit()
        return self.auto[number]

    def record_kind(self) -> str:
        """How the last step was recorded: "whole", "light" (only its calls: settled) or "mixed"."""
        light = sum(isinstance(io, _Light) for io in self.last_io)
        return "whole" if not light else "light" if light == len(self.last_io) else "mixed"

    def _live(self) -> List[CompiledGraph]:
        return [c[0] for c in self.calls if c[1]() is not None]

    def current(self) -> List[CompiledGraph]:
        """The calls of the step in progress (its forwards so far), or a new step's (none)."""
        return [] if self.backward_began else self._live()

    def current_runs(self) -> List[Tuple[CompiledGraph, Plan]]:
        """The calls of the step in progress with a plan, each with the plan it ran under."""
        return [(g, _ran(g, io)) for g, io in self._current_ios() if g.plan is not None]

    def _current_ios(self) -> List[tuple]:
        return [] if self.backward_began else [(g, io) for g, ref, io in self.calls if ref() is not None]

    def hooked(self, graph: CompiledGraph) -> bool:
        """Whether a call of ``graph`` in the step in progress ran under saved-tensor hooks."""
        return any(g is graph and getattr(io, "hooked", False) for g, io in self._current_ios())

    def finished(self) -> List[CompiledGraph]:
        """The calls of the last step whose backward has begun."""
        return self.last

    def io_of(self, calls: Sequence[CompiledGraph]) -> Optional[List[CallIO]]:
        """The run-time record of ``calls`` if they are the last step's calls, else None."""
        if len(calls) == len(self.last) and all(a is b for a, b in zip(calls, self.last)):
            kind = self.record_kind()
            if kind == "whole":
                return self.last_io
            return self.full.get(_signature(calls)) if kind == "light" else None
        return None

    def forget(self, graph: CompiledGraph) -> None:
        """What the steps that call ``graph`` were planned and recorded at, for it is to be planned at
        larger sizes: their plans (planned again), and their run-time record at the old sizes (a settled
        step's calls record nothing of their own, and its plan read that record: a review measured 12.44
        MiB against 12 at every later step); the rest of this step's calls are recorded whole."""
        for sig in [sig for sig in self.planned if graph.index in sig]:
            del self.planned[sig]
        for sig in [sig for sig in self.full if graph.index in sig]:
            del self.full[sig]
        for g in [graph] + [c[0] for c in self.calls]:
            g.settled = False

    def reset(self) -> None:
        self.__init__()


STEP = _Step()


def backward_limit(plan: Plan) -> Optional[int]:
    """What the backward of the graph planned by ``plan`` may peak at (its estimate's measure:
    bytes above its backward's start, what its forward left included) without setting the step's
    estimated peak: the least the step's estimate can be everywhere else (every forward, every
    other graph's backward) less what the step holds beside this backward, at each call of the
    graph in the step (passes/lower.py asks when the backward is compiled, at its first call: by
    then the step's forwards and the later calls' backwards have run; an earlier call, whose
    backward has not, is taken to free all it may before it). A graph's reruns are searched alone,
    counting its forward's outputs as held through its backward; in the step a loss graph compiled
    apart frees the logits and their gradient before the model's backward runs, and its own
    backward, holding both, is the step's peak (a 12-layer GPT-2 at budget 0, hidden 128, on this
    CPU: 77 of the model graph's 122 reruns bring its backward under the loss graph's in the step's
    estimate; the other 45 copied 1,469 nodes). Under FSDP2 the step's estimate counts the
    parameters it gathers and the gradients it reduce-scatters (:class:`Sharding`). The limit is
    the least over the kinds of step one compiled backward serves (:func:`kinds_of_step`). None
    when the step is not known (no backward began, no run-time record of it), with a whole-step
    peak_budget (its plans are the step's), under a process group of two ranks or more without
    FSDP2's sharded parameters (DDP: measured on 2 CPU ranks at budget 0, the example GPT in 4
    graphs, its estimate is the measured peak, 5.02 MiB, and the limit keeps it there; but with
    ``gradient_as_bucket_view`` the limit measured 3.88 MiB against 3.75 with every rerun, a
    transient this estimate does not see), and with parameters some graph
    reads unsharded through part of the step (``reshard_after_forward=False``; the root module's,
    where the whole model is compiled under FSDP2): those are freed after their block's backward, a
    different amount at each backward, which the model does not count. (Before the sharding was
    modelled, FSDP2 on 2 CPU ranks at budget 0, benchmarks/distributed.py, measured 6.93 MiB per
    rank with reruns dropped against the 6.18 of all of them.)"""
    from remat_fx.ranks import _group

    if not STEP.backward_began:
        return None
    calls = STEP.last
    ios = STEP.io_of(calls)
    mine = [i for i, p in enumerate(ran_plans(calls, ios)) if p is plan]
    if not mine or any(g.plan is None or g.options.step_peak is not None for g in calls):
        return None
    sharding = sharding_of(ios)
    if (sharding is None and _group() is not None) or (sharding is not None and not sharding.complete):
        return None
    costs = step_costs(calls, ios)
    found = released_bytes(calls, ios)
    if found is None:
        return None
    released, later = found
    for j, io in enumerate(ios):
        if j not in mine and io.alive_at_own is None:  # its backward is still to come
            later[j] = costs[j].held - released[j]
    # the same backward serves every kind of step (DDP's gradient_as_bucket_view, its gradients there:
    # the limit counting them made measured 4.50 MiB per rank against 3.75 with every rerun; FSDP2
    # without sync, its gradients there whole: on benchmarks/distributed.py's model at budget 0 with
    # the limits of the other kinds, 5.30 MiB against 4.92)
    return min(limit_for(costs, mine, released, later, k, g) for k, g in kinds_of_step(sharding))


def limit_for(costs: Sequence[CallCost], mine: Sequence[int], released: Optional[Sequence[int]] = None,
              later: Optional[Sequence[int]] = None, sharding: Optional[Sharding] = None,
              gradients: str = "made") -> int:
    """The highest ``backward`` (a :class:`CallCost` field) the calls ``mine`` (of one graph) may
    have without raising the estimated peak of the step ``costs`` (:func:`step_peak`, with its
    ``released``, ``later``, ``sharding`` and ``gradients``) above its highest point at any other
    forward or backward."""
    at = step_peak(costs, released, later, sharding, gradients).at
    n = len(costs)
    backward = {i: n + (n - 1 - i) for i in mine}  # the backwards follow the forwards, in reverse
    others = max(a for j, a in enumerate(at) if j not in backward.values())  # the forwards at least
    return min(others - (at[k] - costs[i].backward) for i, k in backward.items())


_lower_module.backward_limit = backward_limit


# -- the whole-step limit --------------------------------------------------------------------------
def step_limit(options: BackendOptions) -> Optional[int]:
    """The whole-step byte limit of a ``peak_budget`` given as a size or ``"auto"`` (None: none, or
    a fraction, which each graph resolves against its own range on the first step)."""
    budget = options.step_peak
    if budget is None:
        return None
    if budget == "auto":
        return STEP.auto_limit()
    return budget.nbytes


_AUTO_GRANULE = 64 * 2**20  # peak_budget="auto" in whole 64 MiB (1 MiB under 1 GiB), rounded down


def auto_limit(margin: float = 0.1) -> int:
    """``peak_budget="auto"``: what the CUDA device can give the step now (free memory plus what
    PyTorch's allocator holds unused), less ``margin``, rounded down to ``_AUTO_GRANULE``: the free
    memory moves by some MiB from run to run (the CUDA context, cuBLAS's workspaces), and the limit
    is in the plan cache's key and AOTAutograd's, which would otherwise miss on every run."""
    if not torch.cuda.is_available():
        raise ValueError("remat_fx: peak_budget='auto' reads the free memory of the CUDA device, and no CUDA "
                         "device is available; give a size instead, e.g. peak_budget='2GiB'")
    free, _ = torch.cuda.mem_get_info()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    limit = int((free + cached) * (1 - margin))
    granule = _AUTO_GRANULE if limit >= 2**30 else 2**20
    return max(limit // granule * granule, 1)


def graph_options(options: BackendOptions, before: Optional[Sequence[CompiledGraph]] = None
                  ) -> Tuple[BackendOptions, bool]:
    """(options for the graph being compiled now, whether the step's limits left it less than the
    user's): a whole-step byte ``peak_budget`` less what the calls ``before`` it in this step hold
    (default: the step's calls so far), and a byte ``memory_budget`` less what they saved."""
    runs = STEP.current_runs() if before is None else [(g, g.plan) for g in before]
    changes = {}
    limit = step_limit(options)
    if limit is not None:
        changes["peak_budget"] = max(limit - _holding(runs), 1)
    budget = options.memory_budget
    if budget is not None and budget.nbytes is not None and runs:
        changes["memory_budget"] = Budget(nbytes=max(budget.nbytes - sum(p.total_bytes for _, p in runs), 0))
    shrunk = bool(runs) and bool(changes)
    return (dataclasses.replace(options, **changes) if changes else options), shrunk


def _holding(runs: Sequence[Tuple[CompiledGraph, Plan]]) -> int:
    """What calls (each with the plan it ran under) hold through the rest of the step's forwards:
    saved for their backward, and their outputs."""
    return sum(p.peak.saved + p.peak.held for _, p in runs)


def compile_graph(gm: fx.GraphModule, example_inputs, options: BackendOptions) -> CompiledGraph:
    """Lower one graph for the backend, planned for the step it is part of. Under a process group,
    a budgeted graph that one rank cannot plan fails on every rank (remat_fx/ranks.py)."""
    from remat_fx.ranks import first_compile, on_every_rank

    budgeted = any(v is not None for v in (options.memory_budget, options.peak_budget, options.peak_fraction,
                                           options.step_peak))
    first = first_compile()
    graph = on_every_rank(lambda: _compile_graph(gm, example_inputs, options), budgeted, example_inputs)
    graph.first_compile = first
    return graph


def _compile_graph(gm: fx.GraphModule, example_inputs, options: BackendOptions) -> CompiledGraph:
    from remat_fx import measured_fit as _fit

    graph = CompiledGraph(gm, example_inputs, options, graph_key(gm, example_inputs))
    cached = _fit.cached_options(graph, options)
    if cached is not None:
        graph.compile(cached)
        return graph
    fitted = next((g for g in STEP.last if g.fit_limit is not None and g.options.key() == options.key()
                   and g.param_ids & graph.param_ids), None) if torch.is_grad_enabled() else None
    if fitted is not None and not _fit.searching() and (options.key(), fitted.fit_limit) not in STEP.fit_said:
        STEP.fit_said.add((options.key(), fitted.fit_limit))  # once, not once per graph of the recompile
        # a recompile of a fitted training graph (a short batch, new sizes, a guard that failed, the model
        # compiled again with the same options): fit's choice lives on the graphs it lowered, and this one
        # takes the compile's options (silent until a review: the full batches after one short batch
        # measured 11.1 MB against a fit to 6 MB)
        warnings.warn(f"remat_fx: graph {graph.index} is compiled after remat.fit chose the plans of this compile's "
                      f"graphs (a recompile: new input sizes, a short batch, a failed guard); it takes the compile's "
                      f"own options, not the fit's, so the fit's peak {fmt_bytes(fitted.fit_limit)} is not held for "
                      f"the steps that call it. Keep batch and sequence sizes fixed (pad, or drop a short last batch: "
                      f"DataLoader(drop_last=True)), or call remat.fit again on a step of the new sizes.",
                      stacklevel=3)
    recorded = _step_cached(graph, options)
    fakes = graph._fakes(graph.example_inputs) if recorded is not None else None
    if recorded is not None and not graph._kept(fakes):
        # as the earlier process lowered it for its step (relower), from the copy of Dynamo's graph and
        # fake inputs: AOTAutograd's cache keys those apart from Dynamo's own graph module (its other
        # attributes) and the real inputs Dynamo passes (dynamic_shapes). (A graph of dynamic shapes
        # without Dynamo's symbolic inputs is compiled as at its first call, as relower keeps it.)
        graph.gm = _copy_dynamo_graph(graph.pristine)
        graph.example_inputs = fakes
        graph.compile(recorded)
        _step_notes(graph)
        return graph
    per_graph, shrunk = graph_options(options)
    if not shrunk:
        try:
            graph.compile(per_graph)
        except (PeakInfeasible, BudgetInfeasible) as e:
            if step_limit_given(options) is None:
                raise
            least = None
            if isinstance(e, PeakInfeasible) and per_graph.peak_budget is not None:
                fits, least = _fits_once_released(graph, per_graph)
                if fits:
                    return graph
            # the least it names is this graph's, at its first call: a step that calls it again, or
            # other graphs, needs more (it read as the step's least, and a limit raised to it failed
            # again on the next step); one that frees the graph's outputs before its backward, less
            released = "" if least is None or not least.held else (
                f" Its least holds its outputs ({fmt_bytes(least.held)}) through its backward: a step that frees "
                f"them first (a loss reduced from them) may peak lower, down to {fmt_bytes(least.step - least.held)} "
                f"({least.step - least.held:,} bytes) for this graph, a limit met from the second step.")
            raise _noted(e, f"That is graph {graph.index} alone, compiled at its first call, before the rest of "
                            f"the step is known: a step that calls it again, or calls other graphs, needs more."
                            f"{released} "
                            f"A first step with a {step_limit_given(options)} of 0 shows the step's least in "
                            f"remat.step_report().") from None
        return graph
    try:
        graph.compile(per_graph)
    except (PeakInfeasible, BudgetInfeasible):  # the calls before it took the step's limit
        left = [f"{what} {'nothing' if nbytes <= 1 else fmt_bytes(nbytes)}" for what, nbytes in (
            ("peak_budget", per_graph.peak_budget),
            ("memory_budget", None if per_graph.memory_budget is None else per_graph.memory_budget.nbytes))
            if nbytes is not None]
        log.warning("remat_fx: the calls before graph %d in this step leave it less than its least plan needs "
                    "(%s left); it is lowered at its least estimated peak for now (at the plan the whole limit "
                    "allows where that saves more than the whole memory_budget), and the step is planned again as "
                    "a whole once it has run", graph.index, ", ".join(left))
        # at its least peak, which goes least over the limit (planned against the whole limit, it was lowered
        # at the fastest plan that limit allows, and the first step went further over it)
        graph.gm = _copy_dynamo_graph(graph.pristine)  # as Dynamo made it: Inductor's passes rewrite what they lower
        graph.compile(shared_options(options, 0.0))
        alone, _ = graph_options(options, before=())
        budget = alone.memory_budget
        try:
            if (alone.peak_budget is not None and graph.plan.peak.step > alone.peak_budget) or \
                    (budget is not None and budget.nbytes is not None and graph.plan.total_bytes > budget.nbytes):
                graph.gm = _copy_dynamo_graph(graph.pristine)
                graph.compile(alone)  # a limit this graph alone cannot meet raises here, naming it
        except (PeakInfeasible, BudgetInfeasible) as e:
            # what it names is this graph's least alone, which the step needs more than (it read as the
            # step's: a limit raised to it failed again on the next step)
            before = STEP.current_runs()
            held = _holding(before)
            raise _noted(e, f"That is graph {graph.index} of this step alone, planned without the {len(before)} "
                            f"call(s) before it in the step, which hold {fmt_bytes(held)} through it (saved for their "
                            f"backward, and outputs): the whole step needs more. A first step with a "
                            f"{'peak_budget' if isinstance(e, PeakInfeasible) else 'memory_budget'} of 0 shows the "
                            f"step's least in remat.step_report().") from None
        graph.over = True
    return graph


_LOWERING = ("fn", "active", "plan", "joint", "grads", "primals", "gm")  # what a compile sets (a lowering)


def _take_first_back(graph: CompiledGraph) -> None:
    """The lowering of its first call again (:func:`_hold_first_step` kept it): not compiled again."""
    for k, v in graph.first.items():
        setattr(graph, k, v)
    graph.version += 1
    graph.steps, graph.settled, graph.over, graph.provisional, graph.first = 0, False, False, False, None
    record_plan(graph.plan)


def _hold_first_step(graph: CompiledGraph) -> None:
    """A graph called again in its first step, before any step that calls it has been planned (a
    block compiled alone and run once per layer, the blocks after a graph break in their loop),
    under a whole-step byte limit: it was planned at its first call for what the calls before it had
    left, as if the step ended with it, and the step may call it any number of times. Where the step
    so far, with this call and as many more as it has had (doubling: as far as the step is known, it
    calls the graph at least that often again), would go over the limit under its plan, it is
    lowered again at its least estimated peak (the step's shared budget 0) for the rest of the step,
    and the step is looked at when the next one begins (``over``): with every graph at its first
    call's plan, if that fits the step now known (the first call's lowering is kept and taken back,
    not compiled again), else planned as a whole. Before, every call ran its first call's plan: a
    graph break in a loop of 8 blocks went 2.1x over a peak_budget of 80 MiB in its first step
    (benchmarks/step.py's model, 168.50 MiB estimated; 70.31 now). What the calls before it hold
    already is not given back: a limit they have taken is met from the next step."""
    if graph.provisional or graph.over or graph.cached is not None or graph.fit_limit is not None or \
            STEP.leaves is not None or graph._kept():
        return
    # looked at where its calls in the step so far are a power of two (1, 2, 4, ...): each look covers
    # the step up to twice its calls, so the first step costs O(n log n) in its calls, not O(n^2)
    number, calls = graph.first_looks
    calls = calls + 1 if number == STEP.number else 1
    graph.first_looks = (STEP.number, calls)
    if calls < 2 or (calls - 1) & (calls - 2):
        return
    if graph.step_record is not None and graph.step_record["calls"].count(graph.key) >= calls:
        # compiled from the plan cache's record of a step that called it at least this often: that step's
        # plans for it (its record is checked once the step has run, _recorded)
        return
    options = graph.options
    limit = step_limit(options)
    budget = options.memory_budget
    saved_limit = budget.nbytes if budget is not None else None
    if limit is None and saved_limit is None:
        return
    runs = STEP.current_runs()
    times = sum(g is graph for g, _ in runs)
    if not times:  # its first call in the step: planned for what the calls before it left
        return
    if saved_tensors_hooked() or STEP.hooked(graph):
        # torch.utils.checkpoint around a call of it (this one, or one before in the step) runs it again in
        # that call's backward, which must save what its forward saved: lowered again between them, it did
        # not (a review: "A different number of tensors was saved during the original forward and
        # recomputation", every other block checkpointed)
        return
    plan = graph.plan
    over = []
    # the step so far, this call and ``times`` more, each once (their parameter gradients too: over, not under)
    ahead = [call_cost(p, g.grads) for g, p in runs] + [graph.cost] * (times + 1)
    if limit is not None and step_peak(ahead, gradients=_gradients_kind([graph])).peak > limit:
        over.append(f"peak_budget {fmt_bytes(limit)}")
    if saved_limit is not None and sum(p.total_bytes for _, p in runs) + (times + 1) * plan.total_bytes > saved_limit:
        over.append(f"memory_budget {fmt_bytes(saved_limit)}")
    if not over:
        return
    from remat_fx import measured_fit as _fit

    if _fit.searching():
        return
    least = shared_options(options, 0.0)
    graph.provisional = True  # looked at once: lowered at its least, or it is at its least already
    if graph.joint is not None and _same(graph.estimate(least), plan):
        return
    first = {k: getattr(graph, k) for k in _LOWERING}
    try:
        graph.relower(least)
    except Exception as e:  # noqa: BLE001 - the plan it has runs on (the step is planned as a whole next)
        for k, v in first.items():  # as it was, whatever the failed lowering had set
            setattr(graph, k, v)
        warnings.warn(f"remat_fx: lowering graph {graph.index} again at its least peak for the rest of its first step "
                      f"failed ({type(e).__name__}: {e}); it runs on with the plan of its first call. Please report "
                      f"this with the model.", stacklevel=3)
        return
    if graph.fn is first["fn"]:  # kept the lowering it had (relower: a graph of dynamic shapes), and said why
        return
    graph.over = graph.provisional = True
    graph.first = first
    log.info("remat_fx: graph %d is called again in its first step (call %d of it): at the plan of its first call the "
             "step would go over its %s as far as it knows, so it is lowered at its least estimated peak (%s) for the "
             "rest of this step; the step is looked at again when the next one begins",
             graph.index, times + 1, " and ".join(over), fmt_bytes(graph.plan.peak.step))


def _fits_once_released(graph: CompiledGraph, options: BackendOptions) -> Tuple[bool, Optional[PeakEstimate]]:
    """Whether a graph that cannot meet its byte ``peak_budget`` alone, at its first call, may meet it
    in its step: its plan of the least estimated peak is lowered instead, and kept (the step is
    planned as a whole once it has run, ``graph.over``) where that peak less the outputs it holds is
    within the limit. The estimate holds its outputs until its backward; a step whose code drops
    them first (a loss reduced from the model's output, whose backward frees it before the graph's)
    peaks lower, as its record shows once it has run (``released_bytes``). Else the graph is
    lowered back as it was and False. With it, the least plan's estimated peak (None: none found)."""
    graph.gm = _copy_dynamo_graph(graph.pristine)  # as Dynamo made it: the failed lowering may have begun
    least = dataclasses.replace(options, peak_budget=None, peak_fraction=0.0)
    try:
        graph.compile(least)
    except (PeakInfeasible, BudgetInfeasible):
        fits, peak = False, None
    else:
        peak = graph.plan.peak
        fits = peak.step - peak.held <= options.peak_budget
    if fits:
        graph.over = True
        log.warning("remat_fx: graph %d alone cannot meet peak_budget %s at its first call (its least estimated "
                    "peak is %s, holding its outputs, %s, through its backward); it is lowered at that least peak "
                    "for now, and the step is planned as a whole once it has run: the limit holds from the next "
                    "step where the step frees those outputs first", graph.index, fmt_bytes(options.peak_budget),
                    fmt_bytes(graph.plan.peak.step), fmt_bytes(graph.plan.peak.held))
        return True, peak
    graph.gm = _copy_dynamo_graph(graph.pristine)
    return False, peak


def _noted(error: Exception, note: str) -> Exception:
    """``error`` again, of its type (a RematError: its message is its one argument), with ``note`` on a
    line of its own after its message."""
    return type(error)(f"{error}\n{note}")


def _signature(calls: Sequence[CompiledGraph]) -> tuple:
    return tuple(g.index for g in calls)


def calls_of(calls: int, graphs: int) -> str:
    """'3 calls of 2 compiled graphs', '1 call of 1 compiled graph': a step's size as messages say it."""
    return f"{calls} call{'' if calls == 1 else 's'} of {graphs} compiled graph{'' if graphs == 1 else 's'}"


# -- a step's own plan in the plan cache (remat_fx/plan_cache.py step_record) ----------------------
# the notes hold_step writes on a plan it takes, which its graph's own record (written when it was
# lowered) may lack: set again on the plan a later process compiles from the step's record
_HELD_NOTES = plan_cache.REPORT_NOTES + ("step_held",)


def _plans_steps(options: BackendOptions) -> bool:
    """Whether a step of graphs compiled with ``options`` may be planned as a whole once it has run
    (_after_step): a whole-step limit, a fraction peak_budget, or a fraction memory_budget with its
    envelope (hold_step)."""
    budget = options.memory_budget
    return options.step_peak is not None or (budget is not None and budget.nbytes is not None) or \
        (budget is not None and budget.fraction is not None and options.peak_slack > 0)


def _step_record_path(graph: CompiledGraph, options: BackendOptions):
    """Where the plan cache keeps the record of ``graph``'s step, or None where it keeps none (the
    cache off, remat.fit searching, no step plan for these options). peak_budget="auto" is keyed by
    the limit as the graph's compile read it (the step's plan reads it again after the optimizer's
    first step, which a later process's first compile does not see; its record is checked against
    the limit of the step it runs in)."""
    from remat_fx import measured_fit as _fit

    if not _plans_steps(options) or not plan_cache.enabled(options) or _fit.searching():
        return None
    limit = None  # the others: in the options
    if options.step_peak == "auto":
        if graph.auto_read is None:
            graph.auto_read = step_limit(options)
        limit = graph.auto_read
    return plan_cache.step_record(graph.key, options, graph.global_state, limit)


def _step_cached(graph: CompiledGraph, options: BackendOptions) -> Optional[BackendOptions]:
    """The options ``graph``'s step gave it when that step was planned as a whole (an earlier
    process, or this one before a torch._dynamo.reset(): the plan cache's step record), where they
    are not ``options`` themselves; else None. A graph found in a record keeps it (``step_record``):
    the step takes the record's decision once it has run, if it is the step recorded (_recorded)."""
    path = _step_record_path(graph, options)
    record = plan_cache.load_step(path) if path is not None else None
    if record is None or graph.key not in record["choice"]:
        return None
    graph.step_record = record
    choice = record["choice"][graph.key]
    if choice == "own" or not (choice is None or isinstance(choice, float)):
        return None
    log.info("remat_fx: graph %d is compiled as its step was planned when first run (shared memory_budget %s, "
             "the step's record in the plan cache)", graph.index, _shared(choice))
    return shared_options(options, choice)


def _step_notes(graph: CompiledGraph) -> None:
    """The notes a step's hold wrote on the plan ``graph`` took (its report as the user's budget)."""
    notes = graph.step_record["notes"].get(graph.key) if graph.step_record is not None else None
    if notes and graph.plan is not None and graph.plan.budget is not None:
        for k, v in notes.items():
            if k in _HELD_NOTES:
                setattr(graph.plan.budget, k, v)


def _keep_step(calls: Sequence[CompiledGraph], kind: str, choice: Dict[CompiledGraph, object], step: dict) -> None:
    """Writes the step's decision (``choice``: graph -> the shared budget it was lowered with, or "own":
    as at its first call) to the plan cache, under each of its graphs, for the next process. A graph
    that kept the lowering it had (relower refused: dynamic shapes) is recorded as it is ("own")."""
    graphs = list(dict.fromkeys(calls))
    paths = [_step_record_path(g, g.options) for g in graphs]
    if any(p is None for p in paths) or any(g.plan is None or g.active is None for g in graphs):
        return
    choice = {g: c if c == "own" or g.active.key() == shared_options(g.options, c).key() else "own"
              for g, c in choice.items()}
    by_key: Dict[str, object] = {}
    for g in graphs:
        if by_key.setdefault(g.key, choice[g]) != choice[g]:
            return  # two graphs of the same code and inputs planned apart: the record could not tell them apart
    notes = {g.key: {k: getattr(g.plan.budget, k) for k in _HELD_NOTES}
             for g in graphs if kind == "hold" and choice[g] != "own" and g.plan.budget is not None}
    plan_cache.save_step(paths, {"kind": kind, "calls": [g.key for g in calls], "choice": by_key,
                                 "plans": {g.key: g.plan.total_bytes for g in graphs}, "notes": notes,
                                 "step": step})


def _recorded(calls: Sequence[CompiledGraph], kind: str):
    """What the plan cache's record of this step decided (a StepPlan for ``kind`` "plan", a StepHold
    for "hold"), where every graph of it was compiled from one record of that kind of these very
    calls and has the plan the record has (saved bytes); else None (planned here)."""
    graphs = list(dict.fromkeys(calls))
    record = graphs[0].step_record
    if record is None or record["kind"] != kind or any(g.step_record != record for g in graphs[1:]) or \
            record["calls"] != [g.key for g in calls]:
        return None
    differs = [g for g in graphs if g.plan is None or record["plans"].get(g.key) != g.plan.total_bytes]
    if differs:
        # lowered again in this process since they were compiled from it (a step planned again: the gradients
        # of an accumulation found there), or compiled to other plans from it (another machine or cost model)
        log.log(logging.DEBUG if any(g.version > 1 for g in differs) else logging.INFO,
                "remat_fx: the plan cache's record of this step does not give graph(s) %s the plans it recorded "
                "(another machine or cost model): the step is planned again", ", ".join(str(g.index) for g in differs))
        return None
    try:
        if kind == "plan":
            return StepPlan.from_record(record["step"])
        taken = {g.index: record["choice"][g.key] for g in graphs if record["choice"][g.key] != "own"}
        return StepHold.from_record(record["step"], taken, _signature(calls))
    except (KeyError, TypeError, ValueError, AttributeError):  # a record this code did not write
        log.info("remat_fx: the plan cache's record of this step is unreadable: the step is planned again")
        return None


def step_limit_given(options: BackendOptions) -> Optional[str]:
    """Which byte limit a step of ``options`` has: 'peak_budget' (a size or "auto"), 'memory_budget'
    (a size), or None (none, or fractions only)."""
    if options.step_peak is not None and (options.step_peak == "auto" or options.step_peak.nbytes is not None):
        return "peak_budget"
    if options.memory_budget is not None and options.memory_budget.nbytes is not None:
        return "memory_budget"
    return None


def _step_limits(options: BackendOptions, bytes_only: bool = False) -> str:
    """The whole-step limits among ``options``, as a user wrote them ('' if none); ``bytes_only``: not a
    fraction peak_budget."""
    said = []
    if options.step_peak is not None and not (bytes_only and options.step_peak != "auto"
                                              and options.step_peak.nbytes is None):
        said.append(f"peak_budget {options.step_peak}")
    if options.memory_budget is not None and options.memory_budget.nbytes is not None:
        said.append(f"memory_budget {fmt_bytes(options.memory_budget.nbytes)}")
    return ", ".join(said)


def _after_step(calls: List[CompiledGraph]) -> None:
    """Once a step of several calls has run: plan it again as a whole if it has a whole-step limit
    (a byte peak_budget or memory_budget) it is estimated to exceed, or a fraction peak_budget to
    resolve on the whole step's range (its first graphs were planned before the later ones were
    known); a step of one call where its graph was lowered at its least peak at its first call for a
    byte limit it missed alone (``_fits_once_released``): planned now, on the step's record."""
    # a step of one call compiled from a step record of a plan: through the ranks' exchange as where it
    # was planned (the graph over its limit then), so that every rank makes the same exchanges
    if any(g.plan is None for g in calls):
        return
    if len(calls) < 2 and not any(g.over or g.gradients_found or (g.step_record or {}).get("kind") == "plan"
                                  for g in calls):
        # planned at its compile, where the step is the graph: but for what the step gives it that its
        # compile did not see (an input made in the step that it keeps through its backward, a frozen
        # prefix's output: 11.36 MB measured against a peak_budget of 11.1 at every step, a review), planned
        # as a whole once, where its estimate is over a byte peak_budget
        # (not under a process group: each rank's own estimate would decide whether it joins the ranks' exchange)
        if not calls or step_limit_given(calls[0].options) != "peak_budget" or _signature(calls) in STEP.planned \
                or _distributed():
            return
        if step_estimate(calls) <= step_limit(calls[0].options):
            STEP.planned[_signature(calls)] = None  # looked at once (again where its graph finds gradients there)
            return
    sig = _signature(calls)
    if sig in STEP.planned:
        failed = STEP.planned[sig]
        if isinstance(failed, (PeakInfeasible, BudgetInfeasible)):
            # raised again at every step of this shape: run on, it went over the limit silently (a review)
            raise type(failed)(*failed.args)
        return
    opts = calls[0].options
    if calls is STEP.last and STEP.record_kind() != "whole" and any(g.grown for g in calls):
        # a graph called at larger sizes than its plan's in a step recorded without what its calls held
        # (settled: their record is the old sizes', dropped): its graphs unsettled, the next step is
        # recorded whole and planned at the new sizes (planned on this one, without the inputs eager code
        # made at them, a review measured 12.44 MiB against 12 at every later step)
        return
    found = [g for g in dict.fromkeys(calls) if g.gradients_found]  # counting the gradients there from now on
    for g in found:
        g.gradients_found = False
    if calls is STEP.last and STEP.record_kind() == "mixed" and step_limit_given(opts) is None:
        # a new graph among settled ones: STEP.settle has the next step recorded whole, and planned
        # there. A byte limit is planned now, on an estimate without what the record lacks (outputs
        # freed before their own call's backward): over, not under. It went over one step more:
        # planned only when the step after had been recorded whole.
        return
    if any(g.options.key() != opts.key() for g in calls):
        # graphs of other models or options: not one step's to plan; said once where any asked for a
        # whole-step limit, which is then not held (it was silent: the model's peak_budget, the loss
        # compiled apart without one, and the step's estimate 49% over the limit its report printed)
        STEP.planned[sig] = None
        for g in dict.fromkeys(calls):  # a graph lowered at its least in its first step keeps it (no step's plan)
            g.over, g.first = False, None
        limited = {g.index: _step_limits(g.options) for g in calls}
        if any(limited.values()) and sig not in STEP.options_said:
            # once (looked at again where a graph of it finds gradients there: a step without zero_grad)
            STEP.options_said.add(sig)
            warnings.warn(
                "remat_fx: the graphs of this step were compiled with different options ("
                + "; ".join(f"graph {i}: {text or 'no whole-step limit'}" for i, text in limited.items())
                + "): a whole-step limit is planned for a step whose graphs share their options, so this one is "
                "not held for the step (each graph was planned against what the graphs before it left, at their "
                "first call only; one called again in the first step, at its least peak from the call where the "
                "step would have gone over). Compile every graph of the step with the same options (the loss too).",
                stacklevel=2)
        return
    STEP.planned[sig] = None
    budget = opts.memory_budget
    saved_limit = budget.nbytes if budget is not None else None
    if opts.step_peak is None and saved_limit is None:
        # no whole-step limit: a fraction memory_budget's plans are held under the larger budgets' on
        # the step's estimate where a graph runs more than once a step (each graph's envelope compares
        # its own peak alone, not what the step holds of it once per call); under monotone="grid",
        # wherever the step has several calls
        if budget is not None and budget.fraction is not None and opts.peak_slack > 0 and \
                (len(set(calls)) < len(calls) or opts.monotone == "grid"):
            recorded = _recorded(calls, "hold")
            if recorded is not None:
                _held(recorded)  # held when this step was first planned: its graphs were compiled so
                return
            try:
                hold_step(calls)
            except KeyboardInterrupt:
                STEP.planned.pop(sig, None)  # interrupted: held at the next step
                raise
            except Exception as e:  # noqa: BLE001 - the plans the step has run are kept, and said so
                # not raised into the user's forward at every step (each rank decides alone: a rank that
                # raised would leave the others waiting in their collectives)
                warnings.warn(f"remat_fx: holding this step's memory_budget {budget.fraction:g} under the larger "
                              f"budgets' on its whole-step estimate failed ({type(e).__name__}: {e}); the step keeps "
                              f"the plans it ran, each held under the larger budgets' on its own estimate. Please "
                              f"report this with the model.", stacklevel=2)
        return
    from remat_fx.ranks import plan_on_every_rank

    # every rank of a process group, planning or not: one that finds no plan fails them all
    try:
        planned = plan_on_every_rank(lambda: _plan_if_needed(calls, opts, saved_limit, bool(found)),
                                     all(g.first_compile for g in calls))
    except (PeakInfeasible, BudgetInfeasible) as e:
        STEP.planned[sig] = type(e)(*e.args)  # no plan for this step: said at each step of it, not searched again
        raise
    except BaseException:
        STEP.planned.pop(sig, None)  # interrupted (Ctrl-C, an error lowering again): planned at the next step
        raise
    # kept for the next process once every rank has planned its step (a rank that failed fails them all)
    if isinstance(planned, StepPlan) and not planned.from_cache:
        _keep_step(calls, "plan", {g: planned.fraction for g in calls}, planned.record())
    elif isinstance(planned, StepKept):
        # a graph lowered again in its first step and taken back, or kept at its least: the next process
        # lowers each graph at its first call as this step runs it (it lowered them again in its first
        # step, and took them back, at every start of the job)
        _keep_step(calls, "kept", planned.choice, planned.record())


def _plan_if_needed(calls: List[CompiledGraph], opts: BackendOptions, saved_limit: Optional[int],
                    found: bool = False) -> Optional[Union["StepPlan", "StepKept"]]:
    """The step planned as a whole where it needs it (its StepPlan); a StepKept where it keeps the
    plans it runs, after a graph was lowered again in its first step; else None. ``found``: a graph of
    it has just found its parameters' gradients there (CompiledGraph._gradients_there)."""
    limit = step_limit(opts)
    # a graph of it to be planned at larger sizes than its plan's (_over_planned_sizes): its plan and the
    # record's are estimates at the old sizes
    grown = any(g.grown for g in calls)
    recorded = _recorded(calls, "plan") if not grown else None
    if recorded is not None:
        # planned so when this step was first planned, and its graphs were compiled so: a byte limit is
        # checked on this step's estimate (planned again if over it), a fraction taken as it was resolved
        fits = limit is None or step_estimate(calls) <= limit
        if fits and (saved_limit is None or sum(g.plan.total_bytes for g in calls) <= saved_limit):
            STEP.planned[_signature(calls)] = recorded.fraction
            recorded.calls = _signature(calls)
            STEP.step_plan = recorded
            log.info("remat_fx: step planned as a whole as its record in the plan cache says: shared memory_budget "
                     "%s, estimated peak %s, saved %s", _shared(recorded.fraction), fmt_bytes(recorded.estimate),
                     fmt_bytes(recorded.saved))
            return recorded
    if limit is None and opts.step_peak is not None:
        return plan_step(calls, fraction=opts.step_peak.fraction, saved_limit=saved_limit)
    estimated = step_estimate(calls)
    saved = sum(p.total_bytes for p in ran_plans(calls, STEP.io_of(calls)))
    exceeded = (limit is not None and estimated > limit) or (saved_limit is not None and saved > saved_limit)
    if exceeded and found:
        # said: its plans were made for steps that make the gradients (its first, or every step before)
        log.warning("remat_fx: the graphs of this step (%s) find their parameters' "
                    "gradients there when they are called (a gradient accumulation's later micro-batches, or "
                    "zero_grad(set_to_none=False)); its peak_budget %s counts them (%s) as the step's, and with them "
                    "its estimated peak is %s: it is planned again counting them",
                    calls_of(len(calls), len(set(calls))), fmt_bytes(limit), fmt_bytes(gradients_held(calls)),
                    fmt_bytes(estimated))
    elif exceeded:
        # said: its graphs were each planned at their first call, before the step was known (a graph
        # called again, graphs compiled before later ones), and the step went over (it was silent
        # where no graph had been planned over what the calls before it left)
        log.warning("remat_fx: the step just run (%s) went over its %s (estimated step "
                    "peak %s, saved for backward %s): %s; it is planned as a whole now, "
                    "for the limit to hold from the next step",
                    calls_of(len(calls), len(set(calls))),
                    " and ".join(w for w in (limit is not None and estimated > limit
                                             and f"peak_budget {fmt_bytes(limit)}",
                                             saved_limit is not None and saved > saved_limit
                                             and f"memory_budget {fmt_bytes(saved_limit)}") if w),
                    fmt_bytes(estimated), fmt_bytes(saved),
                    "its graphs were planned one by one as they were first called, before the step was known"
                    if len(calls) > 1 else
                    "its graph was planned when it was compiled, before the step was known: without what the step "
                    "holds besides it (outputs your code keeps through the backward, inputs made in the step)")
    switched = [g for g in dict.fromkeys(calls) if g.provisional and g.first is not None]
    if switched and not exceeded and not any(g.over for g in calls if g not in switched):
        # a graph lowered at its least peak in the middle of its first step, as far as the step was known
        # then: where the step, now known, fits with every call at the plan of its graph's first call, it
        # runs that lowering again (kept), as before the step was looked at in its first step (which saw a
        # graph break in a loop of 8 blocks 2.1x over the limit it holds now)
        at_first = lambda g: g.first["plan"] if g in switched else g.plan  # noqa: E731
        peak = step_estimate(calls, at_first)
        if (limit is None or peak <= limit) and \
                (saved_limit is None or sum(at_first(g).total_bytes for g in calls) <= saved_limit):
            for g in switched:
                _take_first_back(g)
            log.info("remat_fx: the step fits its %s with every graph at the plan of its first call (estimated "
                     "peak %s): graph(s) %s, lowered at their least for the rest of the first step, run their first "
                     "call's lowering again", _step_limits(opts), fmt_bytes(peak),
                     ", ".join(str(g.index) for g in switched))
            return StepKept(_as_lowered(calls), peak)
    if not (exceeded or found or any(g.over for g in calls)):
        # (with the gradients just found there: planned on the step's estimate that counts them, from the top of
        # the grid, where the plans it runs were made for a limit read without them, under "auto": lower)
        return None
    try:
        return plan_step(calls, limit=limit, saved_limit=saved_limit)
    except (PeakInfeasible, BudgetInfeasible):
        # planned for sizes rounded up past those its calls ran: halfway down to them, then at them (raised
        # where those are not met either)
        for between in (0.5, 0.0) if grown else ():
            if not _at_sizes_run(calls, between):
                continue
            log.info("remat_fx: no plan of the step meets its %s at the sizes it was to be planned for; it is "
                     "planned at %s", _step_limits(opts), "sizes halfway down to those its calls ran" if between
                     else "the sizes its calls ran")
            try:
                return plan_step(calls, limit=limit, saved_limit=saved_limit)
            except (PeakInfeasible, BudgetInfeasible):
                if not between:
                    raise
        # a step within its limit as it ran, planned again because a graph was lowered at its least peak
        # in its first step (_hold_first_step, or at its compile: what the calls before it left was too
        # little): no shared budget meets the limit (the graphs' first-call plans, each for what the
        # calls before it left, are finer than the grid's), and the plans it runs now, each call at its
        # graph's current plan, do (a graph called again runs its least at every call): kept (the first
        # step went under the limit, and the second raised it)
        peak = step_estimate(calls, lambda g: g.plan)  # each call at its graph's current plan
        # (not a graph grown past its plan's sizes: that plan's estimate is at the old ones, under the step's;
        # kept, a review measured 6.32 MiB against 5 at every later step, the report saying 3.97)
        if grown or exceeded or (limit is not None and peak > limit) or \
                (saved_limit is not None and sum(g.plan.total_bytes for g in calls) > saved_limit):
            raise
    for g in calls:
        g.over, g.first = False, None
    log.info("remat_fx: no shared memory budget holds the step within its %s; the plans its graphs run now do "
             "(estimated step peak %s), and are kept", _step_limits(opts), fmt_bytes(peak))
    return StepKept(_as_lowered(calls), peak)


def _at_sizes_run(calls: Sequence[CompiledGraph], between: float = 0.0) -> bool:
    """The graphs of a step to be planned for sizes rounded up past those their calls ran
    (_over_planned_sizes) planned for sizes ``between`` of the way from those run up to them (0: at
    those run; else rounded up to a multiple of 8 over 8, where that is strictly between); whether any
    was."""
    def at(size: int, run: int) -> int:
        if not between:
            return run
        mid = run + int(between * (size - run))
        mid = -(-mid // 8) * 8 if mid > 8 else mid
        return mid if run < mid < size else size  # none strictly between: as it is (the next try is at those run)

    changed = False
    for g in dict.fromkeys(calls):
        if not g.grown:
            continue
        run = [(i, dim, name, at(size, g.sizes_run.get(expr, size)) if size > g.sizes_run.get(expr, size) else size,
                expr) for i, dim, name, size, expr in g.planned_sizes]
        if run != g.planned_sizes:
            g.plan_for(run)
            changed = True
    return changed


def _as_lowered(calls: Sequence[CompiledGraph]) -> Dict[CompiledGraph, object]:
    """How each graph of a step is lowered now, as its step record gives it to the next process: at the
    step's shared budget 0 (lowered at its least in its first step, or at its compile for what the calls
    before it left), or "own" (as at its first call)."""
    return {g: 0.0 if g.active is not None and g.active.key() == shared_options(g.options, 0.0).key() else "own"
            for g in calls}


@dataclass
class StepKept:
    """A step that keeps the plans its graphs run, planned with no shared budget (_plan_if_needed: the
    first calls' lowerings taken back, or no shared budget fits and those it runs do): the choice its
    record gives the next process's graphs at their first call, so that it does not lower them again
    in its first step (each graph: 0.0, the step's shared budget 0, or "own")."""

    choice: Dict[CompiledGraph, object]
    estimate: int

    def record(self) -> dict:
        return {"estimate": self.estimate}


@dataclass
class StepPlan:
    """The shared memory budget a whole step was planned with, and its estimates."""

    fraction: Optional[float]  # the shared memory_budget (None: the user's, or none)
    estimate: int  # the whole-step estimated peak with it
    saved: int  # the whole step's saved bytes with it
    limit: Optional[int]
    tried: Dict[Optional[float], Tuple[int, int]] = field(default_factory=dict)  # fraction -> (peak, saved)
    seconds: float = 0.0
    from_cache: bool = False  # read from the plan cache's step record, not searched
    calls: tuple = ()  # the step's signature (graph index per call) it was planned for; not in the record

    def record(self) -> dict:
        """As the plan cache's step record keeps it (JSON: the fractions tried as a list)."""
        return {"fraction": self.fraction, "estimate": self.estimate, "saved": self.saved, "limit": self.limit,
                "tried": [[f, peak, saved] for f, (peak, saved) in self.tried.items()]}

    @classmethod
    def from_record(cls, step: dict) -> "StepPlan":
        return cls(step["fraction"], step["estimate"], step["saved"], step["limit"],
                   {f: (peak, saved) for f, peak, saved in step["tried"]}, from_cache=True)


def shared_options(options: BackendOptions, fraction: Optional[float]) -> BackendOptions:
    """``options`` with one shared memory budget for every graph of the step (None: the user's
    memory budget if it is a fraction, else none) and the whole-step limits taken off; at 0, the
    least peak each graph's reruns find (option ``least_peak``)."""
    if fraction is not None:
        budget = Budget(fraction=fraction)
    else:
        user = options.memory_budget
        budget = user if user is not None and user.nbytes is None else None
    # the shared budget 0 is the step's least peak (the low end of a whole-step limit), whatever its time
    return dataclasses.replace(options, memory_budget=budget, peak_budget=None, peak_fraction=None, step_peak=None,
                               least_peak=fraction == 0.0)


def _kept_said(calls: Sequence[CompiledGraph]) -> str:
    """Where the caller held the calls' outputs through the step's backward (their tensors alive when it
    began: CallIO.objects), beyond 1 MiB: what the step's estimate counts for them, and how to free them (a
    review: a Hugging Face loop's `out` kept 7.91 MiB of outputs, and the error said only to raise the
    limit, which `loss = model(...).loss` met by 1.6 MiB)."""
    ios = STEP.io_of(calls)
    if ios is None or len(ios) != len(calls):
        return ""
    kept = sum(n for io in ios if io is not None and getattr(io, "objects", None)
               for n, live in zip(io.sizes, io.objects) if live)
    if kept <= 2**20:
        return ""
    return (f"; or let go of the outputs the step's calls returned, {fmt_bytes(kept)} that your code held through "
            f"the backward (such as a Hugging Face ModelOutput kept by `out = model(...); out.loss.backward()`: "
            f"take `loss = model(...).loss`), which every plan counts")


def candidates(options: BackendOptions) -> List[Optional[float]]:
    """The shared budgets a step may be planned with: ``GRID``, under the user's memory budget
    fraction if there is one (its 0 included: the least peak)."""
    user = options.memory_budget
    if user is None or user.nbytes is not None:
        return list(GRID)
    # 0.0 also under a user's budget 0: the least peak, which the user's own (held) budget 0 is not
    return [None] + [f for f in GRID[1:] if f < user.fraction or f == 0.0]


def estimate_curve(calls: Sequence[CompiledGraph], fractions: Optional[Sequence] = None,
                   stop: Optional[Callable[[int, int], bool]] = None) -> Dict:
    """{shared memory budget: (whole-step estimated peak, whole-step saved bytes)}, re-partitioning
    each graph's joint graph (no lowering); stops after the first for which ``stop(peak, saved)``."""
    graphs = list(dict.fromkeys(calls))
    curve: Dict[Optional[float], Tuple[int, int]] = {}
    for f in candidates(calls[0].options) if fractions is None else fractions:
        t0 = time.perf_counter()
        saved, plans = {}, {}
        for g in graphs:
            plan = plans[g] = g.estimate(shared_options(g.options, f))
            saved[g] = plan.total_bytes
        curve[f] = (step_estimate(calls, plans.__getitem__), sum(saved[g] for g in calls))
        log.info("remat_fx: step of %s, shared memory_budget %s: estimated peak %s, saved %s "
                 "(%.1f s)", calls_of(len(calls), len(graphs)), "-" if f is None else f"{f:g}", fmt_bytes(curve[f][0]),
                 fmt_bytes(curve[f][1]), time.perf_counter() - t0)
        if stop is not None and stop(*curve[f]):
            break
    return curve


def _shared(fraction: Optional[float]) -> str:
    """A shared memory budget of the step's plan as the messages name it (None: none shared)."""
    return "none" if fraction is None else f"{fraction:g}"


def plan_step(calls: List[CompiledGraph], limit: Optional[int] = None, fraction: Optional[float] = None,
              saved_limit: Optional[int] = None) -> StepPlan:
    """Plan every graph of a step with one shared memory budget: the largest of ``candidates``
    whose whole-step estimated peak is at most ``limit`` (for a ``fraction``: at most the least
    estimate plus that fraction of the way to the largest budget's) and whose whole-step saved bytes
    are at most ``saved_limit``, and lower them again. The candidates are walked from the top and
    the first that fits is taken, so a smaller limit never gets a higher estimate."""
    t0 = time.perf_counter()
    if fraction is not None:
        curve = estimate_curve(calls)
        top = next(iter(curve.values()))[0]
        low = min(peak for peak, _ in curve.values())
        limit = low + int(fraction * max(top - low, 0))

    def fits(peak, saved):
        return (limit is None or peak <= limit) and (saved_limit is None or saved <= saved_limit)

    if fraction is None:
        curve = estimate_curve(calls, stop=fits)
    fitting = [f for f, (peak, saved) in curve.items() if fits(peak, saved)]
    what = " and ".join(w for w in (limit is not None and f"peak_budget {fmt_bytes(limit)} ({limit:,} bytes)",
                                     saved_limit is not None and f"memory_budget {fmt_bytes(saved_limit)}") if w)
    least = min(curve, key=lambda f: (curve[f][1], curve[f][0]))
    if not fitting and saved_limit is not None and curve[least][1] > saved_limit:
        # the user's memory budget is below the step's least saved bytes (with a peak_budget too: it
        # was said to be the peak that no plan met, naming a peak far under the peak_budget)
        raise BudgetInfeasible(
            f"remat_fx: memory_budget {fmt_bytes(saved_limit)} ({saved_limit:,} bytes) for the whole step "
            f"({calls_of(len(calls), len(set(calls)))}) is below its feasible minimum: every plan "
            f"found saves at least {fmt_bytes(curve[least][1])} ({curve[least][1]:,} bytes), with every graph at "
            f"memory_budget {_shared(least)}. Raise the budget to at least "
            f"{curve[least][1]:,} bytes, or shrink the step (batch, sequence length).")
    if not fitting:
        within = [f for f in curve if saved_limit is None or curve[f][1] <= saved_limit]
        best = min(within, key=lambda f: curve[f])
        among = "" if saved_limit is None else f" that saves at most {fmt_bytes(saved_limit)}"
        raise PeakInfeasible(
            f"remat_fx: {what} for the whole step ({calls_of(len(calls), len(set(calls)))}) is "
            f"below every plan found{among}: the lowest estimated step peak is {fmt_bytes(curve[best][0])} "
            f"({curve[best][0]:,} bytes), saving {fmt_bytes(curve[best][1])}, with every graph at memory_budget "
            f"{_shared(best)}"
            + (f" (with the parameter gradients, {fmt_bytes(gradients_held(calls))}, counted from the step's start: "
               f"its graphs have found them there when called, as in a gradient accumulation's later "
               f"micro-batches or after zero_grad(set_to_none=False), and the limit counts them from then on, for "
               f"this compile)" if accumulating(calls) else "")
            + ". Raise the limit, or shrink the step (batch, sequence length)"
            + _kept_said(calls) + ".")
    chosen = fitting[0]
    for g in dict.fromkeys(calls):
        g.relower(shared_options(g.options, chosen))
        g.over = False
    result = StepPlan(chosen, curve[chosen][0], curve[chosen][1], limit, curve, time.perf_counter() - t0,
                      calls=_signature(calls))
    STEP.planned[_signature(calls)] = chosen
    STEP.step_plan = result
    log.info("remat_fx: step planned as a whole (%s): shared memory_budget %s, estimated peak %s, saved %s (%.1f s)",
             what, "-" if chosen is None else f"{chosen:g}", fmt_bytes(result.estimate), fmt_bytes(result.saved),
             result.seconds)
    return result


# shared memory budgets (fractions) a fraction memory_budget's step is held under, nearest above it first
LEVELS: Tuple[float, ...] = tuple(sorted({1.0 if f is None else f for f in GRID}))


@dataclass
class StepHold:
    """How a fraction memory_budget's step was held under the larger budgets' (:func:`hold_step`)."""

    budget: float  # the user's memory_budget
    estimate: int  # the step's estimated peak with each graph's own plan at the budget
    bound: int  # the least estimated step peak of the larger budgets checked
    levels: Dict[float, int]  # larger budget -> the step's estimated peak with every graph at it
    taken: Dict[int, float]  # graph index -> the budget whose plan it took (within its own saved bytes)
    held: int  # the step's estimated peak after (estimate where nothing was taken)
    seconds: float = 0.0
    calls: Tuple[int, ...] = ()  # the step's calls (graph indices): the step it was held for
    from_cache: bool = False  # read from the plan cache's step record, not searched

    def record(self) -> dict:
        """As the plan cache's step record keeps it (JSON: the levels as a list; what each graph took is
        the record's choice)."""
        return {"budget": self.budget, "estimate": self.estimate, "bound": self.bound,
                "levels": [[x, p] for x, p in self.levels.items()], "held": self.held}

    @classmethod
    def from_record(cls, step: dict, taken: Dict[int, float], calls: Tuple[int, ...]) -> "StepHold":
        return cls(step["budget"], step["estimate"], step["bound"], {x: p for x, p in step["levels"]}, taken,
                   step["held"], 0.0, calls, from_cache=True)

    def __str__(self) -> str:
        text = self._text()
        return text + " (read from the plan cache: held when this step was first planned)" if self.from_cache else text

    def _text(self) -> str:
        if not self.levels:
            return f"memory_budget {self.budget:g}: no larger budget to hold the step's estimate under; kept"
        levels = ", ".join(f"{f:g}: {fmt_bytes(p)}" for f, p in sorted(self.levels.items(), reverse=True))
        text = (f"memory_budget {self.budget:g} held on the step's estimate: its graphs' own plans "
                f"{fmt_bytes(self.estimate)}, the larger budgets' {fmt_bytes(self.bound)} (as each holds its own; "
                f"the step with every graph at {levels})")
        if not self.taken:
            return text + "; kept"
        taken = ", ".join(f"graph {i}: budget {f:g}'s plan" for i, f in sorted(self.taken.items()))
        return (text + f"; took {taken} (each within its own saved bytes at {self.budget:g}): "
                f"{fmt_bytes(self.held)}{'' if self.held <= self.bound else ', as near as it could get'}")


def hold_step(calls: List[CompiledGraph]) -> Optional[StepHold]:
    """A fraction memory_budget's step of several calls (a graph called once per block, the loss
    compiled apart), once it has run: its estimated peak must not rise over the larger budgets'.
    Each graph's own envelope (passes/peak.py monotone_peak) compares the graph's own peak, but a
    plan with a lower peak of its own that saves more is held by the step under every later call,
    once per call of its graph (a block graph called 6 times: the measured step peak 6.09 MB at
    0.9, 6.41 at 0.8; 3.01 at 0.5, 3.92 at 0.4).

    The same envelope on the step's estimate, over the shared budgets of ``LEVELS``: the budget's
    step (each graph's own plan) is held under the step with every graph at the nearest larger
    budget, itself held so in turn, as many levels up as option monotone says ('auto': 2, on up
    while a level peaks over the next or the top, and the top checked; 'grid': all). Where it
    estimates over that bound, each graph takes the plan of a larger budget checked that saves
    within its own saved-bytes target (the budget holds), or of a budget under its own (walked down
    to the first that meets the bound; at 0, the least peak: the user's 0 is held in per-layer
    checkpointing's time, then as long as it takes to hold its peak under the larger budgets'): the
    fastest step that meets the bound, else the lowest; the graphs whose plan changes are lowered
    again. One partition of each graph per budget checked, once per step (its signature); None where
    no graph has a budget to hold."""
    from remat_fx.options import monotone_extends, monotone_levels

    t0 = time.perf_counter()
    opts = calls[0].options
    f = opts.memory_budget.fraction
    graphs = [g for g in dict.fromkeys(calls)
              if g.plan is not None and g.plan.budget is not None and g.plan.budget.solver != "none" and not g._kept()]
    if not graphs:
        return None
    own = {g: g.plan for g in calls}
    # a graph lowered with another budget's plan from a step record that this step is not (another loss,
    # another call order): its own plan is its plan under its own options, lowered back where kept
    moved = [g for g in graphs if g.active is not None and g.active.key() != g.options.key()]
    for g in moved:
        own[g] = g.estimate(g.options)
    extend = monotone_extends(opts.monotone)
    plans: Dict[float, Dict[CompiledGraph, Plan]] = {}
    origin: Dict[int, float] = {}  # id of a plan -> the shared budget it was made at
    raw: Dict[float, int] = {}  # shared budget -> the step's estimate with every graph at it
    held: Dict[Tuple[float, Optional[int]], Tuple[int, Dict[CompiledGraph, Plan]]] = {}

    def step_of(chosen: Dict[CompiledGraph, Plan]) -> int:
        return step_estimate(calls, lambda g: chosen.get(g, own[g]))

    def plans_at(level: float) -> Dict[CompiledGraph, Plan]:
        if level not in plans:
            plans[level] = {g: g.estimate(shared_options(g.options, level)) for g in graphs}
            origin.update((id(p), level) for p in plans[level].values())
        return plans[level]

    def raw_at(level: float) -> int:
        if level not in raw:
            raw[level] = step_of(plans_at(level))
        return raw[level]

    def envelope(level: float, start: Dict[CompiledGraph, Plan], depth: Optional[int]):
        """(the step's estimate, the plans) at ``level`` (``start``: its own plans), held ``depth``
        levels up (None: all)."""
        estimate = step_of(start)
        above = [x for x in LEVELS if x > level]
        if depth == 0 or not above:
            return estimate, start, None
        near, deeper = above[0], None if depth is None else depth - 1
        if extend and deeper == 0 and len(above) > 1 and raw_at(near) > min(raw_at(above[1]), raw_at(above[-1])):
            deeper = 1  # a bump: its own envelope holds it lower
        if (near, deeper) not in held:
            held[near, deeper] = envelope(near, plans_at(near), deeper)[:2]
        bound = held[near, deeper][0]
        if extend:
            bound = min(bound, raw_at(above[-1]))  # the top: saving the most can peak lowest
        if estimate <= bound:
            return estimate, start, bound
        targets = {g: start[g].budget.target for g in graphs}
        tried = [{**start, **{g: p for g, p in plans[x].items() if p.total_bytes <= targets[g]}}
                 for x in above if x in plans]
        # under the budget every plan fits it; at 0, the least peak
        for x in [x for x in reversed(LEVELS) if x < level] or ([0.0] if level == 0.0 else []):
            tried.append({**start, **plans_at(x)})
            if step_of(tried[-1]) <= bound:
                break
        scored = [(step_of(c), sum(c.get(g, own[g]).step_cost_s for g in calls), c) for c in tried]
        meet = [x for x in scored if x[0] <= bound]
        # the fastest step that meets the bound, else the lowest
        best = min(meet, key=lambda x: (x[1], x[0])) if meet else min(scored, key=lambda x: x[:2], default=None)
        if best is None or best[0] >= estimate:
            return estimate, start, bound
        return best[0], best[2], bound

    if 0.0 < f and f in LEVELS:  # its plans at the shared budget are its own
        plans[f] = {g: own[g] for g in graphs}
    estimate = step_of(own)
    depth = monotone_levels(opts.monotone)
    if f == 0.0 and depth is not None:
        depth += 1  # budget 0's bound: budget 0.05's step as it holds it (passes/peak.py monotone_peak)
    result, chosen, bound = envelope(f, dict(own), depth)
    levels = {x: p for x, p in raw.items() if x > f}
    changed = {g: origin[id(p)] for g, p in chosen.items() if g in own and not _same(p, own[g])}
    for g in moved:
        if g not in changed:
            g.relower(g.options)
    taken = {}
    for g, level in changed.items():
        report = g.plan.budget
        g.relower(shared_options(g.options, level))
        picked = g.plan.budget
        if not _same(g.plan, chosen[g]):
            # relower kept the lowering it had (a graph of dynamic shapes: CompiledGraph.relower warns)
            # or planned otherwise: not taken, and its report left as it is
            continue
        taken[g.index] = level
        if picked is not None:  # re-reported as the user's budget, held on the step's estimate
            picked.budget, picked.target, picked.lowered_to = report.budget, report.target, None
            picked.held_under, picked.held_by, picked.held_met, picked.held_levels = None, "", True, None
            picked.fastest_peak = report.fastest_peak or own[g].peak.step
            picked.fastest_step_s = report.fastest_step_s or own[g].step_cost_s
            picked.step_held = (f"budget {level:g}'s plan, which saves within this budget, holds the step's "
                                f"estimated peak at {fmt_bytes(result)} (its own plan: {fmt_bytes(estimate)}; the "
                                f"larger budgets': {fmt_bytes(bound)})")
    if len(taken) < len(changed) or moved:
        result = step_of({g: g.plan for g in graphs})  # what the step runs now
    held_step = StepHold(f, estimate, estimate if bound is None else bound, levels, taken, result,
                         time.perf_counter() - t0, _signature(calls))
    _keep_step(calls, "hold", {g: taken.get(g.index, "own") for g in calls}, held_step.record())
    return _held(held_step)


def _same(a: Plan, b: Plan) -> bool:
    """Two plans of one graph that save and rerun the same (lowering one for the other changes nothing)."""
    return ([x.name for x in a.saved] == [x.name for x in b.saved] and a.peak.step == b.peak.step
            and (a.rerun.names if a.rerun else None) == (b.rerun.names if b.rerun else None))


def _held(result: StepHold) -> StepHold:
    STEP.step_hold = result
    log.info("remat_fx: %s (%.1f s)", result, result.seconds)
    return result


# -- the report ------------------------------------------------------------------------------------
@dataclass
class StepReport:
    """The compiled graphs of the last training step, in call order, with their estimates."""

    calls: List[Tuple[int, Plan, CallCost]]  # (graph index, its plan, what the call adds)
    peak: Optional[StepPeak]
    limit: Optional[int] = None
    # per call, bytes of its held outputs that were dead when the backward began (released_bytes)
    released: Optional[List[int]] = None
    # per call, bytes of its held outputs freed during the later calls' backwards, before its own
    later: Optional[List[int]] = None
    sharding: Optional[Sharding] = None  # FSDP2's gathered parameters per call (None: no sharding seen)
    held: Optional[StepHold] = None  # a fraction memory_budget held on this step's estimate (hold_step)
    # bytes of the parameter gradients the step's estimate counts from its start, found there before it
    # (accumulating: a gradient accumulation's later micro-batches); 0: made by the step
    gradients_there: int = 0
    # the position of the call from whose outputs eager code made the loss (None: a graph returned it)
    eager_loss: Optional[int] = None
    fit_limit: Optional[int] = None  # the peak remat.fit planned the step's graphs under (it replaces ``limit``)
    # a fraction peak_budget: (the fraction, None) where each graph resolved it on its own range; else
    # (the fraction, (the bytes it resolved to, the step's least estimated peak, its peak without a
    # budget)), the two last None where its one graph resolved it without a range
    fraction: Optional[Tuple[float, Optional[Tuple[int, Optional[int], Optional[int]]]]] = None
    # the fraction's range is its one graph's own estimates, which hold the graph's outputs through its
    # backward (a step that frees them first peaks under that range's least)
    fraction_by_graph: bool = False

    @property
    def graphs(self) -> Dict[int, Plan]:
        """Each graph of the step, with the plan of its last call in it (a graph lowered again in the
        middle of its first step ran another before)."""
        return {i: plan for i, plan, _ in self.calls}

    @property
    def saved_bytes(self) -> int:
        """Bytes saved for backward by all the step's calls together (alive at the end of the forwards)."""
        return sum(c.saved for _, _, c in self.calls)

    def __str__(self) -> str:
        if not self.calls:
            return "remat step: no training step has run a graph compiled with backend='remat'"
        p = self.peak
        counted = sum(plan.total_bytes for _, plan, _ in self.calls)  # what a byte memory_budget counts
        lines = [f"remat step: {calls_of(len(self.calls), len(self.graphs))}; estimated step peak "
                 f"{fmt_bytes(p.peak)} (at the {p.phase} of call {p.call}), saved for backward {fmt_bytes(self.saved_bytes)}"
                 + ("" if counted == self.saved_bytes else
                    f" ({fmt_bytes(counted)} with the inputs saved, as a byte memory_budget counts them)")
                 + ("" if self.limit is None or self.fit_limit is not None else
                    f"; peak_budget {fmt_bytes(self.limit)}")
                 + ("" if self.fraction is None or self.fit_limit is not None else
                    _fraction_said(*self.fraction, by_graph=self.fraction_by_graph))
                 + ("" if self.fit_limit is None else
                    f"; planned by remat.fit to a measured peak of {fmt_bytes(self.fit_limit)}"
                    + ("" if self.limit is None else
                       f" (in place of the compile's peak_budget {fmt_bytes(self.limit)})"))
                 + ("" if not self.gradients_there else
                    f"; the compiled graphs' parameter gradients, {fmt_bytes(self.gradients_there)}, counted from the "
                    f"step's start (found there before it: a gradient accumulation)"),
                 f"  {'call':>4s} {'graph':>5s} {'saved':>12s} {'held':>12s} {'freed':>12s} {'freed later':>12s} {'fw peak':>12s} "
                 f"{'bw peak':>12s} {'grads':>12s} {'step at fw':>12s} {'step at bw':>12s}  budget"]
        if self.held is not None:
            lines.insert(1, f"  {self.held}")
        if self.eager_loss is not None:
            lines.insert(1, f"  not counted: the eager code that made the loss from call {self.eager_loss}'s outputs "
                            f"(such as a cross-entropy's log-softmax and its gradient, an eager head's logits, the "
                            f"gradients of parameters no graph reads); compile it with the same options to count it, "
                            f"or measure the step with remat.fit")
        if self.sharding is not None:
            gathered = ", ".join(fmt_bytes(g) for g in self.sharding.gathered)
            lines.insert(1, f"  sharded parameters (FSDP2): gathered per call {gathered}"
                            f"; gradients reduce-scattered over {self.sharding.world} ranks"
                            + ("" if self.sharding.complete else "; some parameters stayed gathered past their "
                               "graph (reshard_after_forward=False, or one FSDP unit over several graphs): not "
                               "counted, and every rerun kept"))
        n = len(self.calls)
        for k, (i, plan, c) in enumerate(self.calls):
            budget = "-" if plan.budget is None else plan.budget.budget
            freed = "-" if self.released is None else fmt_bytes(self.released[k])
            later = "-" if self.later is None else fmt_bytes(self.later[k])
            lines.append(f"  {k:>4d} {i:>5d} {fmt_bytes(c.saved):>12s} {fmt_bytes(c.held):>12s} {freed:>12s} {later:>12s} "
                         f"{fmt_bytes(c.forward):>12s} {fmt_bytes(c.backward):>12s} {fmt_bytes(c.grads):>12s} "
                         f"{fmt_bytes(p.at[k]):>12s} {fmt_bytes(p.at[2 * n - 1 - k]):>12s}  {budget}")
        return "\n".join(lines)


def _fraction_said(fraction: float, resolved: Optional[Tuple[int, Optional[int], Optional[int]]],
                   by_graph: bool = False) -> str:
    """A fraction peak_budget in the step report's first line: the bytes the step resolved it to."""
    if resolved is None:
        return (f"; peak_budget {fraction:g} (a fraction: each graph resolved it on its own range, see "
                f"remat.last_plan(); the step's own is resolved once a step of several graphs has run)")
    limit, least, top = resolved
    if least is None:
        return f"; peak_budget {fraction:g}: {fmt_bytes(limit)}, as its graph resolved it (remat.last_plan())"
    if by_graph:  # a review: "the step's least estimated peak, 217.38 KiB" beside a step estimated at 209.38
        return (f"; peak_budget {fraction:g}: {fmt_bytes(limit)} ({fraction:g} of the way from its graph's least "
                f"estimated peak, {fmt_bytes(least)}, to its peak without a budget, {fmt_bytes(top)}: the graph's "
                f"own estimates, which hold its outputs through its backward)")
    return (f"; peak_budget {fraction:g}: {fmt_bytes(limit)} ({fraction:g} of the way from the step's least "
            f"estimated peak, {fmt_bytes(least)}, to its peak without a budget, {fmt_bytes(top)})")


def _fraction_resolved(calls: Sequence[CompiledGraph]):
    """StepReport.fraction of the step of ``calls`` (its fraction peak_budget, and the bytes it was
    resolved to: by the step's whole-step plan where that is this step's, else by its one graph), and
    StepReport.fraction_by_graph (its one graph resolved it on the graph's own range)."""
    peak = calls[0].options.step_peak if calls else None
    if peak is None or peak == "auto" or peak.nbytes is not None:
        return None, False
    plan = STEP.step_plan
    if plan is not None and plan.calls == _signature(calls) and plan.limit is not None and plan.tried:
        peaks = [p for p, _ in plan.tried.values()]
        return (peak.fraction, (plan.limit, min(peaks), peaks[0])), False
    plan = calls[0].plan
    if len(set(calls)) == 1 and plan is not None and plan.peak_budget is not None and plan.peak_fraction is not None:
        return (peak.fraction, (plan.peak_budget, *(plan.peak_span or (None, None)))), plan.peak_span is not None
    return (peak.fraction, None), False


def step_report() -> StepReport:
    """Every compiled graph of the last training step (the step in progress once its backward has
    begun), with saved bytes and estimated peaks per call, and the estimated peak of the whole step."""
    calls = [g for g in STEP.finished() if g.plan is not None]
    ios = STEP.io_of(calls)
    costs = step_costs(calls, ios)
    limit = step_limit(calls[0].options) if calls and calls[0].options.step_peak not in (None, "auto") else None
    released, later = _released(calls)
    sharding = _sharding(calls)
    held = STEP.step_hold if STEP.step_hold is not None and STEP.step_hold.calls == _signature(calls) else None
    kind = _gradients_kind(calls)
    return StepReport([(g.index, p, c) for g, p, c in zip(calls, ran_plans(calls, ios), costs)],
                      step_peak(costs, released, later, sharding, gradients=kind) if calls else None, limit, released,
                      later, sharding, held,
                      grads_found(costs, sharding, kind == "held") if kind.startswith("held") else 0,
                      STEP.eager_loss if calls and STEP.eager_loss is not None and STEP.eager_loss < len(calls)
                      else None,
                      calls[0].fit_limit if calls else None, *_fraction_resolved(calls))


def step_estimate(calls: Sequence[CompiledGraph], plan_of: Optional[Callable[[CompiledGraph], Plan]] = None) -> int:
    """The last step's ``calls`` estimated peak under ``plan_of`` (candidate plans; by default the ones
    the calls ran), with what its run-time record saw freed and gathered, and the parameter gradients
    there before it where its graphs find them so (:func:`accumulating`)."""
    return step_peak(step_costs(calls, STEP.io_of(calls), plan_of), *_released(calls, plan_of), _sharding(calls),
                     gradients=_gradients_kind(calls)).peak


def accumulating(calls: Sequence[CompiledGraph]) -> bool:
    """Whether a graph of ``calls`` has found its parameters' gradients there when it was called, under a
    whole-step byte peak_budget (a gradient accumulation's later micro-batches, or
    ``zero_grad(set_to_none=False)``): the step's estimate counts them from the step's start (step_peak's
    ``"held"``), so that its limit holds over the whole accumulation, from the memory before them. A step
    that makes them (its first micro-batch) peaks no higher (the estimate is at or above it)."""
    return any(g.accumulates for g in calls)


def _gradients_kind(calls: Sequence[CompiledGraph]) -> str:
    if not accumulating(calls):
        return "made"
    return "held shards" if all(g.shards_found for g in calls if g.accumulates) else "held"


def gradients_held(calls: Sequence[CompiledGraph]) -> int:
    """Bytes of the parameter gradients :func:`accumulating` steps of ``calls`` find there at their start
    (each counted once; under FSDP2 whole: :func:`grads_found`)."""
    return grads_found(step_costs(calls, STEP.io_of(calls)), _sharding(calls), _gradients_kind(calls) != "held shards")


def _released(calls: Sequence[CompiledGraph], plan_of: Optional[Callable[[CompiledGraph], Plan]] = None):
    """released_bytes of the last step's ``calls`` under their plans (``plan_of``: candidate plans; by
    default the ones they ran):
    (before the backwards, during the later backwards), or (None, None)."""
    found = released_bytes(calls, STEP.io_of(calls), plan_of)
    return (None, None) if found is None else found


def _sharding(calls: Sequence[CompiledGraph]) -> Optional[Sharding]:
    """The last step's :class:`Sharding` if ``calls`` are its calls, else None."""
    return sharding_of(STEP.io_of(calls))
