"""remat_fx/sizes.py: the cost model reads a symbolic size at its hint (the compiling call's value),
or at the sizes a graph is planned at for larger calls (remat_fx/step.py)."""
import torch

from remat_fx.passes.cost import concrete as cost_concrete
from remat_fx.sizes import concrete, sizes_at, sizes_key


def _dynamic_input(shape):
    """Dynamo's fake input of a graph compiled with dynamic sizes, from a call at ``shape``."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")
                    if isinstance(n.meta.get("example_value"), torch.Tensor))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x: x * 2, backend=backend, dynamic=True)(torch.randn(*shape))
    torch._dynamo.reset()
    return seen[0]


def test_a_symbolic_size_is_read_at_its_hint_or_at_the_sizes_given():
    x = _dynamic_input((5, 3))
    b, d = x.shape
    assert isinstance(b, torch.SymInt) and isinstance(d, torch.SymInt)
    assert cost_concrete is concrete  # the passes read sizes through it
    assert concrete(b * d) == 15 and concrete(x.numel()) == 15 and concrete(7) == 7 and sizes_key() == ""
    with sizes_at({b.node.expr: 8, d.node.expr: 3}):
        assert concrete(b * d) == 24 and concrete(x.untyped_storage().nbytes()) == 96
        assert sizes_key() != ""
    with sizes_at({b.node.expr: 8}):  # a size of a symbol not given: the whole size at its hint
        assert concrete(b) == 8 and concrete(b * d) == 15
    with sizes_at({}):
        assert concrete(b) == 5 and sizes_key() == ""
    assert concrete(b) == 5
