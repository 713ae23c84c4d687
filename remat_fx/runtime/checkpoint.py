"""remat.checkpoint()(fn)(*args): the region boundary.

Built on PyTorch's non-reentrant checkpoint (saved-tensor hooks, RNG and
autocast replay, nesting). On top of it a region gets a named :class:`Tape`, and
its recompute starts as soon as the region's backward begins: a tiny trigger
node saved last inside the region is unpacked by a pre-hook on the autograd
nodes of the region's outputs, which makes PyTorch recompute the whole region
at once.

Node pre-hooks run after every tensor hook on the same node's outputs. That is
what lets the recompute follow FSDP2: ``fully_shard`` all-gathers a module's
parameters in backward from a tensor hook on the module's outputs, which are the
region's outputs when the region is the module's whole forward (torchtitan's
recipe: checkpoint, then ``fully_shard``). A tensor hook of ours registered
before FSDP's would recompute with the parameters still sharded (DTensors).
"""
from __future__ import annotations

import contextlib
import fnmatch
import inspect
import os
import sys
import warnings
import weakref

import torch
import torch.utils.checkpoint as torch_checkpoint

from remat_fx.naming import META_REGION, META_REGION_GLOBS, NameGlobs, callable_name, close_globs, \
    shadowed_message, tracing_annotation
from remat_fx.policy import CheckpointPolicy
from remat_fx.runtime.handle import RematHandle
from remat_fx.runtime.offload import check_offloader, resolve_offloader
from remat_fx.runtime.torch_compat import (current_graph_task, fire_recompute_trigger, inside_compiled_frame,
                                           new_recompute_trigger, tree_flatten, tree_leaves, tree_unflatten)
from remat_fx.runtime.tape import _ACTIVE, FORWARD, Tape, active_tape

_OPTIONS = {
    "preserve_rng_state": "replay the CPU/CUDA RNG state in recompute (default True)",
    "determinism_check": "PyTorch's check of recomputed tensor metadata: 'default' or 'none'",
    "debug": "PyTorch checkpoint debug traces on mismatch (default False)",
    "save": "glob(s) of op names to SAVE in this region, overriding their call sites",
    "offload": "glob(s) of op names to OFFLOAD in this region",
    "recompute": "glob(s) of op names to RECOMPUTE in this region",
    "offloader": "the offloader OFFLOAD ops in this region use (pack/unpack[/prefetch])",
}
TAPE_KEY = "remat_fx.tapes"


def checkpoint(name=None, /, **options):
    """``remat.checkpoint(name=None, **options)(fn)(*args, **kwargs)``.

    The first call binds options, the second the function, the third the arguments.
    """
    if "name" in options:
        if name is not None:
            raise TypeError("remat.checkpoint: the region name was given twice (positionally and as name=)")
        name = options.pop("name")
    if callable(name):
        raise TypeError(
            "remat.checkpoint takes options, not the function: write "
            f"remat.checkpoint()({callable_name(name)})(*args) (or remat.checkpoint('name', **options)(fn)(*args)). "
            "The empty call is required so it is not mistaken for torch.utils.checkpoint.checkpoint(fn, *args)."
        )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"remat.checkpoint: name must be a string, got {type(name).__name__}")
    if name == "":  # remat.annotate and native_op refuse one too
        raise ValueError("remat.checkpoint: the region name must be a non-empty string, got '' (leave it out for "
                         "the function's name)")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        valid = "\n".join(f"  {k}: {v}" for k, v in _OPTIONS.items())
        raise TypeError(f"remat.checkpoint: unknown option(s) {unknown}; valid options are:\n{valid}")
    if options.get("determinism_check", "default") not in ("default", "none"):
        raise ValueError("remat.checkpoint: determinism_check must be 'default' or 'none', "
                         f"got {options['determinism_check']!r}")
    for flag in ("preserve_rng_state", "debug"):  # a string such as 'no' would read as true
        if flag in options and not isinstance(options[flag], bool):
            raise TypeError(f"remat.checkpoint: {flag} must be True or False, got {options[flag]!r}")
    # checked here, where the user states them, not when the options are bound to a function or run
    try:
        globs = NameGlobs(options.get("save"), options.get("offload"), options.get("recompute"))
    except ValueError as e:
        raise ValueError(f"remat.checkpoint: {e}") from None
    if options.get("offloader") is not None:
        check_offloader(options["offloader"])

    def bind(fn):
        if not callable(fn):
            raise TypeError(f"remat.checkpoint(...) must be applied to a callable, got {type(fn).__name__}")
        return Checkpointed(fn, name, options, globs)

    return bind


