"""Peak: a static estimate of one training step's activation peak, by liveness simulation.

Sizes come from the fake tensors on the nodes. A storage is allocated by the node that makes it
(views share their base's) and freed after its last use; graph outputs live to the end of their
graph. Graph inputs of the forward (parameters, the batch) exist before the step and are not
counted; the backward starts from what the forward saved (less those inputs) and its tangents,
and frees each saved tensor after its last use (both lowerings clear the boxed argument list).
The step's incremental peak is the larger of the forward's and the backward's (the forward's
other outputs, like the loss, held through the backward).

Under the Inductor lowering the graphs are not run op by op (``inlined_nodes``): a pointwise op
(or an embedding or gather: Inductor lowers them pointwise) whose readers are all fusible is
computed inside them (no memory of its own; its inputs stay alive until its last reader), unless
Inductor materialises it on reuse (several readers and a heavy body
or many reads, counted as Inductor does: a view of an op computed in place reads no buffer); a
gather computes the pointwise op it reads at its indices; an mm read only by an add runs as that
add's addmm; a pointwise kernel writes its output over an input of its size that dies there
(``_in_place``). These follow Inductor's own
rules, checked against the buffers of the code it generates. Inductor's buffer reuse (a dead
buffer kept for a later one of its size, up to Inductor's own estimate of the peak) is not
modelled: with a memory or peak budget passes/lower.py turns it off.

Three searches use the estimate: ``fit_peak`` (option peak_budget: the fastest plan under a peak),
``lower_peak`` (option peak_slack: under a memory budget, a lower peak among plans within a
small slack of the fastest plan's estimated step time, walked on their peaks without reruns, the
one it ends on taken if its reruns keep it under the fastest plan's) and ``monotone_peak``
(a smaller memory budget never gives a higher estimated peak than the plans of a few larger
saved-bytes targets: otherwise the lowest-peak plan that fits the budget).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

import torch
import torch.fx as fx

from remat_fx.memory_budget import Budget, fmt_bytes
from remat_fx.options import RematError
from remat_fx.passes.capture import storage_base
from remat_fx.passes.cost import concrete, fusible, indexed_read, realised_reduction


@dataclass(frozen=True)
class PeakEstimate:
    forward: int  # bytes above the step's start, at the forward's peak
    backward: int  # at the backward's peak (what the forward left included)
    saved: int  # what the forward leaves for the backward (not counting its own inputs)
    held: int = 0  # the forward's other outputs (the loss, a next graph's input), held through the backward
    # per forward input (placeholder name): the forward's peak up to its last use, and after it (where an
    # input the caller gives and holds nowhere else is alive: remat_fx/step.py step_costs)
    inputs: Tuple[Tuple[str, int, int], ...] = ()
    # per forward input the forward saves for the backward (its placeholder name): the backward's peak
    # (``held`` included, as ``backward``) up to the backward's last use of it, and after it (where such
    # an input made in the step is alive through the backward: remat_fx/step.py step_costs)
    backward_inputs: Tuple[Tuple[str, int, int], ...] = ()
    # per storage the forward both returns and saves (a model's logits that its loss reads): (its bytes, the
    # backward's peak up to its last use there, the peak after it), ``held`` included; the backward frees it
    # at its last use, unless the caller still holds the output (a Hugging Face ModelOutput kept through
    # backward(): remat_fx/step.py step_costs)
    saved_outputs: Tuple[Tuple[int, int, int], ...] = ()

    @property
    def step(self) -> int:
        return max(self.forward, self.backward)


def storage_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0
    return concrete(val.untyped_storage().nbytes())


def is_view(node: fx.Node, base: Optional[fx.Node] = None) -> bool:
    """A node that shares another node's storage (a view, or a getitem of a multi-output view);
    ``base``: its storage_base, if known."""
    return node.op == "call_function" and (storage_base(node) if base is None else base) is not node


def inlinable_op(node: fx.Node) -> bool:
    """An op Inductor may compute inside its reader's kernel: fusible, not a view, one tensor out."""
    return node.op == "call_function" and node.target is not operator.getitem and fusible(node) \
        and not node.target.is_view and not isinstance(node.meta.get("val"), (tuple, list))


def readers(x, users: Callable, src: Callable, facts: dict) -> Optional[list]:
    """The ops reading ``x``'s values, looking through views; None if a graph output reads them.
    ``users(x)``: what takes ``x`` as an input; ``src(y)``: the FX node ``y`` stands for (the same
    function serves FX graphs and passes/rerun.py's program of copies); ``facts``: as ``node_facts``."""
    found = []
    for user in users(x):
        node = src(user)
        if node.op != "call_function":
            return None
        if (facts.get(node) or node_facts(node, facts)).view:
            more = readers(user, users, src, facts)
            if more is None:
                return None
            found += more
        else:
            found.append(user)
    return found


class NodeFacts(NamedTuple):
    inlinable: bool
    fusible: bool
    view: bool
    pointwise: bool
    on_cpu: bool
    base: fx.Node  # storage_base
    indexed: bool  # indexed_read: a load at computed indices (an embedding, a gather)
    reads_none: bool  # reads no tensor (an iota, a full): a body of no reads, computed in every reader
    takes_inside: bool  # computes an input Inductor has not realised inside it: fusible, or a cat
    reduced: bool  # realised_reduction: a reader loads it as one buffer, whatever the reduction read
    in_place: bool  # written_in_place: its output may be written over an input dying in it
    reduction: bool  # an op tagged a reduction (Inductor gives it a node of its own: fused_back)


def node_facts(node: fx.Node, memo: dict) -> NodeFacts:
    """What the liveness walks ask of a node, again and again (a rerun search simulates its program
    some 80 times): ``memo`` keeps them for the nodes of graphs that do not change meanwhile."""
    found = memo.get(node)
    if found is None:
        base = storage_base(node)
        can_fuse = fusible(node)
        found = memo[node] = NodeFacts(inlinable_op(node), can_fuse, is_view(node, base), pointwise_op(node),
                                       _on_cpu(node), base, indexed_read(node), not node.all_input_nodes,
                                       can_fuse or node.target is _CAT, realised_reduction(node),
                                       written_in_place(node), _reduction(node))
    return found


