"""Lower: compile the partitioned graphs.

``inductor``: Inductor's ``compile_fx`` (C++ on CPU, Triton on CUDA), with our
partition plugged in as its custom partitioner, so Inductor's own joint-graph
passes, decompositions and fw/bw compilers all run as usual.
``eager``: AOTAutograd with the same decompositions, running the partitioned FX
graphs op by op.
"""
from __future__ import annotations

import functools
import hashlib
import pathlib

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from remat_fx.options import BackendOptions
from remat_fx.passes.capture import decompositions
from remat_fx.passes.partition import partition

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


def lower(gm, example_inputs, options: BackendOptions):
    if options.lower == "inductor":
        from torch._inductor.compile_fx import compile_fx

        # AOTAutograd's cache would skip our partition on a hit, and with it the Plan:
        # Inductor's own kernel cache still applies
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs,
                              config_patches={"custom_partitioner_fn": RematPartitioner(options)})
    backend = aot_autograd(
        fw_compiler=_run_eagerly, bw_compiler=_run_eagerly, decompositions=decompositions(),
        partition_fn=functools.partial(partition, options=options), keep_inference_input_mutations=True,
    )
    return backend(gm, example_inputs)
