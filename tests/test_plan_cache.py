"""The plan cache (remat_fx/plan_cache.py): a second process compiling the same graph with the same
options makes the plan the first one's search chose, in one partition, with the same saved
activations, estimated peak and report, and the same gradients."""
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import remat_fx as remat
from remat_fx import plan_cache
from tests.test_step import ATTENTION_LM, MODEL

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


@pytest.mark.slow
def test_second_process_makes_the_searched_plan_in_one_partition(tmp_path):
    # budget 0.5 under monotone="grid": a long search (50-odd partitions) whose plan the envelope held
    # under budget 0.6's, so the entry carries the search's notes on the report (in-process replays
    # of the default mode: the tests below)
    budget, monotone = 0.5, "grid"
    first = _run(tmp_path, budget, monotone)
    entries = list((tmp_path / "plans").glob("plan-*.json"))
    assert len(entries) == 1, entries
    assert not first["from_cache"] and first["evaluations"] > 1  # the search ran
    assert first["notes"]["held_by"] == "0.6" and first["notes"]["held_under"] is not None
    second = _run(tmp_path, budget, monotone)
    assert second["from_cache"] and second["evaluations"] == 1  # one cut: the recorded one
    for k in ("peak", "saved", "reruns", "notes"):
        assert second[k] == first[k], k
    assert "the search's choice read from the plan cache" in second["text"]
    assert "plan cache" not in first["text"]


def _mlp():
    torch.manual_seed(0)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 32))  # noqa: E731
    return torch.nn.Sequential(*[block() for _ in range(4)])


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
    for broken in ("{}", "not json", '{"budgets": [[null, "x"]]}'):  # unreadable: searched again, written anew
        entry.write_text(broken)
        fourth, _ = _step(model, x, memory_budget=0.3)
        assert not fourth.from_cache and json.loads(entry.read_text())["peak"] == plan.peak.step
    good = json.loads(entry.read_text())
    # the right fields with the wrong values (edited, or another version's): searched again, written
    # anew (each of these crashed torch.compile with a TypeError, KeyError, AttributeError or ValueError)
    for field, value in (("fastest_s", "x"), ("cap", "x"), ("report", "x"), ("budgets", [["nope", 0.3, None]]),
                         ("quick", [1, 2]), ("peak", float("nan"))):
        entry.write_text(json.dumps({**good, field: value}))
        with caplog.at_level(logging.INFO, logger="remat_fx"):
            fifth, got = _step(model, x, memory_budget=0.3)
        assert not fifth.from_cache and json.loads(entry.read_text()) == good, field
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert "could not be used" in caplog.text


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
    for off in ("off", "False", " no "):  # the switch's other spellings of off (only "0" was)
        monkeypatch.setenv("REMAT_FX_PLAN_CACHE", off)
        plan, _ = _step(model, x, memory_budget=0.2)
        assert not plan.from_cache
    assert len(list((tmp_path / "plans").glob("plan-*.json"))) == 2
    from remat_fx.plan_cache import switched_on
    monkeypatch.setenv("REMAT_FX_PLAN_CACHE", "of")  # a typo no longer leaves the cache on
    with pytest.raises(ValueError, match=r"^remat_fx: REMAT_FX_PLAN_CACHE='of' is neither on \(1 / true / on / "
                                         r"yes\) nor off \(0 / false / off / no\); set it to 0 to turn the plan "
                                         r"cache off$"):
        switched_on()


def test_a_remat_annotate_budget_is_in_the_graph_key_and_aotautograds_key():
    """remat.annotate's budget (and policy) lives in node metadata, which gm.code does not show: a region
    budget changed between two runs under Inductor hit AOTAutograd's cache and the graph record of the
    old budget, and the new budget was silently ignored (a helper's review: 40,960 bytes saved where
    the new budget's plan saves 32,768)."""
    from remat_fx.options import parse_options
    from remat_fx.passes.lower import RematPartitioner
    from remat_fx.step import graph_key

    lin = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(4)])

    def keys(budget, policy=None):
        def f(x):
            for i, layer in enumerate(lin):
                if i < 2:
                    with remat.annotate("head", policy, memory_budget=budget):
                        x = torch.tanh(layer(x))
                else:
                    x = torch.tanh(layer(x))
            return x.square().mean()

        seen = []

        def capture(gm, example_inputs):
            seen.append((graph_key(gm, example_inputs), RematPartitioner(
                parse_options({}), annotations=plan_cache.annotations_digest(gm)).uuid()))
            return gm.forward

        torch._dynamo.reset()
        torch.compile(f, backend=capture, fullgraph=True)(torch.randn(8, 32))
        (found,) = seen
        return found

    half, none, again = keys(0.5), keys(0.0), keys(0.5)
    assert half == again
    assert half[0] != none[0] and half[1] != none[1]
    assert keys(0.5, "SAVE")[0] != half[0]


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


