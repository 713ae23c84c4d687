"""Ranks that plan together: a graph that one rank cannot compile fails on every rank, with that
rank's message; remat.fit decides on figures every rank agrees on.

Under DDP or FSDP each rank compiles the same graphs in the same order, each planned against its
own inputs: a budget that only one rank cannot meet (a larger batch there, another sequence
length) raised on that rank alone, and the others went on into their next collective, which then
failed with the transport's error (gloo: "Connection closed by peer") or waited for the process
group's timeout (NCCL). Here every rank, after compiling a training graph with a memory or peak
budget, writes whether it could into the process group's store and waits (at most ``WAIT_S``
seconds) for the other ranks' word on the same graph: when one could not, every rank raises an
error naming that rank and its message (the same class for ``BudgetInfeasible`` and
``PeakInfeasible``, else a RuntimeError). A rank that could not raises at once. A step of several
graphs with a whole-step limit, planned again as a whole once it has run (remat_fx/step.py
``_after_step``), exchanges its word the same way (``plan_on_every_rank``), on every rank,
planning or not.

Which graphs take part: training graphs (grad mode on, an input that requires grad) with a budget,
on their frame's first compile (Dynamo's compile id), counted per rank in compile order by a
counter in the store. A recompile (new shapes on one rank), an inference graph (an evaluation on
one rank) or a graph without a budget compiles as before, with no word exchanged. A rank that
waits past ``WAIT_S`` (the ranks compile different graphs, or one compiles much more slowly)
logs a warning and goes on, unless every rank it waits for has said (a key in the store, set
before its work) that it is at work on the same exchange: then it waits on, in steps of
``WAIT_S``, up to ``BUSY_WAIT_S`` (a whole-step plan of a large model can take minutes).
``WAIT_S = 0`` turns the exchange off; keep it under the process group's timeout. A fake process
group (``backend="fake"``) has no store: nothing is exchanged.

remat.fit measures each rank's step: ``agreed`` gives every rank the same figures to decide on
(the largest measured peak, the smallest budget any rank's estimate asks for), so that the ranks
run the same steps and end with the same plan, or fail together.

The store is the default process group's, read with ``torch.distributed.distributed_c10d.
_get_default_store`` (private; checked on torch 2.13 and 2.14: ``tests/test_distributed.py``);
the compile id with ``torch._guards.CompileContext.current_compile_id`` (private, likewise).
"""
from __future__ import annotations

import datetime
import logging
import time
from typing import Callable, Sequence, TypeVar

import torch

log = logging.getLogger("remat_fx")

#: seconds a rank waits for the others' word on a graph it has compiled (0: no exchange)
WAIT_S = 300.0
#: while every silent rank has said it is at work on the same exchange (a long whole-step plan),
#: the wait goes on, in steps of WAIT_S, up to this many seconds in all
BUSY_WAIT_S = 1800.0

_PREFIX = "remat_fx/compile"

T = TypeVar("T")


def _group():
    """torch.distributed with a default process group of two ranks or more that has a store,
    else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # a torch built without distributed
        return None
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    if dist.get_backend() == "fake":  # its store can neither set nor wait
        return None
    return dist


def first_compile() -> bool:
    """Whether Dynamo is compiling a frame for the first time (not a recompile on new shapes)."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return compile_id is None or not getattr(compile_id, "frame_compile_id", 0)


def _training(example_inputs: Sequence) -> bool:
    """AOTAutograd's test: grad mode on and an input that requires grad."""
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def on_every_rank(compile_graph: Callable[[], T], budgeted: bool, example_inputs: Sequence) -> T:
    """``compile_graph()``, whose failure on any rank of the default process group fails every
    rank, for the graphs the module doc names."""
    dist = _group() if budgeted and WAIT_S > 0 and _training(example_inputs) and first_compile() else None
    if dist is None:
        return compile_graph()
    return _exchange(dist, _PREFIX, compile_graph,
                     lambda index: f"compile a graph that this rank could (training graph {index} with a budget, "
                                   f"counted from 0 on each rank)",
                     lambda rank, index: f"rank {rank} compiled its graph {index}; the other ranks did not say within "
                                         f"{WAIT_S:g} s whether they could compile theirs")