def _reduction(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and torch.Tag.reduction in node.target.tags


def inlined_nodes(order: Iterable, inputs: Callable, users: Callable, src: Callable = lambda n: n,
                  facts: Optional[dict] = None) -> Set:
    """What Inductor computes inside its readers' kernels instead of materialising (the ``inline``
    liveness), over a program in topological ``order`` (FX nodes, or passes/rerun.py's items: ``src(x)``
    the FX node ``x`` stands for, ``inputs(x)``/``users(x)`` its producers/readers there).

    An ``inlinable_op`` whose readers (through views) are all fusible ops is inlined when there is
    one reader; with several, it is computed again in each unless Inductor realises it on reuse
    (torch/_inductor/ir.py ``should_realize_on_reuse``): a reduction, or a pointwise body (the op and
    what is inlined into it) that reads more than ``realize_reads_threshold`` buffers or, on CPU,
    uses one of the transcendental ops Inductor will not recompute there. An indexed read (an
    embedding, a gather: ``indexed_read``) is a pointwise body too, as Inductor lowers it: an
    embedding read by a residual add and an RMSNorm is computed inside both. (Counted as
    materialised, it shifted every residual chain's realised add by one: Inductor held one more
    0.5 MiB residual per layer than the estimate said at budget 0 on a Llama of hidden 128, 1.9 /
    3.8 / 7.9 MiB at 8 / 16 / 32 layers, and the measured peak at 32 layers, 39.3 MiB, was over
    per-layer checkpointing's 38.4; with it counted so, 12.83 / 18.95 / 31.86 MiB measured against
    estimates of 12.82 / 19.01 / 31.34.) An op that reads no tensor (an iota, a full) reads no
    buffer and is computed inside every reader, and a cat computes an input inside it too (into its
    slice of the output): position ids from an iota, read by a mask's cat, are not materialised.
    (Counted as materialised, they shifted the residual chains of an 8-layer GPT-2 the same way:
    46.15 MiB measured at budget 0 against an estimate of 38.11, now 38.11.) A reduction Inductor
    realises (``realised_reduction``) is one buffer read in its readers' bodies, whatever it read
    itself: an RMSNorm's output read by two kernels reads the residual sum's inputs and the mean's
    buffer. (Counted through the mean, it was inlined, and a one-layer Llama's step at budget 0.15
    measured 5.5% over the estimate of its reruns.) ``facts``: as ``node_facts``."""
    from torch._inductor import config

    facts = {} if facts is None else facts
    inlined: Set = set()
    body_of: Dict[object, Tuple[bool, Set]] = {}  # (has a heavy op, buffers read) of inlined bodies
    addmm: Set = set()  # adds that take in an mm: an addmm kernel of their own
    mm = torch.ops.aten.mm.default
    threshold = config.realize_reads_threshold
    for x in order:
        node = src(x)
        mine = facts.get(node) or node_facts(node, facts)
        if node.target is mm and mine.on_cpu:
            into = _addmm_reader(x, node, users, src, facts)
            if into is not None:  # the mm runs inside the add's addmm: at the add, reading its inputs there
                inlined.add(x)
                addmm.add(into)
                continue
        if not mine.inlinable or x in addmm:
            continue
        found = readers(x, users, src, facts)
        if found is None or not all((facts.get(n) or node_facts(n, facts)).takes_inside for n in map(src, found)):
            continue
        if not (mine.pointwise or mine.reads_none) and \
                any((facts.get(n) or node_facts(n, facts)).indexed for n in map(src, found)):
            continue  # a reduction (or a copy) read at computed indices is realised first; not an
            # op that reads no tensor (an iota: Inductor computes the index inside the load)
        body = None
        if len(found) <= 1:
            inlined.add(x)
        elif mine.pointwise or mine.indexed or mine.reads_none:  # Inductor's Pointwise IR
            body = _body(x, node, inputs, src, inlined, body_of, facts)
            if not (body[0] and mine.on_cpu) and len(body[1]) <= threshold:
                inlined.add(x)
        if x in inlined:  # what a reader's body reads through it: a realised reduction is one buffer
            body_of[x] = (False, {mine.base}) if mine.reduced else \
                body or _body(x, node, inputs, src, inlined, body_of, facts)
    return inlined


def _addmm_reader(x, node: fx.Node, users: Callable, src: Callable, facts: dict):
    """The add ``x`` (an mm) is folded into, as Inductor's post-grad pass does on CPU (``mm(a, b) + c``
    -> ``addmm(c, a, b)``, when the mm has no other reader and ``c`` is a tensor of its dtype); else None.
    ``node``: ``src(x)``, an mm on the CPU (the caller asks); ``facts``: as ``node_facts``, where the
    answer for the two FX nodes is kept too."""
    found = list(users(x))
    if len(found) != 1 or src(found[0]).target is not torch.ops.aten.add.Tensor:
        return None
    add = src(found[0])
    key = (node, add)  # what follows reads the two nodes alone
    folds = facts.get(key)
    if folds is None:
        folds = len(add.args) == 2 and add.kwargs.get("alpha", 1) == 1 and add.args[0] is not add.args[1]
        if folds:
            other = add.args[1] if add.args[0] is node else add.args[0]
            val, mine = getattr(other, "meta", {}).get("val"), node.meta.get("val")
            folds = isinstance(val, torch.Tensor) and isinstance(mine, torch.Tensor) and val.dtype == mine.dtype
        facts[key] = folds
    return found[0] if folds else None


# a cat computes an input Inductor has not realised straight into its slice of the output (a
# pointwise cat, or ConcatKernel's realize_into): for the input, a reader that computes it inside
_CAT = torch.ops.aten.cat.default
_HEAVY = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})  # ir.py's list for CPU


def _body(x, node: fx.Node, inputs: Callable, src: Callable, inlined: Set, body_of: dict,
          facts: dict) -> Tuple[bool, Set]:
    heavy = node.target.overloadpacket.__name__ in _HEAVY
    reads: Set = set()
    for m in inputs(x):
        n = src(m)
        f = facts.get(n) or node_facts(n, facts)
        if f.view:
            m = _through_views(m, inputs, src, facts)
            f = node_facts(src(m), facts)
        if m in body_of:
            h, r = body_of[m]
            heavy, reads = heavy or h, reads | r
        else:
            reads.add(f.base)
    return heavy, reads


def _through_views(m, inputs: Callable, src: Callable, facts: dict):
    """What a read of ``m`` reads: through views (an expand of an inlined iota reads no buffer; the
    iota is computed in place, as Inductor's ``num_reads`` counts), to the op that made the values."""
    while (facts.get(src(m)) or node_facts(src(m), facts)).view:
        tensors = [i for i in inputs(m) if isinstance(src(i).meta.get("val"), torch.Tensor)]
        if len(tensors) != 1:
            break
        m = tensors[0]
    return m