AOT_STEP = MODEL + r"""
import json, re, sys
import remat_fx as remat
from torch._dynamo.utils import counters
from remat_fx.step import STEP
torch.manual_seed(0)

model = Model(d=32)  # blocks with a graph break halfway: a step of two compiled graphs
x = torch.randn(4, 64, 32)
model(x).backward()
want = [p.grad.clone() for p in model.parameters()]
f = torch.compile(model, backend="remat", options=json.loads(sys.argv[1]))
for _ in range(2):
    model.zero_grad()
    f(x).backward()
for p, w in zip(model.parameters(), want):
    torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5)
graphs = sorted({c for c in STEP.finished() if c.plan is not None}, key=lambda g: g.index)
hits = counters["aot_autograd"]["autograd_cache_hit"]
from_cache = [g.plan.from_cache for g in graphs]
partitions = [g.plan.peak_evaluations for g in graphs]  # 0: no partition ran (a hit), 1: the plan cache's replay
# the text less what a hit changes: the search's count of plans and the cache's marks
marks = "; the search's choice read from the plan cache"
plans = [re.sub(r" \(\d+ plans estimated\)", "", str(g.plan).replace(marks, "")) for g in graphs]
step = str(remat.step_report())
estimates = [g.estimate(g.active).total_bytes for g in graphs]  # after a hit: traced and partitioned again first
assert all(g.joint is not None for g in graphs)
print(json.dumps({"aot_hits": hits, "from_cache": from_cache, "partitions": partitions,
                  "shared": STEP.step_plan and STEP.step_plan.fraction, "estimate": estimates,
                  "step_from_cache": STEP.step_plan and STEP.step_plan.from_cache,
                  "options": [g.active.key() for g in graphs],
                  "saved": [[(s.name, s.bytes) for s in g.plan.saved] for g in graphs],
                  "peak": [g.plan.peak.step for g in graphs], "step": step, "plan": plans,
                  "lowered": [repr(g.plan.lowered) for g in graphs]}))
"""


