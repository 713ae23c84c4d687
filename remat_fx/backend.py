"""The ``remat`` torch.compile backend: capture -> tag -> partition -> lower, one pass a file.

    torch.compile(model, backend="remat", options={"save": ["*.qkv"], "lower": "eager"})

Registered under the ``torch_dynamo_backends`` entry point, so ``backend="remat"``
works without importing remat_fx first.
"""
from __future__ import annotations

from remat_fx.options import parse_options
from remat_fx.step import compile_graph


def backend(gm, example_inputs, options=None):
    """A torch.compile backend; ``options`` as in :func:`remat_fx.options.parse_options`. Each graph
    is planned as part of its training step (remat_fx/step.py)."""
    return compile_graph(gm, example_inputs, parse_options(options))
