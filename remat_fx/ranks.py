"""A graph that one rank cannot plan fails on every rank, with that rank's message.

Under DDP or FSDP each rank compiles the same graphs in the same order, each planned against its
own inputs: a budget that only one rank cannot meet (a larger batch there, another sequence
length) raised on that rank alone, and the others went on into their next collective, which then
failed with the transport's error (gloo: "Connection closed by peer") or waited for the process
group's timeout (NCCL). Here every rank, after compiling a graph with a memory or peak budget,
writes whether it could into the process group's store and waits (at most ``WAIT_S`` seconds) for
the other ranks' word on the same graph (training graphs with a budget, counted in compile order):
when one could not (``BudgetInfeasible``, ``PeakInfeasible``), every rank raises the same error
class, naming that rank and its message. A rank that could not plan raises at once. A rank that
waits past ``WAIT_S`` (the ranks compile different graphs, or one compiles much more slowly) logs
a warning and goes on, as before.

The store is the default process group's, read with ``torch.distributed.distributed_c10d.
_get_default_store`` (private; checked on torch 2.13 and 2.14; ``tests/test_distributed.py``).
"""
from __future__ import annotations

import datetime
import logging
from typing import Callable, Dict, TypeVar

import torch

log = logging.getLogger("remat_fx")

#: seconds a rank waits for the others' word on a graph it has compiled
WAIT_S = 300.0

_PREFIX = "remat_fx/compile"
_counts: Dict[int, int] = {}  # id(default process group) -> graphs agreed on so far

T = TypeVar("T")


def _group():
    """(torch.distributed, default process group) with two ranks or more, else None."""
    try:
        import torch.distributed as dist
    except ImportError:  # a torch built without distributed
        return None
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return dist, dist.group.WORLD


def on_every_rank(compile_graph: Callable[[], T], budgeted: bool) -> T:
    """``compile_graph()`` (a CompiledGraph), whose planning error on any rank of the default
    process group fails every rank. Only training graphs planned against a memory or peak budget
    (``budgeted``) are counted and waited on: an inference graph (an evaluation on one rank) has
    no plan to fail, and another error is the rank's own."""
    from remat_fx.passes.budget import BudgetInfeasible
    from remat_fx.passes.peak import PeakInfeasible

    group = _group() if budgeted and torch.is_grad_enabled() else None
    if group is None:
        return compile_graph()
    dist, pg = group
    from torch.distributed.distributed_c10d import _get_default_store

    store, rank, world = _get_default_store(), dist.get_rank(), dist.get_world_size()

    def key() -> str:  # the next training graph's, in compile order
        index = _counts.get(id(pg), 0)
        _counts[id(pg)] = index + 1
        return f"{_PREFIX}/{index}/"

    try:
        result = compile_graph()
    except (BudgetInfeasible, PeakInfeasible) as e:  # raised by a training graph's partition
        store.set(key() + str(rank), f"{type(e).__name__}\n{e}")
        raise
    if getattr(result, "plan", None) is None:
        return result  # an inference graph
    mine = key()
    index = int(mine.split("/")[-2])
    store.set(mine + str(rank), "ok")
    others = [mine + str(r) for r in range(world) if r != rank]
    try:
        store.wait(others, datetime.timedelta(seconds=WAIT_S))
    except Exception as e:  # noqa: BLE001 - the store's timeout error differs across versions
        log.warning("remat_fx: rank %d compiled its graph %d; the other ranks did not say within %g s whether they "
                    "could plan theirs (%s): going on", rank, index, WAIT_S, str(e).splitlines()[0][:200])
        return result
    for r in range(world):
        if r == rank:
            continue
        word = store.get(mine + str(r)).decode()
        if word != "ok":
            name, message = word.split("\n", 1)
            error = {"BudgetInfeasible": BudgetInfeasible, "PeakInfeasible": PeakInfeasible}[name]
            raise error(f"remat_fx: rank {r} of {world} could not compile a graph that this rank could (the "
                        f"{_ordinal(index + 1)} training graph with a budget each rank compiled): {name}: {message}")
    return result


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"