def plan_on_every_rank(plan_step: Callable[[], T], first_compiles: bool) -> T:
    """``plan_step()``: a step of several graphs with a whole-step limit, planned again as a whole
    once it has run (remat_fx/step.py ``_after_step``), whose failure on any rank fails every rank.
    Each rank plans on its own estimates, so with uneven inputs one rank may find no plan that fits
    while the others go on; they went on into the step's collectives, where the failed rank never
    came (gloo: "Connection closed by peer"; NCCL: a hang until the process group's timeout). Every
    rank calls this once per new step of budgeted graphs, planning or not, and waits (at most
    ``WAIT_S``) for the others' word. ``first_compiles``: every graph of the step from its frame's
    first compile; a step with a recompile (new shapes on one rank) is not waited on."""
    dist = _group() if WAIT_S > 0 and first_compiles else None
    if dist is None:
        return plan_step()
    return _exchange(dist, "remat_fx/step", plan_step,
                     lambda index: f"plan its step within the whole-step limit, which this rank could (step {index} "
                                   f"planned as a whole, counted from 0 on each rank)",
                     lambda rank, index: f"rank {rank} planned its step {index} as a whole; the other ranks did not "
                                         f"say within {WAIT_S:g} s whether they could plan theirs")


def _exchange(dist, prefix: str, fn: Callable[[], T], failed: Callable[[int], str],
              timed_out: Callable[[int, int], str]) -> T:
    """``fn()`` on this rank, then its word ("ok", or the error) in the process group's store, under
    this rank's count of ``prefix`` exchanges, and the other ranks' word on the same count: an error
    of theirs is raised here too (the same class for BudgetInfeasible and PeakInfeasible)."""
    from torch.distributed.distributed_c10d import _get_default_store

    from remat_fx.passes.budget import BudgetInfeasible
    from remat_fx.passes.peak import PeakInfeasible

    store, rank, world = _get_default_store(), dist.get_rank(), dist.get_world_size()
    index = store.add(f"{prefix}/count/{rank}", 1) - 1  # this rank's exchanges so far, in the store's lifetime
    key = f"{prefix}/{index}/"
    store.set(f"{key}busy/{rank}", "1")  # at work on this exchange: the others wait for its word past WAIT_S
    try:
        result = fn()
    except Exception as e:
        try:
            store.set(key + str(rank), f"{type(e).__name__}\n{e}")
        except Exception:  # noqa: BLE001 - the rank's own error is the one to raise
            pass
        raise
    store.set(key + str(rank), "ok")
    others = [r for r in range(world) if r != rank]
    started = time.monotonic()
    while True:
        try:
            store.wait([key + str(r) for r in others], datetime.timedelta(seconds=WAIT_S))
            break
        except Exception as e:  # noqa: BLE001 - the store's timeout error differs across versions
            silent = [r for r in others if not store.check([key + str(r)])]
            at_work = all(store.check([f"{key}busy/{r}"]) for r in silent)
            if not at_work or time.monotonic() - started >= BUSY_WAIT_S:
                log.warning("remat_fx: %s (%s): going on", timed_out(rank, index), str(e).splitlines()[0][:200])
                return result
            log.warning("remat_fx: rank %d waits for rank(s) %s, at work on the same exchange (%s %d) for %.0f s",
                        rank, ", ".join(map(str, silent)), prefix, index, time.monotonic() - started)
    for r in range(world):
        if r == rank:
            continue
        word = store.get(key + str(r)).decode()
        if word != "ok":
            name, message = word.split("\n", 1)
            error = {"BudgetInfeasible": BudgetInfeasible, "PeakInfeasible": PeakInfeasible}.get(name, RuntimeError)
            raise error(f"remat_fx: rank {r} of {world} could not {failed(index)}: {name}: {message}")
    return result


def agreed(value: T, combine: Callable[[list], T]) -> T:
    """``combine`` of every rank's ``value`` (a list by rank), under a default process group of two
    ranks or more; ``combine([value])`` without one. A collective (``all_gather_object``, public): every
    rank must call it at the same point. remat.fit takes its decisions on the ranks' agreed figures
    (the largest measured peak, ...), so that every rank runs the same number of steps, lowers the
    same plans and fails, when nothing fits, together; on per-rank figures the ranks' searches could
    take different branches, and one rank would run a step (and its collectives) the others never
    run. Under NCCL the objects travel on ``torch.cuda.current_device()``: set each rank's device
    (``torch.cuda.set_device``), as torch.distributed asks."""
    dist = _group()
    if dist is None:
        return combine([value])
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return combine(values)


def together(fn: Callable[[], T], what: str) -> T:
    """``fn()`` on every rank; if it raised on any rank, every rank raises (the rank's own error
    where it failed, a RuntimeError naming that rank elsewhere) instead of going on into a step
    whose collectives the failed rank never joins. A collective, as ``agreed``."""
    try:
        result, error = fn(), None
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        result, error = None, e
    words = agreed(None if error is None else f"{type(error).__name__}: {error}", lambda by_rank: by_rank)
    if error is not None:
        raise error
    failed = [(r, w) for r, w in enumerate(words) if w is not None]
    if failed:
        rank, word = failed[0]
        raise RuntimeError(f"remat_fx: rank {rank} of {len(words)} failed while {what}: {word}")
    return result
