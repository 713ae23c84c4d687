"""The plan as the user reads it: str(plan) lists activations only, under names the user knows,
one consistent budget story; plan.format(full=True) is the full table."""
import re

import pytest
import torch

import remat_fx as remat
from remat_fx.passes.plan import BudgetReport

KiB = 1024


class Block(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_compact_view_lists_activations_by_the_names_the_user_knows():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())

    def step(x):
        return model(x).sum()

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="remat", options={"lower": "eager"})
    compiled(torch.randn(2, 4, 32)).backward()
    plan = remat.last_plan()
    text = str(plan)
    lines = text.splitlines()
    activations = {s.storage for s in plan.saved if not s.parameter}
    assert lines[0] == (f"remat plan (eager lowering): {len(activations)} activations saved for backward, "
                        f"{remat.memory_budget.fmt_bytes(plan.total_bytes)}; recompute "
                        f"{plan.recompute_flops:,} FLOPs ({len(plan.recomputed)} forward nodes rerun in backward, "
                        f"est. {plan.recompute_cost_s * 1e3:.3f} ms)")
    params = sum(s.parameter for s in plan.saved)
    assert params and lines[-1] == (f"  {params} parameters (not activations) omitted; plan.format(full=True) "
                                    f"lists every saved tensor")
    rows = {re.split(r"\s{2,}", line.strip())[0]: line for line in lines[2:-1]}
    # saved views are filed under the tensor they view (0.relu, not 1.up.view); relu's backward mask
    # (an op the partitioner moved into the forward) under the value it reads
    assert list(rows) == ["input x", "0.relu", "le(0.relu)", "0.down.addmm", "1.relu", "le(1.relu)"], text
    assert rows["input x"] == "  input x        2x4x32 float32 1.00 KiB  graph input"
    assert rows["le(0.relu)"] == "  le(0.relu)    2x4x128    bool 1.00 KiB  min-cut choice"
    assert "primals_" not in text and "view" not in text

    full = plan.format(full=True)
    assert full.splitlines()[0].startswith(f"remat plan (eager lowering): {len(plan.saved)} saved for backward, "
                                           f"{plan.total_bytes:,} bytes")
    assert len(full.splitlines()) == 2 + len(plan.saved)  # header, peak, one line per saved tensor
    assert re.search(r"\n  primals_\d+ +32x128 +float32 +0  parameter", full)


@pytest.mark.parametrize("region", ["torch.utils.checkpoint", "remat.checkpoint"])
def test_a_region_whose_output_is_a_view_keeps_its_boundary_and_says_whose_it_is(region):
    """Blocks ending in a Linear over a 3-d input, each in a checkpoint region: a region's output is
    a view of its addmm, which the min-cut is free to redo, and it redid it with the addmm, so that
    only the step's input was saved and the whole forward was recomputed at once in backward (the
    eager tape holds each region's output). The storage the output views is now kept, as the
    region's output. A torch.utils.checkpoint region (Hugging Face's gradient_checkpointing_enable)
    is named as such (it was "checkpoint region '?'")."""
    import torch.utils.checkpoint as tuc

    torch.manual_seed(0)
    blocks = torch.nn.ModuleList([Block(), Block(), Block()])

    def step(x):
        for i, block in enumerate(blocks):
            x = (tuc.checkpoint(block, x, use_reentrant=False) if region == "torch.utils.checkpoint"
                 else remat.checkpoint(f"b{i}")(block)(x))
        return x.square().sum()

    x = torch.randn(4, 8, 32, requires_grad=True)
    step(x).backward()
    want = [p.grad.clone() for p in blocks.parameters()] + [x.grad]
    blocks.zero_grad(set_to_none=True)
    x.grad = None
    torch._dynamo.reset()
    torch.compile(step, backend="remat", options={"lower": "eager"}, fullgraph=True)(x).backward()
    for got, expected in zip([p.grad for p in blocks.parameters()] + [x.grad], want):
        torch.testing.assert_close(got, expected)
    plan = remat.last_plan()
    text = str(plan)
    assert "'?'" not in text
    rows = [line.split() for line in text.splitlines()[2:] if "output of" in line]
    owner = (lambda i: "a torch.utils.checkpoint region") if region == "torch.utils.checkpoint" else \
        (lambda i: f"checkpoint region 'b{i}'")
    want_rows = [(f"{i}.down.addmm", f"output of {owner(i)}") for i in range(3)]
    assert [(r[0], " ".join(r[5:])) for r in rows] == want_rows, text
    assert plan.total_bytes == 4 * 4 * KiB  # the input and the three blocks' outputs


def test_tensors_sharing_a_name_share_a_row_with_a_count():
    from remat_fx.passes.plan import SavedActivation, _compact_rows

    def act(fx_name, shape, nbytes, reason="min-cut choice", storage=None, storage_shape=None):
        return SavedActivation("blk.add", fx_name, shape, torch.float32, nbytes, reason, label="blk.add",
                               storage=storage or fx_name, storage_shape=storage_shape or shape)

    rows = _compact_rows([act("add", (8, 128), 4 * KiB), act("add_1", (8, 32), KiB),
                          act("view", (256, 4), 0, "min-cut choice (alias of blk.add)", "add", (8, 128))])
    assert rows == ["  blk.add x2  8x128, 8x32 float32 5.00 KiB  min-cut choice"]


