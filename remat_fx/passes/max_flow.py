"""The max-flow under PyTorch's min-cut: networkx's Boykov-Kolmogorov instead of its default.

``torch._functorch.partitioners.solve_min_cut`` builds a networkx graph of the joint graph and calls
``networkx.minimum_cut`` on it, whose default max-flow is preflow-push. Boykov-Kolmogorov, also
networkx's, finds the same cut faster on these graphs (the min-cuts of one planning, measured
2026-12-02: a 2-layer GPT at budget 0.2, 8 graphs, 0.265 s -> 0.078 s; a 2-layer Hugging Face
GPT-2 at budget 0, 11 graphs, 0.345 -> 0.221 s; the 8-layer Llama of benchmarks/llama_depth.py at
budget 0, 14 graphs, 1.61 -> 0.87 s). The cut is the same whatever the max-flow: the
capacities are integers (bytes; infinite ones become one large integer in the residual network),
so every algorithm reaches an exact maximum flow, and ``minimum_cut``'s sink side (the nodes that
reach the sink in the residual graph) is the same for every maximum flow.

``boykov_kolmogorov_flow`` puts it in place for the length of remat's partition: the function
``networkx.minimum_cut`` is swapped by name for the process while the block runs (networkx is
what PyTorch's partitioner imports at each call), with ``flow_func`` given where the caller gave
none, and put back after. ``tests/test_compile.py`` checks that the partitioner reaches it (torch
2.13 here; 2.14 in CI's selection) and that the plans are those of the default flow.
"""
from __future__ import annotations

import contextlib
import functools


@contextlib.contextmanager
def boykov_kolmogorov_flow():
    """``networkx.minimum_cut`` uses Boykov-Kolmogorov's max-flow until the block ends."""
    try:
        import networkx
        from networkx.algorithms.flow import boykov_kolmogorov
    except ImportError:  # pragma: no cover - PyTorch's min-cut needs networkx
        yield
        return
    real = networkx.minimum_cut

    @functools.wraps(real)
    def minimum_cut(flowG, _s, _t, capacity="capacity", flow_func=None, **kwargs):
        return real(flowG, _s, _t, capacity=capacity, flow_func=flow_func or boykov_kolmogorov, **kwargs)

    networkx.minimum_cut = minimum_cut
    try:
        yield
    finally:
        networkx.minimum_cut = real
