"""Two gloo processes on CPU, for the distributed tests (tests/test_distributed.py).

``run_ranks(worker, *args)`` starts one process per rank (``spawn``), each joining a gloo
process group on a free port, runs ``worker(rank, *args)`` there and returns what each rank
returned. The processes are always joined with a deadline and killed past it, so a hang (a
collective one rank never reaches) fails the test instead of wedging the suite; a rank that
raises fails it with that rank's traceback.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(worker, rank: int, port: int, out_dir: str, pg_timeout: float, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # two ranks share the machine's cores
    result = {"rank": rank}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        # every rank's gloo mesh connected before any goes on: a worker that returns at once (rank 1
        # of test_a_rank_that_compiles_alone...) exited while rank 0 was still connecting, which failed
        # with "Gloo connectFullMesh failed ... Connection closed by peer" (torch 2.14.1, a busy machine)
        dist.barrier()
        try:
            result["value"] = worker(rank, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


class RankFailed(AssertionError):
    pass


def run_ranks(worker, *args, timeout: float = 120.0, pg_timeout: float = 30.0, raise_errors: bool = True):
    """``worker(rank, *args)`` on ``WORLD`` gloo ranks; a list of what each returned, by rank.
    With ``raise_errors=False`` a rank's result is ``{"error": traceback}`` when it raised."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="remat_dist_") as out_dir:
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(worker, rank, port, out_dir, pg_timeout, args), daemon=True)
                 for rank in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
        results = []
        for rank in range(WORLD):
            path = os.path.join(out_dir, f"{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append({"rank": rank, "error": f"rank {rank} wrote no result (exit code "
                                                       f"{procs[rank].exitcode})"})
    if hung:
        raise RankFailed(f"ranks {hung} still running after {timeout:.0f} s: killed. Results of the others: "
                         + "; ".join(r.get("error", "ok") for r in results))
    if raise_errors:
        errors = [f"rank {r['rank']}:\n{r['error']}" for r in results if "error" in r]
        if errors:
            raise RankFailed("\n".join(errors))
        return [r["value"] for r in results]
    return [r if "error" in r else r["value"] for r in results]
