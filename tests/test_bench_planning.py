"""benchmarks/planning.py: planning the captured joint graph again gives the compile's plan, and its
split of the planning time counts the parts it names."""
import os
import re

import pytest
import torch

import benchmarks.planning as planning
import remat_fx as remat
from benchmarks.llama_depth import build
from remat_fx.memory_budget import fmt_bytes
from remat_fx.options import OptionError
from remat_fx.passes import partition as _partition
from remat_fx.passes import rerun as _rerun

ARGS = ["--layers", "2", "--hidden", "32", "--intermediate", "64", "--heads", "2", "--vocab", "128", "--seq", "16",
        "--batch", "2", "--lower", "eager", "--threads", "0"]


def _compiled_plan(options, bf16=False):
    import argparse

    shape = argparse.Namespace(layers=2, hidden=32, intermediate=64, heads=2, vocab=128, seq=16, batch=2)
    torch._dynamo.reset()
    model, loss, ids = build(shape)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = torch.compile(loss, backend="remat", options=options)(ids)
    out.backward()
    plan = remat.last_plan()
    torch._dynamo.reset()
    return plan.total_bytes, plan.peak.step, plan.rerun.reruns if plan.rerun is not None else 0


@pytest.mark.slow
def test_planning_benchmark_replans_the_compiles_plan_and_splits_its_time(tmp_path, monkeypatch):
    # the plan cache on, as for a user: the benchmark turns it off while it plans (a second planning
    # of a variant would otherwise replay the first's plan in one min-cut) and back on after
    monkeypatch.setenv("REMAT_FX_PLAN_CACHE", "1")
    monkeypatch.setenv("REMAT_FX_CACHE_DIR", str(tmp_path / "cache"))
    wrapped = {name: getattr(_partition, name) for name in
               ("min_cut_rematerialization_partition", "apply_budget", "rerun_for_peak", "estimate_peak")}
    simulate = _rerun._Program.simulate
    out = tmp_path / "planning.md"
    text = planning.main(ARGS + ["--budgets", "0,0.5", "--repeat", "2", "--out", str(out)])
    assert out.read_text() == text
    assert os.environ["REMAT_FX_PLAN_CACHE"] == "1"
    assert not (tmp_path / "cache").exists()  # nothing recorded while it planned
    # the wrappers are taken off again
    assert all(getattr(_partition, name) is fn for name, fn in wrapped.items())
    assert _rerun._Program.simulate is simulate
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and re.fullmatch(r"[\d.]+", cells[1]):
            rows[cells[0]] = cells
    assert list(rows) == ["0", "0.5"], text
    for label, cells in rows.items():
        total = float(cells[1])
        parts = [tuple(float(x) for x in c.split(" / ")) for c in cells[2:7]]
        min_cut, solver, rerun, simulated, estimates = parts
        assert min_cut[0] >= 2 and solver[0] >= 1 and estimates[0] >= 1, (label, cells)  # the plan without a
        # budget and the budget's own: two min-cuts at least, each plan estimated
        assert simulated[1] <= rerun[1] + 0.01, (label, cells)  # simulate runs inside the rerun searches
        assert min_cut[1] + solver[1] + rerun[1] + estimates[1] <= total + 0.01, (label, cells)
        assert float(cells[7]) >= -0.01, (label, cells)  # "other": what the named parts leave
    assert float(rows["0"][4].split(" / ")[0]) >= 1 and float(rows["0"][5].split(" / ")[0]) >= 1  # budget 0's search
    assert "\nmonotone=default: the estimated peak " in text, text  # the two budgets' verdict (test below)
    # the same plans a compile under these options makes: saved bytes, estimated peak, reruns
    for label, options in (("0", {"memory_budget": 0.0}), ("0.5", {"memory_budget": 0.5})):
        saved, peak, reruns = _compiled_plan(dict(options, lower="eager"))
        cells = rows[label]
        assert (cells[8], cells[9], int(cells[10])) == (fmt_bytes(saved), fmt_bytes(peak), reruns), (label, cells)