class Checkpointed:
    """A function bound to checkpoint options; call it with the function's arguments."""

    def __init__(self, fn, name, options, globs: NameGlobs):
        self.fn = fn
        self.name = name if name is not None else callable_name(fn)
        self.globs = globs  # made from the options' save/offload/recompute when remat.checkpoint was written
        self.offloader = options.get("offloader")
        self.torch_options = dict(
            preserve_rng_state=options.get("preserve_rng_state", True),
            determinism_check=options.get("determinism_check", "default"),
            debug=options.get("debug", False),
        )

    def __repr__(self) -> str:
        return f"remat.checkpoint('{self.name}')({callable_name(self.fn)})"

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            # compiler mode: PyTorch's checkpoint HOP, with the region's name and globs on its nodes
            globs = (self.globs.save, self.globs.offload, self.globs.recompute)
            # PyTorch's debug traces are an eager-only feature (they need their own context_fn)
            options = {k: v for k, v in self.torch_options.items() if k != "debug"}
            with tracing_annotation({META_REGION: self.name, META_REGION_GLOBS: globs}):
                out = torch_checkpoint.checkpoint(_TracedBody(self), kwargs, *args, use_reentrant=False,
                                                  **options)
            return check_output(out, self.name)
        if inside_compiled_frame():  # Dynamo gave up on this call and runs it eagerly
            # said once the region has run: where its body raises, its own error says why
            with _fallback_said(self):
                return self._eager(args, kwargs)
        return self._eager(args, kwargs)

    def _eager(self, args, kwargs):
        if not torch.is_grad_enabled():
            return check_output(self.fn(*args, **kwargs), self.name)
        parent = active_tape()
        if parent is not None:
            # A nested region is a RECOMPUTE consumer of its parent: inputs produced by the
            # parent's SAVE ops are saved on the parent tape and loaded in its recompute.
            handle = RematHandle(None, parent.auto_name(f"region:{self.name}"), CheckpointPolicy.RECOMPUTE,
                                 kind="region", tape=parent)
            flat, spec = tree_flatten((args, kwargs))
            args, kwargs = tree_unflatten(list(handle.load_inputs(tuple(flat))), spec)
        tape = Tape(self.name, self.globs or None, resolve_offloader(self.offloader),
                    self.torch_options["preserve_rng_state"])
        in_tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tape.inputs = [weakref.ref(t) for t in in_tensors]
        # the user's kwargs travel as one positional dict: none can collide with checkpoint's own
        out = torch_checkpoint.checkpoint(
            _RegionBody(self.fn, tape), kwargs, *args, use_reentrant=False, **self.torch_options
        )
        if self.globs:
            _note_globs(self, tape)
        trigger, tape.trigger = tape.trigger, None
        inputs = {id(t) for t in in_tensors}
        # an input returned unchanged is not the region's: no hook or tape on it
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad
                and id(t) not in inputs]
        if outs and trigger is not None:
            start = _StartRecompute(tape, trigger)
            nodes = list({id(t.grad_fn): t.grad_fn for t in outs if t.grad_fn is not None}.values())
            for node in nodes:
                # after every tensor hook on this node's outputs (FSDP's all-gather among them)
                node.register_prehook(start.on_node)
                node.metadata.setdefault(TAPE_KEY, []).append(tape)
            for t in outs:
                if t.grad_fn is None:  # a leaf the region returned (no node to hook)
                    t.register_hook(start)
        return out


