"""The eager runtime's private-torch surface (remat_fx/runtime/torch_compat.py).

The runtime was checked on torch 2.13 and 2.14 (torch_compat.CHECKED_VERSIONS): on any
other torch the first test fails and names the module to re-check. The others pin down
what each private path must still do, so a torch release that changes one fails here,
by name, rather than somewhere deep in a gradient test.
"""
from __future__ import annotations

import gc
import warnings
import pathlib
import re
from collections import defaultdict

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import remat_fx as remat
from remat_fx.runtime import torch_compat as compat

P = remat.CheckpointPolicy
RUNTIME = pathlib.Path(compat.__file__).parent


def test_running_torch_is_a_checked_version():
    assert compat.version_checked(), (
        f"torch {torch.__version__} is not among the versions the eager runtime's private PyTorch "
        f"internals were checked on ({', '.join(compat.CHECKED_VERSIONS)}). Re-check each path listed "
        f"in the docstring of {compat.HERE} on this torch (this file's other tests cover them, then "
        "the whole suite), then add the version to CHECKED_VERSIONS and to pyproject.toml's torch pin."
    )


def test_checked_versions_match_the_pin():
    pyproject = (RUNTIME.parent.parent / "pyproject.toml").read_text()
    pin = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', pyproject)
    assert pin, "pyproject.toml pins torch as >=X.Y,<X.Z"
    lo, hi = (int(pin[1]), int(pin[2])), (int(pin[3]), int(pin[4]))
    allowed = [f"{lo[0]}.{m}" for m in range(lo[1], hi[1])] if lo[0] == hi[0] else None
    assert allowed == list(compat.CHECKED_VERSIONS), (
        f"pyproject.toml allows torch {allowed}, {compat.HERE} was checked on {compat.CHECKED_VERSIONS}")


_PRIVATE = re.compile(
    r"torch\._C\b|torch\._(?!dynamo\.explain)\w|torch_checkpoint\._|torch\.utils\.checkpoint\._|_pytree"
    r"|\._version\b|\._base\b|_make_wrapper_subclass|StorageWeakRef|__closure__|_top_saved_tensors")


def test_private_torch_uses_live_only_in_the_compat_module():
    found = []
    for path in sorted(RUNTIME.glob("*.py")):
        if path.name == "torch_compat.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if _PRIVATE.search(code) and "compat." not in code:
                found.append(f"{path.name}:{i}: {line.strip()}")
    assert not found, f"private torch used outside {compat.HERE}:\n" + "\n".join(found)


def test_saved_tensors_hooks_are_seen_inside_a_checkpoint_region_and_hooks_of_ones_own():
    seen = []
    x = torch.randn(4, requires_grad=True)
    assert not compat.saved_tensors_hooked()
    torch_checkpoint.checkpoint(lambda t: seen.append(compat.saved_tensors_hooked()) or t.sin(), x, use_reentrant=False)
    with torch.autograd.graph.save_on_cpu():
        seen.append(compat.saved_tensors_hooked())
    assert seen == [True, True] and not compat.saved_tensors_hooked()


def test_checkpoint_frame_counts_saved_tensors_and_sees_early_stop():
    seen = []

    def body(x):
        frame = compat.current_checkpoint_frame()
        before = frame.saved_count()
        y = x.sin()  # saves x
        seen.append((before, frame.saved_count(), frame.early_stop))
        return y.cos()

    x = torch.randn(4, requires_grad=True)
    assert compat.current_checkpoint_frame() is None
    torch_checkpoint.checkpoint(body, x, use_reentrant=False)
    with torch_checkpoint.set_checkpoint_early_stop(False):
        torch_checkpoint.checkpoint(body, x, use_reentrant=False)
    (b0, a0, early0), (_, _, early1) = seen
    assert a0 == b0 + 1 and early0 is True and early1 is False


@pytest.mark.parametrize("retain", [False, True])
def test_backward_keeps_graph(retain):
    assert compat.backward_keeps_graph() is True  # outside a backward
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda g: seen.append(compat.backward_keeps_graph()))
    y.sum().backward(retain_graph=retain)
    assert seen == [retain]


@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace")
def test_inside_compiled_frame():
    assert compat.inside_compiled_frame() is False
    seen = []

    def f(x):
        torch._dynamo.graph_break()
        seen.append(compat.inside_compiled_frame())
        return x + 1

    torch._dynamo.reset()
    torch.compile(f, backend="eager")(torch.randn(2))
    assert seen == [True]


