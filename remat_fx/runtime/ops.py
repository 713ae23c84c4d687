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

import contextlib
import functools
from contextvars import ContextVar
from typing import Optional

import torch
from torch.utils import checkpoint as torch_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from remat_fx.naming import callable_name, check_name, op_annotation
from remat_fx.policy import CheckpointPolicy, coerce_policy
from remat_fx.runtime import torch_compat as compat
from remat_fx.runtime.handle import RematHandle
from remat_fx.runtime.tape import FORWARD, TensorMeta, active_tape, rng_restore, rng_snapshot
from remat_fx.runtime.torch_compat import tree_flatten, tree_unflatten


class _Pending:
    __slots__ = ("name", "policy", "taken")

    def __init__(self, name, policy):
        self.name, self.policy, self.taken = name, policy, False


_PENDING: ContextVar[Optional[_Pending]] = ContextVar("remat_fx_pending_op", default=None)


def _check_callable(fn, call: str, what: str) -> None:
    """Where the op is named, not where it is first called (a string there failed as 'str' object is not callable)."""
    if not torch.compiler.is_compiling() and not callable(fn):  # (Dynamo cannot trace callable() on every fn)
        raise TypeError(f"{call}: fn must be {what}, got {type(fn).__name__} {fn!r}")


def op(fn, name: str, policy=None):
    """Name one call of an ``auto_forward`` autograd Function: ``remat.op(Fn.apply, name, policy)(*args)``."""
    check_name(name, "remat.op")
    _check_callable(fn, f"remat.op(fn, '{name}')", "an autograd Function's apply (Fn.apply)")
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
                # a SAVE/OFFLOAD Function is not run in recompute: an enclosing SAVE scope's cache
                # must not count the calls of its forward (compat.without_dispatch_modes)
                hide = compat.without_dispatch_modes(list(tape.caching)) \
                    if handle.policy.skips_recompute and tape.caching else contextlib.nullcontext()
                try:
                    with hide:
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


def _written(func, args, kwargs) -> list:
    """The tensors an op writes into: its arguments the schema marks written (``Tensor(a!)``, ``out=``,
    lists of them), positional or by name."""
    specs = func._schema.arguments
    found = [a for spec, a in zip(specs, args) if spec.alias_info is not None and spec.alias_info.is_write]
    found += [kwargs[spec.name] for spec in specs[len(args):]
              if spec.name in kwargs and spec.alias_info is not None and spec.alias_info.is_write]
    return [t for t in tree_flatten(found)[0] if isinstance(t, torch.Tensor)]


def _watched(val) -> Optional[torch.Tensor]:
    """A cached value's tensor whose version counter tells an in-place change: the tensor itself, or
    the op's output an offloader kept in place (``_OffloadedValue.kept``)."""
    return val if isinstance(val, torch.Tensor) else val.kept if isinstance(val, _OffloadedValue) else None


class _BlockPolicy:
    """The caching policy of one SAVE/OFFLOAD scope's forward: every op's outputs are kept
    (``_must_save``), except two kinds of op that run again in the recompute instead. Casts
    (``_to_copy``): autocast's cast cache makes their count differ between forward and recompute
    (``_CastsOfRecompute``). And an op that writes in place into a tensor made before the scope
    (``h.mul_(3)`` in a SAVE block, ``h`` from before it; ``o.copy_(...)`` into a buffer made before it):
    a cached answer left the recomputed ``h`` unchanged for the ops after the block (silently wrong
    gradients). Which tensors the recompute makes again cannot be told from here (a temporary made
    without grad is a leaf, as a module's buffer is), so every such write runs again: a module buffer
    updated in a SAVE block (BatchNorm's running statistics) is updated twice per step, as it is
    anywhere else in a region (docs/eager.md, Safety). A random op writing so (``h.uniform_()``) cannot
    be run again with the forward's draws, and is refused. This needs the op's
    output in the policy's context (torch 2.13/2.14); where a torch calls the policy before the op
    (2.11's list layout) every op is kept as before, ``_must_save``'s answer, which that torch's replay,
    asking the policy again, gets from ``_must_save`` too (2.13/2.14's replay does not ask)."""

    __slots__ = ("made", "where")

    def __init__(self, where: tuple):
        self.made: set = set()  # storages the scope's own ops made (not views, not what in-place ops wrote into)
        self.where = where  # (op or block name, region name): for the error only

    def __call__(self, ctx, func, *args, **kwargs):
        decision = _must_save(ctx, func, *args, **kwargs)
        out = getattr(ctx, "op_output", _ABSENT)
        if out is not _ABSENT:
            schema = func._schema
            if func is torch.ops.aten._to_copy.default:
                decision = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
            elif schema.is_mutable and any(compat.storage_key(t) not in self.made
                                           for t in _written(func, args, kwargs)):
                if torch.Tag.nondeterministic_seeded in func.tags:
                    raise RuntimeError(
                        f"remat_fx: {func} in '{self.where[0]}' (region '{self.where[1]}') writes random values in "
                        f"place into a tensor made before it: the recompute cannot draw them again as the forward "
                        f"did. Make the block RECOMPUTE, or draw into a new tensor (torch.rand_like) inside it.")
                decision = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
            if not func.is_view and not schema.is_mutable:  # an in-place op's output is what it wrote into
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        self.made.add(compat.storage_key(t))
        return decision


