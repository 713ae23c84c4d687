"""PyTorch's min-cut extracts two graphs twice over: remat's partition serves the repeats.

Each ``min_cut_rematerialization_partition`` call extracts graphs out of the joint graph
(``torch._functorch.partitioners._extract_graph_with_inputs_outputs``: a copy of every op that
depends only on the given inputs, then dead-code elimination) four times: the forward alone (in
``classify_nodes``, which reads only its nodes' names), the backward, the forward with the saved
values, and the backward again (``_extract_fwd_bwd_modules``: the first backward only tells which
saved values it reads; the second is asked with the same inputs whenever none went unread). A
planning makes up to ten min-cuts of one joint graph (budget 0 on the 8-layer Llama of
benchmarks/planning.py: 40 extractions, about 2.3 s of its 13, 19 of them repeats).

``extracted_once`` serves, for the length of remat's partition, the two repeats with the graph
already made:

* the second backward of a min-cut, with the first one's graph (same joint graph, same inputs and
  outputs in the same order, nothing changed in between: checked node by node), once; the first
  was read, not changed, and not kept;
* the forward alone of each later min-cut of the same joint graph, with the first one's, to
  ``classify_nodes`` only (which reads the names of its nodes), while the joint graph's nodes,
  their inputs and their partitioner tags are those it was made from.

Anything else is extracted by PyTorch's function as always. Like passes/engine_order.py's
reordering, PyTorch's private functions are swapped by name for the process while the block runs
and put back after; a torch without them is left as it is. ``tests/test_compile.py`` checks every
served graph against a fresh extraction on the installed torch (2.13; 2.14 in CI's selection,
whose functions call the extraction in the same pattern).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Dict, Optional

import torch.fx as fx


def _structure(graph: fx.Graph) -> tuple:
    """What an extraction of ``graph`` reads, node by node: the node, its inputs, its tag."""
    return tuple((n, n.args, tuple(n.kwargs.items()), n.meta.get("partitioner_tag")) for n in graph.nodes)


class _Served:
    """The extractions of one partition, and what was served (``served``: the calls answered from
    the memo, by kind)."""

    def __init__(self, real: Callable):
        self.real = real
        self.signature = inspect.signature(real)
        self.backward: Dict[tuple, tuple] = {}  # this min-cut's backwards: key -> (graph, structures)
        self.forward_only: Optional[tuple] = None  # (key, graph, structure of the joint graph)
        self.in_classify = False
        self.served = {"backward": 0, "forward_only": 0}

    def key(self, args, kwargs) -> Optional[tuple]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError:
            return None
        bound.apply_defaults()
        values = dict(bound.arguments)
        joint, inputs, outputs = (values.pop(name, None) for name in ("joint_graph", "inputs", "outputs"))
        if not isinstance(joint, fx.Graph) or inputs is None or outputs is None:
            return None
        rest = tuple(sorted((name, tuple(v) if isinstance(v, list) else v) for name, v in values.items()))
        key = (joint, tuple(inputs), tuple(outputs), rest)
        try:
            hash(key)
        except TypeError:  # an argument that cannot be compared so: not served
            return None
        return key

    def extract(self, *args, **kwargs):
        key = self.key(args, kwargs)
        if key is None:
            return self.real(*args, **kwargs)
        subgraph = dict(key[3]).get("subgraph")
        if self.in_classify:
            found = self.forward_only
            if found is not None and found[0] == key and found[2] == _structure(key[0]):
                self.served["forward_only"] += 1
                return found[1]
            graph = self.real(*args, **kwargs)
            self.forward_only = (key, graph, _structure(key[0]))
            return graph
        if subgraph == "backward":
            found = self.backward.pop(key, None)
            if found is not None and found[1] == (_structure(key[0]), _structure(found[0])):
                self.served["backward"] += 1
                return found[0]
            graph = self.real(*args, **kwargs)
            self.backward[key] = (graph, (_structure(key[0]), _structure(graph)))
            return graph
        return self.real(*args, **kwargs)

    def classify(self, real: Callable, *args, **kwargs):
        self.backward.clear()  # a new min-cut: the backwards of the last one are not served
        self.in_classify = True
        try:
            return real(*args, **kwargs)
        finally:
            self.in_classify = False


@contextlib.contextmanager
def extracted_once():
    """PyTorch's min-cut partitioner extracts through a memo of the repeats until the block ends."""
    from torch._functorch import partitioners

    extract = getattr(partitioners, "_extract_graph_with_inputs_outputs", None)
    classify = getattr(partitioners, "classify_nodes", None)
    if extract is None or classify is None:
        yield
        return
    served = _Served(extract)
    partitioners._extract_graph_with_inputs_outputs = served.extract
    partitioners.classify_nodes = functools.partial(served.classify, classify)
    try:
        yield
    finally:
        partitioners._extract_graph_with_inputs_outputs = extract
        partitioners.classify_nodes = classify
