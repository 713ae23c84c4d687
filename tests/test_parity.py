"""One annotation, two modes: the example GPT keeps the same named activations, with the same
bytes, on the eager tape and in the compiled plan (both lowerings), with the same gradients."""
import pytest
import torch

import remat_fx as remat
from tests.test_example_gpt import CFG, gpt


@pytest.mark.parametrize("lower", ["eager", "inductor"])
def test_gpt_same_named_activations_and_gradients(lower):
    idx, targets = gpt.random_batch(CFG, 2, seed=3)
    want = gpt.grads_of(gpt.make_model(CFG, "none", "recompute_all"), idx, targets)

    model = gpt.make_model(CFG, "remat", "save_matmuls")
    eager = remat.memory_report(model(idx, targets)).bytes_by_owner()
    act = 2 * CFG.seq * CFG.d_model * 4
    assert eager["layers.0.attn.qkv"] == 3 * act  # the qkv output, kept for the recomputed attn.core

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="remat", options={"lower": lower}, fullgraph=True)
    model.zero_grad(set_to_none=True)
    loss = compiled(idx, targets)
    plan = remat.last_plan()
    assert plan.lower == lower
    assert plan.bytes_by_owner() == eager
    loss.backward()
    for name, g in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["recompute_all", "save_matmuls", "save_all", "alternate"])
def test_gpt_policy_mixes_compiled_match_eager_gradients(policy):
    P = remat.CheckpointPolicy
    chosen = {"save_all": lambda n: P.SAVE,
              "alternate": lambda n: P.SAVE if n.endswith((".qkv", ".core", ".up")) else P.RECOMPUTE}.get(policy, policy)
    idx, targets = gpt.random_batch(CFG, 2, seed=4)
    want = gpt.grads_of(gpt.make_model(CFG, "none", "recompute_all"), idx, targets)
    model = gpt.make_model(CFG, "remat", chosen)
    eager = remat.memory_report(model(idx, targets)).bytes_by_owner()
    torch._dynamo.reset()
    loss = torch.compile(model, backend="remat", options={"lower": "eager"}, fullgraph=True)(idx, targets)
    compiled = remat.last_plan().bytes_by_owner()
    if policy != "save_all":
        assert compiled == eager
    else:
        # native SAVE ops (the residual adds, gelu) keep SAVE-made inputs on the eager tape even
        # where their backward does not read them (an add's): the compiled plan keeps less
        assert sum(compiled.values()) < sum(eager.values())
    loss.backward()
    for name, g in want.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["its policy", "its region's glob"])
def test_a_save_annotate_block_owns_what_it_keeps_in_both_modes(how):
    """``bytes_by_owner`` files a SAVE ``remat.annotate`` block's activations under the block's name
    in the compiled plan, as the eager tape does (it left them out: ``{}`` against ``{'blk.act': 512}``)."""
    P = remat.CheckpointPolicy
    w = torch.randn(16, 16, requires_grad=True)

    def body(x):
        with remat.annotate("blk.act", policy=P.SAVE if how == "its policy" else None):
            h = torch.tanh(x)
        return h @ w

    def f(x):
        return remat.checkpoint("r", save=[] if how == "its policy" else ["blk.*"])(body)(x)

    x = torch.randn(8, 16)
    assert remat.memory_report(f(x)).bytes_by_owner() == {"blk.act": 8 * 16 * 4}
    torch._dynamo.reset()
    torch.compile(f, backend="remat", fullgraph=True, options={"lower": "eager"})(x).sum().backward()
    assert remat.last_plan().bytes_by_owner() == {"blk.act": 8 * 16 * 4}
