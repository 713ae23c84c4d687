"""The benchmarks' paired timing: each pair's ratio is b's step over a's, the order alternating."""
import benchmarks.timing as timing


class _Fake:
    """A model + loss whose step advances a fake clock by ``seconds`` and logs its name."""

    def __init__(self, name, seconds, clock, log):
        self.name, self.seconds, self.clock, self.log = name, seconds, clock, log

    def zero_grad(self, set_to_none=True):
        pass

    def __call__(self):
        self.log.append(self.name)
        self.clock[0] += self.seconds
        return self

    def backward(self):
        pass


def test_paired_time_ratios_alternate_the_order_and_divide_b_by_a(monkeypatch):
    clock, log = [0.0], []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    a, b = _Fake("a", 0.1, clock, log), _Fake("b", 0.25, clock, log)
    ratios = timing.paired_time_ratios((a, a), (b, b), rounds=4)
    assert [round(r, 9) for r in ratios] == [2.5] * 4
    assert log == ["a", "b",  # the unrecorded pair
                   "a", "b", "b", "a", "a", "b", "b", "a"]


def _saved_bytes(fn, x):
    """Bytes the step saves for backward (the compiled graph's saved tensors pass these hooks)."""
    import torch

    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    out.backward()
    return sum(saved)


def test_torch_budget_backend_keeps_its_budget_beside_another_and_after_a_reset():
    """Two functions compiled with PyTorch's budget set around their first call shared one graph
    (Inductor's wrappers compare equal), and after a reset recompiled at the default budget: the
    benchmark then timed budget 1's graph for every budget. Bound to the backend, each keeps its own."""
    import torch

    from benchmarks import torch_budget

    w = torch.randn(256, 256, requires_grad=True)

    def loss(x):
        return ((x @ w).sin() @ w).sin().sum()  # budget 1 saves 1.25 MiB, budget 0 512 KiB

    x = torch.randn(256, 256)
    full = torch.compile(loss, backend=torch_budget.backend(1.0), fullgraph=True)
    least = torch.compile(loss, backend=torch_budget.backend(0.0), fullgraph=True)
    full_bytes, least_bytes = _saved_bytes(full, x), _saved_bytes(least, x)
    assert least_bytes < full_bytes
    torch._dynamo.reset()  # as the benchmarks do between variants: each recompiles at its next call
    assert _saved_bytes(least, x) == least_bytes
    assert _saved_bytes(full, x) == full_bytes


def test_each_variant_keeps_its_own_compiled_code_and_plans_under_its_own_switch(monkeypatch):
    """benchmarks/variants.py: two variants with equal options, one without the blocks-first
    rerun search, each compiled once (no Dynamo reset, after which an earlier variant compiles again
    under the later one's switch) and planned with its own switch, which is restored after."""
    import torch

    from benchmarks.variants import variant_backend
    from remat_fx.passes import partition, rerun

    seen = []
    plan = partition._partition

    def recording(*args, **kwargs):
        seen.append(rerun._BLOCKS_FIRST)
        return plan(*args, **kwargs)

    monkeypatch.setattr(partition, "_partition", recording)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    options = {"memory_budget": 0.5, "lower": "eager"}
    values = torch.compile(model, backend=variant_backend({**options, "_blocks_first": False}))
    both = torch.compile(model, backend=variant_backend(options))
    for _ in range(3):
        for fn in (values, both):
            fn(x).sum().backward()
    assert seen == [False, True]
    assert rerun._BLOCKS_FIRST is True


def test_warm_start_medians_take_each_ratio_within_its_round():
    """benchmarks/warm_start.py --rounds: a variant's ratio is its first step over PyTorch's of the
    same round, and the table gives the median of those (not a ratio of medians)."""
    from benchmarks.warm_start import median_table

    def run(first, planning=None):
        return {"first_s": first, "planning_s": planning, "inductor_s": first / 2, "compiled": 40}

    rounds = {"PyTorch budget 0.1": [(run(40.0), 1.0), (run(60.0), 1.0), (run(44.0), 1.0)],
              "remat memory_budget 0.1": [(run(50.0, 5.0), 1.25), (run(66.0, 7.0), 1.1), (run(57.2, 6.0), 1.3)]}
    lines = median_table(rounds)
    assert lines[0].startswith("| variant | first step s (median of 3) |")
    assert lines[2] == "| PyTorch budget 0.1 | 44.0 | 1.00 (1.00, 1.00, 1.00) |  | 22.0 | 40 |"
    # the median of the rounds' ratios, 1.25; the ratio of the medians would be 57.2 / 44.0 = 1.30
    assert lines[3] == "| remat memory_budget 0.1 | 57.2 | 1.25 (1.25, 1.10, 1.30) | 6.0 | 28.6 | 40 |"
