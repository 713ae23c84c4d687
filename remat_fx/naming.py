"""One naming scheme for both modes: remat names and the globs that select them.

A remat name is a dotted string such as ``layers.3.attn.qkv``; it must be unique
inside one checkpoint region. Globs use :mod:`fnmatch` syntax (``*.qkv``,
``layers.[0-3].*``) and are matched against the full name.
"""
from __future__ import annotations

import difflib
import fnmatch
from typing import Dict, Iterable, List, Optional, Tuple

_KINDS = ("SAVE", "OFFLOAD", "RECOMPUTE")


def _as_patterns(value, option: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):  # its keys would be read as the globs, its values dropped
        raise ValueError(f"option {option!r} must be a glob string or a list of them, got a dict {value!r}")
    if isinstance(value, (bytes, bytearray)):  # read one by one, its bytes were named as ints (got 120)
        raise ValueError(f"option {option!r} must be a glob string or a list of them, got {type(value).__name__} "
                         f"{value!r}: decode it to a str")
    try:
        pats = tuple(value)
    except TypeError:
        raise ValueError(f"option {option!r} must be a glob string or a list of them, got {value!r}") from None
    for p in pats:
        if not isinstance(p, str):
            raise ValueError(f"option {option!r} must hold glob strings, got {p!r}")
    return pats


class NameGlobs:
    """Maps names to a policy name through ``save``/``offload``/``recompute`` globs.

    When several kinds match, the order is RECOMPUTE > OFFLOAD > SAVE: asking to
    recompute is the memory-safe choice, so it wins a conflict.
    """

    __slots__ = ("save", "offload", "recompute", "_cache")

    def __init__(self, save: Iterable[str] = (), offload: Iterable[str] = (), recompute: Iterable[str] = ()):
        self.save = _as_patterns(save, "save")
        self.offload = _as_patterns(offload, "offload")
        self.recompute = _as_patterns(recompute, "recompute")
        # the same glob in two kinds: the first of RECOMPUTE > OFFLOAD > SAVE wins, the other is dead
        for loser, winner in (("save", "recompute"), ("offload", "recompute"), ("save", "offload")):
            both = [p for p in getattr(self, loser) if p in getattr(self, winner)]
            if both:
                raise ValueError(f"glob {both[0]!r} is in both {loser}= and {winner}=: {winner.upper()} wins a "
                                 f"conflict, so it would never {loser} anything; keep it in one of the two")
        self._cache: dict = {}

    def __bool__(self) -> bool:
        return bool(self.save or self.offload or self.recompute)

    def match(self, name: str) -> Optional[str]:
        try:
            return self._cache[name]
        except KeyError:
            pass
        found = None
        for kind, pats in (("RECOMPUTE", self.recompute), ("OFFLOAD", self.offload), ("SAVE", self.save)):
            if any(fnmatch.fnmatchcase(name, p) for p in pats):
                found = kind
                break
        self._cache[name] = found
        return found


def shadowed_message(what: str, pattern: str, names: List[str], winner: str, scope: str = "") -> str:
    """The warning for a glob (``what``: "region 'r' save") every match of which a stronger kind's glob
    takes (``winner``, as NameGlobs.match names it): it decides nothing ``scope`` (" in this graph")."""
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return (f"remat_fx: {what} glob '{pattern}' decides nothing{scope}: all it selects ({shown}) a "
            f"{winner.lower()} glob selects too, and {winner} wins a conflict (RECOMPUTE > OFFLOAD > SAVE). "
            f"Narrow the {winner.lower()} glob, or drop this one.")


def join(*parts: Optional[str]) -> str:
    """Join name parts with dots, skipping empty ones."""
    return ".".join(p for p in parts if p)


def callable_name(fn) -> str:
    # __name__, not __qualname__: the same in both modes (Dynamo mis-traces __qualname__)
    return getattr(fn, "__name__", None) or type(fn).__name__


def check_name(name, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what}: the op name must be a non-empty string, got {name!r}")
    return name


# -- the annotation schema both modes share ----------------------------------
# Under torch.compile the runtime APIs write these keys into torch.fx.traceback.annotate,
# which AOTAutograd copies onto every joint-graph node traced inside (node.meta["custom"]).
META_NAME = "remat_name"  # the remat name of the op (or annotate block) the node belongs to
META_POLICY = "remat_policy"  # CheckpointPolicy name written at the call site, or None
META_KIND = "remat_kind"  # "op" (autograd Function), "native", "annotate"
META_REGION = "remat_region"  # the enclosing remat.checkpoint region's name
META_REGION_GLOBS = "remat_region_globs"  # (save, offload, recompute) glob tuples of that region
META_BUDGET_REGION = "remat_budget_region"  # the innermost remat.annotate(..., memory_budget=...) block
META_BUDGET = "remat_budget"  # that block's budget, as written (fraction, bytes or size string)
META_KEYS = frozenset({META_NAME, META_POLICY, META_KIND, META_REGION, META_REGION_GLOBS, META_BUDGET_REGION,
                       META_BUDGET})


def tracing_annotation(entries: dict):
    """A context manager that tags the ops traced inside it with ``entries`` (no-op in eager)."""
    import torch.fx.traceback as fx_traceback

    return fx_traceback.annotate(entries)


def op_annotation(name: str, policy, kind: str):
    """The annotation a named op (kind "op", "native" or "annotate") puts on its traced nodes."""
    return tracing_annotation({META_NAME: name, META_POLICY: policy.name if policy is not None else None,
                               META_KIND: kind})


def close_globs(pattern: str, candidates: List[str]) -> List[Tuple[str, List[str]]]:
    """Up to 3 globs close to ``pattern`` that do match (for the warning on a glob that selects
    nothing, in both modes): each candidate name written in the pattern's shape (its dotted parts
    aligned from the left, and from the right, with the pattern's wildcard parts kept), with the
    candidates each matches."""
    parts = pattern.split(".")
    wild = [any(c in part for c in "*?[") for part in parts]
    forms: Dict[str, None] = {}
    for name in candidates:
        words = name.split(".")
        if len(words) < len(parts):
            continue
        for aligned in (words[:len(parts)], words[len(words) - len(parts):]):
            form = ".".join(p if w else a for p, w, a in zip(parts, wild, aligned))
            if form != pattern:
                forms[form] = None
    found = []
    for form in difflib.get_close_matches(pattern, list(forms), n=10, cutoff=0.7):
        hits = [n for n in candidates if fnmatch.fnmatchcase(n, form)]
        if hits:
            found.append((form, hits))
    return found[:3]
