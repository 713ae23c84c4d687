"""benchmarks/gpu.py's reference rows, which no compile is needed for (its compiled rows are the
benchmark's to measure)."""
import argparse
import warnings

import pytest
import torch

import benchmarks.gpu as gpu  # builds Hugging Face models: transformers is a test dependency, not skipped


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_per_layer_checkpointing_row_checkpoints_without_a_deprecated_call(model):
    """The row every remat budget is held against: Hugging Face's own per-layer checkpointing,
    switched on through the name transformers 5 keeps (``gradient_checkpointing_enable`` warns
    that it goes in v6), peaks under eager's on the same model and step."""
    args = argparse.Namespace(model=model, device=torch.device("cpu"), layers=4, hidden=64, vocab=256, batch=2,
                              seq=64, steps=1, lower="inductor", warm_kernels=False, bf16=False)
    eager = gpu.run_variant("eager", args)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        checkpointed = gpu.run_variant("eager, per-layer checkpointing", args, checkpointing=True)
    assert 0 < checkpointed["peak"] < 0.75 * eager["peak"], (checkpointed["peak"], eager["peak"])
