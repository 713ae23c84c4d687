"""OFFLOAD through pluggable offloaders, and memory_report's names, bytes and table."""
import warnings

import pytest
import torch

import remat_fx as remat
from tests.conftest import modes_with_compile_gap
from tests.helpers import P, assert_equal_grads, exp, grads, linear


class CountingOffloader:
    """Packs into a (clone, id) pair and logs every call, to see what went through it and when."""

    def __init__(self):
        self.log = []

    def pack(self, t):
        self.log.append(("pack", tuple(t.shape)))
        return {"data": t.clone(), "shape": tuple(t.shape)}

    def prefetch(self, packed):
        self.log.append(("prefetch", packed["shape"]))

    def unpack(self, packed):
        self.log.append(("unpack", packed["shape"]))
        return packed["data"]


def _block(w1, w2):
    def block(x):
        h = linear(x.sin(), w1, "a", P.OFFLOAD)  # saves x.sin() (offloaded) and w1 (a parameter: kept)
        h = exp(h, "e", P.RECOMPUTE)  # consumes an OFFLOAD output: saves it, offloaded too
        return linear(h, w2, "b", P.RECOMPUTE)
    return block


@modes_with_compile_gap("compiler mode saves OFFLOAD ops on the device; offload planning is not built yet")
@pytest.mark.parametrize("how", ["option", "context"])
def test_offload_goes_through_the_offloader(mode, how):
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    block = _block(w1, w2)
    want = grads(block(x).sum(), [x, w1, w2])
    off = CountingOffloader()
    if how == "option":
        step = mode(lambda x: remat.checkpoint(offloader=off)(block)(x).sum())
        out = step(x)
    else:
        with remat.use_offloader(off):
            out = mode(lambda x: remat.checkpoint()(block)(x).sum())(x)
    assert off.log == [("pack", (4, 8)), ("pack", (4, 8))]
    report = remat.memory_report(out)
    assert {(e.op, e.name, e.policy, e.bytes) for e in report.entries if e.policy != "PARAM"} == {
        ("a", "x", "OFFLOAD", 128), ("e", "inputs.0", "OFFLOAD", 128)}
    assert_equal_grads(grads(out, [x, w1, w2]), want)
    # prefetched as soon as the region's backward began, then unpacked by the recompute
    assert off.log[2:] == [("prefetch", (4, 8))] * 2 + [("unpack", (4, 8))] * 2


def test_region_option_beats_context():
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    outer, inner = CountingOffloader(), CountingOffloader()
    with remat.use_offloader(outer):
        remat.checkpoint(offloader=inner)(_block(w1, w2))(torch.randn(4, 8)).sum().backward()
    assert outer.log == [] and len(inner.log) == 6


def test_default_offloader_keeps_cpu_tensors():
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    block = _block(w1, w2)
    want = grads(block(x).sum(), [x, w1, w2])
    assert_equal_grads(grads(remat.checkpoint()(block)(x).sum(), [x, w1, w2]), want)
    t = torch.randn(3)
    off = remat.CPUOffloader()
    assert off.unpack(off.pack(t)) is t


def test_native_offload():
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        return remat.native_op(torch.mm, "mm", policy=P.OFFLOAD)(x.sin(), w).cos()

    want = grads(block(x).sum(), [x, w])
    off = CountingOffloader()
    out = remat.checkpoint(offloader=off)(block)(x).sum()
    assert [e.policy for e in remat.memory_report(out).entries if e.op == "mm"] == ["OFFLOAD"]
    assert_equal_grads(grads(out, [x, w]), want)
    assert [k for k, _ in off.log] == ["pack", "prefetch", "unpack"]


def test_bad_offloader():
    with pytest.raises(TypeError, match=r"an offloader needs pack\(tensor\) and unpack\(packed\) methods"):
        remat.use_offloader(object())  # where it is named, not when the scope is entered


def test_use_offloader_without_with_warns_that_it_set_nothing():
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    off = CountingOffloader()
    with pytest.warns(RuntimeWarning, match=r"use_offloader\(.*\) was never entered, so it set nothing: .*"
                                            r"write `with remat.use_offloader\(...\):`"):
        remat.use_offloader(off)
    remat.checkpoint()(_block(w1, w2))(torch.randn(4, 8)).sum().backward()
    assert off.log == []  # the default offloader ran
    scope = remat.use_offloader(off)  # entered later, and twice over: no warning, each exit restores
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with scope as got:
            assert got is off
            with scope:
                pass
            remat.checkpoint()(_block(w1, w2))(torch.randn(4, 8)).sum().backward()
        del scope
    assert len(off.log) == 6
    decorated = CountingOffloader()

    @remat.use_offloader(decorated)  # a decorator, as the contextmanager it replaced was: entered per call
    def step():
        remat.checkpoint()(_block(w1, w2))(torch.randn(4, 8)).sum().backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step()
    assert len(decorated.log) == 6


