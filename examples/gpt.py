"""A small GPT whose matmuls and attention core are remat-aware autograd Functions.

    python examples/gpt.py

Model: token embedding + learned positions, ``n_layer`` pre-LN blocks (causal
multi-head self-attention, GELU MLP), final LayerNorm, tied (default) or untied
LM head.

Inside a block the named remat ops are::

    layers.{i}.attn.qkv       Linear (x @ W^T + b)                      remat.op
    layers.{i}.attn.core      softmax(QK^T/sqrt(d) + causal mask) V     remat.op (hand-written backward)
    layers.{i}.attn.proj      Linear                                    remat.op
    layers.{i}.attn.residual  x + dropout(attn)                         remat.native_op
    layers.{i}.mlp.up         Linear                                    remat.op
    layers.{i}.mlp.act        gelu                                      remat.native_op
    layers.{i}.mlp.down       Linear                                    remat.op
    layers.{i}.mlp.residual   x + dropout(mlp)                          remat.native_op

LayerNorms and reshapes are plain PyTorch.  The output of a SAVE op is a
data-less placeholder during recompute, so every op that reads a matmul output
is itself a remat op: qkv -> attn.core (a Function), proj -> attn.residual,
up -> mlp.act, down -> mlp.residual (native_op, RECOMPUTE under the presets).
So any policy that maps these names to SAVE/RECOMPUTE is valid, in particular
``save_matmuls`` (SAVE qkv/proj/up/down, recompute the rest, including the
attention core) and ``recompute_all``.

The Functions keep no state on ``ctx`` besides ``ctx.save_for_backward``
(their backward derives shapes from the saved tensors and uses
``ctx.needs_input_grad``), so they need no care about which of the two
forward executions (original or recompute) set what.
"""
from __future__ import annotations

import gc
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import remat_fx as remat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.memory import SavedTensorBytes, fmt_bytes, heap_bytes  # noqa: E402

P = remat.CheckpointPolicy


# -----------------------------------------------------------------------------
# policies: op name -> CheckpointPolicy
# -----------------------------------------------------------------------------
MATMULS = ("qkv", "proj", "up", "down")


def save_matmuls(name: str) -> P:
    """SAVE the four matmuls of each block (``*.qkv``, ``*.proj``, ``*.up``, ``*.down``), RECOMPUTE the rest."""
    return P.SAVE if name.rsplit(".", 1)[-1] in MATMULS else P.RECOMPUTE


def recompute_all(name: str) -> P:
    """RECOMPUTE everything: the same schedule as torch.utils.checkpoint around each block."""
    return P.RECOMPUTE


POLICIES: Dict[str, Callable[[str], P]] = {"save_matmuls": save_matmuls, "recompute_all": recompute_all}


# -----------------------------------------------------------------------------
# remat-aware autograd Functions
# -----------------------------------------------------------------------------
class Linear(torch.autograd.Function):
    """``x @ w^T + b`` over the last dim of ``x`` (any leading dims); saves x and w."""

    @staticmethod
    @remat.auto_forward("x", "w")
    def forward(ctx, x, w, b):
        out = F.linear(x, w, b)
        ctx.save_for_backward(x, w)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = grad @ w if need_x else None
        gw = g2.t() @ x.reshape(-1, x.shape[-1]) if need_w else None
        gb = g2.sum(0) if need_b else None
        return gx, gw, gb


def _causal_mask(t: int, device) -> torch.Tensor:
    # built per call: a module-level cache would be a side effect inside traced checkpoint regions
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


