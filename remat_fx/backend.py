"""The ``remat`` torch.compile backend: capture -> tag -> partition -> lower, one pass a file.

    torch.compile(model, backend="remat", options={"save": ["*.qkv"], "lower": "eager"})

Registered under the ``torch_dynamo_backends`` entry point, so ``backend="remat"``
works without importing remat_fx first.
"""
from __future__ import annotations

from remat_fx.options import parse_options
from remat_fx.passes.lower import lower


def backend(gm, example_inputs, options=None):
    """A torch.compile backend; ``options`` as in :func:`remat_fx.options.parse_options`."""
    return lower(gm, example_inputs, parse_options(options))