def _rows(text):
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and re.fullmatch(r"[\d.]+", cells[1]):
            rows[cells[0]] = cells
    return rows


def test_planning_benchmark_captures_under_bf16_autocast_as_the_gpu_benchmark_runs():
    """--autocast bf16 (on CUDA by default, as benchmarks/gpu.py runs its models): the joint graph
    with the casts autocast puts in, planned as a compile under autocast plans it."""
    text = planning.main(ARGS + ["--budgets", "0.5", "--autocast", "bf16"])
    assert "lower=eager, cpu, bf16 autocast, torch" in text, text
    cells = _rows(text)["0.5"]
    saved, peak, reruns = _compiled_plan({"memory_budget": 0.5, "lower": "eager"}, bf16=True)
    assert (cells[8], cells[9], int(cells[10])) == (fmt_bytes(saved), fmt_bytes(peak), reruns), cells
    float32 = _compiled_plan({"memory_budget": 0.5, "lower": "eager"})
    assert (saved, peak) != float32[:2], "the same plan as in float32: the autocast did not reach the graph"


def test_planning_benchmark_refuses_a_peak_budget_before_it_compiles(monkeypatch):
    """A peak_budget is the whole step's (remat_fx/step.py): one joint graph's partition alone would
    plan another limit. Refused at once, before the compile that captures the graph, as is an
    option the backend would refuse."""
    monkeypatch.setattr(planning, "build", lambda args: pytest.fail("compiled before refusing"))
    with pytest.raises(SystemExit, match="'peak=24MiB': a peak_budget is planned for the whole step"):
        planning.main(ARGS + ["--budgets", "0.1,peak=24MiB"])
    with pytest.raises(OptionError, match="monotone"):  # the options' own errors, before the compile too
        planning.main(ARGS + ["--budgets", "0.1", "--monotone", "default,grd"])
    if not torch.cuda.is_available():  # a device the host lacks: said before the model is built
        with pytest.raises(SystemExit, match="--device cuda, but torch .* sees no CUDA device here"):
            planning.main(ARGS + ["--budgets", "0.1", "--device", "cuda"])


