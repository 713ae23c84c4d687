"""The eager runtime's private-torch surface, in one place.

Everything in ``remat_fx/runtime/`` that reaches past PyTorch's public API goes
through this module, so a new torch release is checked here and nowhere else.
Where a public API does the job it is used instead (``torch.utils.checkpoint.checkpoint``,
``create_selective_checkpoint_contexts``, ``torch.autograd.Function``,
``torch.autograd.graph.register_multi_grad_hook``).

Checked on torch 2.13.0 (CPU wheel; the whole suite passes) and torch 2.14.1 (CUDA 13
wheel run on CPU; every eager-runtime test passes, and the whole suite but one
order-dependent measured-peak check of the compiled whole step, test_step.py's
test_whole_step_peak_fractions_are_monotone, which passes on its own and with its file).
:data:`CHECKED_VERSIONS` lists them, and
tests/test_torch_compat.py fails on any other torch until this module is
re-checked there. Each use below says what it needs, what happens without it,
and what differs across versions:

* **Immediate-recompute trigger** (:func:`new_recompute_trigger`, public API, version-
  dependent lifetime). A tiny ``autograd.Function`` saves one tensor inside the region;
  unpacking it (``grad_fn.saved_tensors``) makes PyTorch's checkpoint recompute the
  region. Before pytorch#179924 (torch 2.11; 2.12 not checked) a Python ``grad_fn`` object
  does not own its node: once the Function's output tensor is gone the node is freed with
  its saved tensors, and the unpack fails with "Trying to backward through the graph a
  second time" (the 2.11 failure of issue 16). In 2.13 and 2.14 the ``grad_fn`` owns the
  node. So the trigger keeps the output tensor, which owns the node on every version.
* **Selective-checkpoint caching of native SAVE ops** (:func:`sac_forward_mode`,
  :func:`sac_replay_mode`, :func:`sac_cached`, :func:`sac_map`). The modes come from the
  public ``create_selective_checkpoint_contexts``; their shared ``storage`` is private
  and changed layout: torch 2.13/2.14 keep ``{op: {call index: entry}}`` (entries are
  ``_VersionWrapper`` trees or sentinels); torch 2.11 keeps ``{op: [entry, ...]}``
  (saved calls only, popped in order by the replay mode, which asks the policy again;
  2.12 not checked). The layout is read from the storage's ``default_factory``; one code
  path per layout. The list layout is written from torch 2.11's torch/utils/checkpoint.py
  and was NOT run here (no 2.11/2.12 wheel).
  A cached leaf is an object whose ``.val`` is the tensor (``_VersionWrapper`` in every
  version seen). An unknown layout raises with a message naming this module. torch 2.14
  can route the cache through the user's ``saved_tensors_hooks``
  (``respect_saved_tensors_hooks``, private on the mode): the runtime turns that off, as
  torch 2.13 behaves, because it checks, offloads and reports the cached tensors itself.
* **A SAVE op nested in a SAVE block** (:func:`without_dispatch_modes`): the enclosing block's
  caching (or replay) mode is taken off the dispatch stack while the nested op runs, with
  ``torch.utils._python_dispatch``'s ``_get_current_dispatch_mode_stack``, ``_pop_mode`` and
  ``_push_mode`` (private, unchanged since torch 2.0; checked on 2.13 and 2.14 by
  tests/test_native_op.py). Without it the block's replay gives a later call of the nested op's
  op the nested call's output (silently wrong gradients where the shapes agree). The same
  function lets a cast the forward took from autocast's cast cache run past a block's replay in
  the recompute (runtime/ops.py ``_CastsOfRecompute``), and a RECOMPUTE scope inside a SAVE block
  run past the block's cache and replay (``SacScope``).
* **The innermost checkpoint frame** (:func:`current_checkpoint_frame`): the region's
  count of tensors saved so far and its early-stop flag, read from the closure of the
  pack hook of ``torch.utils.checkpoint``'s ``_checkpoint_hook`` (through
  ``torch._C._autograd._top_saved_tensors_default_hooks``). No public equivalent. Without
  it (None) the tape keeps what trailing ops saved until backward: more memory, same
  gradients. Same shape (``frame.weak_holders``, ``frame.early_stop``) in the 2.11 source
  and in 2.13/2.14.
* **Whether the running backward keeps the graph** (:func:`backward_keeps_graph`):
  ``torch._C._current_graph_task_id`` and ``torch._C._autograd._get_current_graph_task_keep_graph``
  (in torch since 2.5). No public equivalent. Without them the tape assumes
  ``retain_graph=True``: saved tensors live until the graph is freed, gradients the same.
  The graph-task id also tells a region's recompute pre-hooks, one per output node, that
  another output node already started the recompute in this backward
  (:func:`current_graph_task`; PyTorch's ``register_multi_grad_hook(mode="any")`` reads the
  same id). Without it a region starts its recompute early in the first backward only; a
  second backward through a retained graph recomputes lazily, at the first unpack.
* **Running inside a compiled frame's eager fallback** (:func:`inside_compiled_frame`):
  ``torch._C._dynamo.eval_frame.get_eval_frame_callback``. Only decides whether to warn.
* **Tensor internals**: ``Tensor._version`` (in-place checks), ``Tensor._base`` (views of
  a SAVE op's output), ``Tensor._make_wrapper_subclass`` (placeholders),
  ``StorageWeakRef`` (storage identity for aliases), ``torch.utils._pytree``. Long-standing
  (older than torch 2.0), unchanged in 2.13/2.14; no public equivalents.
"""
from __future__ import annotations