def _aot_runner(tmp_path, options):
    env = dict(os.environ, REMAT_FX_PLAN_CACHE="1", REMAT_FX_CACHE_DIR=str(tmp_path / "remat"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=str(ROOT))

    def run():
        out = subprocess.run([sys.executable, "-c", AOT_STEP, json.dumps(options)], capture_output=True, text=True,
                             timeout=600, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        return dict(json.loads(out.stdout.strip().splitlines()[-1]), log=out.stderr)

    return run


@pytest.mark.slow
def test_a_second_process_loads_the_graphs_from_aotautograds_cache_with_their_plan(tmp_path):
    """Inductor: the second process compiles each graph as the first planned its step (the step's
    record in the plan cache), from AOTAutograd's cache, at its first call: no tracing, partition or
    step plan, and the first step is within the limit (as the first process's is now); the
    plans, the step view and the gradients are the first process's."""
    # half the step's saved bytes without a budget: each graph planned alone saves too much, so the
    # step is planned again as a whole with one shared fraction (graphs compiled under byte budgets, then that)
    run = _aot_runner(tmp_path, {"memory_budget": 593920})
    first = run()
    assert first["aot_hits"] == 0
    assert first["shared"] is not None and not first["step_from_cache"]  # the step was planned as a whole: each
    # graph lowered again with the plans its estimates searched for (the plan cache, in this process)
    assert first["from_cache"] == [True, True] and first["partitions"] == [1, 1]
    folder = tmp_path / "remat" / "plans"
    records = sorted(folder.glob("graph-*.pkl"))
    # two graphs under their byte budgets, the one called again in the first step at its least peak for
    # the rest of it (remat_fx/step.py _hold_first_step), and both under the shared fraction
    assert len(records) == 5
    assert len(list(folder.glob("step-*.json"))) == 2  # the step's record, under each of its graphs
    second = run()
    # the two graphs at the shared fraction, at their first call: not under the byte budgets first
    assert second["aot_hits"] == 2 and second["from_cache"] == [True, True]
    assert second["partitions"] == [0, 0] and second["step_from_cache"]  # no partition ran, no step plan
    # nor the first process's first step (the graph called again runs at its least peak from its second call
    # on: remat_fx/step.py _hold_first_step); before that, it went over, and said so
    assert "went over" not in second["log"] and "went over" not in first["log"]
    for k in ("shared", "saved", "peak", "step", "plan", "estimate", "options"):
        assert second[k] == first[k], k
    for record in records:  # a hit without its plan: compiled again without AOTAutograd's cache
        record.write_bytes(b"not a record")
    third = run()
    assert third["aot_hits"] == 2 and third["peak"] == first["peak"] and third["saved"] == first["saved"]
    assert sum(plan_cache.load_record(r) is not None for r in records) == 2  # the two it used, written again


HOLD_STEP = ATTENTION_LM + r"""
import json, sys
import remat_fx as remat
from remat_fx import step as step_mod
from remat_fx.step import STEP

g = torch.Generator().manual_seed(1)
x, y = torch.randint(0, 128, (8, 64), generator=g), torch.randint(0, 128, (8, 64), generator=g)
torch.manual_seed(0)
model = Model()
loss_of(model(x), y).backward()
want = [p.grad.clone() for p in model.parameters()]
searched = []
hold = step_mod.hold_step
step_mod.hold_step = lambda calls: searched.append(len(calls)) or hold(calls)
options = json.loads(sys.argv[1])
run = torch.compile(model, backend="remat", options=options)
loss = torch.compile(loss_of, backend="remat", options=options) if sys.argv[2] == "compiled loss" else loss_of
for _ in range(3):
    model.zero_grad(set_to_none=True)
    loss(run(x), y).backward()
for p, w in zip(model.parameters(), want):
    torch.testing.assert_close(p.grad, w, rtol=1e-5, atol=1e-6)
report = remat.step_report()
graphs = sorted(set(STEP.last), key=lambda g: g.index)
print(json.dumps({"searched": searched, "held": str(report.held), "taken": sorted(report.held.taken.values()),
                  "estimate": report.peak.peak, "from_cache": report.held.from_cache,
                  "saved": [[(s.name, s.bytes) for s in g.plan.saved] for g in graphs],
                  "peak": [g.plan.peak.step for g in graphs], "budget": [str(g.plan.budget) for g in graphs],
                  "options": [g.active.memory_budget.fraction for g in graphs]}))
"""


def test_a_second_process_holds_the_step_as_the_first_did_without_searching(tmp_path):
    """A fraction memory_budget's step held on its whole-step estimate (remat_fx/step.py hold_step: a
    block graph called 6 times a step, the loss apart) is in the plan cache too: the second process
    compiles each graph with the plan its step took, at its first call, and takes the hold as it
    was, without its search: the same plans, reports and step estimate, the same gradients."""
    run = _hold_runner(tmp_path)
    first = run()
    assert first["searched"] == [7] and not first["from_cache"] and first["taken"]  # held: a plan taken
    assert first["options"] == [0.9, 0.9]  # budget 0.9's plans, lowered again
    second = run()
    assert second["searched"] == [] and second["from_cache"]  # the hold read, not searched
    assert second["held"] == first["held"] + " (read from the plan cache: held when this step was first planned)"
    for k in ("taken", "estimate", "saved", "peak", "budget", "options"):
        assert second[k] == first[k], k
    assert all("in its step, budget 0.9's plan, which saves within this budget" in b for b in second["budget"])


def _hold_runner(tmp_path):
    def run(loss="compiled loss", folder=tmp_path):
        env = dict(os.environ, REMAT_FX_PLAN_CACHE="1", REMAT_FX_CACHE_DIR=str(folder), PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", HOLD_STEP, json.dumps({"lower": "eager", "memory_budget": 0.8}),
                              loss], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        got["budget"] = [re.sub(r"solver, [0-9.]+ ms", "solver", b) for b in got["budget"]]  # its own solve time
        return got

    return run


@pytest.mark.slow
def test_a_step_other_than_the_recorded_one_is_held_from_its_graphs_own_plans(tmp_path):
    """The record of a step held with its loss compiled apart gives the block graph budget 0.9's plan
    at its first call; a process whose step computes the loss eagerly is not that step: it is held
    from the graph's own plan at 0.8 (it took the recorded plan as its own, reported the step's own
    estimate as 0.9's, and the next process searched again), as a process without the record holds
    it, and its own record is read by the next process."""
    run = _hold_runner(tmp_path)
    alone = run("eager loss", folder=tmp_path / "alone")  # the eager-loss step, without any record
    assert alone["searched"] and alone["taken"], alone
    first = run()
    assert first["searched"] and first["taken"]
    second = run("eager loss")  # compiled from the compiled-loss step's record, then held as its own step
    assert second["searched"] and not second["from_cache"]
    for k in ("held", "taken", "estimate", "saved", "peak", "budget", "options"):
        assert second[k] == alone[k], k
    third = run("eager loss")
    assert third["searched"] == [] and third["from_cache"]
    for k in ("taken", "estimate", "saved", "peak", "budget", "options"):
        assert third[k] == alone[k], k


AUTO_STEP = MODEL + r"""
import json, torch
from remat_fx import options as options_module, step as step_mod
from remat_fx.step import STEP
options_module._cuda_available = lambda: True  # a device's free memory, stood in for
read = {"optimizer": False}
# the free memory at a step's start: 1.25 MiB before the optimizer's first step, 1 MiB after (its state)
step_mod.auto_limit = lambda: 5 * 2**18 - (2**18 if read["optimizer"] else 0)
planned = []
plan_step = step_mod.plan_step
step_mod.plan_step = lambda *a, **k: planned.append(1) or plan_step(*a, **k)
torch.manual_seed(0)
model = Model(d=32)  # blocks with a graph break halfway: a step of two compiled graphs
x = torch.randn(4, 64, 32)
f = torch.compile(model, backend="remat", options={"lower": "eager", "peak_budget": "auto"})
for _ in range(3):
    model.zero_grad(set_to_none=True)
    f(x).backward()
    read["optimizer"] = True
print(json.dumps({"planned": len(planned), "from_cache": STEP.step_plan.from_cache, "limit": STEP.step_plan.limit,
                  "shared": STEP.step_plan.fraction}))
"""


def test_a_peak_budget_auto_steps_record_is_keyed_by_the_limit_its_first_compile_read(tmp_path):
    """peak_budget="auto": the step is planned at the second step's start, against the device's free
    memory read after the optimizer's first step, which a later process's first compile does not
    see; its record is keyed by the reading of the graphs' compile, so the next process finds it
    (keyed by the later reading, it never did), checks it against its own step's limit, and plans
    nothing."""
    env = dict(os.environ, REMAT_FX_PLAN_CACHE="1", REMAT_FX_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))

    def run():
        out = subprocess.run([sys.executable, "-c", AUTO_STEP], capture_output=True, text=True, timeout=600,
                             env=env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = run()
    assert first["planned"] == 1 and not first["from_cache"] and first["limit"] == 2**20
    second = run()
    assert second["planned"] == 0 and second["from_cache"] and second["shared"] == first["shared"]


def test_a_cache_folder_that_cannot_be_written_is_said_once_and_a_tilde_is_the_home(tmp_path, monkeypatch):
    """REMAT_FX_CACHE_DIR naming a file (or a folder the process cannot write): the compile's plans were
    silently never kept, where remat.fit warned for the same folder; '~/x' made a folder named '~' in
    the working directory (a helper's review)."""
    import warnings

    monkeypatch.setenv("REMAT_FX_PLAN_CACHE", "1")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("REMAT_FX_CACHE_DIR", str(blocker))
    monkeypatch.setattr(plan_cache, "_UNWRITABLE", set())
    model, x = _mlp(), torch.randn(16, 32)
    want = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
    with pytest.warns(UserWarning, match=r"^remat_fx: the plan cache could not write in .*a_file/plans \(\w+Error: "
                                         r".*\): the plans made here are not kept for the next run, which plans "
                                         r"again\. Set REMAT_FX_CACHE_DIR to a folder it can write, or "
                                         r"REMAT_FX_PLAN_CACHE=0 to turn the cache off\.$"):
        plan, got = _step(model, x, memory_budget=0.3)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per folder
        _step(model, x, memory_budget=0.2)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("REMAT_FX_CACHE_DIR", "~/cache")
    assert plan_cache.cache_root() == tmp_path / "cache"


def test_a_failed_write_leaves_neither_a_partial_entry_nor_its_temporary_file(tmp_path, monkeypatch):
    """write_atomic (every cache writer's): the old file or the new one, never a part, and no
    temporary file left in the folder when the write fails (a full disk)."""
    path = tmp_path / "plans" / "plan-x.json"
    plan_cache.write_atomic(path, b"old")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(plan_cache.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        plan_cache.write_atomic(path, b"new")
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan-x.json"]


def test_writers_of_one_process_write_one_entry_side_by_side(tmp_path):
    """Writers that share a process id (threads here; ranks in containers that share the cache
    folder) each write through a temporary file of their own: none fails, none leaves a file behind,
    and the entry is one writer's whole. (The temporary file was named by the process id: one
    writer's rename took it from under another, whose write then failed.)"""
    import threading

    path = tmp_path / "plans" / "plan-x.json"
    errors = []

    def writer(k):
        try:
            for _ in range(200):
                plan_cache.write_atomic(path, str(k).encode() * 1000)
        except OSError as e:  # pragma: no cover - the failure this test is for
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_bytes() in {str(k).encode() * 1000 for k in range(4)}
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan-x.json"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~plan_cache._UMASK  # as open() makes a file, for the cache's readers


def test_a_hit_after_a_lowering_over_the_limit_keeps_the_plan_the_hit_was_cached_with(tmp_path, monkeypatch):
    """Under a byte peak_budget a graph may be lowered several times (passes/lower.py
    _lower_within_peak): in a second process the first lowering can miss AOTAutograd's cache, be
    partitioned and go over the limit, and the next hit the cache, where the first process left the
    lowering that met it. The compiled code is the hit's: so is the plan (from the record), not the
    plan partitioned before it, which the record then kept in its place."""
    import copy

    from torch._dynamo.utils import counters

    from remat_fx import step as step_module
    from remat_fx.passes import partition
    from remat_fx.passes.plan import record as record_plan
    from remat_fx.step import STEP

    torch._dynamo.reset()
    STEP.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    torch.compile(model, backend="remat", options={"lower": "eager"})(torch.randn(4, 8)).sum().backward()
    graph = STEP.finished()[0]
    over, met = copy.copy(graph.plan), copy.copy(graph.plan)
    over.peak_budget, met.peak_budget = 1, 2  # which plan is which
    path = tmp_path / "record"
    plan_cache.save_record(path, met, graph.grads, graph.primals)  # the first process's: the lowering that met it

    def lowered_twice(gm, example_inputs, options, aot_cache=None, aot_lookup=True):
        for sink in partition._SINKS:  # the first lowering: partitioned, over the limit
            sink.append(graph.joint)
        record_plan(over)
        counters["aot_autograd"]["autograd_cache_hit"] += 1  # the second: a hit
        return "the hit's code"

    monkeypatch.setattr(step_module, "lower", lowered_twice)
    assert graph._lower(graph.active, path) == "the hit's code"
    assert graph.plan.peak_budget == 2 and graph.plan.from_cache and graph.joint is None
    assert plan_cache.load_record(path)["plan"].peak_budget == 2
    STEP.reset()


@pytest.mark.slow
def test_a_byte_peak_budget_caches_the_lowering_that_met_it_in_inductors_schedule(tmp_path):
    """A byte peak_budget is checked against Inductor's schedules of the lowered graphs: the first
    process's lowering that met it is what AOTAutograd's cache keeps, and the second process loads
    it with the plan and the lowered estimate that were checked."""
    run = _aot_runner(tmp_path, {"peak_budget": 460_800})  # 450 KiB: under the step's 562 KiB without it
    first = run()
    assert first["aot_hits"] == 0 and "None" not in first["lowered"]  # checked on the schedules
    second = run()
    assert second["aot_hits"] == 2 and second["from_cache"] == [True, True] and second["partitions"] == [0, 0]
    for k in ("saved", "peak", "step", "plan", "lowered", "estimate"):
        assert second[k] == first[k], k
    assert "peak_budget 450.00 KiB" in second["step"]


def test_a_lowering_from_the_fx_graph_cache_alone_is_scheduled_again_before_the_peak_budget_accepts_it(
        tmp_path, monkeypatch):
    """Inductor's FX graph cache gives a lowered graph without scheduling it again: under a byte
    peak_budget such a lowering (here: the FX graph cache kept, AOTAutograd's entries removed) is
    made again with the caches off, so that the plan's lowered estimate is read, not taken on trust."""
    import shutil

    from remat_fx.passes.lower import lower
    from remat_fx.options import parse_options

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32))
    x = torch.randn(64, 32)
    options = parse_options({"peak_budget": 200_000})
    lowered = []
    for _ in range(2):
        torch._dynamo.reset()

        def backend(gm, example_inputs):
            fn = lower(gm, example_inputs, options, aot_cache=lambda plan: None)  # the caches on, no record kept
            lowered.append(remat.last_plan().lowered)
            return fn

        torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
        shutil.rmtree(tmp_path / "inductor" / "aotautograd", ignore_errors=True)
    assert list((tmp_path / "inductor").glob("fxgraph/*/*"))  # the FX graph cache's entries stayed
    assert lowered[0] is not None and lowered[1] == lowered[0]
