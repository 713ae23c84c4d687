"""The example GPT: every checkpoint variant matches no checkpointing bitwise; exact saved names/bytes."""
import importlib.util
import pathlib
import sys

import pytest
import torch

import remat_fx as remat

_spec = importlib.util.spec_from_file_location(
    "example_gpt", pathlib.Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
gpt = sys.modules["example_gpt"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

CFG = gpt.GPTConfig(vocab=64, seq=16, d_model=32, n_head=2, n_layer=2)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_all_variants_match_no_checkpointing(dropout):
    cfg = gpt.GPTConfig(**{**CFG.__dict__, "dropout": dropout})
    idx, targets = gpt.random_batch(cfg, 2, seed=1)

    def grads(ckpt, pol):
        model = gpt.make_model(cfg, ckpt, pol)
        torch.manual_seed(11)  # same dropout masks in every variant
        return gpt.grads_of(model, idx, targets)

    want = grads("none", "recompute_all")
    for ckpt, pol in [("torch", "recompute_all"), ("remat", "recompute_all"), ("remat", "save_matmuls"),
                      ("remat", lambda n: remat.CheckpointPolicy.SAVE)]:
        got = grads(ckpt, pol)
        for name in want:
            assert torch.equal(got[name], want[name]), (ckpt, pol, name)


def test_save_matmuls_holds_exactly_the_named_tensors():
    batch = 2
    model = gpt.make_model(CFG, "remat", "save_matmuls")
    idx, targets = gpt.random_batch(CFG, batch)
    report = remat.memory_report(model(idx, targets))
    act = batch * CFG.seq * CFG.d_model * 4  # one (B, T, C) float32 activation
    # Each SAVE matmul's backward input (LN outputs, the core's output, gelu's output) is made by a
    # recomputed op, so the recompute hands it over again and the tape keeps nothing for it; a SAVE
    # matmul's output is kept for the recomputed op that reads it. Nothing is kept for the trailing
    # residual add after mlp.down: the recompute stops after the region's last saved tensor.
    per_layer = {
        "attn.core.inputs.0": 3 * act,  # the qkv output
        "attn.residual.inputs.1": act,  # the proj output
        "mlp.act.inputs.0": 4 * act,  # the up output
    }
    want = {f"layers.{i}.{k}" for i in range(CFG.n_layer) for k in per_layer}
    assert report.names() == want
    got = {e.qualname: e.bytes for e in report.entries if e.policy == "SAVE"}
    for i in range(CFG.n_layer):
        for k, nbytes in per_layer.items():
            assert got[f"layers.{i}.{k}"] == nbytes, k
    inputs = [e for e in report.entries if e.policy == "INPUT"]
    assert [e.bytes for e in inputs] == [act] * CFG.n_layer
    assert report.total_bytes == CFG.n_layer * (sum(per_layer.values()) + act)


def test_save_matmuls_owners():
    model = gpt.make_model(CFG, "remat", "save_matmuls")
    idx, targets = gpt.random_batch(CFG, 2)
    act = 2 * CFG.seq * CFG.d_model * 4
    assert remat.memory_report(model(idx, targets)).bytes_by_owner() == {
        f"layers.{i}.{op}": n for i in range(CFG.n_layer)
        for op, n in (("attn.qkv", 3 * act), ("attn.proj", act), ("mlp.up", 4 * act))}
