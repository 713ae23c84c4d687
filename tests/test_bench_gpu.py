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


def test_verdicts_check_each_monotone_mode_on_its_own_rows():
    """--monotone default,grid measures both modes per budget: each mode's rows are checked for a
    peak that does not rise as the budget falls, and PyTorch's first step is compared with the
    default mode's row at its budget."""
    mib = 2**20

    def row(variant, peak, ms=100.0, first_s=10.0):
        return {"variant": variant, "peak": peak * mib, "ms": ms, "first_s": first_s}

    rows = [row("eager, per-layer checkpointing", 20),
            row("PyTorch budget 0.1", 42, ms=100.0, first_s=30.0),
            row("remat memory_budget 0.1", 17, ms=101.0, first_s=45.0),
            row("remat memory_budget 0.1, monotone grid", 17, ms=110.0, first_s=60.0),
            row("remat memory_budget 0.05", 18.4, ms=120.0),
            row("remat memory_budget 0.05, monotone grid", 17, ms=125.0)]
    out = gpu.verdicts(rows)
    assert out[0] == "- remat memory_budget, measured peak non-increasing as the budget falls: NO (1% spread allowed)"
    assert out[1] == ("- remat memory_budget, monotone grid, measured peak non-increasing as the budget falls: yes "
                      "(1% spread allowed)")
    assert out[3] == ("- PyTorch budget 0.1 (42.0 MiB, 100.0 ms): remat memory_budget 0.1 (17.0 MiB, 101.0 ms); "
                      "first step at the same budget 1.50x PyTorch's")