import contextlib
import copy
import re
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401 (re-exported)

#: major.minor versions of torch this module (and the whole suite) was checked on
CHECKED_VERSIONS = ("2.13", "2.14")

HERE = "remat_fx/runtime/torch_compat.py"


def torch_version() -> Tuple[int, int]:
    """(major, minor) of the running torch."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def version_checked() -> bool:
    return "%d.%d" % torch_version() in CHECKED_VERSIONS


def _unsupported(what: str) -> RuntimeError:
    return RuntimeError(
        f"remat_fx: {what} on torch {torch.__version__}, which this version of remat_fx was not "
        f"checked on (checked: {', '.join(CHECKED_VERSIONS)}). The private PyTorch internals the "
        f"eager runtime relies on are all in {HERE}: re-check them there for this torch."
    )


# -- tensor internals ---------------------------------------------------------

def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by in-place ops)."""
    return t._version


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor a view was taken of, or None."""
    return t._base


def make_wrapper_subclass(cls, size, stride, storage_offset, dtype, device, requires_grad=False):
    """A data-less instance of a ``__torch_dispatch__`` Tensor subclass."""
    return torch.Tensor._make_wrapper_subclass(
        cls, size, strides=stride, storage_offset=storage_offset, dtype=dtype, device=device,
        requires_grad=requires_grad,
    )


def storage_key(t: torch.Tensor) -> Optional[int]:
    """A key equal for every tensor on the same storage while that storage is alive (its
    StorageImpl's address, ``storage_ref``'s key) without making a weak reference (0.03 ms for
    200 tensors, a quarter of ``storage_ref``'s); None for a tensor without a storage of its own
    (a wrapper subclass)."""
    try:
        return t.untyped_storage()._cdata
    except Exception:  # noqa: BLE001 - subclasses without storage raise various errors
        return None


def storage_ref(t: torch.Tensor) -> Tuple[Any, Callable[[], bool]]:
    """(key, expired): a key equal for every tensor on the same storage, and whether that
    storage is gone. Holds no reference to the storage."""
    ref = StorageWeakRef(t.untyped_storage())
    return ref.cdata, ref.expired


# -- autograd engine state ----------------------------------------------------

_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_graph_task_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def backward_keeps_graph() -> bool:
    """False only inside a backward that frees the graph (no retain_graph/create_graph).
    Outside a backward, or where torch cannot tell, True (the safe answer: keep tensors)."""
    if _graph_task_id is None or _graph_task_keep_graph is None:
        return True
    if _graph_task_id() == -1:
        return True
    return bool(_graph_task_keep_graph())


def current_graph_task() -> int:
    """An id of the backward running now; -1 outside one, or where torch cannot tell."""
    return -1 if _graph_task_id is None else _graph_task_id()


try:
    _eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
except AttributeError:  # pragma: no cover - torch without Dynamo's C extension
    _eval_frame_callback = None


def inside_compiled_frame() -> bool:
    """True while a torch.compile'd function runs code Dynamo could not trace (its eager fallback)."""
    return _eval_frame_callback is not None and _eval_frame_callback() not in (None, False)


# -- the checkpoint frame -----------------------------------------------------

class CheckpointFrame:
    """What the runtime reads of the innermost ``torch.utils.checkpoint`` region being run."""

    __slots__ = ("_holders", "early_stop")

    def __init__(self, holders: list, early_stop: bool):
        self._holders, self.early_stop = holders, early_stop

    def saved_count(self) -> int:
        """How many tensors the region has saved for backward so far."""
        return len(self._holders)


def _global_early_stop() -> bool:
    return getattr(torch_checkpoint, "_enable_checkpoint_early_stop", None) is not False


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are in force now (a ``torch.utils.checkpoint`` region, whose
    backward runs the same code again and expects it to save the same tensors; ``save_on_cpu``;
    a user's ``saved_tensors_hooks``)."""
    return bool(torch._C._autograd._top_saved_tensors_default_hooks(False))


def current_checkpoint_frame() -> Optional[CheckpointFrame]:
    """The innermost non-reentrant checkpoint region running now, or None when there is none
    or torch's hooks changed shape (then trailing ops simply keep what they saved)."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = hooks[0] if hooks else None
    cells = getattr(pack, "__closure__", None) or ()
    names = getattr(getattr(pack, "__code__", None), "co_freevars", ())
    for name, cell in zip(names, cells):
        if name == "frame":
            frame = cell.cell_contents
            holders = getattr(frame, "weak_holders", None)
            if not isinstance(holders, list):
                return None
            early = getattr(frame, "early_stop", None)
            return CheckpointFrame(holders, early if isinstance(early, bool) else _global_early_stop())
    return None


# -- the immediate-recompute trigger -----------------------------------------

class _RecomputeTrigger(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dummy):
        ctx.save_for_backward(dummy)
        return dummy.new_empty(0)

    @staticmethod
    def backward(ctx, grad):  # never on a backward path: only its saved tensor is unpacked
        return grad


def new_recompute_trigger() -> torch.Tensor:
    """Save one empty tensor through the innermost saved-tensor hooks (inside a checkpoint
    region: the region's own). Returns what :func:`fire_recompute_trigger` needs: the
    Function's output, which owns the node and so its saved tensor on every torch version
    (a bare ``grad_fn`` does not on torch 2.11)."""
    return _RecomputeTrigger.apply(torch.empty(0, requires_grad=True))


def fire_recompute_trigger(trigger: torch.Tensor) -> None:
    """Unpack the trigger's saved tensor: inside a checkpoint region, PyTorch recomputes it now."""
    trigger.grad_fn.saved_tensors  # noqa: B018 - the unpack is the point


# -- selective-checkpoint (SAC) storage ----------------------------------------

INDEXED = "indexed"  # torch 2.13, 2.14: {op key: {call index: entry}}
LISTED = "listed"  # torch 2.11 (source read, not run): {op key: [entry, ...]}


def _contexts(policy_fn):
    return torch_checkpoint.create_selective_checkpoint_contexts(policy_fn, allow_cache_entry_mutation=True)


def sac_layout(storage) -> str:
    factory = getattr(storage, "default_factory", None)
    if factory is dict:
        return INDEXED
    if factory is list:
        return LISTED
    raise _unsupported(f"selective checkpointing keeps its cache as {type(storage).__name__}"
                       f"({getattr(factory, '__name__', factory)})")


def sac_forward_mode(policy_fn):
    """(mode, storage): a TorchDispatchMode that runs ops and caches the outputs of those
    ``policy_fn`` saves, and the storage it fills."""
    caching, _ = _contexts(policy_fn)
    if hasattr(caching, "respect_saved_tensors_hooks"):
        # torch 2.14: the cache may go through the user's saved_tensors_hooks around the region
        # (None: not yet, with a FutureWarning). The tape checks, offloads and reports the cached
        # tensors itself: keep them plain tensors, without the warning
        caching.respect_saved_tensors_hooks = False
    storage = caching.storage
    sac_layout(storage)  # fail before the forward, not in the recompute
    return caching, storage


@contextlib.contextmanager
def without_dispatch_modes(modes: list):
    """The TorchDispatchModes ``modes`` (an enclosing SAVE scope's caching modes) off the dispatch
    stack for the block; the modes above them stay on, in their order. A SAVE/OFFLOAD op nested in a
    SAVE block caches its own outputs, and in recompute replays them (or, an autograd Function, is
    not run at all): the enclosing block's cache must not count its calls in the forward either, or
    the block's replay gives each later call of the same op the output of the call before it
    (wrong gradients where the shapes agree, a shape error where not). Uses
    ``torch.utils._python_dispatch``'s ``_get_current_dispatch_mode_stack``, ``_pop_mode`` and
    ``_push_mode`` (private, in torch since 2.0: what its own ``_pop_mode_temporarily`` uses)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    hidden = {id(m) for m in modes}
    if not modes or not any(id(m) in hidden for m in _get_current_dispatch_mode_stack()):
        yield
        return
    popped = []  # top first
    while any(id(m) in hidden for m in _get_current_dispatch_mode_stack()):
        popped.append(_pop_mode())
    kept = [m for m in reversed(popped) if id(m) not in hidden]  # bottom first
    for m in kept:
        _push_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for m in reversed(popped):
            _push_mode(m)


def sac_replay_mode(policy_fn, storage):
    """A TorchDispatchMode that returns the cached outputs in ``storage`` (one pass: give it
    a fresh :func:`sac_map` copy each recompute) and runs the ops ``policy_fn`` did not save."""
    caching, cached = _contexts(policy_fn)
    shared = caching.storage
    if sac_layout(shared) != sac_layout(storage):  # pragma: no cover - one torch, one layout
        raise _unsupported("selective checkpointing changed its cache layout between forward and recompute")
    shared.update(storage)
    return cached


def _entries(storage) -> Iterator[Tuple[Any, Any, Any]]:
    layout = sac_layout(storage)
    for key, calls in storage.items():
        items = calls.items() if layout == INDEXED else enumerate(calls)
        for idx, entry in items:
            yield key, idx, entry


def _is_cached_leaf(leaf) -> bool:
    return hasattr(leaf, "val") and hasattr(leaf, "get_val")


def sac_cached(storage) -> Iterator[Tuple[str, Any]]:
    """(label, value) of every cached output: the tensor, or what :func:`sac_map` made of it."""
    for key, idx, entry in _entries(storage):
        for k, leaf in enumerate(tree_leaves(entry)):
            if _is_cached_leaf(leaf) and leaf.val is not None:
                yield f"{key}#{idx}.{k}", leaf.val


def sac_map(storage, fn):
    """A copy of ``storage`` (same layout) with every cached value ``v`` replaced by ``fn(v)``;
    ``storage`` itself is unchanged. Non-cached entries (recompute sentinels) are kept."""

    def leaf(w):
        if not _is_cached_leaf(w):
            return w
        w = copy.copy(w)
        w.val = fn(w.val)
        return w

    layout = sac_layout(storage)
    out = defaultdict(dict if layout == INDEXED else list)
    for key, calls in storage.items():
        if layout == INDEXED:
            out[key] = {idx: tree_map(leaf, entry) for idx, entry in calls.items()}
        else:
            out[key] = [tree_map(leaf, entry) for entry in calls]
    return out