class AttnCore(torch.autograd.Function):
    """Causal attention ``softmax(QK^T / sqrt(d)) V`` on a packed ``qkv`` of shape (B, T, 3C).

    Returns (B, T, C).  Saves q, k, v (views into qkv) and the probabilities.
    """

    @staticmethod
    @remat.auto_forward("q", "k", "v", "probs")
    def forward(ctx, qkv, n_head: int):
        B, T, C3 = qkv.shape
        C = C3 // 3
        D = C // n_head
        q, k, v = qkv.view(B, T, 3, n_head, D).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, T, D) each
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(D))
        scores.masked_fill_(_causal_mask(T, qkv.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        y = probs @ v  # (B, H, T, D)
        ctx.save_for_backward(q, k, v, probs)
        return y.transpose(1, 2).reshape(B, T, C)

    @staticmethod
    def backward(ctx, gy):
        q, k, v, probs = ctx.saved_tensors
        B, H, T, D = q.shape
        scale = 1.0 / math.sqrt(D)
        gy = gy.reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
        gv = probs.transpose(-2, -1) @ gy
        gp = gy @ v.transpose(-2, -1)
        gs = probs * (gp - (gp * probs).sum(-1, keepdim=True))
        gs = gs * scale
        gq = gs @ k
        gk = gs.transpose(-2, -1) @ q
        gqkv = torch.stack((gq, gk, gv), 0).permute(1, 3, 0, 2, 4).reshape(B, T, 3 * H * D)
        return gqkv, None


# -----------------------------------------------------------------------------
# model
# -----------------------------------------------------------------------------
@dataclass
class GPTConfig:
    vocab: int = 512
    seq: int = 128
    d_model: int = 256
    n_head: int = 4
    n_layer: int = 4
    dropout: float = 0.0
    tie_weights: bool = True


PolicyArg = Union[str, Callable[[str], P]]


def _as_policy(policy: PolicyArg) -> Callable[[str], P]:
    if isinstance(policy, str):
        try:
            return POLICIES[policy]
        except KeyError:
            raise ValueError(f"unknown policy preset {policy!r}; presets: {sorted(POLICIES)}") from None
    if not callable(policy):
        raise TypeError(f"policy must be a preset name or a callable name -> CheckpointPolicy, got {policy!r}")
    return policy


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, index: int, model: "GPT"):
        super().__init__()
        assert cfg.d_model % cfg.n_head == 0
        self.index = index
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self._model = [model]  # not a submodule: the policy lives on the GPT
        p = f"layers.{index}"
        self.names = {k: f"{p}.{k}" for k in ("attn.qkv", "attn.core", "attn.proj", "attn.residual",
                                             "mlp.up", "mlp.act", "mlp.down", "mlp.residual")}

    def _residual(self, x, branch):
        if self.dropout > 0.0 and self.training:
            branch = F.dropout(branch, self.dropout, True)
        return x + branch

    def forward(self, x):
        pol = self._model[0].policy
        n = self.names

        def linear(h, mod, key):
            return remat.op(Linear.apply, n[key], policy=pol(n[key]))(h, mod.weight, mod.bias)

        def native(fn, key):
            return remat.native_op(fn, n[key], policy=pol(n[key]))

        qkv = linear(self.ln1(x), self.qkv, "attn.qkv")
        y = remat.op(AttnCore.apply, n["attn.core"], policy=pol(n["attn.core"]))(qkv, self.n_head)
        x = native(self._residual, "attn.residual")(x, linear(y, self.proj, "attn.proj"))
        h = linear(self.ln2(x), self.up, "mlp.up")
        h = native(F.gelu, "mlp.act")(h)
        return native(self._residual, "mlp.residual")(x, linear(h, self.down, "mlp.down"))


class GPT(nn.Module):
    """``checkpoint``: "none", "remat" (remat.checkpoint per block) or "torch"
    (torch.utils.checkpoint per block, non-reentrant).  ``policy``: a preset name
    ("save_matmuls", "recompute_all") or a callable op name -> CheckpointPolicy."""

    CHECKPOINTS = ("none", "remat", "torch")

    def __init__(self, cfg: GPTConfig, checkpoint: str = "none", policy: PolicyArg = "save_matmuls"):
        super().__init__()
        self.cfg = cfg
        self.checkpoint = checkpoint
        self.policy = policy
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, self) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = None if cfg.tie_weights else nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(self._init)
        for b in self.blocks:  # GPT-2 style scaled init of the residual projections
            for lin in (b.proj, b.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    @property
    def checkpoint(self) -> str:
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, value: str) -> None:
        if value not in self.CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {self.CHECKPOINTS}, got {value!r}")
        self._checkpoint = value

    @property
    def policy(self) -> Callable[[str], P]:
        return self._policy

    @policy.setter
    def policy(self, value: PolicyArg) -> None:
        self._policy = _as_policy(value)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        B, T = idx.shape
        if T > self.cfg.seq:
            raise ValueError(f"sequence length {T} > cfg.seq {self.cfg.seq}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for i, block in enumerate(self.blocks):
            if self.checkpoint == "remat":
                x = remat.checkpoint(f"layers.{i}")(block)(x)
            elif self.checkpoint == "torch":
                x = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight) if self.lm_head is None else self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -----------------------------------------------------------------------------
