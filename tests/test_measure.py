"""remat_fx.measure on the CPU: torch.profiler's allocation events (a private API, isolated in
remat_fx/measure.py; checked on torch 2.13.0 and 2.14.1, the two versions CI runs)."""
import gc

import torch

from remat_fx.measure import step_peak_bytes


def _model_and_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    x = torch.randn(64, 256)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().sum().backward()

    return model, step


def test_cpu_step_peak_does_not_depend_on_what_ran_before():
    """The CPU allocator learns a block's size only while a profiler records memory: the free of
    the last step's gradients was missed after an unprofiled step and seen after a profiled one,
    so the same step measured differently by what ran before it. Now it measures what the step
    allocates, every time, whatever ran before."""
    model, step = _model_and_step()
    step()
    after_unprofiled = step_peak_bytes(step, "cpu")
    after_profiled = step_peak_bytes(step, "cpu")
    step()
    again = step_peak_bytes(step, "cpu")
    assert after_unprofiled == after_profiled == again
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    hidden = 64 * 1024 * 4
    # the new gradients are all alive at the end, and the backward held the hidden activations
    # and their gradient at least while the first layer's weight gradient was made
    assert grads + hidden <= after_unprofiled <= grads + 6 * hidden, (after_unprofiled, grads, hidden)


def test_cpu_step_peak_credits_the_frees_of_its_own_allocations():
    """A step that allocates and frees the same bytes over and over peaks at one block, not their sum."""
    def step():
        for _ in range(8):
            torch.empty(1 << 20, dtype=torch.uint8).fill_(1)

    assert step_peak_bytes(step, "cpu") == 1 << 20


def test_cpu_step_peak_does_not_credit_garbage_from_before_it_collected_during_it():
    """The CPU measurement runs no collection first: garbage made before the call (a reference
    cycle holding 4 MiB, made during an earlier measured call, so that the allocator knows its
    size and its free makes an event) that the collector frees during the call lowers nothing;
    the call's own 8 MiB are its peak."""
    class Cycle:
        pass

    kept = []

    def make():
        cycle = Cycle()
        cycle.me, cycle.block = cycle, torch.ones(1 << 20)
        kept.append(cycle)

    def step():
        gc.collect()  # frees the cycle's 4 MiB inside the measured call
        torch.empty(1 << 21).fill_(1)

    enabled = gc.isenabled()
    gc.disable()  # the cycle stays until the step collects it
    try:
        step_peak_bytes(make, "cpu")
        kept.clear()
        assert step_peak_bytes(step, "cpu") == 1 << 23
    finally:
        if enabled:
            gc.enable()


def test_an_address_allocated_again_was_freed_in_between():
    """A block freed on a thread the profiler does not follow (gloo's, where FSDP's collectives drop
    their buffers) makes no free event; when its address is allocated again, the block before it
    there is credited as freed. Events: (time, order, bytes, address); bytes below 0 free."""
    from remat_fx.measure import _peak

    a, b = 0x1000, 0x2000
    # a allocated, its free unseen, a allocated again: one block there, not two
    assert _peak([(1, 0, 100, a), (2, 1, 50, b), (3, 2, 100, a)]) == 150
    # the second block at that address larger: the level rises by the difference only
    assert _peak([(1, 0, 100, a), (2, 1, 300, a), (3, 2, -300, a)]) == 300
    # a free seen is credited once (the later allocation there does not credit it again)
    assert _peak([(1, 0, 100, a), (2, 1, -100, a), (3, 2, 40, b), (4, 3, 100, a)]) == 140
    # a free of a block allocated before the events (unknown size) is not credited
    assert _peak([(1, 0, -500, b), (2, 1, 100, a)]) == 100
