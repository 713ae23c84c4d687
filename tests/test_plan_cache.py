"""The plan cache (remat_fx/plan_cache.py): a second process compiling the same graph with the same
options makes the plan the first one's search chose, in one partition, with the same saved
activations, estimated peak and report, and the same gradients."""
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import remat_fx as remat
from remat_fx import plan_cache

ROOT = Path(__file__).resolve().parents[1]

STEP = r"""
import json, sys, torch
import remat_fx as remat
from remat_fx.plan_cache import REPORT_NOTES
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
                              for _ in range(8)])
x = torch.randn(32, 64)
want = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
f = torch.compile(model, backend="remat", fullgraph=True,
                  options={"lower": "eager", "memory_budget": float(sys.argv[1]), "monotone": sys.argv[2]})
got = torch.autograd.grad(f(x).square().mean(), list(model.parameters()))
for a, b in zip(got, want):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
p = remat.last_plan()
print(json.dumps({"from_cache": p.from_cache, "evaluations": p.peak_evaluations, "peak": p.peak.step,
                  "saved": [(s.name, s.bytes) for s in p.saved], "reruns": p.rerun.names if p.rerun else None,
                  "notes": {k: getattr(p.budget, k) for k in REPORT_NOTES}, "text": str(p)}))
"""


def _run(tmp_path, budget, monotone="nearest"):
    env = dict(os.environ, REMAT_FX_PLAN_CACHE="1", REMAT_FX_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", STEP, str(budget), monotone], capture_output=True, text=True,
                         timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("budget,monotone", [(0.3, "nearest"), (0.5, "grid")])
def test_second_process_makes_the_searched_plan_in_one_partition(tmp_path, budget, monotone):
    first = _run(tmp_path, budget, monotone)
    entries = list((tmp_path / "plans").glob("plan-*.json"))
    assert len(entries) == 1, entries
    assert not first["from_cache"] and first["evaluations"] > 1  # the search ran
    if monotone == "grid":  # the envelope held it under budget 0.6's plan: notes the search wrote on the report
        assert first["notes"]["held_by"] == "0.6" and first["notes"]["held_under"] is not None
    second = _run(tmp_path, budget, monotone)
    assert second["from_cache"] and second["evaluations"] == 1  # one cut: the recorded one
    for k in ("peak", "saved", "reruns", "notes"):
        assert second[k] == first[k], k
    assert "the search's choice read from the plan cache" in second["text"]
    assert "plan cache" not in first["text"]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))
                                 for _ in range(4)])


def _step(model, x, **options):
    torch._dynamo.reset()
    f = torch.compile(model, backend="remat", fullgraph=True, options={"lower": "eager", **options})
    grads = torch.autograd.grad(f(x).square().mean(), list(model.parameters()))
    return remat.last_plan(), grads


def test_an_entry_that_no_longer_gives_its_plan_is_searched_again_and_rewritten(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("REMAT_FX_PLAN_CACHE", "1")
    monkeypatch.setenv("REMAT_FX_CACHE_DIR", str(tmp_path))
    model, x = _mlp(), torch.randn(16, 32)
    want = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    plan, _ = _step(model, x, memory_budget=0.3)
    (entry,) = (tmp_path / "plans").glob("plan-*.json")
    record = json.loads(entry.read_text())
    assert record["peak"] == plan.peak.step and record["saved"] == plan.total_bytes
    record["peak"] += 1  # as if the cost model or the estimate had changed under it
    entry.write_text(json.dumps(record))
    with caplog.at_level(logging.INFO, logger="remat_fx"):
        again, got = _step(model, x, memory_budget=0.3)
    assert not again.from_cache and again.peak_evaluations > 1
    assert "the plan cache's plan for this graph now saves" in caplog.text and "searching again" in caplog.text
    assert json.loads(entry.read_text())["peak"] == plan.peak.step  # written again
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    third, _ = _step(model, x, memory_budget=0.3)
    assert third.from_cache and third.peak.step == plan.peak.step


def test_other_options_are_another_entry_and_the_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_FX_PLAN_CACHE", "1")
    monkeypatch.setenv("REMAT_FX_CACHE_DIR", str(tmp_path))
    model, x = _mlp(), torch.randn(16, 32)
    _step(model, x, memory_budget=0.3)
    plan, _ = _step(model, x, memory_budget=0.5)
    assert not plan.from_cache  # the budget is part of the key
    assert len(list((tmp_path / "plans").glob("plan-*.json"))) == 2
    plan, _ = _step(model, x, memory_budget=0.3, cost_model="profile")
    assert not plan.from_cache  # measured op times: not cached
    monkeypatch.setenv("REMAT_FX_PLAN_CACHE", "0")
    plan, _ = _step(model, x, memory_budget=0.2)
    assert not plan.from_cache
    assert len(list((tmp_path / "plans").glob("plan-*.json"))) == 2


def test_the_key_reads_the_module_paths_the_names_come_from(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_FX_CACHE_DIR", str(tmp_path))
    from remat_fx.options import parse_options
    from remat_fx.pareto import _capture

    model, x = _mlp(), torch.randn(16, 32)
    (gm, _, kwargs), = _capture(model, (x,), {})
    options = parse_options({"memory_budget": 0.3})
    args = (kwargs["num_fwd_outputs"], kwargs.get("static_lifetime_input_indices"))
    path = plan_cache.entry(gm, *args, options).path
    assert path == plan_cache.entry(gm, *args, options).path
    assert path != plan_cache.entry(gm, *args, parse_options({"memory_budget": 0.31})).path
    node = next(n for n in gm.graph.nodes if n.meta.get("nn_module_stack"))
    stack = node.meta["nn_module_stack"]
    node.meta["nn_module_stack"] = {k: (path_ + ".renamed", cls) for k, (path_, cls) in stack.items()}
    assert path != plan_cache.entry(gm, *args, options).path