def test_as_cuda_gives_every_value_a_fake_cuda_twin_with_its_storage():
    """--as-cuda (planning.as_cuda): the CPU-captured joint graph's values become fake CUDA tensors of
    the same shape, strides, offset, dtype and storage bytes, views sharing their base's storage
    again, so remat's CUDA rules and roofline plan it; the joint inputs likewise."""
    import argparse

    from torch.multiprocessing.reductions import StorageWeakRef

    from remat_fx.passes.cost import node_device
    from remat_fx.passes.peak import node_facts, storage_bytes
    from remat_fx.pareto import _capture

    shape = argparse.Namespace(layers=1, hidden=32, intermediate=64, heads=2, vocab=128, seq=16, batch=2)
    torch._dynamo.reset()
    _, loss, ids = build(shape)
    graphs = _capture(loss, (ids,), {"lower": "eager"})
    gm = graphs[0][0]
    nodes = [n for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    before = {n: (n.meta["val"], storage_bytes(n)) for n in nodes}

    def storages():
        return {StorageWeakRef(n.meta["val"].untyped_storage()) for n in nodes}

    shared = [(a, b) for a in nodes for b in nodes if a is not b and a.op == "call_function"
              and StorageWeakRef(a.meta["val"].untyped_storage()) == StorageWeakRef(b.meta["val"].untyped_storage())]
    assert shared, "no two values share a storage in the captured graph"
    distinct = len(storages())
    assert node_device(gm.graph.nodes).type == "cpu" and node_facts(nodes[-1], {}).on_cpu

    converted = planning.as_cuda(graphs)
    assert converted[0][0] is gm
    for n, (v, nbytes) in before.items():
        t = n.meta["val"]
        assert t.device.type == "cuda", n
        assert (t.shape, t.stride(), t.storage_offset(), t.dtype, t.requires_grad) == \
            (v.shape, v.stride(), v.storage_offset(), v.dtype, v.requires_grad), n
        assert storage_bytes(n) == nbytes, n
    for a, b in shared:
        assert StorageWeakRef(a.meta["val"].untyped_storage()) == StorageWeakRef(b.meta["val"].untyped_storage())
    assert len(storages()) == distinct  # and those that did not share one still do not
    inputs = [x for x in torch.utils._pytree.tree_leaves(converted[0][1]) if isinstance(x, torch.Tensor)]
    assert inputs and all(x.device.type == "cuda" for x in inputs)
    assert node_device(gm.graph.nodes).type == "cuda" and not node_facts(nodes[-1], {}).on_cpu
    torch._dynamo.reset()


def test_as_cuda_keeps_a_storage_whose_bytes_are_not_whole_elements_of_a_view():
    """A dtype view of part of an odd-sized storage (4 of 5 bytes read as one int32) keeps its
    storage's 5 bytes, shared with the uint8 value it views."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    from remat_fx.passes.peak import storage_bytes

    with FakeTensorMode() as mode:
        raw = torch.empty(5, dtype=torch.uint8)
        word = raw[:4].view(torch.int32)
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.view.dtype, (g.call_function(torch.ops.aten.slice.Tensor, (x, 0, 0, 4)),
                                                    torch.int32))
    g.output((y,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    x.meta["val"], y.meta["val"] = raw, word
    assert mode is not None
    (_, inputs, _), = planning.as_cuda([(gm, (raw,), {})])
    for node, v in ((x, raw), (y, word)):
        t = node.meta["val"]
        assert (t.device.type, t.dtype, t.shape, t.untyped_storage().nbytes()) == ("cuda", v.dtype, v.shape, 5)
    assert StorageWeakRef(x.meta["val"].untyped_storage()) == StorageWeakRef(y.meta["val"].untyped_storage())
    assert inputs[0] is x.meta["val"] and storage_bytes(y) == 5


def test_planning_benchmark_plans_as_on_cuda_without_a_gpu():
    """--as-cuda on this host: the graph captured on the CPU, planned under CUDA's rules (the table
    says so); refused with --device cuda, where the graph is CUDA's already."""
    from remat_fx.roofline import CUDA

    text = planning.main(ARGS + ["--budgets", "0", "--as-cuda"])
    assert "lower=eager, cpu planned as on CUDA, bf16 autocast, torch" in text, text
    assert "0" in _rows(text)
    plan = remat.last_plan()  # planned by the cost model's CUDA roofline
    assert f"{CUDA.flops_per_s:.3g} FLOP/s" in plan.cost_model and plan.budget.at_minimum, plan.cost_model
    with pytest.raises(SystemExit, match="--as-cuda plans a graph captured on the CPU as on CUDA"):
        planning.main(ARGS + ["--budgets", "0", "--as-cuda", "--device", "cuda"])


def test_planning_benchmark_says_where_the_estimated_peak_rises_as_the_budget_falls():
    """Each --monotone mode's verdict over the fraction budgets it planned, in any order given: the
    first budget whose estimated peak is over the lowest of the larger budgets', named with both;
    none with fewer than two fractions (a byte budget is not on their scale)."""
    mib = 2 ** 20
    assert planning.verdict("2", {"0": 19.7 * mib, "0.3": 16 * mib, "0.1": 12.8 * mib, "0.05": 22.65 * mib}) \
        == "monotone=2: the estimated peak **rises** as the budget falls: 0.05 at 22.65 MiB over 0.1's " \
           "12.80 MiB (+77%)"
    assert planning.verdict("grid", {"0.3": 16 * mib, "0.1": 12.8 * mib, "0": 12.8 * mib}) == \
        "monotone=grid: the estimated peak does not rise as the budget falls (0.3 to 0)"
    assert planning.verdict("1", {"0.1": mib, "7MiB": 9 * mib}) == ""
    assert planning.verdict("1", {"0.1": mib, "7MiB": 9 * mib, "0.5": mib}).endswith("(0.5 to 0.1)")