_ABSENT = object()


def native_op(fn, name: str, policy=None):
    """Name one call of native PyTorch ops: ``remat.native_op(torch.mm, name, policy)(x, w)``."""
    check_name(name, "remat.native_op")
    _check_callable(fn, f"remat.native_op(fn, '{name}')", "a PyTorch function or op (torch.mm, F.gelu)")
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
    RECOMPUTE the ops simply run (inside a SAVE/OFFLOAD block, past its cache and replay)."""

    __slots__ = ("handle", "mode", "storage", "hidden")

    def __init__(self, handle: RematHandle):
        self.handle, self.mode, self.storage, self.hidden = handle, None, None, None

    def __enter__(self):
        handle, tape = self.handle, self.handle.tape
        recompute = handle.policy is CheckpointPolicy.RECOMPUTE
        if recompute and not tape.caching:
            return self
        entered = []  # (context, whether it is on tape.caching), in the order entered
        try:
            # an enclosing SAVE scope's cache does not see this scope's calls, in the forward nor in the
            # recompute (where this scope replays them from its own cache, and runs what it did not cache;
            # a RECOMPUTE scope runs them again, from the RNG state they began with in the forward: the
            # block's replay skips its ops before them without drawing, and restores its RNG state after)
            if tape.caching:
                if recompute and tape.phase == FORWARD:
                    handle.record.rng_before = rng_snapshot() if tape.preserve_rng else None
                elif recompute and handle.record.rng_before is not None:
                    rng_restore(handle.record.rng_before)
                hidden = compat.without_dispatch_modes(list(tape.caching))
                hidden.__enter__()
                entered.append((hidden, False))
                self.mode = hidden
            if not recompute:
                if tape.phase == FORWARD:
                    policy = _BlockPolicy((handle.name, tape.name))
                    self.mode, self.storage = compat.sac_forward_mode(policy)
                else:
                    # cache hits on in-place ops (dropout's bernoulli_) bump versions: checked in load() instead
                    self.mode = compat.sac_replay_mode(_must_save, handle.record.sac.load(tape, handle.name))
                self.mode.__enter__()
                entered.append((self.mode, True))
                if tape.phase != FORWARD:  # casts run past the replay (_CastsOfRecompute)
                    casts = _CastsOfRecompute(self.mode)
                    casts.__enter__()
                    entered.append((casts, True))
        except BaseException:
            self.mode = None
            _leave(entered, (None, None, None))  # the enclosing modes back on, as they were
            raise
        tape.caching.extend(c for c, on_tape in entered if on_tape)
        self.hidden = entered
        return self

    def __exit__(self, *exc):
        if self.mode is None:
            return False
        entered, self.hidden = self.hidden, None
        tape = self.handle.tape
        for _, on_tape in entered:
            if on_tape:
                tape.caching.pop()
        _leave(entered, exc)
        if exc[0] is None:
            handle, rec = self.handle, self.handle.record
            if self.storage is not None:
                offloader = handle.tape.offloader if handle.policy is CheckpointPolicy.OFFLOAD else None
                rec.sac = SacCache(self.storage, offloader)
            else:
                if rec.sac is not None and not rec.sac.released:
                    rec.sac.settled()  # the replay's own in-place answers (dropout's bernoulli_) changed versions
                if rec.rng_after is not None and handle.tape.preserve_rng:
                    rng_restore(rec.rng_after)
        return False


def _leave(entered: list, exc) -> None:
    """Exit the contexts of ``entered`` (context, on tape) last first, every one even where one raises
    (the first error is raised after)."""
    error = None
    for context, _ in reversed(entered):
        try:
            context.__exit__(*exc)
        except BaseException as e:  # noqa: BLE001 - the others are left all the same
            error = error or e
    if error is not None:
        raise error


class _CastsOfRecompute(TorchDispatchMode):
    """Above a scope's replay mode in the recompute: every cast (``_to_copy``) runs as it is, past the
    replay, and the forward caches none (``_BlockPolicy``). Under autocast a weight cast before the
    scope (a tied weight, a region called twice) comes from autocast's cast cache in the forward, so
    the scope saw no cast of it, while the recompute, its cast cache empty, casts it: the replay then
    failed on a call it had not cached, or handed it the scope's next cached cast of the same shape
    (silently wrong gradients). A cast is cheap to redo, and the counts no longer need to match."""

    def __init__(self, replay):
        super().__init__()
        self.replay = replay

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func is torch.ops.aten._to_copy.default:
            with compat.without_dispatch_modes([self.replay]):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


class SacCache:
    """The outputs PyTorch's SAC caching mode stored for one native SAVE/OFFLOAD call (its storage
    layout is torch's and version-dependent: only torch_compat reads or copies it)."""

    __slots__ = ("entries", "offloader", "released", "_version_of")

    def __init__(self, storage, offloader):
        self.offloader = offloader
        self.released = False
        # the op may mutate its own intermediates (dropout's bernoulli_): what must not
        # change is each cached tensor from the end of the op to its recompute
        self._version_of = {label: compat.tensor_version(val) for label, val in compat.sac_cached(storage)
                            if isinstance(val, torch.Tensor)}
        self.entries = compat.sac_map(storage, self._pack) if offloader is not None else storage

    def settled(self) -> None:
        """After a recompute's replay: the versions its answers to in-place ops (dropout's bernoulli_,
        a relu_) gave the cached tensors are theirs now, so that a second backward through a retained
        graph does not take them for the user's changes (it raised "modified in place")."""
        for label, val in self.tensors():
            watched = _watched(val)
            if watched is not None:
                self._version_of[label] = compat.tensor_version(watched)

    def _pack(self, val):
        return _OffloadedValue(self.offloader, val) if isinstance(val, torch.Tensor) else val

    def tensors(self):
        """(label, tensor-or-offloaded) pairs, for reports."""
        if self.released:
            return iter(())
        return compat.sac_cached(self.entries)

    def prefetch(self):
        pre = getattr(self.offloader, "prefetch", None)
        if pre is None:
            return
        for _, val in self.tensors():
            if isinstance(val, _OffloadedValue):
                pre(val.packed)

    def load(self, tape, name):
        if self.released:
            raise RuntimeError(
                f"remat_fx: the saved outputs of native op '{name}' in region '{tape.name}' were already "
                "released by an earlier backward. Pass retain_graph=True to the first backward."
            )

        for label, val in self.tensors():
            watched = _watched(val)  # an offloaded value kept in place (a CPU tensor) is the op's output itself
            if watched is not None:
                version, was = compat.tensor_version(watched), self._version_of[label]
                if version != was:
                    raise RuntimeError(
                        f"remat_fx: output {label} of native op '{name}' in region '{tape.name}' was modified in "
                        f"place after the op ran (version {was} -> {version}); its gradient would be "
                        "wrong. Clone it before modifying it, or make the op RECOMPUTE."
                    )

        # a fresh copy per recompute: the replay consumes it, and offloaded values come back as new tensors
        storage = compat.sac_map(self.entries, lambda v: v.unpack() if isinstance(v, _OffloadedValue) else v)
        if not tape.keep_graph:
            self.entries = None
            self.released = True
        return storage


class _OffloadedValue:
    __slots__ = ("packed", "offloader", "meta", "kept")

    def __init__(self, offloader, original: torch.Tensor):
        self.offloader = offloader
        self.packed = offloader.pack(original.detach())
        self.meta = TensorMeta.of(original)
        # packed in place (CPUOffloader keeps CPU tensors as they are): the op's output, whose in-place
        # changes SacCache.load refuses as it does a SAVE op's (an OFFLOAD op's were never checked)
        packed = self.packed
        self.kept = packed if isinstance(packed, torch.Tensor) and \
            compat.storage_key(packed) == compat.storage_key(original) is not None else None

    def unpack(self):
        return self.offloader.unpack(self.packed)
