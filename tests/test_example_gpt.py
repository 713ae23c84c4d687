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
    per_layer = {
        "attn.qkv.x": act,  # LN1 output, the matmul's backward input
        "attn.core.inputs.0": 3 * act,  # qkv output (a SAVE op's), consumed by the recomputed core
        "attn.proj.x": act,
        "attn.residual.inputs.1": act,  # proj output, read by the recomputed residual add
        "mlp.up.x": act,
        "mlp.act.inputs.0": 4 * act,
        "mlp.down.x": 4 * act,  # gelu output, the down matmul's backward input
    }  # mlp.residual.inputs.1 (down's output) is not kept: the recompute stops before that trailing add
    want = {f"layers.{i}.{k}" for i in range(CFG.n_layer) for k in per_layer}
    assert report.names() == want
    got = {e.qualname: e.bytes for e in report.entries if e.policy == "SAVE"}
    for i in range(CFG.n_layer):
        for k, nbytes in per_layer.items():
            assert got[f"layers.{i}.{k}"] == nbytes, k
    inputs = [e for e in report.entries if e.policy == "INPUT"]
    assert [e.bytes for e in inputs] == [act] * CFG.n_layer
    assert report.total_bytes == CFG.n_layer * (sum(per_layer.values()) + act)