# helpers shared with benchmarks/eager.py
# -----------------------------------------------------------------------------
# (label, checkpoint, policy)
VARIANTS = (
    ("no checkpointing", "none", "recompute_all"),
    ("torch.utils.checkpoint per block", "torch", "recompute_all"),
    ("remat all-recompute", "remat", "recompute_all"),
    ("remat save-matmuls", "remat", "save_matmuls"),
)


def random_batch(cfg: GPTConfig, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab, (batch, cfg.seq), generator=g)
    targets = torch.randint(cfg.vocab, (batch, cfg.seq), generator=g)
    return idx, targets


def make_model(cfg: GPTConfig, checkpoint: str, policy: PolicyArg, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg, checkpoint=checkpoint, policy=policy)


def measure_memory(cfg: GPTConfig, batch: int, checkpoint: str, policy: PolicyArg, repeats: int = 2) -> dict:
    """Bytes held from forward to backward by one variant, on a fresh model.

    Runs ``repeats`` forward+backward passes and reports the last (the first one
    pays one-time allocations).  ``heap``: mallinfo2 delta around the forward;
    ``report``: ``remat.memory_report(loss).total_bytes`` (remat only);
    ``hooks``: unique non-parameter storages seen by saved_tensors_hooks (an
    extra, separate pass so that the hooks cannot disturb the heap reading).
    """
    model = make_model(cfg, checkpoint, policy)
    idx, targets = random_batch(cfg, batch)
    res = {}
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        gc.collect()
        before = heap_bytes()
        loss = model(idx, targets)
        gc.collect()
        res["heap"] = heap_bytes() - before
        res["report"] = remat.memory_report(loss).total_bytes if checkpoint == "remat" else None
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    with SavedTensorBytes(exclude=model.parameters()) as seen:
        loss = model(idx, targets)
    res["hooks"] = seen.total_bytes
    loss.backward()
    del loss, model
    gc.collect()
    return res


def grads_of(model: GPT, idx, targets):
    model.zero_grad(set_to_none=True)
    model(idx, targets).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def check_gradients(cfg: GPTConfig, batch: int = 2) -> Dict[str, bool]:
    """torch.equal of every parameter gradient vs. no checkpointing, per variant."""
    idx, targets = random_batch(cfg, batch, seed=1)
    want = grads_of(make_model(cfg, "none", "recompute_all"), idx, targets)
    out = {}
    for label, ckpt, pol in VARIANTS[1:]:
        got = grads_of(make_model(cfg, ckpt, pol), idx, targets)
        out[label] = all(torch.equal(got[n], want[n]) for n in want)
    return out


def main() -> None:
    torch.manual_seed(0)
    cfg = GPTConfig()
    batch, steps = 8, 8
    print(f"config: {cfg}, batch {batch}, torch {torch.__version__}, {torch.get_num_threads()} threads")

    # 1. train a few steps with remat save-matmuls
    model = make_model(cfg, "remat", "save_matmuls")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx, targets = random_batch(cfg, batch)
    t0 = time.perf_counter()
    for step in range(steps):
        loss = model(idx, targets)
        if step == 0:
            print("\nmemory_report(loss) after the first forward (before backward):")
            print(remat.memory_report(loss))
            print()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")
    print(f"{steps} steps in {time.perf_counter() - t0:.1f}s")
    del model, opt, loss

    # 2. gradients vs. no checkpointing (bitwise)
    print("\ngradients torch.equal to no checkpointing:")
    for label, ok in check_gradients(cfg).items():
        print(f"  {label:34s} {ok}")

    # 3. activation bytes held from forward to backward
    print(f"\nactivation bytes held from forward to backward (batch {batch}, 2nd of 2 runs, fresh model each):")
    header = f"| {'variant':34s} | {'mallinfo2 delta':>15s} | {'memory_report':>13s} | {'saved_tensors_hooks':>19s} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for label, ckpt, pol in VARIANTS:
        r = measure_memory(cfg, batch, ckpt, pol)
        print(f"| {label:34s} | {fmt_bytes(r['heap']):>15s} | {fmt_bytes(r['report']):>13s} | "
              f"{fmt_bytes(r['hooks']):>19s} |")


def pareto_example():
    """For ``python -m remat_fx pareto examples/gpt.py:pareto_example``: the model (no checkpoint
    annotations: the budget decides) and one batch."""
    cfg = GPTConfig(n_layer=2, d_model=128, seq=64, vocab=256)
    model = make_model(cfg, "none", "recompute_all")
    _causal_mask(cfg.seq, torch.device("cpu"))
    return model, random_batch(cfg, 4)


if __name__ == "__main__":
    main()

