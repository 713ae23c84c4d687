"""remat under DDP and FSDP2 (``fully_shard``), on real gloo process groups (2 CPU processes).

Each test spawns one process group and runs many cases in it (spawning costs seconds);
tests/distributed.py joins the processes with a deadline, so a hang fails instead of wedging
the suite. Gradients are compared with the same model run in one process on the two ranks'
batches concatenated (each rank computes that reference itself); dropout runs compare every
budget with a run that recomputes nothing, under the same per-rank seeds.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat_fx as remat
from tests.distributed import WORLD, run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch built without torch.distributed/gloo")

D, T, B = 128, 8, 4  # width (DDP's buckets are >= 1 MiB: two or more per model), tokens, batch per rank
BUDGETS = {"none": {}, "0.3": {"memory_budget": 0.3}, "0": {"memory_budget": 0}, "save glob": {"save": ["*up.addmm"]}}


class Block(nn.Module):
    """LayerNorm -> up -> GELU -> down (-> dropout), residual. ``region``: None, or the options of a
    remat.checkpoint around the whole forward (then up and down are named remat.native_ops)."""

    def __init__(self, index: int, p: float = 0.0, region=None):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.name, self.p, self.region = f"blocks.{index}", p, region

    def body(self, x):
        if self.region is None:
            h = self.down(F.gelu(self.up(self.ln(x))))
        else:
            h = remat.native_op(F.linear, f"{self.name}.up")(self.ln(x), self.up.weight, self.up.bias)
            h = remat.native_op(F.linear, f"{self.name}.down")(F.gelu(h), self.down.weight, self.down.bias)
        return x + F.dropout(h, self.p, self.training)

    def forward(self, x):
        if self.region is None:
            return self.body(x)
        return remat.checkpoint(self.name, **self.region)(self.body)(x)


class Net(nn.Module):
    """``outside``: remat.checkpoint around each block's call (AC outside the FSDP unit)
    instead of inside its forward."""

    def __init__(self, n: int = 3, p: float = 0.0, region=None, outside: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(i, p, None if outside else region) for i in range(n))
        self.outside = region if outside else None

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x) if self.outside is None else remat.checkpoint(f"blocks.{i}", **self.outside)(block)(x)
        return x


def batch(rank: int) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(100 + rank))


def loss_of(out):
    return out.square().mean()


def reference_grads(n: int = 3):
    """The same model in one process, on the ranks' batches concatenated."""
    net = Net(n)
    loss_of(net(torch.cat([batch(r) for r in range(WORLD)]))).backward()
    return {k: p.grad for k, p in net.named_parameters()}


def full_grads(model) -> dict:
    """Gradients by parameter name, whole (an FSDP gradient is a DTensor shard: gathered)."""
    model = getattr(model, "module", model)  # DDP
    model = getattr(model, "_orig_mod", model)  # torch.compile
    out = {}
    for k, p in model.named_parameters():
        g = p.grad
        out[k.replace("module.", "").replace("_orig_mod.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def grad_error(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    return max(((got[k] - want[k]).abs().max() / want[k].abs().max().clamp_min(1e-12)).item() for k in want)


def shard(net: Net, compile_options=None, whole: bool = False):
    from torch.distributed.fsdp import fully_shard

    for block in net.blocks:
        fully_shard(block)
        if compile_options is not None and not whole:
            block.compile(backend="remat", options=compile_options)
    fully_shard(net)
    if compile_options is not None and whole:
        return torch.compile(net, backend="remat", options=compile_options)
    return net


def ddp(net: Net, compile_options=None):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(net, bucket_cap_mb=1)  # a block's parameters are ~0.5 MiB: DDPOptimizer splits the graph
    return model if compile_options is None else torch.compile(model, backend="remat", options=compile_options)


def step(model, x, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    out = model(x)
    loss_of(out).backward()
    return out


# -- the eager runtime ---------------------------------------------------------------------------

def test_recompute_starts_after_every_tensor_hook_on_the_region_outputs():
    """FSDP2 all-gathers a module's parameters in backward from a tensor hook on the module's
    outputs, registered after the module's forward ran, i.e. after the region inside it
    returned: the region's recompute must start after such hooks, not before."""
    events = []
    w = torch.randn(D, D, requires_grad=True)

    def body(x):
        events.append("forward")
        return torch.tanh(x @ w)

    x = torch.randn(2, D, requires_grad=True)
    y = remat.checkpoint("r")(body)(x)
    y.register_hook(lambda g: events.append("tensor hook"))
    y.sum().backward()
    assert events == ["forward", "tensor hook", "forward"]


EAGER_REGIONS = {"recompute all": {}, "save glob": {"save": "*.up"}, "offload + save": {"save": "*.up", "offload": "*.down"}}


def _eager_worker(rank):
    want = reference_grads()
    x = batch(rank)
    results = {}
    for engine, outside, regions in (("fsdp", False, EAGER_REGIONS), ("fsdp", True, {"recompute all": {}}),
                                     ("ddp", False, {"recompute all": {}, "save glob": {"save": "*.up"}})):
        for label, region in regions.items():
            net = Net(region=region, outside=outside)
            # what the tapes hold, in one process at this rank's batch: parameters are never counted
            local = Net(region=region, outside=outside)
            held_local = remat.memory_report(local(x)).total_bytes
            model = shard(net) if engine == "fsdp" else ddp(net)
            out = model(x)
            held = remat.memory_report(out).total_bytes
            loss_of(out).backward()
            key = f"{engine}{' (checkpoint outside fully_shard)' if outside else ''}, {label}"
            results[key] = (grad_error(full_grads(model), want), held, held_local)
    # dropout, per-rank seeds: every region equals the run that recomputes nothing
    for engine in ("fsdp", "ddp"):
        wrap = shard if engine == "fsdp" else ddp
        plain = wrap(Net(p=0.25))
        step(plain, x, seed=7 + rank)
        base = full_grads(plain)
        for label, region in EAGER_REGIONS.items():
            model = wrap(Net(p=0.25, region=region))
            step(model, x, seed=7 + rank)
            got = full_grads(model)
            results[f"{engine}, dropout, {label}"] = (max((got[k] - base[k]).abs().max().item() for k in base), 0, 0)
    return results


def test_eager_runtime_under_fsdp2_and_ddp():
    """remat.checkpoint inside fully_shard'ed blocks (torchtitan's order: AC, then fully_shard),
    around them, and under DDP: gradients match one process on the whole batch, dropout with
    per-rank seeds matches a run that recomputes nothing, and the tapes hold what they hold in
    one process (FSDP's parameters are not counted)."""
    per_rank = run_ranks(_eager_worker, timeout=120)
    for rank, results in enumerate(per_rank):
        for case, (err, held, held_local) in results.items():
            if "dropout" in case:
                assert err == 0, f"rank {rank}, {case}: gradients differ from the run without recompute by {err}"
                continue
            assert err < 1e-5, f"rank {rank}, {case}: gradients off by {err:.2e} (relative)"
            assert held == held_local > 0, f"rank {rank}, {case}: tapes hold {held} bytes, {held_local} in one process"
