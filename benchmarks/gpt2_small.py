"""GPT-2 small (12 layers, 768 wide, 124M parameters, from its config: no download) for the
budget solver's timing on a full-size graph:

    python -m remat_fx pareto benchmarks/gpt2_small.py:model_and_batch --lower eager \\
        --budgets 0,0.1,0.3,0.5,0.7,0.9,1 --out benchmarks/out/gpt2_small

The table's "solve ms" column is the budget pass per budget (feasible minimum, 0-1 program, tags).
"""
import torch
import torch.nn.functional as F


def model_and_batch(seq: int = 128, batch: int = 1, dropout: float = 0.1):
    import transformers

    cfg = transformers.GPT2Config(n_positions=1024, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def loss(ids):
        logits = model(ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    return loss, (ids,)