def test_report_names_bytes_and_table():
    w1, w2 = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def block(h):
        h = linear(h.sin(), w1, "l1", P.SAVE)  # saves sin(x): 512 B; w1 is a parameter
        h = exp(h, "e", P.SAVE)  # saves its output: 512 B
        return linear(h, w2, "l2", P.RECOMPUTE)  # saves exp's output for recompute: alias, 0 B

    y = remat.checkpoint("blk0")(block)(x)
    out = remat.checkpoint("blk1")(block)(y)
    report = remat.memory_report(out)
    rows = [(e.region, e.op, e.name, e.policy, e.bytes, e.alias_of) for e in report.entries]
    assert rows == [
        ("blk0", "", "inputs.0", "PARAM", 0, None),
        ("blk0", "l1", "x", "SAVE", 512, None),
        ("blk0", "l1", "w", "PARAM", 0, None),
        ("blk0", "e", "y", "SAVE", 512, None),
        ("blk0", "l2", "inputs.0", "SAVE", 0, "blk0:e.y"),
        ("blk1", "", "inputs.0", "INPUT", 512, None),
        ("blk1", "l1", "x", "SAVE", 512, None),
        ("blk1", "l1", "w", "PARAM", 0, None),
        ("blk1", "e", "y", "SAVE", 512, None),
        ("blk1", "l2", "inputs.0", "SAVE", 0, "blk1:e.y"),
    ]
    assert report.total_bytes == 2560
    assert report.bytes_by("region") == {"blk0": 1024, "blk1": 1536}
    assert report.names() == {"l1.x", "e.y", "l2.inputs.0"}
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split() == ["region", "op", "tensor", "shape", "dtype", "policy", "bytes"]
    body = [ln for ln in lines[2:] if not ln.startswith("-") and not ln.startswith("total")]
    assert sum(int(ln.split()[-1].replace(",", "")) for ln in body) == 2560
    assert lines[-1].split() == ["total", "2,560"]
    assert "inputs.0 = e.out (alias of blk0:e.y)" in text
    assert [e.source for e in report.entries if e.op == "l2"] == ["e.out", "e.out"]
    out.sum().backward()  # after backward the tapes hold nothing
    assert remat.memory_report(out).total_bytes == 512  # only blk1's input, a live activation


def test_region_globs_override_call_sites():
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def block(x):
        h = linear(x.sin(), w1, "layers.0.mlp.up", P.RECOMPUTE)
        return linear(h, w2, "layers.0.mlp.down", P.SAVE).view(-1)

    want = grads(block(x).sum(), [x, w1, w2])
    out = remat.checkpoint(save="*.up", recompute=["*.down"])(block)(x)
    assert remat.memory_report(out).names() == {"layers.0.mlp.up.x", "layers.0.mlp.down.inputs.0"}
    assert_equal_grads(grads(out.sum(), [x, w1, w2]), want)
    with pytest.raises(ValueError, match="option 'save' must hold glob strings"):
        remat.checkpoint(save=[3])(block)(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path of CPUOffloader needs a GPU")
def test_default_offloader_moves_cuda_tensors_to_pinned_host():
    w1, w2 = [torch.randn(8, 8, device="cuda", requires_grad=True) for _ in range(2)]
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    block = _block(w1, w2)
    want = grads(block(x).sum(), [x, w1, w2])
    out = remat.checkpoint()(block)(x).sum()
    slot = remat.runtime.report.find_tapes(out)[0].records[0].saved[0]
    assert slot.value.host.device.type == "cpu" and slot.value.host.is_pinned()
    assert_equal_grads(grads(out, [x, w1, w2]), want)


def test_compiler_mode_says_it_keeps_offload_as_save():
    """Compiler mode has no offload planning (the gap above): an OFFLOAD op's values are saved on the
    device and the offloader is never called. The compile says so once, naming them, and the plan's
    reason for each says it; the gradients are the eager run's."""
    import warnings

    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    block = _block(w1, w2)
    want = grads(block(x).sum(), [x, w1, w2])
    off = CountingOffloader()
    torch._dynamo.reset()
    step = torch.compile(lambda x: remat.checkpoint("r", offloader=off)(block)(x).sum(), backend="remat",
                         options={"lower": "eager"}, fullgraph=True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = step(x)
    said = [str(w.message) for w in seen if "offload" in str(w.message)]
    assert said == ["remat_fx: compiler mode does not offload: 1 value(s) marked OFFLOAD (a) are kept on the device "
                    "as SAVE and no offloader is called. Run the region eagerly (the named tape offloads them) or "
                    "mark them SAVE."], said
    assert off.log == []
    reasons = {s.name: s.reason for s in remat.last_plan().saved}
    assert reasons["a"] == ("OFFLOAD at the call site of 'a' (kept on the device as SAVE: compiler mode does "
                            "not offload)")
    assert_equal_grads(grads(out, [x, w1, w2]), want)
    torch._dynamo.reset()


def test_memory_report_names_what_it_takes_and_why_it_is_empty():
    """memory_report(3) and a compiled model's output gave an empty table, silently: the first is
    refused, naming what it takes; the second's table says where the compiled plan is read."""
    with pytest.raises(TypeError, match=r"^remat.memory_report takes the tensors a forward computed \(its outputs, "
                                        r"e.g. the loss\), got int$"):
        remat.memory_report(3)
    torch._dynamo.reset()
    w = torch.randn(8, 8, requires_grad=True)
    out = torch.compile(lambda x: remat.checkpoint("r")(lambda x: (x @ w).tanh())(x).sum(), backend="remat",
                        options={"lower": "eager"}, fullgraph=True)(torch.randn(4, 8, requires_grad=True))
    report = remat.memory_report(out)
    assert report.entries == [] and str(report).endswith(
        "(no remat.checkpoint region on the eager tape upstream of these outputs; under "
        "torch.compile(backend='remat') read remat.last_plan() or remat.step_report())")
    torch._dynamo.reset()
