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