def test_trigger_survives_its_output_going_away_and_fires_the_recompute():
    """torch <= 2.12 frees a custom Function's node (and its saved tensors) when its output
    dies, whatever holds the grad_fn: the trigger must keep the output (issue 16, torch 2.11)."""
    runs = []
    kept = {}

    def body(x):
        runs.append(1)
        kept.setdefault("trigger", compat.new_recompute_trigger())
        return x.sin()

    x = torch.randn(4, requires_grad=True)
    out = torch_checkpoint.checkpoint(body, x, use_reentrant=False)
    gc.collect()
    assert len(runs) == 1
    compat.fire_recompute_trigger(kept["trigger"])
    assert len(runs) == 2
    out.sum().backward()
    torch.testing.assert_close(x.grad, x.detach().cos())


def _must_save(ctx, func, *args, **kwargs):
    return torch_checkpoint.CheckpointPolicy.MUST_SAVE


def test_sac_modes_cache_and_replay():
    x = torch.randn(3, 3)
    mode, storage = compat.sac_forward_mode(_must_save)
    with mode:
        y = torch.mm(x, x).relu()
    cached = dict(compat.sac_cached(storage))
    assert len(cached) == 2 and all(isinstance(v, torch.Tensor) for v in cached.values())
    torch.testing.assert_close(list(cached.values())[-1], y)
    doubled = compat.sac_map(storage, lambda v: v * 2)
    assert all(torch.equal(a * 2, b) for a, b in zip(cached.values(), dict(compat.sac_cached(doubled)).values()))
    zeros = torch.zeros(3, 3)
    for _ in range(2):  # a fresh copy replays once; the next recompute gets another
        with compat.sac_replay_mode(_must_save, compat.sac_map(storage, lambda v: v)):
            z = torch.mm(zeros, x).relu()  # replayed from the cache, not run
        torch.testing.assert_close(z, y)


class _Leaf:  # the shape of torch's cache leaf (_VersionWrapper): .val and .get_val
    def __init__(self, val):
        self.val = val

    def get_val(self, allow_mutation):
        return self.val


@pytest.mark.parametrize("layout", [compat.INDEXED, compat.LISTED])
def test_sac_layouts(layout):
    """Both storage layouts: torch 2.13/2.14's {op: {index: entry}} (run for real above) and
    torch 2.11's {op: [entry]} (written from its source; no 2.11 wheel here)."""
    t0, t1 = torch.ones(1), torch.zeros(2)
    if layout == compat.INDEXED:
        storage = defaultdict(dict, {"mm": {0: _Leaf(t0), 1: object()}, "relu": {0: (_Leaf(t1), _Leaf(3))}})
    else:
        storage = defaultdict(list, {"mm": [_Leaf(t0)], "relu": [(_Leaf(t1), _Leaf(3))]})
    assert compat.sac_layout(storage) == layout
    labels = [label for label, _ in compat.sac_cached(storage)]
    assert labels == ["mm#0.0", "relu#0.0", "relu#0.1"]
    mapped = compat.sac_map(storage, lambda v: v + 1 if isinstance(v, torch.Tensor) else v)
    assert compat.sac_layout(mapped) == layout
    assert [v if not isinstance(v, torch.Tensor) else v.tolist() for _, v in compat.sac_cached(mapped)] == \
        [[2.0], [1.0, 1.0], 3]
    assert storage["mm"][0].val is t0  # the original is untouched


def test_sac_unknown_layout_names_the_compat_module():
    with pytest.raises(RuntimeError, match="torch_compat.py"):
        compat.sac_layout({})


def test_native_save_inside_user_saved_tensors_hooks():
    """torch 2.14 can send SAC's cache through the user's saved_tensors_hooks (and warns that it
    will by default): the tape keeps its cache plain, as on 2.13, so reports and checks still see
    tensors, and no FutureWarning is raised."""
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        return remat.native_op(torch.mm, "proj", policy=P.SAVE)(x.sin(), w).cos()

    want = torch.autograd.grad(block(x).sum(), [x, w])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: ("packed", t), lambda p: p[1]):
            out = remat.checkpoint("blk")(block)(x)
    cached = [e for e in remat.memory_report(out).entries if e.op == "proj"]
    assert [(e.shape, e.bytes) for e in cached] == [((4, 8), 128)]
    got = torch.autograd.grad(out.sum(), [x, w])
    for a, b in zip(got, want):
        assert torch.equal(a, b)