@pytest.mark.parametrize("report, text", [
    (BudgetReport("0.3", 6246, 6 * KiB, KiB, 18 * KiB, "ilp", 0.065, 7.6e-5),
     "budget 0.3: target 6.10 KiB (0.3 of the way from the feasible minimum 1.00 KiB to the maximum 18.00 KiB), "
     "achieved 6.00 KiB; ilp solver, 65 ms; est. recompute 0.076 ms"),
    (BudgetReport("1", 18 * KiB, 18 * KiB, KiB, 18 * KiB, "none", 0.771, 0.0),
     "budget 1: target 18.00 KiB (the feasible maximum, the plan without a budget; the minimum is 1.00 KiB), "
     "achieved 18.00 KiB: the plan without a budget fits, no solver ran; est. recompute 0.000 ms"),
    (BudgetReport("0", KiB, KiB, KiB, 18 * KiB, "greedy", 0.002, 1e-4),
     "budget 0: target 1.00 KiB (the feasible minimum; the maximum, the plan without a budget, is 18.00 KiB), "
     "achieved 1.00 KiB; greedy solver, 2 ms; est. recompute 0.100 ms"),
    (BudgetReport("2.00 MiB", 2 * 1024 * KiB, 240 * KiB, 240 * KiB, 240 * KiB, "none", 0.1, 0.0),
     "budget 2.00 MiB: target 2.00 MiB (every plan saves 240.00 KiB), achieved 240.00 KiB: the plan without a "
     "budget fits, no solver ran; est. recompute 0.000 ms"),
    (BudgetReport("0.5", 1500 * KiB, 1413 * KiB, 100 * KiB, 2900 * KiB, "ilp", 0.3, 1e-3, lowered_to=1464 * KiB,
                  fastest_peak=4 * 1024 * KiB, fastest_step_s=0.0125),
     "budget 0.5: target 1.46 MiB (0.5 of the way from the feasible minimum 100.00 KiB to the maximum 2.83 MiB), "
     "achieved 1.38 MiB: solved at a lower target, 1.43 MiB, for a lower estimated peak (the fastest plan under "
     "1.46 MiB: est. peak 4.00 MiB, est. step 12.5 ms); ilp solver, 300 ms; est. recompute 1.000 ms"),
    (BudgetReport("0.1", 16 * KiB, 14 * KiB, KiB, 150 * KiB, "ilp", 0.2, 6e-4, lowered_to=16 * KiB,
                  fastest_peak=193 * KiB, fastest_step_s=0.0033, held_under=158 * KiB, held_by="0.15"),
     "budget 0.1: target 16.00 KiB (0.1 of the way from the feasible minimum 1.00 KiB to the maximum 150.00 KiB), "
     "achieved 14.00 KiB: held at or under 158.00 KiB, the estimated peak of budget 0.15's plan (the monotone "
     "envelope; the fastest plan under 16.00 KiB: est. peak 193.00 KiB, est. step 3.3 ms); ilp solver, 200 ms; "
     "est. recompute 0.600 ms"),
    (BudgetReport("0.1", 16 * KiB, 10 * KiB, KiB, 150 * KiB, "ilp", 0.2, 6e-4, lowered_to=12 * KiB,
                  fastest_peak=193 * KiB, fastest_step_s=0.0033, held_under=158 * KiB, held_by="0.15",
                  held_met=False, held_levels=1),
     "budget 0.1: target 16.00 KiB (0.1 of the way from the feasible minimum 1.00 KiB to the maximum 150.00 KiB), "
     "achieved 10.00 KiB: held as near as it could get to 158.00 KiB, the estimated peak of budget 0.15's first "
     "plan (before its own envelope), solved at a lower target, 12.00 KiB (the monotone envelope; the fastest plan "
     "under 16.00 KiB: est. peak 193.00 KiB, est. step 3.3 ms); ilp solver, 200 ms; est. recompute 0.600 ms"),
], ids=["fraction", "one-no-solver", "zero", "size-empty-range", "lowered", "held", "held-missed-first-plan"])
def test_budget_story(report, text):
    assert str(report) == text


def test_an_infeasible_peak_with_no_room_to_choose_says_what_every_plan_saves():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block())
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="remat",
                             options={"lower": "eager", "memory_budget": 0, "peak_budget": 1024})
    with pytest.raises(remat.PeakInfeasible) as info:  # as it is: Dynamo does not wrap it in BackendCompilerFailed
        compiled(torch.randn(2, 4, 32)).sum().backward()
    assert str(info.value).startswith("remat_fx: peak_budget"), str(info.value)
    assert re.search(r"peak_budget 1.00 KiB \(1,024 bytes\) is below every estimated step peak found: the lowest "
                     r"is [0-9.]+ KiB \([0-9,]+ bytes\), saving [0-9.]+ KiB for backward \(every plan saves "
                     r"[0-9.]+ KiB\)\. Raise peak_budget to at least", str(info.value)), str(info.value)


def test_long_planning_logs_each_candidate_plan(monkeypatch, caplog):
    """Planning past _PROGRESS_S seconds says what it is doing (INFO, logger remat_fx): each plan's
    saved bytes, estimated peak and estimated step time with its reruns (the peak searches trade
    one for the other)."""
    import logging

    import remat_fx.passes.partition as partition

    monkeypatch.setattr(partition, "_PROGRESS_S", 0.0)
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    with caplog.at_level(logging.INFO, logger="remat_fx"):
        f = torch.compile(model, backend="remat", options={"lower": "eager", "memory_budget": 0.3})
        f(torch.randn(4, 16)).sum().backward()
    lines = [r.getMessage() for r in caplog.records if "planning a graph of" in r.getMessage()]
    assert lines and re.search(r"^remat_fx: planning a graph of \d+ nodes, [0-9.]+ s so far: plan 1, memory_budget 0.3, "
                               r"saves [0-9.]+ [KMG]?i?B, estimated peak [0-9.]+ [KMG]?i?B, estimated step [0-9.]+ ms "
                               r"\(\d+ reruns\)$", lines[0]), lines
    torch._dynamo.reset()
