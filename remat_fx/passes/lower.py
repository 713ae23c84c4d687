"""Lower: compile the partitioned graphs.

``inductor``: Inductor's ``compile_fx`` (C++ on CPU, Triton on CUDA), with our
partition plugged in as its custom partitioner, so Inductor's own joint-graph
passes, decompositions and fw/bw compilers all run as usual.
``eager``: AOTAutograd with the same decompositions, running the partitioned FX
graphs op by op.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import pathlib
import re

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from remat_fx.options import BackendOptions
from remat_fx.passes.capture import decompositions
from remat_fx.passes.partition import partition
from remat_fx.passes.plan import input_names

_SOURCES = sorted((pathlib.Path(__file__).resolve().parents[1]).rglob("*.py"))


class RematPartitioner(CustomPartitionerFn):
    """Our partition as Inductor's ``custom_partitioner_fn``."""

    def __init__(self, options: BackendOptions):
        self.options = options

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.pop("compiler", None)
        return partition(gm, joint_inputs, options=self.options, **kwargs)

    def uuid(self):
        digest = hashlib.sha256(repr(self.options.key()).encode())
        for path in _SOURCES:
            digest.update(path.read_bytes())
        return digest.hexdigest()


def _run_eagerly(gm, example_inputs):
    """Run the FX graph op by op, taking its inputs as a boxed list it clears after unpacking, so
    each input (a saved activation, in backward) is freed after its last use, as Inductor's code does."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()

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
    each other and with their readers. Everything else is asked of the choices in effect."""

    _NEAR = 8  # scheduler positions: a fusion this close moves nothing far

    def __init__(self, prior):
        self._prior = prior
        self._reruns = {}  # id(scheduler) -> sorted (scheduler position, rerun number) of the copies

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
        return self._prior.can_fuse(scheduler, node1, node2, shared_data_score)


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


def _compile_keeping_reruns_late(*args, keep_peak: bool = False, **kwargs):
    """Inductor's compile of one graph (forward, or the backward: compiled lazily, at its first
    call), with the fusion choices of _KeepRerunsLate. ``keep_peak`` (a memory or peak budget was
    given): without Inductor's buffer reuse, which keeps a dead buffer alive for a later one of its
    size whenever that stays under Inductor's own estimate of the peak, not ours (measured on the
    example GPT at budget 0: a 3 MiB buffer held across the backward's peak, 27.1 -> 31.0 MiB)."""
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    with V.set_choices_handler(_KeepRerunsLate(V.choices)), \
            config.patch(allow_buffer_reuse=config.allow_buffer_reuse and not keep_peak):
        return compile_fx_inner(*args, **kwargs)


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


def lower(gm, example_inputs, options: BackendOptions):
    with input_names(_input_names(gm)):
        return _lower(gm, example_inputs, options)


def _lower(gm, example_inputs, options: BackendOptions):
    if options.lower == "inductor":
        from torch._inductor.compile_fx import compile_fx

        # AOTAutograd's cache would skip our partition on a hit, and with it the Plan:
        # Inductor's own kernel cache still applies
        with torch._functorch.config.patch(enable_autograd_cache=False):
            keep_peak = options.memory_budget is not None or options.peak_budget is not None \
                or options.peak_fraction is not None
            return compile_fx(gm, example_inputs,
                              inner_compile=functools.partial(_compile_keeping_reruns_late, keep_peak=keep_peak),
                              config_patches={"custom_partitioner_fn": RematPartitioner(options)})
    backend = aot_autograd(
        fw_compiler=_run_eagerly, bw_compiler=_run_eagerly, decompositions=decompositions(),
        partition_fn=functools.partial(partition, options=options), keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)
