"""Shrink a failing case: delete what the failure does not need, greedily, until nothing more can go.

Candidates, tried in this order, each kept when the case still fails the same way (same kind,
and for an error the same exception type):

- a block inlined (its body kept, the region / annotation / autocast gone), or dropped whole;
- an op deleted (its readers read its first input instead: every value has the same shape);
- a graph break deleted;
- a ``remat.native_op`` / ``remat.op`` wrapper removed (the bare op stays);
- a backend option, region option or annotate option dropped.
"""
from __future__ import annotations

import time
from typing import Callable, Iterator, List, Optional, Tuple

from remat_fx.fuzz.oracle import Result, check
from remat_fx.fuzz.program import Block, GraphBreak, Op, Program


def _paths(body, prefix=()) -> Iterator[Tuple[int, ...]]:
    for i, s in enumerate(body):
        yield prefix + (i,)
        if isinstance(s, Block):
            yield from _paths(s.body, prefix + (i,))


def _at(body, path):
    """(the list holding the statement at ``path``, its index)."""
    for i in path[:-1]:
        body = body[i].body
    return body, path[-1]


def _remap(body, old: int, new: int) -> None:
    for s in body:
        if isinstance(s, Op):
            s.ins = [new if i == old else i for i in s.ins]
        elif isinstance(s, Block):
            _remap(s.body, old, new)


def _defined(s) -> List[Tuple[int, int]]:
    """(value, the value its readers fall back on) for the ops in ``s``."""
    if isinstance(s, Op):
        return [(s.out, s.ins[0])]
    if isinstance(s, Block):
        return [d for t in s.body for d in _defined(t)]
    return []


def candidates(p: Program) -> Iterator[Program]:
    paths = list(_paths(p.body))
    # blocks: drop whole (largest first), then inline
    for inline in (False, True):
        for path in paths:
            q = p.copy()
            body, i = _at(q.body, path)
            s = body[i]
            if not isinstance(s, Block):
                continue
            if inline:
                body[i:i + 1] = s.body
            else:
                del body[i]
                for old, new in reversed(_defined(s)):
                    _remap(q.body, old, new)
            yield q
    for path in reversed(paths):  # ops and graph breaks, last first (a later op reads earlier ones)
        q = p.copy()
        body, i = _at(q.body, path)
        s = body[i]
        if isinstance(s, (Op, GraphBreak)):
            del body[i]
            if isinstance(s, Op):
                _remap(q.body, s.out, s.ins[0])
            yield q
    for path in paths:
        q = p.copy()
        body, i = _at(q.body, path)
        s = body[i]
        if isinstance(s, Op) and s.wrap is not None:
            s.wrap = None
            yield q
        if isinstance(s, Block):
            for key in list(s.options):
                q = p.copy()
                body, i = _at(q.body, path)
                del body[i].options[key]
                yield q
    for key in list(p.options):
        if key != "lower":
            q = p.copy()
            del q.options[key]
            yield q


def _same(a: Result, b: Result) -> bool:
    if a.kind != b.kind:
        return False
    if a.kind in ("internal_error", "remat_error", "undocumented_text", "invalid_program"):
        return a.detail.split(":")[0] == b.detail.split(":")[0]
    return True


def shrink(p: Program, failure: Optional[Result] = None, *, max_checks: int = 200, max_seconds: float = 300.0,
           check_fn: Callable[[Program], Result] = check, log: Optional[Callable[[str], None]] = None
           ) -> Tuple[Program, Result, int]:
    """The smallest program found that fails like ``p`` does: (program, its result, checks run)."""
    failure = failure or check_fn(p)
    t0, checks = time.perf_counter(), 0
    progress = True
    while progress and checks < max_checks and time.perf_counter() - t0 < max_seconds:
        progress = False
        for q in candidates(p):
            if checks >= max_checks or time.perf_counter() - t0 >= max_seconds:
                break
            checks += 1
            r = check_fn(q)
            if _same(r, failure):
                p, failure, progress = q, r, True
                if log:
                    log(f"  shrunk to {len(p.ops())} ops, {len(p.blocks())} blocks, {len(p.options)} options")
                break
    return p, failure, checks
