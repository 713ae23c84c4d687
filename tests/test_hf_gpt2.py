"""A Hugging Face transformers GPT-2 (small config, no download) with remat.checkpoint per block:
gradients equal to no checkpointing, eagerly and under backend="remat"."""
import pytest
import torch
import transformers

import remat_fx as remat


class RematBlock(torch.nn.Module):
    """Wraps a GPT2Block so its forward runs as one remat.checkpoint region."""

    def __init__(self, block, index):
        super().__init__()
        self.block, self.name = block, f"h.{index}"

    def forward(self, *args, **kwargs):
        return remat.checkpoint(self.name)(self.block)(*args, **kwargs)


def _model(dropout=0.0):
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _loss(model, ids):
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gpt2_checkpoint_per_block(mode, dropout):
    model = _model(dropout)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)  # the reference runs in the same mode: compiled dropout draws differently
    mode(lambda ids: _loss(model, ids))(ids).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for i, block in enumerate(model.transformer.h):
        model.transformer.h[i] = RematBlock(block, i)
    torch._dynamo.reset()
    torch.manual_seed(5)
    mode(lambda ids: _loss(model, ids))(ids).backward()
    mode.assert_grads([p.grad for p in model.parameters()], want)
    if mode.compiled:
        saved = {s.name: s for s in remat.last_plan().saved}
        assert saved["transformer.h.0.block.add"].reason == "output of checkpoint region 'h.0'"
        # dropout's draws are kept as the bool masks made from them (a quarter of the float32 draw)
        masks = [s for s in remat.last_plan().saved if s.reason.startswith("made from random op")]
        assert bool(masks) == (dropout > 0) and all(s.dtype == torch.bool for s in masks), masks
        assert [s for s in remat.last_plan().saved if s.reason.startswith("random op")] == []