class _TracedBody:
    """What the checkpoint HOP traces under torch.compile.

    If Dynamo cannot trace the region as one graph it graph-breaks and runs PyTorch's
    checkpoint eagerly with Dynamo disabled inside, so this body then runs eagerly: it
    falls back to the named tape (same names and policies), with one warning.
    """

    __slots__ = ("owner", "tape")

    def __init__(self, owner: "Checkpointed"):
        self.owner, self.tape = owner, None

    def __call__(self, kwargs, *args):
        if torch.compiler.is_compiling():
            return self.owner.fn(*args, **kwargs)
        owner = self.owner
        first = self.tape is None
        if first:
            self.tape = Tape(owner.name, owner.globs or None, resolve_offloader(owner.offloader),
                             owner.torch_options["preserve_rng_state"])
        with _fallback_said(owner) if first else contextlib.nullcontext():
            out = _RegionBody(owner.fn, self.tape)(kwargs, *args)
        self.tape.trigger = None  # PyTorch's checkpoint recomputes this region lazily here
        return out


_WARNED = set()


@contextlib.contextmanager
def _fallback_said(region: "Checkpointed"):
    """The fallback's warning, once the region's body has run: where the body raises (a bad policy
    or option, an error of the user's code), that error says why, not a warning of a graph break."""
    yield
    _warn_fallback(region)


_GLOBS_SEEN = set()  # (region name, kind, glob) reported on: checked once a process
# (region name, kind, glob) -> [matched by any call so far, the names those calls ran]: judged when the
# first backward begins, on every call of the forward (as compiler mode judges a glob on every call of
# its region in the graph: a glob naming layer 1's ops, on a region name every layer shares, is not
# a miss at layer 0)
_GLOBS_PENDING: dict = {}
_LIBRARY = tuple(os.path.dirname(path) + os.sep  # remat_fx's folder, torch's
                 for path in (os.path.dirname(os.path.abspath(__file__)), inspect.getfile(torch)))


def _note_globs(region: "Checkpointed", tape: Tape) -> None:
    """What the region's globs selected among the ops its forward named (``_report_globs`` says
    which selected none)."""
    names = None
    for kind in ("save", "offload", "recompute"):
        for pattern in getattr(region.globs, kind):
            key = (region.name, kind, pattern)
            if key in _GLOBS_SEEN:
                continue
            if names is None:
                names = [rec.name for rec in tape.records if not rec.name.startswith("region:")]
            # [decided an op's policy on some call, the names those calls ran, {name: the stronger kind
            # whose glob took it}: a glob that matches only what a stronger kind takes decides nothing]
            entry = _GLOBS_PENDING.setdefault(key, [False, {}, {}])
            for n in names:
                if not entry[0] and fnmatch.fnmatchcase(n, pattern):
                    winner = region.globs.match(n)
                    if winner == kind.upper():
                        entry[0] = True
                    elif len(entry[2]) < 256:
                        entry[2][n] = winner
            if not entry[0] and len(entry[1]) < 256:
                entry[1].update(dict.fromkeys(names))


def _report_globs() -> None:
    """One warning per region glob that selected none of the named ops of the forward before this
    backward, once a process, said at the user's line (the backward's call)."""
    if not _GLOBS_PENDING:
        return
    pending = list(_GLOBS_PENDING.items())
    _GLOBS_PENDING.clear()
    # a glob given to every layer's region that selects in some of them ("L[0246].fc1": the even
    # layers) is not said once for each region it finds nothing in
    decided = {(kind, pattern) for (_, kind, pattern), (matched, _, _) in pending if matched}
    for (name, kind, pattern), (matched, seen, taken) in pending:
        _GLOBS_SEEN.add((name, kind, pattern))
        if matched or (kind, pattern) in decided:
            continue
        if taken:
            warnings.warn(shadowed_message(f"region '{name}' {kind}", pattern, list(taken), next(iter(taken.values()))),
                          UserWarning, stacklevel=_users_level())
            continue
        names = list(seen)
        suggestions = close_globs(pattern, names)
        hint = ("; did you mean " + ", ".join(f"'{g}'" for g, _ in suggestions) + "?") if suggestions else \
            (f"; its named ops: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}." if names else
             "; it ran no named op.")
        warnings.warn(
            f"remat_fx: region '{name}' {kind} glob '{pattern}' matched none of the ops its forward named{hint} "
            "On the eager tape a region's globs select the ops named by remat.op, native_op or annotate; the "
            "<module path>.<op> names of other ops (and a module's output, *.qkv) exist only under "
            "torch.compile(backend='remat').", UserWarning, stacklevel=_users_level())


