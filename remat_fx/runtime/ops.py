"""Call-site naming: remat.op + remat.auto_forward, and remat.native_op.

``remat.op(Fn.apply, "name", policy)(*args)`` hands the name and policy to the
``@remat.auto_forward``-decorated forward of ``Fn`` through a ContextVar, so the
forward keeps its original signature and ``ctx.save_for_backward`` body.

``remat.native_op(fn, "name", policy)(*args)`` names a call of plain PyTorch ops.
SAVE keeps its outputs and does not rerun it (PyTorch's selective-checkpoint
caching, scoped to this one call); RECOMPUTE reruns it. Both save inputs whose
producer is skipped in recompute, so the op's own backward has real tensors.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from contextvars import ContextVar
from typing import Optional

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._pytree import tree_flatten, tree_unflatten

from remat_fx.naming import callable_name, check_name, op_annotation
from remat_fx.policy import CheckpointPolicy, coerce_policy
from remat_fx.runtime.handle import RematHandle
from remat_fx.runtime.tape import FORWARD, TensorMeta, active_tape, rng_restore


class _Pending:
    __slots__ = ("name", "policy", "taken")

    def __init__(self, name, policy):
        self.name, self.policy, self.taken = name, policy, False


_PENDING: ContextVar[Optional[_Pending]] = ContextVar("remat_fx_pending_op", default=None)


def op(fn, name: str, policy=None):
    """Name one call of an ``auto_forward`` autograd Function: ``remat.op(Fn.apply, name, policy)(*args)``."""
    check_name(name, "remat.op")
    policy = coerce_policy(policy, what=f"remat.op('{name}')")

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            with op_annotation(name, policy, "op"):
                return fn(*args, **kwargs)
        pending = _Pending(name, policy)
        token = _PENDING.set(pending)
        try:
            out = fn(*args, **kwargs)
        finally:
            _PENDING.reset(token)
        if not pending.taken:
            raise TypeError(
                f"remat.op('{name}'): {callable_name(fn)} ran no forward decorated with @remat.auto_forward, "
                "so the name and policy were not used. Decorate the Function's forward with "
                "@remat.auto_forward(<names of its saved tensors>), or use remat.native_op for native ops."
            )
        return out

    return call


def auto_forward(*saved_names: str):
    """Decorate an autograd Function's ``forward(ctx, ...)``; ``saved_names`` name the tensors
    it passes to ``ctx.save_for_backward``, in order."""
    for n in saved_names:
        check_name(n, "remat.auto_forward")
    if len(set(saved_names)) != len(saved_names):
        raise ValueError(f"remat.auto_forward: saved tensor names must be distinct, got {saved_names}")

    def decorate(forward):
        where = callable_name(forward)

        @functools.wraps(forward)
        def wrapped(ctx, *args, **kwargs):
            if torch.compiler.is_compiling():  # names travel as annotations (see remat.op)
                return forward(ctx, *args, **kwargs)
            pending = _PENDING.get()
            token = _PENDING.set(None)  # Functions called inside this forward get no name
            try:
                tape = active_tape()
                if pending is not None:
                    pending.taken = True
                    name, policy = pending.name, pending.policy
                if tape is None:  # outside regions the forward runs as written
                    return forward(ctx, *args, **kwargs)
                if pending is None:
                    # unnamed call inside a region: recomputed, with a positional name
                    name, policy = tape.auto_name(where), None
                handle = RematHandle(ctx, name, policy)
                handle.inputs = args
                if handle.policy.skips_recompute:
                    handle.check_inputs(args)
                ret = handle.maybe_load_saved()
                if ret is not None:
                    return ret
                args = handle.load_inputs(args) if handle.policy is CheckpointPolicy.RECOMPUTE else args
                captured = []
                ctx.save_for_backward = lambda *ts: captured.append(ts)
                try:
                    out = forward(ctx, *args, **kwargs)
                finally:
                    del ctx.save_for_backward
                saved = captured[-1] if captured else ()
                if len(saved) != len(saved_names):
                    raise TypeError(
                        f"remat.auto_forward on {where} (op '{name}'): the forward saved {len(saved)} "
                        f"tensor(s) but the decorator names {len(saved_names)}: {list(saved_names)}. "
                        "Name each tensor passed to ctx.save_for_backward, in order."
                    )
                handle.save_for_backward(dict(zip(saved_names, saved)))
                if isinstance(out, tuple):
                    return handle.finish(out, single=False)
                return handle.finish((out,), single=True)
            finally:
                _PENDING.reset(token)

        return wrapped

    return decorate


def _must_save(ctx, func, *args, **kwargs):
    # views are free to redo and would pin (and charge, and offload) their base, e.g. a weight's .t()
    if func.is_view:
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    return torch_checkpoint.CheckpointPolicy.MUST_SAVE


def native_op(fn, name: str, policy=None):
    """Name one call of native PyTorch ops: ``remat.native_op(torch.mm, name, policy)(x, w)``."""
    check_name(name, "remat.native_op")
    policy = coerce_policy(policy, what=f"remat.native_op('{name}')")

    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            with op_annotation(name, policy, "native"):
                return fn(*args, **kwargs)
        tape = active_tape()
        if tape is None:
            return fn(*args, **kwargs)
        handle = RematHandle(None, name, policy, kind="native", tape=tape)
        if kwargs or any(isinstance(a, (list, tuple, dict)) for a in args):
            flat, spec = tree_flatten((args, kwargs))
            args, kwargs = tree_unflatten(list(handle.load_inputs(tuple(flat))), spec)
        else:  # flat positional arguments: no pytree round trip on the hot path
            args = handle.load_inputs(args)
        with SacScope(handle):
            out = fn(*args, **kwargs)
        handle.finish((out,) if isinstance(out, torch.Tensor) else tuple(tree_flatten(out)[0]), single=True)
        return out

    return call


class SacScope:
    """Run a block of native ops as one named op: under SAVE/OFFLOAD the forward caches every
    op's output (PyTorch's SAC caching mode) and the recompute replays them from the cache
    without running the ops, then restores the RNG the skipped ops consumed. Under
    RECOMPUTE the ops simply run."""

    __slots__ = ("handle", "mode", "storage")

    def __init__(self, handle: RematHandle):
        self.handle, self.mode, self.storage = handle, None, None

    def __enter__(self):
        handle, tape = self.handle, self.handle.tape
        if handle.policy is CheckpointPolicy.RECOMPUTE:
            return self
        if tape.phase == FORWARD:
            self.storage = defaultdict(dict)
            self.mode = torch_checkpoint._CachingTorchDispatchMode(_must_save, self.storage)
        else:
            # cache hits on in-place ops (dropout's bernoulli_) bump versions: checked in load() instead
            self.mode = torch_checkpoint._CachedTorchDispatchMode(None, handle.record.sac.load(tape, handle.name), True)
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.mode is None:
            return False
        self.mode.__exit__(*exc)
        if exc[0] is None:
            handle, rec = self.handle, self.handle.record
            if self.storage is not None:
                offloader = handle.tape.offloader if handle.policy is CheckpointPolicy.OFFLOAD else None
                rec.sac = SacCache(self.storage, offloader)
            elif rec.rng_after is not None and handle.tape.preserve_rng:
                rng_restore(rec.rng_after)
        return False


class SacCache:
    """The outputs PyTorch's SAC caching mode stored for one native SAVE/OFFLOAD call."""

    __slots__ = ("entries", "offloader", "released", "_version_of")

    def __init__(self, storage, offloader):
        # storage: {func: {call index: pytree of _VersionWrapper}}
        self.entries = storage
        self.offloader = offloader
        self.released = False
        # the op may mutate its own intermediates (dropout's bernoulli_): what must not
        # change is each cached tensor from the end of the op to its recompute
        self._version_of = {label: val._version for label, val in self.tensors()
                            if isinstance(val, torch.Tensor)}
        if offloader is not None:
            for calls in storage.values():
                for idx, wrapped in calls.items():
                    calls[idx] = torch.utils._pytree.tree_map(self._pack, wrapped)

    def _pack(self, w):
        if isinstance(w, torch_checkpoint._VersionWrapper) and isinstance(w.val, torch.Tensor):
            w.val = _OffloadedValue(self.offloader, w.val)
        return w

    def tensors(self):
        """(label, tensor-or-offloaded) pairs, for reports."""
        for func, calls in self.entries.items():
            for idx, wrapped in calls.items():
                for k, w in enumerate(torch.utils._pytree.tree_leaves(wrapped)):
                    val = getattr(w, "val", None)
                    if val is not None:
                        yield f"{func}#{idx}.{k}", val

    def prefetch(self):
        pre = getattr(self.offloader, "prefetch", None)
        if pre is None:
            return
        for _, val in self.tensors():
            if isinstance(val, _OffloadedValue):
                pre(val.packed)

    def _versions(self):
        for label, val in self.tensors():
            if isinstance(val, torch.Tensor):
                yield label, val, self._version_of[label]

    def load(self, tape, name):
        if self.released:
            raise RuntimeError(
                f"remat_fx: the saved outputs of native op '{name}' in region '{tape.name}' were already "
                "released by an earlier backward. Pass retain_graph=True to the first backward."
            )

        for label, val, version in self._versions():
            if val._version != version:
                raise RuntimeError(
                    f"remat_fx: output {label} of native op '{name}' in region '{tape.name}' was modified in "
                    f"place after the op ran (version {version} -> {val._version}); its gradient would be "
                    "wrong. Clone it before modifying it, or make the op RECOMPUTE."
                )

        def fresh(w):  # offloaded values come back as new tensors
            if isinstance(w, torch_checkpoint._VersionWrapper) and isinstance(w.val, _OffloadedValue):
                return torch_checkpoint._VersionWrapper(w.val.unpack())
            return w

        storage = {f: {i: torch.utils._pytree.tree_map(fresh, wr) for i, wr in calls.items()}
                   for f, calls in self.entries.items()}
        if not tape.keep_graph:
            self.entries = {}
            self.released = True
        return storage


class _OffloadedValue:
    __slots__ = ("packed", "offloader", "meta")

    def __init__(self, offloader, original: torch.Tensor):
        self.offloader = offloader
        self.packed = offloader.pack(original.detach())
        self.meta = TensorMeta.of(original)

    def unpack(self):
        return self.offloader.unpack(self.packed)