def pointwise_op(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
        and torch.Tag.pointwise in node.target.tags and not node.target.is_view


def own_buffer(key, donated: Set = frozenset()) -> bool:
    """A storage Inductor may write over: one of its own buffers, not the output of an op returning
    several tensors, or a graph input (a placeholder, or a ``shared`` key) AOTAutograd donates to
    the backward: its key in ``donated`` (``backward_inputs``; Inductor's wrapper reuses no other
    input, tangents included)."""
    node = getattr(key, "src", key)
    if not isinstance(node, fx.Node) or node.op == "placeholder":
        return key in donated
    return node.target is not operator.getitem


def held_to_end(node: fx.Node) -> bool:
    """A backward's incoming gradient (a ``tangents`` input) on CUDA: alive until the backward
    returns, not only until its last reader. The compiled backward drops its own reference there,
    but on CUDA the autograd engine still holds the tensor (on the CPU it does not). Measured on an
    H100 (torch 2.11, both lowerings, float32 and bf16): a step whose peak comes after the last
    reader of a 2 MiB incoming gradient peaks exactly as high whether or not a hook keeps the
    gradient alive to the end, 2.00 MiB above this model's estimate with the gradient freed at its
    reader; on this CPU (torch 2.13) the hook adds the 2 MiB and the estimate equals the step.
    On the GPT-2 of docs/benchmarks.md it was the logits' gradient, 785 MiB, still allocated when
    Inductor padded the LM head's weight."""
    if node.op != "placeholder" or not str(node.target).startswith("tangents"):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.device.type == "cuda"


def _on_cpu(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return not isinstance(val, torch.Tensor) or val.device.type == "cpu"


def reads_through(x, inputs: Callable, inlined: Set, memo: dict) -> Set:
    """What ``x`` reads: its inputs, and what those in ``inlined`` read (computed inside ``x``; the
    caller puts views in it too, since a view of an inlined op is computed inside its reader)."""
    found = memo.get(x)
    if found is None:
        found = set()
        for m in inputs(x):
            found.add(m)
            if m in inlined:
                found |= reads_through(m, inputs, inlined, memo)
        memo[x] = found
    return found


def liveness(n: int, storages: Dict[object, Tuple[int, int]], reads: List[Iterable], outputs: Set,
             writers: Optional[Set] = None, donated: Set = frozenset(), apart: Optional[Callable] = None) -> tuple:
    """(bytes live at each of positions 0..n, last use of each storage) of a program of ``n``
    positions: ``storages`` {key: (position allocated, bytes)}, ``reads[i]`` the keys position ``i``
    reads (its own output included), ``outputs`` the keys alive to the end (position ``n``). A
    storage is alive from its allocation while its last reader runs. ``writers`` (Inductor): the
    storages its pointwise kernels make, which may be written in place (``_in_place``) over a
    storage of their own or an input in ``donated``, unless ``apart(writer, input)``."""
    last: Dict[object, int] = {}
    for i, keys in enumerate(reads):  # in order: each key's last read is the last written
        last.update(dict.fromkeys(keys, i))
    for k, (start, _) in storages.items():  # and never before its allocation
        if last.get(k, -1) < start:
            last[k] = start
    for k in outputs:
        last[k] = n
    starts = _in_place(storages, reads, last, writers, donated, apart) if writers else {}
    events = [0] * (n + 2)
    for k, (start, nbytes) in storages.items():
        events[starts.get(k, start)] += nbytes
        events[last[k] + 1] -= nbytes
    live, acc = [], 0
    for i in range(n + 1):
        acc += events[i]
        live.append(acc)
    return live, last


def _in_place(storages, reads, last, writers: Set, donated: Set = frozenset(),
              apart: Optional[Callable] = None) -> Dict[object, int]:
    """Inductor writes a pointwise kernel's output over an input of the same size that dies in
    that kernel (``inplace_buffers``): one of its own buffers, or a graph input AOTAutograd donates
    to the backward (``donated``: ``own_buffer``), unless ``apart(output, input)`` (``writes_apart``).
    The output takes no memory of its own until the input's is free. {storage: position its own
    memory starts} for the outputs written in place."""
    moved: Dict[object, int] = {}
    taken: Set = set()
    for k in writers:
        start, nbytes = storages[k]
        if not nbytes:
            continue
        for r in reads[start]:
            if r is not k and r not in taken and last[r] == start and storages[r][1] == nbytes \
                    and storages[r][0] < start and own_buffer(r, donated) and not (apart and apart(k, r)):
                taken.add(r)
                moved[k] = start + 1
                break
    return moved


# ops whose loads Inductor indexes by one dimension of the kernel's loops apart from the others (a
# pad's mask, a slice's offset, a cat's bounds): the loops cannot be merged across that dimension
_UNMERGED = frozenset({torch.ops.aten.constant_pad_nd.default, torch.ops.aten.slice.Tensor, _CAT,
                       torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default})


_INDEX_PUT = torch.ops.aten.index_put.default


def written_in_place(node: fx.Node) -> bool:
    """An op Inductor may write over an input that dies in it (``_in_place``): a pointwise op, or on
    CUDA an index_put (an embedding's gradient accumulated into zeros: Inductor's reinplacing pass
    makes it an index_put_ into them; measured on an H200, torch 2.11, the 8-layer Llama's 250 MiB
    embedding gradient was one buffer, not the zeros and a copy, 250 MiB under the estimate there
    at budget 0.1). Not seen on the CPU, where torch 2.13 lowers it to a masked index_put of its own."""
    return (node.target is _INDEX_PUT and not _on_cpu(node)) or pointwise_op(node)


def writes_apart(writer, dying, inputs: Callable, src: Callable, inside: Set, key: Callable) -> bool:
    """Whether Inductor on CUDA gives the pointwise ``writer`` a buffer of its own rather than writing
    it over ``dying`` (a storage it reads, which dies in its kernel): the kernel also computes a
    reduction of ``dying`` (``inside``: inlined, or a view), and the writer's body reads through a
    pad, a slice or a cat. Inductor writes in place only where every load of the input in the fused
    kernel has one index (``decide_inplace_update``): the reduction's loops merge the rows
    (4 x 2048 -> 8192) and the writer's, which index one of them apart, do not. Measured on an
    H200 (torch 2.11, benchmarks/gpu.py's 8-layer Llama, budget 0): the loss's backward read the
    shifted labels recomputed from the batch (``constant_pad_nd``, ``slice``), its 500 MiB gradient
    of the logits took a buffer of its own beside the logits, and the step peaked 500 MiB over this
    model (3,255.5 MiB; Inductor's own schedule, passes/lowered_peak.py, said the same); at budget
    0.1 the labels were saved, the gradient was written over the logits. On the CPU Inductor wrote
    it over them in both plans (its fused loops are not compared so). An index_put (``written_in_place``)
    is written over the tensor it puts into, nothing else."""
    if src(writer).target is _INDEX_PUT:  # only over the tensor it puts into
        first = next(iter(inputs(writer)), None)
        return first is None or key(first) != dying
    if _on_cpu(src(writer)):
        return False
    body, stack = {}, [writer]  # ordered, as found
    while stack:
        for m in inputs(stack.pop()):
            if m in inside and m not in body:
                body[m] = None
                stack.append(m)
    if not any(src(m).target in _UNMERGED for m in body):
        return False
    for m in body:
        target = src(m).target
        if isinstance(target, torch._ops.OpOverload) and torch.Tag.reduction in target.tags:
            seen, stack = {m}, [m]
            while stack:
                for y in inputs(stack.pop()):
                    if key(y) == dying:
                        return True
                    if y in inside and y not in seen:
                        seen.add(y)
                        stack.append(y)
    return False


RERUN_OF = "remat_fx.rerun_of"  # node meta of a rerun's copy: the name of the node it copies (passes/rerun.py)
_FUSED_WITHIN = 64  # Inductor fuses two kernels that read one buffer only this close in its order


def fused_back(original, copy, position: dict, inputs: Callable, users: Callable, src: Callable, inlined: Set,
               facts: dict, kernels: Callable[[int, int], int]) -> bool:
    """Whether Inductor on CUDA computes the rerun ``copy`` (a pointwise kernel) in the kernel of its
    ``original``: the two read the same buffers, and fewer than ``_FUSED_WITHIN`` kernels lie
    between them (Inductor's horizontal fusion; choices.py ``are_long_distant_nodes``), so the copy's
    output is made with the original's and the rerun frees nothing. Measured on an H200 (torch 2.11,
    benchmarks/gpu.py's 8-layer Llama, budget 0): a rerun's cast of the LM head's weight to bf16,
    22 nodes after the first cast, was written by the first cast's kernel, and both 125 MiB copies
    were alive across the loss's kernel, at the step's peak. Not where either is read through a view
    that several kernels read: Inductor realises that view, in its own index space, and the two
    kernels' loads no longer match (in the same run the copies of two MLP weights' casts, read
    through a transpose by three kernels, kept kernels of their own 85 nodes on). ``position``:
    each item's index in the program; ``inputs`` / ``users``: an item's producers and readers;
    ``inlined``: its items computed inside their readers; ``kernels(i, j)``: how many of the
    program's items i..j-1 are ``is_kernel`` (``kernel_counter``: a program with many copies asks it
    of many spans, counted once)."""
    mine = facts.get(src(copy)) or node_facts(src(copy), facts)
    if mine.on_cpu or not mine.pointwise or copy in inlined or original in inlined or \
            position[copy] < position[original]:
        return False
    # the same buffers read first: a copy that reads other copies (most of a rerun's) is answered here
    a, b = list(inputs(original)), list(inputs(copy))
    if len(a) != len(b) or any(x is not y for x, y in zip(a, b)):
        return False
    for x in (original, copy):
        stack = list(users(x))
        while stack:
            y = stack.pop()
            if (facts.get(src(y)) or node_facts(src(y), facts)).view:
                readers_of_view = [r for r in users(y) if users(r)]  # not what nothing reads
                if len(readers_of_view) > 1:
                    return False
                stack += readers_of_view
    return kernels(position[original] + 1, position[copy]) < _FUSED_WITHIN


def is_kernel(x, users: Callable, src: Callable, inlined: Set, facts: dict) -> bool:
    """Whether Inductor's order has a node for ``x`` (``fused_back`` counts those between a copy and
    its original): what it materialises, and each reduction (a node of its own, fused into its
    reader's kernel later); not what nothing reads (a rerun's original left unread)."""
    if not users(x):
        return False
    node = src(x)
    f = facts.get(node) or node_facts(node, facts)
    return (x not in inlined and not f.view) or f.reduction


def kernel_counter(order: list, users: Callable, src: Callable, inlined: Set, facts: dict) -> Callable[[int, int], int]:
    """``kernels(i, j)``: how many of ``order[i:j]`` are ``is_kernel``, from a prefix count made on the
    first question (``fused_back`` asks it of the span between each copy and its original)."""
    prefix: List[int] = []

    def kernels(lo: int, hi: int) -> int:
        if not prefix:
            prefix.append(0)
            for x in order:
                prefix.append(prefix[-1] + is_kernel(x, users, src, inlined, facts))
        return prefix[hi] - prefix[lo]
    return kernels


def simulate(gm: fx.GraphModule, counted_inputs: Iterable[str] = (), shared: Dict[str, str] = None,
             inline: bool = False, donated: Iterable[str] = ()) -> tuple:
    """(peak bytes, bytes live at the end) of running ``gm`` op by op; placeholders named in
    ``counted_inputs`` are live from the start (and freed after their last use, or at the end:
    ``held_to_end``), others are free.
    ``shared`` maps placeholder names to a storage key: placeholders that are views of one storage
    (saved views of one forward tensor) count once, until the last use of any of them. ``inline``
    (the Inductor lowering): ``inlined_nodes`` take no memory, and their inputs live until the
    user they are computed inside, and a pointwise kernel may write over an input that dies in it
    if it is a placeholder named in ``donated`` (saved and donated to the backward: ``backward_inputs``)."""
    _, storages, outputs, live, _ = _timeline(gm, counted_inputs, shared, inline, donated)
    return max(live), sum(storages[k][1] for k in outputs if k in storages)


def forward_simulation(gm: fx.GraphModule, inline: bool = False) -> Tuple[int, Tuple[Tuple[str, int, int], ...]]:
    """(``simulate(gm, inline=inline)[0]``, per placeholder (name, the peak up to its last use, the peak
    after it)): one timeline for both."""
    nodes, _, _, live, last = _timeline(gm, (), None, inline)
    span = _spans(live)
    return max(live), tuple((node.name, *span(last[node])) for node in nodes if node.op == "placeholder")


def _spans(live: List[int]) -> Callable[[int], Tuple[int, int]]:
    """For a timeline's bytes live per position: position -> (the peak up to it, the peak after it)."""
    n = len(live)
    before, after = list(live), list(live) + [0]
    for t in range(1, n):
        before[t] = max(before[t - 1], live[t])
    for t in range(n - 1, -1, -1):
        after[t] = max(after[t + 1], live[t])
    return lambda t: (before[min(t, n - 1)], after[min(t, n - 1) + 1])


def backward_simulation(bw: fx.GraphModule, counted: Iterable[str], shared: Dict[str, str], inline: bool,
                        donated: Iterable[str], inputs: Set[str]) -> Tuple[int, Tuple[Tuple[str, int, int], ...]]:
    """(``simulate(bw, ...)[0]``, per forward input in ``inputs`` that the backward reads (a saved
    placeholder of ``bw`` whose ``shared`` storage is it: (its name, the peak up to the backward's last
    use of it, the peak after it))): one timeline for both. The input's own bytes are in neither."""
    nodes, _, _, live, last = _timeline(bw, counted, shared, inline, donated)
    span = _spans(live)
    names = {shared.get(node.name) for node in nodes if node.op == "placeholder"} & set(inputs)
    return max(live), tuple((name, *span(last[name])) for name in sorted(names) if name in last)


def alive_at_peak(gm: fx.GraphModule, counted_inputs: Iterable[str] = (), shared: Dict[str, str] = None,
                  inline: bool = False, donated: Iterable[str] = ()) -> Tuple[int, fx.Node, List[Tuple[int, object]]]:
    """(bytes at the peak of ``simulate``, the node it is reached at, [(bytes, storage) alive
    there, largest first]): a storage is the node that made it, or a placeholder's ``shared`` key."""
    nodes, storages, _, live, last = _timeline(gm, counted_inputs, shared, inline, donated)
    t = max(range(len(live)), key=live.__getitem__)
    alive = [(nbytes, k) for k, (start, nbytes) in storages.items() if nbytes and start <= t <= last[k]]
    return live[t], nodes[min(t, len(nodes) - 1)], sorted(alive, key=lambda a: -a[0])


def _timeline(gm: fx.GraphModule, counted_inputs: Iterable[str], shared: Optional[Dict[str, str]], inline: bool,
              donated: Iterable[str] = ()):
    """(nodes, {storage: (position, bytes)}, storages alive to the end, bytes live per position,
    last position of each storage) of ``simulate``."""
    counted, shared = set(counted_inputs), shared or {}
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    index = {n: i for i, n in enumerate(nodes)}
    inlined = inlined_nodes(nodes, lambda n: n.all_input_nodes, lambda n: n.users) if inline else set()

    keys: dict = {}  # asked of each node once per read of it: some 280,000 times planning an 8-layer Llama

    def key(node: fx.Node):
        found = keys.get(node)
        if found is None:
            base = storage_base(node)
            found = keys[node] = shared.get(base.name, base) if base.op == "placeholder" else base
        return found

    hoisted: Dict[fx.Node, int] = {}  # rerun copies Inductor computes in their originals' kernels: there
    if inline:
        named, facts = {n.name: n for n in nodes}, {}
        users, src = (lambda x: x.users), (lambda x: x)
        kernels = kernel_counter(nodes, users, src, inlined, facts)
        for n in nodes:
            original = named.get(n.meta.get(RERUN_OF))
            if original is not None and fused_back(original, n, index, lambda x: x.all_input_nodes, users, src,
                                                   inlined, facts, kernels):
                hoisted[n] = index[original]
    storages: Dict[object, Tuple[int, int]] = {}
    for node in nodes:
        k = key(node)
        if k not in storages:
            base = storage_base(node)
            producer = index.get(base.args[0]) if base.target is operator.getitem else None
            storages[k] = allocation(base, hoisted.get(base, index.get(base, 0)), producer, counted, base in inlined)
    memo: dict = {}
    # a view reads what its input reads: the kernel that reads a view of an inlined op computes that
    # op (a 16-layer Llama's logits, read by the loss's inlined softmax through a view, were counted
    # as freed one position before the kernel that reads them, 3.9 MiB under the measured peak)
    inside = inlined | {n for n in nodes if is_view(n)} if inline else inlined
    reads = [{key(node)} | {key(m) for m in reads_through(node, lambda x: x.all_input_nodes, inside, memo)}
             for node in nodes]
    outputs: Set[object] = {key(n) for n in nodes if held_to_end(n)}  # alive to the end, as the outputs
    fx.node.map_arg(next(n for n in reversed(gm.graph.nodes) if n.op == "output").args,
                    lambda n: outputs.add(key(n)))
    writers = {key(n) for n in nodes if n not in inlined and n not in hoisted and written_in_place(n)} \
        if inline else None
    donated = set(donated)
    live, last = liveness(len(nodes), storages, reads, outputs, writers,
                          {key(n) for n in nodes if n.op == "placeholder" and n.name in donated},
                          lambda w, r: writes_apart(w, r, lambda x: x.all_input_nodes, lambda x: x, inside, key))
    return nodes, storages, outputs, live, last


def allocation(src: fx.Node, position: int, producer_position: Optional[int], counted: Set[str],
               inlined: bool, nbytes: Optional[int] = None) -> Tuple[int, int]:
    """(position, bytes) of the storage node ``src`` makes at ``position``: graph inputs exist from
    the start (free unless named in ``counted``); a getitem's storage is made with its tuple-returning
    producer (at ``producer_position``); a tuple itself, and an inlined op, take nothing. ``nbytes``:
    ``storage_bytes(src)``, if known."""
    if src.op == "placeholder":
        return 0, (storage_bytes(src) if nbytes is None else nbytes) if src.name in counted else 0
    if src.target is operator.getitem:
        return producer_position, storage_bytes(src) if nbytes is None else nbytes
    if inlined or isinstance(src.meta.get("val"), (tuple, list)):
        return position, 0
    return position, storage_bytes(src) if nbytes is None else nbytes


class BackwardInputs(NamedTuple):
    """What simulating a backward needs to know of its inputs (``backward_inputs``)."""

    counted: Set[str]  # placeholders live from its start: saved activations, tangents
    shared: Dict[str, str]  # saved placeholder -> the forward storage it is (views of one storage count once)
    held: int  # bytes of the forward's other outputs held through the backward
    saved: int  # bytes of the storages the forward saves
    donated: Set[str]  # saved placeholders Inductor may write over: donated to the backward (their storage
    # is neither a forward input or output, which the caller holds, nor a backward output)


def backward_inputs(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> BackwardInputs:
    """The inputs of ``bw`` for simulating it (``BackwardInputs``). AOTAutograd donates to the
    backward (lets Inductor write over) the saved activations whose storage is not also a forward
    input, a forward output or a backward output (``torch._functorch.config.donated_buffer``):
    measured, a 16-layer Llama whose logits are both returned and saved peaked 3.4 MiB over an
    estimate that let the backward's first kernel write over them."""
    fw_out = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    saved = [n for n in fw_out[num_fwd_outputs:] if isinstance(n, fx.Node)]
    counted = {n.name for n in saved if storage_base(n).op != "placeholder"}
    shared = {n.name: storage_base(n).name for n in saved}  # bw placeholders keep the saved nodes' names
    user_outputs = {storage_base(n) for n in fw_out[:num_fwd_outputs] if isinstance(n, fx.Node)}
    saved_bases = {storage_base(n) for n in saved if storage_base(n).op != "placeholder"}
    held = sum(storage_bytes(b) for b in user_outputs - saved_bases if b.op != "placeholder")
    counted |= {n.name for n in bw.graph.nodes if n.op == "placeholder" and str(n.target).startswith("tangents")}
    bw_outputs: List[fx.Node] = []
    fx.node.map_arg(next(n for n in reversed(bw.graph.nodes) if n.op == "output").args, bw_outputs.append)
    returned = {storage_base(n).name for n in bw_outputs if storage_base(n).op == "placeholder"}
    not_donated = user_outputs | {storage_base(n) for n in saved if n.name in returned}  # by storage, as AOTAutograd
    donated = {n.name for n in saved if storage_base(n) in saved_bases - not_donated} \
        if getattr(torch._functorch.config, "donated_buffer", True) else set()
    return BackwardInputs(counted, shared, held, sum(storage_bytes(b) for b in saved_bases), donated)


def estimate(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, inline: bool = False,
             forward_peak: Optional[int] = None, forward_inputs: Tuple[Tuple[str, int, int], ...] = ()
             ) -> PeakEstimate:
    """``forward_peak``, ``forward_inputs``: ``forward_simulation(fw, inline)``, where the caller has it."""
    counted, shared, held, saved, donated = backward_inputs(fw, bw, num_fwd_outputs)
    fw_peak = simulate(fw, inline=inline)[0] if forward_peak is None else forward_peak
    fw_inputs = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
    fw_out = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    returned = {storage_base(n) for n in fw_out[:num_fwd_outputs] if isinstance(n, fx.Node)}
    kept = {storage_base(n) for n in fw_out[num_fwd_outputs:] if isinstance(n, fx.Node)}
    both = {b.name: b for b in returned & kept if b.op != "placeholder"}
    bw_peak, spans = backward_simulation(bw, counted, shared, inline, donated, fw_inputs | set(both))
    return PeakEstimate(forward=fw_peak, backward=held + bw_peak, saved=saved, held=held, inputs=forward_inputs,
                        backward_inputs=tuple((name, held + up_to, held + rest) for name, up_to, rest in spans
                                              if name in fw_inputs),
                        saved_outputs=tuple((storage_bytes(both[name]), held + up_to, held + rest)
                                            for name, up_to, rest in spans if name in both))


class PeakInfeasible(RematError):
    """No plan meets the peak budget (estimated, or measured by remat.fit)."""


_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.05, 0.0)


_TOWARD_STEPS = 8  # partitions fit_peak's search toward the cap makes, at most, before the grid
_RESOLUTION = 0.005  # of the feasible saved-bytes range: the search ends with a fitting target this close to one over
_LEAST_SLOPE = 0.25  # bytes of estimated peak per saved byte, the least the secant steps assume


def fit_peak(cut, feasible: Callable, budgets, cap: Optional[int], fraction: Optional[float] = None,
             alike: Optional[float] = None):
    """The fastest plan whose estimated step peak is at most ``cap`` bytes, or, with ``fraction``
    instead, at most that fraction of the way from the least estimated peak (the plan saving the
    fewest bytes) to the peak without a budget. Saved-bytes targets are searched from the plan
    without a budget down towards the cap (``_toward_cap``: a few partitions where the peak falls
    with the saved bytes); where that fails (the peak stops falling before the cap: too little is
    saved to cut the recompute chains), they are tried from the largest allowed down a grid, then
    bisected between the last plan over the cap and the first under it. ``cut(budgets)`` returns
    (fw, bw, plan, tags); ``cut(budgets, quick=True)`` the partition without its reruns;
    ``feasible(budgets)`` the budget solver's report for ``budgets`` without a partition (its
    feasible range, which a byte cap's search needs from the least-saved plan: the partition it
    cost was 0.9-1.5 s of 17-21 s of planning on the 8-layer Llama of benchmarks/gpu.py). With
    ``alike``, the targets that bracket the cap are solved again with repeated blocks alike
    (``_final_alike``)."""
    found, over = _fit_peak(cut, feasible, budgets, cap, fraction)
    span = found[2].peak_span
    found = found if alike is None else _final_alike(cut, budgets, found, over, alike)
    found[2].peak_span = span  # (its fraction: set by the partition, on a plan cache's replay too)
    return _as_asked(cut, budgets, found)


def _as_asked(cut, budgets, found):
    """``found`` (a peak search's plan) reported under the user's memory_budget where it was solved at
    a lower saved-bytes target than the user's: the report keeps the user's budget and target, and
    notes the target solved for and the fastest plan's estimates (as lower_peak's does)."""
    report = found[2].budget
    if None not in budgets or report is None or report.lowered_to is not None:
        return found
    first = cut(budgets)
    user = first[2].budget
    if user is None or report.target >= user.target:
        return found
    _reported_as_asked(report, user, report.target, first[2])
    return found


def _reported_as_asked(report, user, solved: int, fastest) -> None:
    """``report`` (of a plan solved at the saved-bytes target ``solved``) keeps the user's budget and
    target (``user``'s report), noting ``solved`` and the estimates of ``fastest``, the fastest plan
    under the user's target."""
    report.budget, report.target, report.lowered_to = user.budget, user.target, solved
    report.fastest_peak, report.fastest_step_s = fastest.peak.step, fastest.step_cost_s


def _fit_peak(cut, feasible: Callable, budgets, cap: Optional[int], fraction: Optional[float]):
    """(fit_peak's plan without ``alike``, the smallest saved-bytes target the search found over the
    cap above that plan's, or None)."""
    least = _overall(budgets, Budget(fraction=0.0))  # the fewest saved bytes
    first = cut(budgets)
    span = None
    if fraction is not None:
        high = first[2].peak.step
        low = min(high, cut(least)[2].peak.step)
        cap = low + int(fraction * (high - low))
        span = (low, high)
    if first[2].peak.step <= cap:
        return _mark(first, cap, span), None
    if fraction == 0.0:  # the least peak's own plan: a search for a faster one at that peak took 35 s
        return _mark(cut(least), cap, span), None  # of planning on benchmarks/gpu.py's Llama, and found none
    # the feasible range; the least peak's plan (its reruns' search, the longest) only when needed
    report = feasible(least) if fraction is None else cut(least)[2].budget  # a fraction has cut it already
    lo, top = report.minimum, report.maximum
    if None in budgets:
        top = min(top, budgets[None].target(lo, top))
    seen: list = []  # the plans the search toward the cap cut: the least peak found may be one of them

    def toward(*args, **kwargs):
        seen.append(cut(*args, **kwargs))
        return seen[-1]

    found, over = _toward_cap(toward, budgets, cap, lo, top, first, lambda: cut(least))
    if found is not None:
        return _mark(found, cap, span), over
    probe = cut(least)
    tried = [(first[2].total_bytes, first)]
    above, found = top, None
    for f in _GRID[1:]:
        target = lo + int((top - lo) * f)
        result = probe if f == 0.0 else cut(_overall(budgets, Budget(nbytes=target)))
        tried.append((target, result))
        if result[2].peak.step <= cap:
            found = (target, result)
            break
        above = target
    if found is None:
        best = min([r for _, r in tried] + seen, key=lambda r: r[2].peak.step)
        raise PeakInfeasible(
            f"remat_fx: peak_budget {fmt_bytes(cap)} ({cap:,} bytes) is below every estimated step peak found: "
            f"the lowest is {fmt_bytes(best[2].peak.step)} ({best[2].peak.step:,} bytes), saving "
            f"{fmt_bytes(best[2].total_bytes)} for backward ("
            + (f"every plan saves {fmt_bytes(lo)}" if lo == top else
               f"feasible saved bytes {fmt_bytes(lo)} .. {fmt_bytes(top)}")
            + f"). Raise peak_budget to at least {best[2].peak.step:,} bytes, or shrink the step "
            f"(batch, sequence length).")
    good_target, good = found
    for _ in range(4):  # bisect towards more saved bytes (less recompute) while under the cap
        mid = (good_target + above) // 2
        if mid <= good_target or mid >= above:
            break
        result = cut(_overall(budgets, Budget(nbytes=mid)))
        if result[2].peak.step <= cap:
            good_target, good = mid, result
        else:
            above = mid
    return _mark(good, cap, span), (above if above < top else None)


FINAL_ALIKE = 0.05  # option blocks_alike "final": the recompute (fraction of the forward's time) it may add


def _final_alike(cut, budgets, found, over: Optional[int], alike: float):
    """``found`` (a peak search's plan) or the fastest of the plans solved with repeated blocks alike
    (``cut(..., alike=alike)``, the budget solver's blocks_alike) at the two saved-bytes targets that
    bracket the cap: ``found``'s, and ``over``, the smallest target the search cut over the cap
    above it (None: none was). A plan alike is taken where it fits the same cap and is not estimated
    slower, reruns included. Inductor compiles one set of kernels for blocks planned alike, fewer in
    the first step. The search itself solves each target for the fastest plan, whose blocks often
    differ (which of several blocks of equal cost saves a tensor is the solver's arbitrary choice).
    The second target is there because a plan alike saves at most its target, often less (every
    block saves the same ops: its saved bytes come in steps of a block's), and what it saves does
    not set its peak as the fastest plans' do: on the 8-layer Llama of benchmarks/gpu.py at
    peak_budget 24 MiB the fastest plans peak about 16.2 MiB over what they save, near the cap, while
    the plan alike at the target over the cap (11.96 MiB) saves 11.95 MiB, peaks at 23.53 MiB with
    one rerun and is estimated at 348.4 ms a step, against 359.1 for the plan alike at the found
    target (8.05 MiB saved, 2 reruns) and 367.5 for the search's (11.05 MiB, 13 reruns)
    (docs/budgets.md#repeated-blocks-alike). Costs a budget solve per target, and a partition with
    its rerun search for each plan alike (the same tags are partitioned once): 0.4-1.6 s of planning
    there (20, 24 and 30 MiB, planning the joint graph alone)."""
    report, cap = found[2].budget, found[2].peak_budget
    if report is None or report.solver == "none":
        return found  # the plan without a budget: no solver to ask
    targets = (report.target,) if over is None else (report.target, over)
    kept = [r for r in (cut(_overall(budgets, Budget(nbytes=t)), alike=alike) for t in targets)
            if r[2].budget.alike and r[2].peak.step <= cap and r[2].step_cost_s <= found[2].step_cost_s]
    return _mark(min(kept, key=lambda r: (r[2].step_cost_s, r[2].peak.step)), cap) if kept else found


def _toward_cap(cut, budgets, cap: int, lo: int, top: int, over, least: Callable):
    """(A plan under ``cap``, or None; the smallest target cut over the cap, above those that fit,
    or None if only ``top``'s is) found by stepping the saved-bytes target down from ``over`` (the
    plan without a budget, over the cap; its target ``top``) as a secant search on the plans'
    saved bytes and estimated peaks: the first step assumes the peak falls byte for byte with the
    saved bytes (it falls by at most that: the saved tensors are alive at the backward's peak, and
    the recompute that replaces them is alive there too), each later one the slope between the last
    two plans (at least ``_LEAST_SLOPE``), always from the smallest target over the cap, and kept
    between it and the largest that fits (a bisection where the step falls outside or next to a
    target already cut, or after two steps that fit, or once the peak rose from one step to the
    next: the steps passed the valley's floor, where too little is saved to cut the recompute
    chains). ``least()``, the plan saving the fewest bytes, is the one that fits when a step would
    go below the range or the peak rose before any fit. It ends when those two targets are
    ``_RESOLUTION`` of the range apart, with the fastest plan that fits (estimated step time: a plan
    just over the cap before its reruns pays for those that bring it under). None when ``least()``
    is needed and does not fit (fit_peak's grid looks for the valley's floor), or after
    ``_TOWARD_STEPS`` partitions without a fitting plan. Measured on the 8-layer Llama of
    benchmarks/gpu.py at peak_budgets 20, 24, 30 and 40 MiB: 5-7 partitions (8-13 s) where the grid and
    its bisection made 12-16 (15-33 s), and plans estimated 0.4% slower to 2.8% faster (the joint
    graph of an eager-lowered capture; on the one Inductor partitions, 8-9 in all, 17-21 s)."""
    above_t, above = top, over  # the smallest target over the cap, and its plan
    below_t = below = None  # the largest target that fits, and its plan
    tolerance = max(1, int(_RESOLUTION * (top - lo)))
    steps, last, sides, fits, stalled = 0, [over], [], [], False
    while steps < _TOWARD_STEPS:
        if below is not None and above_t - below_t <= tolerance:
            break
        slope = 1.0
        if len(last) >= 2:
            (x0, y0), (x1, y1) = ((r[2].total_bytes, r[2].peak.step) for r in last[-2:])
            if x1 != x0:
                slope = max(_LEAST_SLOPE, min(1.0, (y1 - y0) / (x1 - x0)))
        # at least ``tolerance`` under the plan over the cap: a few bytes over would step a few bytes
        target = min(above[2].total_bytes - int((above[2].peak.step - cap) / slope), above_t - tolerance)
        if below is None and (target <= lo or stalled):
            floor = least()
            if floor[2].peak.step > cap:
                return None, None
            below_t, below = lo, floor
            fits.append(floor)
        if below is not None and (stalled or sides[-2:] == ["below", "below"]
                                  or not below_t + tolerance // 2 < target < above_t - tolerance // 2):
            target = (below_t + above_t) // 2  # a bisection
            if not below_t < target < above_t:
                break
        result = cut(_overall(budgets, Budget(nbytes=target)))
        steps += 1
        last.append(result)
        if result[2].peak.step <= cap:
            below_t, below = target, result
            sides.append("below")
            fits.append(result)
        else:
            # where the peak no longer falls with the saved bytes, the steps bisect from here on
            stalled = stalled or result[2].peak.step > above[2].peak.step
            above_t, above = target, result
            sides.append("above")
    if not fits:
        return None, None
    # the fastest that fits: the reruns that bring a plan under the cap cost time, so the largest
    # target that fits is not always the fastest plan
    return min(fits, key=lambda r: (r[2].step_cost_s, r[2].peak.step)), (above_t if above_t < top else None)


def _overall(budgets, budget: Budget):
    """``budgets`` with the overall (non-region) budget replaced by ``budget``."""
    return {**{k: v for k, v in budgets.items() if k is not None}, None: budget}


def _mark(result, cap, span=None):
    result[2].peak_budget, result[2].peak_span = cap, span
    return result


_LOWER_STEPS = (0.95, 0.9, 0.85, 0.8)  # saved-bytes targets tried under the budget's, as its fraction


def lower_peak(cut, budgets, first, slack: float):
    """The peak tie-break of a memory budget: the fastest plan under the budget (``first``, from
    ``cut(budgets)``) is often one of several of about the same time whose step peaks differ by
    10-15%, since the solver counts saved bytes, not what is alive together in backward. Lower
    saved-bytes targets (``_LOWER_STEPS`` of the budget's) are solved while their estimated step
    time stays within ``slack`` of the fastest plan's and their estimated peak without reruns
    (``cut(..., quick=True)``: no rerun search) is lower than the best so far: the walk stops at
    the first target that does not lower it. Its last target is solved first, and where it is lower
    than the fastest plan the walk ends there (one partition instead of four: on the 8-layer Llama
    of benchmarks/gpu.py the walks of budgets 0.3 and 0.15, and of the grid targets the envelope
    compares them with, went all the way, and the same plans are chosen). Only the walk's last plan then gets its rerun search
    (allowed what its own time leaves of the slack), and it is taken if, reruns included, it has a
    lower estimated peak than ``first``. (Until 2026-11-27 every target of the walk got its rerun
    search and the walk compared peaks after reruns: a 32-layer Llama at budget 0.15 spent 31 of its
    53 s of planning in the rerun searches of 10 plans, where now 4 get one; the peaks without and
    with reruns fell together along every walk traced on it and on the 8-layer Llama.) Where the last
    target's plan peaks to the byte where the fastest plan does (and is no faster), the peak is set
    by what the saved bytes do not change and the walk ends there: planned as on CUDA, an 8-layer
    Llama of hidden 1024 peaks at 489.82 MiB at every budget, and its planning fell by a third. The
    report keeps the user's target and notes the one solved for."""
    plan = first[2]
    report = plan.budget
    if slack <= 0 or None not in budgets or report is None or report.solver == "none":
        return first
    fastest_s = plan.step_cost_s - (plan.rerun.cost_s if plan.rerun is not None else 0.0)
    limit = fastest_s * (1 + slack)
    best, best_target = cut(budgets, quick=True), None  # first's partition, without its reruns
    level: list = []  # the walk's targets whose plan peaks exactly where the fastest plan does

    def lower(f):
        """(target, its plan without reruns) if the target is feasible, within the time limit and
        of a lower peak than the best so far, else None."""
        target = int(report.target * f)
        if target <= report.minimum:  # the minimum's plan is budget 0's: its reruns have budget 0's allowance
            return None
        result = cut(_overall(budgets, Budget(nbytes=target)), quick=True)
        if result[2].peak.step == best[2].peak.step:
            level.append(f)
        if result[2].step_cost_s > limit or \
                (result[2].peak.step, result[2].step_cost_s) >= (best[2].peak.step, best[2].step_cost_s):
            return None
        return target, result

    # the walk's last target first: where it is lower, the walk ends there in one partition instead of
    # four (the walks traced went all the way more often than not); where it is not, the walk goes
    # target by target from the first, ending at the first miss, as it would have without it
    found = lower(_LOWER_STEPS[-1])
    if found is not None:
        best_target, best = found
    elif not level:  # a fifth fewer saved bytes peaking to the byte where the fastest plan does: the
        # peak is set by what the saved bytes do not change (the gradients, near the backward's end),
        # and the walk's targets between the two peak there too
        for f in _LOWER_STEPS[:-1]:
            found = lower(f)
            if found is None:
                break  # each target costs a partition: the walk ends at the first miss
            best_target, best = found
    if best_target is None:
        return first
    best = cut(_overall(budgets, Budget(nbytes=best_target)), fastest_s)  # with its reruns
    if (best[2].peak.step, best[2].step_cost_s) >= (plan.peak.step, plan.step_cost_s):
        return first
    chosen = best[2].budget
    _reported_as_asked(chosen, report, best_target, plan)
    if best[2].peak.step == plan.peak.step:  # taken for its time (the reruns' differ), not its peak
        chosen.lowered_for = "the same estimated peak at a lower estimated step time"
    chosen.solve_seconds += report.solve_seconds
    return best


def monotone_peak(cut, budgets, chosen, slack: float, levels: Optional[int] = 2, extend: bool = False):
    """The monotone envelope of a memory budget: a smaller budget must not give a higher estimated
    peak than a larger one. ``chosen`` (lower_peak's plan) is compared with the plan of the
    saved-bytes target of ``_GRID`` (fractions of the feasible range) just above the budget's, as
    that budget would plan it: when it has a lower estimated peak (the bound), the budget's fastest
    partition takes reruns down to the bound whatever their time; if they cannot reach it, the plan
    of the largest grid target under the budget's that meets the bound (it fits the budget too), and
    only if none does the feasible minimum's, its reruns too toward the bound whatever their time:
    the fastest of those that meet the bound, else the lowest-peak one. (Taking the feasible
    minimum's plan, the least peak, whenever the reruns missed put budget 0.3 of a wide 8-layer
    Llama at 47.90 MiB, under 0.15's 64.51; it now takes a grid target's under it, 76.51 MiB. Until
    2026-12-06 the feasible minimum's reruns went on to the least peak they found, however far under
    the bound: planned as on CUDA, benchmarks/gpu.py's Llama in bf16 at budget 0.1, whose chain
    held 0.15 under 0.2's 15.71 MiB, took 125 reruns to 9.44 MiB there (and so at 0.1) where 8, its
    blocks, meet the bound at 12.90; 22.4 s of planning, now 13.9 s, 0.1 at 12.80 MiB.) The
    budget's saved bytes are never exceeded. At the top of the
    grid nothing is above. At the feasible minimum (budget 0) nothing else fits: its plan, given
    reruns up to per-layer checkpointing's estimated step (passes/partition.py _rerun_allowance), is
    held under the plan budget 0.05's own compile makes (one level more than ``levels``), by reruns
    whatever their time, else it takes the least peak they find.

    ``levels`` (option monotone): the nearby target's plan is itself held the same way under the target
    above it, ``levels`` targets up in all (1: lower_peak's plan of the nearest target as it is; None,
    monotone="grid": every target up to the top of the grid, so that down the grid's targets the
    estimated peak never rises, at 2-4x the planning). Each level costs one to five partitions, each
    with a rerun search. Two (the default from 2026-11-30) hold the nearest target under the next one:
    with 1, an 8-layer Llama's budget 0.05 was compared with 0.1's first plan (22.27 MiB) and kept 22.27
    MiB where 0.1's own compile held it at 21.27 MiB under 0.15's (docs/budgets.md). ``extend``
    (monotone="auto", the default since 2026-12-06: ``levels`` 2): where the chain's last level's first
    plan peaks over the fastest plan of the grid target above it or of the top of the grid (a bump: that
    level's own compile holds it lower), the chain goes on up, level by level, to the first level that
    does not (planned as on
    CUDA, benchmarks/gpu.py's Llama in bf16 at budget 0.05: 0.1's plan held under 0.15's first plan,
    24.04 MiB, a bump over 0.2's 15.71, kept 0.05 at 22.65 MiB where 0.1's own compile gives 12.80;
    extended to 0.2, 12.79 MiB, as the grid's). The check compares with the next level's fastest plan,
    reruns included (its plan, after the peak tie-break, peaks at or under that: a bump within the
    tie-break's gain goes unseen; against its partition without reruns, a check of one partition and no
    rerun search, the same Llama in float32 kept 0.1 at 26.00 MiB over 0.2's 24.00: 0.2's first plan,
    26.31, is a bump over 0.25's plan, not over its partition); each extension costs that level's plans.
    The top of the grid is checked too (one partition more): where saving the most peaks lowest, as
    recomputing makes temporaries, a bump two levels or more under the top is over no level above it
    (8 Linear+GELU blocks, d 64, with a graph break: budget 0.6's first graph kept its first plan, 2.88
    MB, saving 5x the bytes of 0.7's, held under the top's 2.82 MB; measured step peak 7.41 MB at 0.6,
    6.88 at 0.7; now 6.88 at both).
    Not monotone by construction: a level under its neighbour above can still be over that neighbour's
    own envelope. Made the default once its tighter bound at budget 0 no longer gave the test GPT a plan
    of whole blocks rerun toward it that the least peak's plan beats in peak and time (passes/rerun.py:
    the values' search toward the blocks' plan's peak; docs/budgets.md, "monotone='auto': on up past a
    bump").
    ``cut(budgets, fastest_s, cap)`` returns (fw, bw, plan, tags) and caches by its arguments, so a
    target solved for one comparison is not solved again."""
    return _envelope(cut, budgets, chosen, slack, levels, extend)[0]


def _envelope(cut, budgets, chosen, slack: float, depth: Optional[int], extend: bool = False):
    """(monotone_peak's plan for ``budgets`` (``chosen``: lower_peak's), the grid levels its bound
    was made from): its bound the nearby grid target's plan held by its own envelope ``depth - 1``
    levels up (0: ``chosen`` as it is; None: every level up to the top of the grid), with
    ``extend`` further up while the last level is a bump (monotone_peak)."""
    plan = chosen[2]
    report = plan.budget
    if depth == 0 or None not in budgets or report is None or report.solver == "none":
        return chosen, 0
    if report.at_minimum and depth is not None:
        depth += 1  # budget 0's bound: budget 0.05's plan as its own compile holds it
    lo, hi = report.minimum, report.maximum
    fraction: Dict[int, float] = {}  # saved-bytes target -> its grid fraction (the largest giving it)
    for f in _GRID:
        fraction.setdefault(lo + int((hi - lo) * f), f)
    grid = sorted(fraction, reverse=True)  # saved-bytes targets, largest first
    above = [t for t in grid if t > report.target]
    if not above:
        return chosen, 0
    near = min(above)
    nearby = _overall(budgets, Budget(nbytes=near))
    near_chosen = lower_peak(cut, nearby, cut(nearby), slack)
    deeper = None if depth is None else depth - 1
    higher = [t for t in grid if t > near]
    # with extend, a bump goes on up: its own compile holds it under the level above (that level's
    # fastest plan, with the reruns its slack allows: its plan peaks at or under it), or under the top
    # of the grid (saving the most can peak lowest where recomputing makes temporaries: a bump two
    # levels down from the top is not over the level above it, and was kept over the top's peak)
    if extend and deeper == 0 and higher and near_chosen[2].peak.step > min(
            cut(_overall(budgets, Budget(nbytes=t)))[2].peak.step for t in {min(higher), max(higher)}):
        deeper = 1
    held, levels = _envelope(cut, nearby, near_chosen, slack, deeper, extend)
    levels = None if depth is None else levels + 1
    bound = held[2].peak.step
    if plan.peak.step <= bound:
        return chosen, levels
    best = cut(budgets, None, bound)
    if best[2].peak.step > bound:
        # the grid targets under the budget fit it too: the largest whose plan meets the bound, before
        # the feasible minimum's, which saves the least and so recomputes the most
        fits = [chosen, best]
        for t in (t for t in grid if lo < t < report.target):
            below = _overall(budgets, Budget(nbytes=t))
            result = lower_peak(cut, below, cut(below), slack)
            if result[2].peak.step <= bound:
                fits.append(result)
                break
        else:  # the feasible minimum's partition, its reruns toward the bound whatever their time
            fits.append(cut(_overall(budgets, Budget(fraction=0.0)), None, bound))
        meet = [r for r in fits if r[2].peak.step <= bound]
        best = (min(meet, key=lambda r: (r[2].step_cost_s, r[2].peak.step)) if meet
                else min(fits, key=lambda r: (r[2].peak.step, r[2].step_cost_s)))
    if best is chosen:
        return chosen, levels
    picked = best[2].budget  # this call's own copy (passes/partition.py cut): re-reported as the budget's
    picked_target = picked.target if picked.lowered_to is None else picked.lowered_to
    solve_s = report.solve_seconds + picked.solve_seconds
    picked.budget, picked.target, picked.lowered_to = report.budget, report.target, picked_target
    picked.fastest_peak = report.fastest_peak if report.lowered_to is not None else plan.peak.step
    picked.fastest_step_s = report.fastest_step_s if report.lowered_to is not None else plan.step_cost_s
    picked.solve_seconds = solve_s
    picked.held_under, picked.held_met, picked.held_levels = bound, best[2].peak.step <= bound, levels
    picked.held_by = f"{fraction[near]:g}"
    return best, levels
