import gc
import os

# Each pytest-xdist worker gets its share of the cores for torch's intra-op threads (OpenMP), set
# before torch starts them: on 2 cores, 2 workers of 2 threads each left OpenMP's spinning threads
# contending for the cores, and the suite took 1116 s; on 1 thread each, 847 s (2026-12-07). The
# subprocesses tests start (the plan cache's processes) inherit it. Inductor's C++ kernels depend on
# the thread count: tests/test_peak.py runs its 8-layer Llama at 2 threads and at 1.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

import pytest  # noqa: E402
import torch  # noqa: E402

if _workers > 1:  # torch may have been imported before this file: set it here too
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# the plan cache (remat_fx/plan_cache.py) off for the suite, its subprocesses included: a test that
# compiles a graph an earlier test compiled would otherwise replay that search instead of running it
# (tests/test_plan_cache.py turns it on, in a folder of its own)
os.environ["REMAT_FX_PLAN_CACHE"] = "0"

from tests import helpers  # noqa: E402


def pytest_collection_finish(session):
    """What importing torch, transformers and the test modules made lives to the end of the session:
    frozen out of the cyclic collector's reach, each full collection walks only what the tests made.
    Full collections are frequent here (Python's own, remat_fx/measure.py's before a measured step,
    a compiling step's released-bytes record in remat_fx/step.py began): on tests/test_budget.py
    (one process, 2026-12-02) 51 of them took 24.4 s of 301.5 s, 0.48 s each; frozen, 0.24-0.30 s
    each (66 in 16.1 s)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """The tests marked slow (each 18 s or more of a 2-worker run, 2026-12-02) run first, in their
    order, then the rest: on 2 workers (``--dist worksteal``, pyproject.toml) the end of the run is then
    short tests that either worker takes, not a long one that starts late while the other worker
    sits idle. Every worker collects the same order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable


@pytest.fixture(autouse=True)
def _fresh():
    helpers.reset()
    torch.manual_seed(0)
    yield
    helpers.reset()


class Mode:
    """How a test runs its step: eagerly (bitwise-equal gradients expected) or under
    torch.compile(backend="remat", fullgraph=True) with the eager lowering (decompositions
    reorder float math: allclose at 1e-5). Inductor-lowered tests are few and separate."""

    def __init__(self, name: str):
        self.name = name
        self.compiled = name == "compile"

    def __call__(self, fn):
        if not self.compiled:
            return fn
        return torch.compile(fn, backend="remat", options={"lower": "eager"}, fullgraph=True)

    def assert_grads(self, got, want):
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            if self.compiled:
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"gradient {i}: {m}")
            else:
                assert torch.equal(a, b), f"gradient {i} differs: max abs diff {(a - b).abs().max().item()}"

    def __repr__(self):
        return self.name


@pytest.fixture(params=["eager", "compile"])
def mode(request):
    torch._dynamo.reset()
    return Mode(request.param)


def modes_with_compile_gap(reason: str):
    """Parametrize ``mode`` directly where compiler mode has a known gap (strict xfail)."""
    return pytest.mark.parametrize(
        "mode", [Mode("eager"), pytest.param(Mode("compile"), marks=pytest.mark.xfail(strict=True, reason=reason))],
        ids=["eager", "compile"])