def _users_level() -> int:
    """The ``stacklevel`` of the user's line for a warning said by the caller: the first frame outside
    remat_fx, torch and contextlib (from a region's call, or from inside the backward its hook runs in)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and (frame.f_code.co_filename.startswith(_LIBRARY) or
                                 frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    return level


def _warn_fallback(region: "Checkpointed") -> None:
    key = (region.name, getattr(region.fn, "__code__", None) or type(region.fn))
    if key in _WARNED:
        return
    _WARNED.add(key)
    name = region.name
    warnings.warn(
        f"remat_fx: torch.compile could not trace checkpoint region '{name}' as one graph (a graph break "
        "inside it), so the region runs on the eager named tape instead: the same names and policies are "
        "honoured, without compiler partitioning. Make the region traceable (see torch._dynamo.explain) "
        "to compile it.",
        stacklevel=_users_level(),
    )


class _RegionBody:
    """What PyTorch's checkpoint runs, in forward and again in each recompute."""

    __slots__ = ("fn", "tape")

    def __init__(self, fn, tape):
        self.fn, self.tape = fn, tape

    def __call__(self, kwargs, *args):
        tape = self.tape
        phase = tape.begin_pass()
        # Saved first: unpacking it makes PyTorch recompute the region, which then stops (early
        # stop) after the last tensor the region saves, so trailing ops that save nothing never rerun.
        trigger = new_recompute_trigger()
        if phase == FORWARD:
            tape.trigger = trigger
        token = _ACTIVE.set(tape)
        try:
            out = self.fn(*args, **kwargs)
            check_output(out, tape.name)
            tape.end_pass()
        finally:
            _ACTIVE.reset(token)
        return out


class _StartRecompute:
    """Pre-hook on the nodes of a region's outputs: recompute the region when its backward
    begins, once per backward (the first of its output nodes to run)."""

    __slots__ = ("tape", "trigger", "task")

    def __init__(self, tape, trigger):
        self.tape, self.trigger, self.task = tape, trigger, None

    def on_node(self, grad_outputs):
        self(None)

    def __call__(self, grad):
        if self.trigger is None:
            return
        task = current_graph_task()  # -1 where torch cannot tell: then the first backward only
        if task == self.task:
            return  # another output node of the region, in the same backward
        self.task = task
        _report_globs()  # the forward has run whole: its regions' globs are judged on all their calls
        self.tape.prefetch()
        fire_recompute_trigger(self.trigger)  # PyTorch's checkpoint recomputes the region now
        if not self.tape.keep_graph:
            # the trigger's saved tensor pins PyTorch's checkpoint frame and so the region's
            # inputs: let them go with the rest of the graph's buffers
            self.trigger = None


def check_output(out, region: str, path: str = "output"):
    """A region returns a Tensor or exact builtin tuple/list/dict of them, recursively."""
    if isinstance(out, torch.Tensor):
        return out
    t = type(out)
    if t is tuple or t is list:
        for i, v in enumerate(out):
            check_output(v, region, f"{path}[{i}]")
        return out
    if t is dict:
        for k, v in out.items():
            check_output(v, region, f"{path}[{k!r}]")
        return out
    if isinstance(out, tuple) and hasattr(t, "_fields"):
        kind = f"a namedtuple ({t.__name__})"
    elif isinstance(out, (tuple, list, dict)):
        kind = f"a subclass of {t.__mro__[1].__name__} ({t.__name__})"
    else:
        kind = f"a non-tensor leaf of type {t.__name__}"
    raise TypeError(
        f"remat.checkpoint region '{region}': {path} is {kind}. A checkpointed function must return a "
        "Tensor or an exact tuple, list or dict of them (recursively); convert it, e.g. return "
        "tuple(out) or dict(out), and pass non-tensor values outside the region."
    )
