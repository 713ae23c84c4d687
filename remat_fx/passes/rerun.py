"""Rerun: recompute a value a second time in the backward, when holding it sets the step's peak.

With few bytes saved, the backward recomputes the forward from the graph inputs: to reach the
last layer's gradients it recomputes every layer, and each layer's values then wait for their
own gradients, so everything recomputed is alive at once (at budget 0 the peak is no lower than
without checkpointing). Eager per-block checkpointing avoids this by recomputing each block again
from its input right before the block's backward.

This pass does the same without knowing the blocks, on the backward graph's liveness (the model
of passes/peak.py): at the backward's peak it picks a value held there but not used there, whose
next use comes later, and emits a second copy of it just before that use, together with the
values it is computed from that are no longer alive then (its closure, stopping at values that
still are, e.g. a block's input; or, a second candidate, only at values that stay alive across
the peak anyway, so that one rerun from further back frees every value on the way, as a per-block
checkpoint does); from there on every reader of a value the closure remakes reads the copy, so
the originals die at their last earlier use. A getitem of an op returning several tensors is
copied with that op (the tensors are the op's: a lone copied getitem would free nothing).
Candidates are ranked by bytes freed at the peak per second of recompute (the cost
model's); a rerun is kept only if it lowers the step's estimated peak (or narrows the stretch at
that peak on the way down) and its recompute fits the time allowance left, and at the end only the
shortest prefix of reruns that comes within 1% of the lowest peak is kept. Under a time allowance
the search runs a second time with candidates ranked by what they cut off the top of the
backward's live bytes per second (``_cut_above``: a value freed at the peak lowers it only where
no other position holds as much), and the better of the two is kept: on the Llama of
benchmarks/gpu.py at budget 0.15 the first ranking spent 5.4 of 6.6 ms on a residual chain whose
4 MiB freed at the peak lowered it by 0.23 MiB, the second took four single matmuls first
(24.27 -> 21.30 MiB estimated against 22.28). Searching for the lowest peak (budget 0 with
peak_slack 0, the low end of a fraction peak_budget), or toward budget 0's cap (the monotone
envelope's: budget 0.05's plan; not above the minimum: with whole blocks first toward its cap,
budget 0.05 of that Llama took a plan of 18 reruns that measured 18.0 MiB against its estimate and
0.1's 17.4) on a backward of numbered blocks (``model.layers.3``, from the nodes'
module paths), a second search first offers each block as one candidate: every value of the block
held at the peak, but not its outputs to other blocks, rerun together before the first later use
of any of them, which is per-block checkpointing's structure; once no block lowers the peak it goes
on value by value. Of the two, the faster plan is kept where its peak is within 1% of the lower
one, or of two within 2% of each other's recompute the one copying fewer nodes (``_choose``:
budget 0 of that Llama toward its cap, 35 reruns copying 697 nodes against 78 copying 912, 1.8%
more recompute; 40 kernels compiled instead of 55). Toward budget 0's cap the blocks' search runs
first; where its plan meets the cap the values' search then runs toward that plan's peak, allowed
its time less _NEAR_FASTEST and its copied nodes, and its plan replaces the blocks' only where it
gets there: no higher, faster, no larger (since 2026-12-06; before, the values' search was not run
there, and on the test GPT under monotone='auto' 3 blocks met the cap with 1.27 ms of recompute
and 238 copied nodes, where the values reach a lower peak with 0.48 ms and 79). On the 8-layer
Llama of benchmarks/gpu.py at budget 0 with peak_slack 0 (Inductor's liveness) 8 blocks take
the estimate from 91.3 to 23.3 MiB for 72 ms of recompute and the values after them to 16.73 MiB,
200 ms and 2,230 copied nodes in all, where values alone reach 16.60 MiB with 235 ms and 2,532:
the blocks' plan is kept. On small models and under the eager lowering the values' plan was
faster. It stops when the step's peak is the forward's (the backward can no longer set it).
Random ops, mutations and anything that reads a tangent are never rerun. When the backward is
compiled, the step may show that another of its graphs sets its peak: ``shorten`` then keeps
only the first reruns it needs.
"""
from __future__ import annotations

import bisect
import dataclasses
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set

import numpy as np
import torch
import torch.fx as fx

from remat_fx.passes.capture import is_random, numbered_block
from remat_fx.passes.cost import flops
from remat_fx.passes.lazy_module import new_module
from remat_fx.passes.peak import (RERUN_OF, allocation, fused_back, held_to_end, inlined_nodes, kernel_counter,
                                  liveness, node_facts, storage_bytes, writes_apart)

RERUN = "remat_fx.rerun"  # node meta of a copy: the number of its rerun (1, 2, ...)


@dataclass
class RerunReport:
    reruns: int = 0  # values recomputed a second time
    nodes: int = 0  # nodes emitted again (values and their closures)
    flops: int = 0  # FLOPs of those nodes
    cost_s: float = 0.0  # the cost model's estimate of their time
    peak_before: int = 0  # the step's estimated peak without them
    peak_after: int = 0
    seconds: float = 0.0
    allowance_s: Optional[float] = None  # the recompute time they were allowed (None: the lowest peak)
    names: List[str] = field(default_factory=list)  # FX names of the values rerun (a block's path: the whole block)
    shortened_from: Optional[int] = None  # reruns the search kept, where the step dropped the last ones (shorten)
    # what shorten() needs, until the backward is compiled: the backward without reruns, and per
    # kept rerun (program, backward's estimated peak with it, name, FX nodes it copies, seconds so far)
    _steps: Optional[tuple] = field(default=None, repr=False, compare=False)

    @property
    def shortenable(self) -> bool:
        """Whether ``shorten`` may still drop some of the reruns (until the backward is compiled)."""
        return self._steps is not None

    def settled(self) -> "RerunReport":
        """This report without what ``shorten`` keeps until the backward is compiled (the programs
        hold the backward's nodes): for a plan kept where no backward compiles (remat.pareto's points)."""
        return self if self._steps is None else dataclasses.replace(self, _steps=None)


class _Item:
    """One node of the program being rewritten: ``ins`` maps each input node of ``src`` to the
    item that provides it (a copy, after a rerun); ``copy``: the number of the rerun it is a copy
    of (0: an original)."""

    __slots__ = ("src", "ins", "copy")

    def __init__(self, src: fx.Node, ins: Dict[fx.Node, "_Item"], copy: int = 0):
        self.src, self.ins, self.copy = src, ins, copy


def _rerunnable(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if is_random(node):  # draws from the RNG (attention with dropout_p=0 does not)
        return False
    return not target._schema.is_mutable


class _Program:
    def __init__(self, bw: fx.GraphModule, counted: Set[str], shared: Dict[str, str], inline: bool,
                 donated: Set[str] = frozenset()):
        self.items: List[_Item] = []
        made: Dict[fx.Node, _Item] = {}
        reads_tangent: Set[fx.Node] = set()
        for node in bw.graph.nodes:
            item = _Item(node, {m: made[m] for m in node.all_input_nodes})
            made[node] = item
            self.items.append(item)
            if (node.op == "placeholder" and str(node.target).startswith("tangents")) or \
                    any(m in reads_tangent for m in node.all_input_nodes):
                reads_tangent.add(node)
        self.rerunnable = {n for n in made if n not in reads_tangent and _rerunnable(n)}
        self.counted, self.shared, self.inline = counted, shared, inline
        self.donated = [item for item in self.items if item.src.op == "placeholder" and item.src.name in donated]
        # an item's storage root depends only on the item (never mutated) and ``shared``: one memo
        # for every program the search tries
        self.roots: Dict[_Item, object] = {}
        self.facts: dict = {}  # node_facts of the backward's nodes, which the search never changes
        self.nbytes: Dict[fx.Node, int] = {}  # storage bytes of each node
        self.seconds: Dict[fx.Node, float] = {}  # the cost model's time of each node
        self.to_end = [item for item in self.items if held_to_end(item.src)]  # alive to the end (never copied)
        self.blocks: Dict[fx.Node, Optional[str]] = {}  # a node's numbered block (``model.layers.3``)
        named = {item.src.name: item for item in self.items}  # copies an earlier rerun made: their originals
        self.on_cpu = all(node_facts(item.src, self.facts).on_cpu for item in self.items)  # CUDA's rules apart
        self.marked = {item: named[item.src.meta[RERUN_OF]] for item in self.items
                       if item.src.meta.get(RERUN_OF) in named}

    def block(self, node: fx.Node) -> Optional[str]:
        """``capture.numbered_block(node)``, looked up once per node."""
        if node not in self.blocks:
            self.blocks[node] = numbered_block(node)
        return self.blocks[node]

    def root(self, item: _Item, memo: dict):
        found = memo.get(item)
        if found is not None:
            return found
        src = item.src
        if src.op == "placeholder":
            key = self.shared.get(src.name, item)
        elif (self.facts.get(src) or node_facts(src, self.facts)).view:  # passes/peak.py is_view, memoised
            key = self.root(item.ins[src.args[0]], memo)
        else:
            key = item
        memo[item] = key
        return key

    def _apart(self, items: List[_Item], inlined: Set[_Item], memo: dict) -> Callable:
        """passes/peak.py ``writes_apart`` over this program's items (what a kernel computes inside
        it: the items inlined, and views), the set built on the first question only; not asked on
        the CPU, where it is always False."""
        inside: List[Set[_Item]] = []

        def apart(writer, dying) -> bool:
            if not inside:
                facts = self.facts
                inside.append(inlined | {item for item in items
                                         if (facts.get(item.src) or node_facts(item.src, facts)).view})
            return writes_apart(writer, dying, lambda x: x.ins.values(), lambda x: x.src, inside[0],
                                lambda x: memo[x] if x in memo else self.root(x, memo))
        return apart

    def _hoisted(self, items: List[_Item], inlined: Set[_Item], position: Dict[_Item, int],
                 users: Dict[_Item, List[_Item]]) -> Dict[_Item, int]:
        """{copy: its original's position} for the copies Inductor computes in their original's
        kernel (passes/peak.py ``fused_back``); an original no longer read is not computed."""
        if self.on_cpu:
            return {}
        copied = {item.src for item in items if item.copy}
        if not copied and not self.marked:
            return {}
        originals = {item.src: item for item in items if not item.copy and item.src in copied and item in users}
        found = {}
        inputs, readers, src = (lambda x: x.ins.values()), (lambda x: users.get(x, ())), (lambda x: x.src)
        kernels = kernel_counter(items, readers, src, inlined, self.facts)  # counted once per program
        for item in items:
            original = originals.get(item.src) if item.copy else self.marked.get(item)
            if original is not None and original in users and \
                    fused_back(original, item, position, inputs, readers, src, inlined, self.facts, kernels):
                found[item] = position[original]
        return found

    def simulate(self):
        """Liveness of the program as passes/peak.simulate counts it (with ``inline``, as Inductor
        runs it): (live bytes per position, root of each position, start, last, uses, size by root,
        the items inlined, the position of each item)."""
        items = self.items
        memo = self.roots
        position = {item: i for i, item in enumerate(items)}
        roots = [memo[item] if item in memo else self.root(item, memo) for item in items]
        inlined: Set[_Item] = set()
        if self.inline:
            users: Dict[_Item, List[_Item]] = {}
            for item in items:
                for m in item.ins.values():
                    if m in users:
                        users[m].append(item)
                    else:
                        users[m] = [item]
            inlined = inlined_nodes(items, lambda x: x.ins.values(), lambda x: users.get(x, ()), lambda x: x.src,
                                    self.facts)
        hoisted = self._hoisted(items, inlined, position, users) if self.inline else {}
        storages: Dict[object, tuple] = {}
        nbytes = self.nbytes
        for i, (item, r) in enumerate(zip(items, roots)):
            if r not in storages:
                src = item.src
                producer = position[item.ins[src.args[0]]] if src.target is operator.getitem else None
                size = nbytes.get(src)
                if size is None:
                    size = nbytes[src] = storage_bytes(src)
                storages[r] = allocation(src, hoisted.get(item, i), producer, self.counted, item in inlined, size)
        end = len(items) - 1  # the output
        # what each position reads, as storage roots: its inputs', and through an inlined input
        # (computed inside it) or a view of one what that one reads (passes/peak.py reads_through,
        # over roots)
        through: Dict[_Item, set] = {}
        facts = self.facts
        reads, uses = [], {}
        for i, item in enumerate(items):
            keys = set()
            for m in item.ins.values():
                keys.add(memo[m])
                t = through.get(m)
                if t is not None:
                    keys |= t
            for k in keys:
                if k in uses:
                    uses[k].append(i)
                else:
                    uses[k] = [i]
            if item in inlined:
                through[item] = keys
                reads.append(keys | {roots[i]})
            else:
                keys.add(roots[i])
                reads.append(keys)
                if self.inline and (facts.get(item.src) or node_facts(item.src, facts)).view:
                    through[item] = keys
        outputs = {memo[m] for m in items[end].ins.values()} | {memo[item] for item in self.to_end}
        writers = {roots[i] for i, item in enumerate(items[:end]) if item not in inlined and item not in hoisted
                   and (facts.get(item.src) or node_facts(item.src, facts)).in_place} if self.inline else None
        live, last = liveness(end, storages, reads[:end], outputs, writers, {memo[item] for item in self.donated},
                              self._apart(items, inlined, memo) if self.inline and not self.on_cpu else None)
        start = {k: v[0] for k, v in storages.items()}
        size = {k: v[1] for k, v in storages.items()}
        return live, roots, start, last, uses, size, inlined, position


class Searched:
    """The rerun searches of one planning (``rerun_for_peak``'s ``searched``): each backward's
    program and its liveness before any rerun, and each program a search made, by the program and
    the rerun it came from, with its liveness. Under a time allowance the search runs twice, with
    two rankings that take the same reruns on most steps, and the peak searches search one
    partition's backward again toward a cap, whose first steps are most often those taken before:
    each program is simulated once. (The 8-layer Llama of benchmarks/planning.py at budget 0: 225
    programs simulated where there were 348, the same plans.) A program and its liveness take about
    330 bytes per position (measured there: 468,000 positions kept, 153 MiB): the first
    ``per_backward`` programs made from each backward are kept (the steps searches share are the
    first ones), up to ``limit`` positions in all (about 100 MB; the Llama: 229,000 positions, the
    planning's resident memory 77 MiB over its 832 without them, the same 225 simulations), and
    none after that. The backwards' own programs are kept besides (one per partition searched).
    Since 2026-12-06 only the programs a search took are kept so (a program simulated and not taken
    is never gone on from): of every program simulated only its state is kept, which is all a
    search that tries it again needs to pass it over (the same program has the same state). As on
    CUDA, the bf16 Llama of benchmarks/planning.py --as-cuda simulated 704 / 810 programs at budgets
    0.05 / 0 where it took 852 / 954 (628 / 632 with every program kept, at 300 MB more), the same
    plans: planning 17.1-18.0 s at 0.05 against 19.1-19.5 s, two runs each."""

    limit = 300_000
    per_backward = 32

    def __init__(self):
        self.backwards: dict = {}
        self.programs: dict = {}
        self.outcomes: dict = {}  # every program simulated, kept or not: (the program it came from, its state)
        self.made: Dict[int, int] = {}  # programs kept, by the backward (the id of its _Program)
        self.positions = 0

    def keep(self, key, backward: int, before, items, sim, state) -> None:
        """``before`` is kept with its program: the key holds its id."""
        if self.positions + len(items) > self.limit or self.made.get(backward, 0) >= self.per_backward:
            return
        self.positions += len(items)
        self.made[backward] = self.made.get(backward, 0) + 1
        self.programs[key] = (before, items, sim, state)


@dataclass
class _State:
    peak: int  # the step's: the backward's, or the floor if higher
    width: int  # positions at the peak
    backward: int  # the backward's peak


def rerun_for_peak(bw: fx.GraphModule, counted: Set[str], shared: Dict[str, str], held: int, floor: int,
                   cost: Callable[[fx.Node], float], allowance: Optional[float] = None, cap: Optional[int] = None,
                   min_gain: float = 0.0, inline: bool = False, max_closure: int = 256,
                   tries: int = 6, patience: int = 40, max_reruns: int = 2000, donated: Set[str] = frozenset(),
                   shortenable: Optional[bool] = None, blocks_first: bool = False,
                   searched: Optional["Searched"] = None):
    """(backward graph with the reruns, RerunReport); ``bw`` itself is left as it was.
    ``counted``/``shared``: as passes/peak.simulate; ``held``: bytes the forward leaves alive beyond
    the backward's inputs (its other outputs); ``floor``: the forward's peak (the step's peak cannot
    fall below it); ``allowance``: the seconds of recompute (cost model) the reruns may add to the
    step, None for the lowest peak found whatever it costs; ``cap``: a peak_budget; ``min_gain``:
    without a cap, reruns are kept only if they lower the estimated peak by at least this fraction
    (the estimate's error under the lowering); ``inline``: liveness as under Inductor
    (passes/peak.simulate); ``donated``: saved placeholders donated to it (passes/peak.backward_inputs);
    ``shortenable``: whether ``shorten`` may drop the last reruns when the step peaks elsewhere (default:
    without a cap; a peak_budget keeps what it chose, the monotone envelope's cap need not);
    ``blocks_first``: toward a ``cap`` too, the search with whole blocks first (budget 0's cap): it
    runs before the value-by-value one, which runs only where the blocks' plan does not meet the cap;
    ``searched``: what the searches of one planning found (``Searched``), kept by the caller while it
    plans: a backward searched again (under another time allowance, toward a cap) starts from there."""
    t0 = time.perf_counter()
    memo = Searched() if searched is None else searched
    key = (id(bw), id(cost), frozenset(counted), tuple(sorted(shared.items())), inline, frozenset(donated), held,
           floor)  # the program memoises ``cost``'s times
    found = memo.backwards.get(key)
    if found is None:
        prog = _Program(bw, counted, shared, inline, donated)
    else:
        _, prog, start = found
        prog.items = start[0]
    report = RerunReport(allowance_s=allowance)

    def state():
        live = prog.simulate()
        peak = held + max(live[0])
        step = max(floor, peak)
        width = sum(1 for v in live[0] if held + v >= step) if peak >= floor else 0
        return live, _State(step, width, peak)

    if found is None:
        sim, cur = state()
        memo.backwards[key] = ((bw, cost), prog, (prog.items, sim, cur))  # kept: their ids stay their own
    else:
        _, sim, cur = found[2]
    report.peak_before = report.peak_after = cur.peak
    backward0 = cur.backward
    # under a time allowance the search runs twice, ranking candidates by what they cut off the top
    # of the backward's live bytes and by the bytes they free at its peak, and keeps the better
    items0 = prog.items
    ways = [(True, False), (False, False)] if allowance is not None else [(False, False)]
    with_blocks = _BLOCKS_FIRST and allowance is None and (cap is None or blocks_first) and \
        len({prog.block(n) for n in prog.rerunnable} - {None}) > 1
    if with_blocks:  # the lowest peak (or budget 0's cap), on a backward of numbered blocks
        # toward a cap the blocks' search runs first; where its plan meets the cap, the values' search
        # runs toward that plan's peak in its time less _NEAR_FASTEST, and its plan replaces the
        # blocks' only where it reaches that peak copying no more nodes (what Inductor lowers and
        # compiles in the first step): no higher, faster and no larger
        ways = [(False, True)] + ways if cap is not None else ways + [(False, True)]
    kept = []
    within, toward, blocks_plan = allowance, cap, None
    for by_cut, blocks in ways:
        prog.items = items0  # the backward without reruns
        history = _search(prog, state, sim, cur, held, floor, cost, within, toward, max_closure, tries, patience,
                          max_reruns, by_cut, blocks, memo=memo,
                          max_nodes=None if blocks_plan is None else _copied(blocks_plan))
        kept.append(history[:_prefix(history, report.peak_before, toward, min_gain)])
        if blocks_plan is not None:
            values_plan = kept[-1]
            better = values_plan and values_plan[-1][1].peak <= toward and _copied(values_plan) <= _copied(blocks_plan)
            kept = [values_plan if better else blocks_plan]
            break
        if blocks and cap is not None and kept[-1] and kept[-1][-1][1].peak <= cap:
            blocks_plan = kept[-1]
            within, toward = blocks_plan[-1][4] / (1 + _NEAR_FASTEST), blocks_plan[-1][1].peak
    keep = _choose(kept, cur) if with_blocks else min(kept, key=lambda found: _outcome(found, cur))
    if len(keep) > 1 and not inline:  # under Inductor: see _prune
        keep = _prune(prog, keep, state)
    if keep:
        prog.items = keep[-1][0]
        report.peak_after = keep[-1][1].peak
        _tally(report, keep)
        if cap is None if shortenable is None else shortenable:  # a peak_budget keeps the reruns it chose
            report._steps = (bw, backward0, [(h[0], h[1].backward, *h[2:]) for h in keep])
        bw = _materialize(bw, prog.items)
    report.seconds = time.perf_counter() - t0
    return bw, report


def _search(prog: _Program, state, sim, cur: _State, held: int, floor: int, cost, allowance, cap, max_closure: int,
            tries: int, patience: int, max_reruns: int, by_cut: bool, blocks: bool = False,
            memo: Optional["Searched"] = None, max_nodes: Optional[int] = None) -> list:
    """The greedy search from the program ``prog`` holds (its liveness ``sim``, state ``cur``): the
    history (items, state, FX name, nodes, seconds so far) after each rerun taken. ``by_cut``: rank
    candidates first by what they cut off the top of the backward's live bytes (``_cut_above``);
    ``blocks``: whole numbered blocks first (_candidates), until a step takes a single value;
    ``memo``: the programs earlier searches made (``Searched``); ``max_nodes``: the search ends once
    its reruns have copied more nodes than this."""
    memo = Searched() if memo is None else memo
    history = []
    offer = blocks
    best = (cur.peak, 0)
    stale, spent, copied = 0, 0.0, 0
    # with a cap, the search ends once the peak meets it (_prefix keeps the fewest reruns that do)
    while len(history) < max_reruns and cur.peak > max(floor, cap or 0) and stale < patience:
        live, roots, start, last, uses, size, inlined, index = sim
        t_star = max(range(len(live)), key=lambda i: (live[i], -i))
        level = max(floor - held, int(live[t_star] * (1 - _TOP))) if by_cut else None
        candidates = _candidates(prog, live, roots, start, last, uses, size, inlined, index, t_star, cost, max_closure,
                                 level, offer)
        taken = None
        affordable = [c for c in candidates if allowance is None or spent + c[2]["seconds"] <= allowance]
        for score, root, plan in affordable[:tries]:
            before = prog.items
            # the searches of one backward often try the same rerun on the same program (the two
            # rankings under a time allowance agree on most steps): each program is simulated once
            key = (id(before), tuple(map(id, plan["closure"])), plan["at"], len(history) + 1)
            found = memo.programs.get(key)
            if found is None:
                seen = memo.outcomes.get(key)
                if seen is not None and not (seen[1].peak, seen[1].width) < (cur.peak, cur.width):
                    continue  # simulated before, and not taken there either (the same program, the same state)
                prog.items = _apply(before, plan, len(history) + 1)
                new_sim, new = state()
                memo.outcomes[key] = (before, new)
            else:
                _, prog.items, new_sim, new = found
            if (new.peak, new.width) < (cur.peak, cur.width):
                if found is None:  # taken: the next search from ``before`` takes it too, and goes on from it
                    memo.keep(key, id(prog), before, prog.items, new_sim, new)
                taken = (root, plan)
                sim, cur = new_sim, new
                break
            prog.items = before
        if taken is None:
            if offer:  # no block lowers the peak: the single values from here on
                offer = False
                continue
            break
        root, plan = taken
        offer = offer and plan["block"] is not None
        spent += plan["seconds"]
        history.append((prog.items, cur, plan["block"] or root.src.name, plan["nodes"], spent))
        copied += len(plan["nodes"])
        if max_nodes is not None and copied > max_nodes:
            break
        if cur.peak < best[0]:
            best, stale = (cur.peak, len(history)), 0
        else:
            stale += 1
    return history


def _choose(kept: list, start: _State) -> list:
    """Of the searches' kept reruns (value by value, whole blocks first), those within _NEAR_LOWEST
    of the lowest peak; of them the fastest, or where others' recompute is within _NEAR_FASTEST of
    its, the one of those copying the fewest nodes (what Inductor lowers and compiles in the first step)."""
    near = min(_outcome(found, start)[0] for found in kept) * (1 + _NEAR_LOWEST)
    close = [found for found in kept if _outcome(found, start)[0] <= near]
    fastest = min(_outcome(found, start)[1] for found in close) * (1 + _NEAR_FASTEST)
    return min((found for found in close if _outcome(found, start)[1] <= fastest),
               key=lambda found: (_copied(found), _outcome(found, start)[1], _outcome(found, start)[0]))


def _outcome(kept: list, start: _State) -> tuple:
    """What a search's kept reruns give, lower is better: the estimated peak, then their time."""
    return (kept[-1][1].peak, kept[-1][4]) if kept else (start.peak, 0.0)


def shorten(report: RerunReport, bw: fx.GraphModule, limit: Optional[int]):
    """(backward, report, how much higher its estimated peak is) with only the first of the kept
    reruns needed to bring the backward's estimated peak to ``limit`` (the reruns are kept in the
    order the search found them, each lowering the peak: the first k are the search's own plan had
    it been told to stop there), or None when all of them are needed, ``limit`` is None, or ``bw``
    (the backward with the reruns, as AOTAutograd hands it to be compiled) no longer has the
    inputs and outputs the search saw (AOTAutograd may take effect tokens out or inline
    saved-tensor hooks after the partition). Called once, when the backward is compiled: the
    search's programs are let go. The step gives ``limit``: what the backward may peak at without
    setting the step's estimated peak (remat_fx/step.py); a backward searched alone counts its
    forward's outputs as held throughout, and cannot know that a later graph's backward (a loss
    graph holding the logits and their gradient) peaks higher. The report's figures are those of
    the shortened backward."""
    if report._steps is None:
        return None
    source, backward0, steps = report._steps
    report._steps = None  # once: the programs hold the backward's nodes
    if limit is None or _signature(bw) != _signature(source):
        return None
    if backward0 <= limit:
        k = 0
    else:
        k = next((k for k, step in enumerate(steps, 1) if step[1] <= limit), len(steps))
    if k >= len(steps):
        return None
    short = RerunReport(peak_before=report.peak_before, seconds=report.seconds, allowance_s=report.allowance_s,
                        shortened_from=report.reruns)
    higher = (steps[k - 1][1] if k else backward0) - steps[-1][1]
    if not k:
        short.peak_after = report.peak_before
        return source, short, higher
    items, peak = steps[k - 1][:2]
    short.peak_after = max(peak, report.peak_after)
    _tally(short, steps[:k])
    return _materialize(source, items), short, higher


def _tally(report: RerunReport, kept: list) -> None:
    """The reruns of ``kept`` (the search's history: items, state or peak, name, nodes, seconds so far) that
    are in its last program, counted into ``report``: a later rerun placed before an earlier one's
    copies that remakes all they made leaves them unread (a block's rerun past a value rerun alone
    before), and the graph drops them."""
    alive = _alive(kept[-1][0])
    before = 0.0
    for number, (_, _, name, nodes, spent) in enumerate(kept, 1):
        if number in alive:
            report.reruns += 1
            report.names.append(name)
            report.nodes += len(nodes)
            report.flops += sum(flops(n) for n in nodes)
            report.cost_s += spent - before
        before = spent


def _copied(kept: list) -> int:
    """The nodes the reruns of ``kept`` (a search's history) copy into its last program (as _tally)."""
    if not kept:
        return 0
    alive = _alive(kept[-1][0])
    return sum(len(h[3]) for number, h in enumerate(kept, 1) if number in alive)


def _alive(items: List[_Item]) -> Set[int]:
    """The numbers of the reruns whose copies something in the program reads (the output reads,
    or an op with side effects), as the graph's dead-code elimination would leave them."""
    live = {id(items[-1])}
    numbers: Set[int] = set()
    for item in reversed(items):
        if id(item) in live or (item.src.op == "call_function" and item.src.is_impure()):
            live.update(id(m) for m in item.ins.values())
            if item.copy:
                numbers.add(item.copy)
    return numbers


def _prune(prog: _Program, keep: list, state) -> list:
    """The kept reruns without those the others make needless: each in turn, the costliest first,
    is taken out (``_without``) if the step's estimated peak and its width stay at most the kept
    reruns'. The greedy search takes the cheap reruns that narrow the peak first, and later ones,
    from further back, remake what they did. The history of the reruns left, in the search's
    order: (items, state, FX name, nodes, seconds so far) after each, each program the last one
    without the later reruns (``shorten`` keeps a prefix of them).

    Measured, eager lowering, budget 0: the example GPT's block 12 reruns of 218 MFLOPs (the
    recompute itself is 75) -> 9 of 189, the same estimated peak; an 8-layer Llama (benchmarks/
    llama_depth.py's issue shape) 128 reruns of 2,055 copied nodes -> 96 of 1,589, step 320 -> 283
    ms, measured peak 12.26 -> 12.31 MiB, planning +1.3 s. Not under Inductor, where the estimate
    is the liveness model's and not the lowering's: the same Llama's pruned backward (74 reruns,
    1,209 nodes, the same 12.38 MiB estimate) measured 13.49 against 12.65 MiB (15.08 against 13.52
    before passes/lower.py refused the fusions that pull a kernel ahead), as Inductor's own
    schedule said too (passes/lowered_peak.py), and its planning took 2.4 s more; why it measures
    higher was not found."""
    final, target = keep[-1][0], (keep[-1][1].peak, keep[-1][1].width)
    seconds = [h[4] - (keep[k - 1][4] if k else 0.0) for k, h in enumerate(keep)]
    dropped: Set[int] = set()
    for k in sorted(range(len(keep)), key=lambda k: -seconds[k]):
        prog.items = _without(final, dropped | {k + 1})
        st = state()[1]
        if (st.peak, st.width) <= target:
            dropped.add(k + 1)
    if not dropped:
        prog.items = final
        return keep
    left = [k for k in range(len(keep)) if k + 1 not in dropped]
    out, spent = [], 0.0
    for j, k in enumerate(left):
        later = {m + 1 for m in left[j + 1:]}
        items = _without(final, dropped | later)
        prog.items = items
        spent += seconds[k]
        out.append((items, state()[1], keep[k][2], keep[k][3], spent))
    # the reruns left numbered 1, 2, ... again (passes/lower.py tells reruns apart by number), in
    # new items: the programs the searches made (rerun.Searched) keep theirs
    number = {k + 1: j for j, k in enumerate(left, 1)}
    made: Dict[_Item, _Item] = {}
    for n, h in enumerate(out):
        items = []
        for item in h[0]:  # in program order: an item's inputs are made before it
            found = made.get(item)
            if found is None:
                ins = {m: made[p] for m, p in item.ins.items()}
                changed = item.copy or any(ins[m] is not p for m, p in item.ins.items())
                found = made[item] = _Item(item.src, ins, number[item.copy] if item.copy else 0) if changed else item
            items.append(found)
        out[n] = (items, *h[1:])
    prog.items = out[-1][0]
    return out


def _without(items: List[_Item], numbers: Set[int]) -> List[_Item]:
    """The program with the copies of the reruns ``numbers`` taken out: a reader of one of them
    reads instead the latest version of its value made before it (every version of a value
    computes the same; the value's original comes before every copy of it, so one is there): an
    earlier rerun's copy where another rerun remade the value before, else the original."""
    if not numbers:
        return items
    new: Dict[_Item, _Item] = {}
    latest: Dict[fx.Node, _Item] = {}
    out = []
    for item in items:
        if item.copy in numbers:
            continue
        ins, changed = {}, False
        for m, p in item.ins.items():
            q = latest[p.src] if p.copy in numbers else new.get(p, p)
            ins[m] = q
            changed = changed or q is not p
        if changed:
            new[item] = _Item(item.src, ins, item.copy)
            item = new[item]
        latest[item.src] = item
        out.append(item)
    return out


def _signature(gm: fx.GraphModule):
    out = next(iter(reversed(gm.graph.nodes)))
    return [n.name for n in gm.graph.find_nodes(op="placeholder")], len(out.args[0])


# under a time allowance, candidates are ranked by how much they cut the live bytes above this
# fraction below the backward's peak (_cut_above), per second of recompute
_TOP = 0.05
_NEAR_LOWEST = 0.01  # reruns past the first peak this close to the lowest one found are not kept
# two searches' reruns this close in recompute time are alike in time: the one copying fewer nodes is
# kept (the first step's Inductor lowers and compiles what they copy)
_NEAR_FASTEST = 0.02
# for the lowest peak and toward budget 0's cap, also a search rerunning whole numbered blocks first (_candidates)
_BLOCKS_FIRST = True


def _prefix(history, peak0: int, cap, min_gain: float) -> int:
    """How many reruns to keep (all of them fit the time allowance): with a peak cap, the fewest that
    meet it; otherwise (or when none does) the fewest that come within ``_NEAR_LOWEST`` of the
    lowest peak, if that lowers the peak by at least ``min_gain`` (a fraction of ``peak0``). The
    search's last reruns buy little: on a 12-layer GPT-2's backward at budget 0 (hidden 128, bf16)
    its last 6 of 128 lowered the estimate by 0.7% and copied 828 nodes, a third of the recompute
    the reruns added and 16% of the backward Inductor compiles (5,280 nodes, 4,452 without them),
    a lowering well inside the estimate's error under Inductor."""
    if cap is not None:
        for k, h in enumerate(history, 1):
            if h[1].peak <= cap:
                return k if peak0 > cap else 0
    peaks = [peak0] + [h[1].peak for h in history]
    near = min(peaks) * (1 + _NEAR_LOWEST)
    k = next(k for k, peak in enumerate(peaks) if peak <= near)
    return k if k and peaks[k] <= (1 - min_gain) * peak0 else 0


def _candidates(prog: _Program, live, roots, start, last, uses, size, inlined, index, t_star, cost, max_closure,
                level: Optional[int] = None, blocks: bool = False):
    """(score, root, plan) for values held across ``t_star`` but not used there, best first;
    ``index``: the position of each item. Scored by the bytes they free at ``t_star`` per second of
    recompute; with a ``level`` (in the backward's live bytes, below its peak), first by how much
    they cut the live bytes above it (``_cut_above``) per second: a value freed at the peak lowers
    it only where no other position holds as much, and under a time allowance the recompute spent
    on a rerun that merely moves the peak elsewhere is lost. ``blocks``: also one candidate per
    numbered block (``model.layers.3``) rerunning every value of it held there before the first
    later use of any of them, ranked before the single values."""
    items = prog.items
    used_here = {roots[i] for i in [t_star]} | {prog.root(m, prog.roots) for m in items[t_star].ins.values()}
    end = len(items) - 1
    held = []
    for r, s in start.items():
        if size[r] and s < t_star < last[r] <= end and r not in used_here and isinstance(r, _Item) \
                and r.src in prog.rerunnable:
            held.append(r)
    held.sort(key=lambda r: -size[r])

    def later_use(r) -> bool:  # read again after t_star, before the output
        positions = uses.get(r, ())
        return bool(positions) and t_star < positions[-1] < end
    seconds_of = prog.seconds
    profile = np.asarray(live, dtype=np.int64) if level is not None else None
    moves = [(r, [r], None) for r in held[:32] if later_use(r)]
    if blocks:
        by_block: Dict[str, list] = {}
        for r in held:
            b = prog.block(r.src) if later_use(r) else None
            # the block's outputs (read by another block) stay: the others are rerun from them
            if b is not None and all(prog.block(items[i].src) in (b, None) for i in uses[r]):
                by_block.setdefault(b, []).append(r)
        moves.extend((rs[0], rs, b) for b, rs in by_block.items() if len(rs) > 1)
    out = []
    for r, members, block in moves:
        rs = set(members)
        later = sorted({i for m in members for i in uses[m] if i > t_star})
        u = later[0]
        late_users = [items[i] for i in later]
        rewired = set(late_users)  # they read the copies; an inlined op among them need not be copied
        need = {m for user in late_users for m in user.ins.values() if _reaches(m, rs, roots, index, inlined, rewired)}
        for wide in (False, True):
            found = _closure(prog, rs, need, u, t_star, roots, index, start, last, uses, size, inlined, used_here,
                             max_closure * len(members), wide)
            if found is _CANNOT:  # the wide closure holds the narrow one: it cannot either
                break
            if found is None:
                continue
            closure, extended = found
            # every later reader of a value the closure remakes reads the copy (_apply): a value held
            # across t_star whose next use comes at u or later dies before t_star too
            freed, freed_roots = -sum(extended.values()), []
            for item in closure:
                root = roots[index[item]]
                if root is item and (root in rs or _freed_at(root, t_star, u, start, last, uses, used_here, size)):
                    freed += size[root]
                    freed_roots.append(root)
            if freed <= 0:
                continue
            order = sorted(closure, key=index.__getitem__)
            nodes = [it.src for it in order]  # summed in program order: the same score on every run
            seconds = 0.0
            for n in nodes:
                c = seconds_of.get(n)
                if c is None:
                    c = seconds_of[n] = cost(n)
                seconds += c
            score = freed / (seconds + 1e-9)
            if level is not None:
                score = (_cut_above(profile, level, freed_roots, extended, u, t_star, start, last, uses, size)
                         / (seconds + 1e-9), score)
            out.append((score, r, {"closure": order, "need": need, "at": u, "users": late_users,
                                   "nodes": nodes, "seconds": seconds, "block": block}))
    out.sort(key=lambda c: (c[2]["block"] is not None, c[0]), reverse=True)
    return out


def _cut_above(profile, level: int, freed, extended, u: int, t_star: int, start, last, uses, size) -> int:
    """By how many byte-positions a rerun before position ``u`` lowers the backward's live bytes
    (``profile``, a numpy array by position) above ``level`` (summed over positions: what lies above
    it), as it frees each storage in ``freed`` (held across ``t_star``) from its last use before
    ``t_star`` to ``u`` and keeps those in ``extended`` (bytes > 0) alive from their last use to
    ``u``. An estimate for ranking: the copies' own bytes around ``u`` are left out (the search
    simulates the rerun it takes). Where another position outside the stretch holds as much as
    ``t_star``, freeing a value there lowers nothing, however large it is."""
    spans = []
    for root in freed:
        positions = uses.get(root, ())
        k = bisect.bisect_left(positions, t_star)
        spans.append((positions[k - 1] if k else start[root], -size[root]))
    spans.extend((last[root], nbytes) for root, nbytes in extended.items() if nbytes)
    lo = min(a for a, _ in spans) + 1
    if lo >= u:
        return 0
    window = profile[lo:u]
    after = window.copy()
    for a, nbytes in spans:
        after[a + 1 - lo:] += nbytes
    return int(np.maximum(window - level, 0).sum() - np.maximum(after - level, 0).sum())


_CANNOT = object()  # _closure: too large, or it reads an output of an op that cannot run again


def _closure(prog: _Program, rs: Set, need, u: int, t_star: int, roots, index, start, last, uses, size, inlined,
             used_here, max_closure: int, wide: bool):
    """(closure, extended) of a rerun of the storages ``rs`` before position ``u``: the items to copy, in no
    order, and {storage: bytes it now stays alive across t_star} of what they read that cannot run
    again; ``_CANNOT`` if the closure is too large or cannot be built, None if it does not remake
    what the late users read. It stops at values alive at ``u`` anyway (``wide``: only at those
    that stay alive across ``t_star`` anyway, so that a rerun from further back also frees the
    values held across the peak on the way, as a per-block checkpoint does). The wide closure holds
    the narrow one (it stops at fewer values), so where the narrow one cannot be built, neither can
    the wide one."""
    closure: Dict[_Item, None] = {}
    stack, extended = [(m, False) for m in need], {}
    while stack:
        item, forced = stack.pop()
        if item in closure:
            continue
        i = index[item]
        root = roots[i]
        if not forced and root not in rs and i < u and last[root] >= u and item not in inlined and \
                not (wide and _freed_at(root, t_star, u, start, last, uses, used_here, size)):
            continue  # alive at u anyway (an inlined op is not: it is computed inside each reader)
        if item.src not in prog.rerunnable:
            if forced:  # an output of an op that cannot run again
                return _CANNOT
            extended[root] = size[root] if start[root] <= t_star and last[root] < t_star else 0
            continue  # kept alive until u (a saved tensor, a parameter)
        closure[item] = None
        if len(closure) > max_closure:
            return _CANNOT
        # a getitem of an op returning several tensors owns no storage of its own: its copy is
        # a new tensor only if the op runs again (else it is the first copy's, made at the op)
        own = item.src.target is operator.getitem and _owns_outputs(item)
        stack.extend((m, own) for m in item.ins.values())
    if not need <= closure.keys():  # e.g. an inlined op that reads a tangent
        return None
    return closure, extended


def _freed_at(root, t_star: int, u: int, start, last, uses, used_here, size) -> bool:
    """Whether storage ``root`` is held across ``t_star`` and not read from then until ``u``."""
    if not size.get(root) or root in used_here or not start[root] < t_star < last[root]:
        return False
    positions = uses.get(root, ())  # ascending (_Program.simulate appends them in order)
    k = bisect.bisect_left(positions, t_star)
    return k == len(positions) or positions[k] >= u


def _owns_outputs(item: _Item) -> bool:
    """A getitem of a (non-view) op returning several tensors: the tensors are that op's."""
    src = item.src
    if src.target is not operator.getitem:
        return False
    parent = src.args[0]
    return not (isinstance(parent.target, torch._ops.OpOverload) and parent.target.is_view)


def _reaches(m: _Item, rs: Set, roots, index, inlined, rewired) -> bool:
    """Whether reading ``m`` reads one of the storages ``rs``: ``m`` is (a view of) it, or an inlined op (not
    itself rewired to the copies) computed inside its reader from a chain that reads it."""
    if roots[index[m]] in rs:
        return True
    return m in inlined and m not in rewired and any(_reaches(x, rs, roots, index, inlined, rewired)
                                                     for x in m.ins.values())


def _apply(items: List[_Item], plan, number: int) -> List[_Item]:
    """A new program with the plan's closure copied in before position ``at`` (copies of rerun
    ``number``) and its later users reading the copies (items are never mutated: the previous
    program stays valid for undo)."""
    copies: Dict[_Item, _Item] = {}
    for item in plan["closure"]:
        copies[item] = _Item(item.src, {m: copies.get(p, p) for m, p in item.ins.items()}, copy=number)
    at = plan["at"]
    replaced: Dict[_Item, _Item] = {}
    out = items[:at]  # before ``at`` nothing changes
    out.extend(copies[c] for c in plan["closure"])
    for item in items[at:]:  # from here on, everything the copies remake is read from them
        if any(p in copies or p in replaced for p in item.ins.values()):
            new = _Item(item.src, {m: copies.get(p) or replaced.get(p, p) for m, p in item.ins.items()}, item.copy)
            replaced[item] = new
            item = new
        out.append(item)
    return out


def _materialize(bw: fx.GraphModule, items: List[_Item]) -> fx.GraphModule:
    graph = fx.Graph(owning_module=bw, tracer_cls=bw.graph._tracer_cls)
    graph._codegen = bw.graph._codegen
    env: Dict[int, fx.Node] = {}
    taken = {item.src.name for item in items}
    count = 0
    for item in items:
        src = item.src
        args, kwargs = fx.node.map_arg((src.args, src.kwargs), lambda m, item=item: env[id(item.ins[m])])
        name = src.name
        if item.copy:  # a name no original has (the namespace would otherwise shift theirs)
            count += 1
            while f"{src.name}_rerun{count}" in taken:
                count += 1
            name = f"{src.name}_rerun{count}"
        node = graph.create_node(src.op, src.target, args, kwargs, name, src.type)
        if node.name != name:
            raise RuntimeError(f"remat_fx: rerun could not keep the name {name!r} ({node.name!r})")
        node.meta = dict(src.meta)
        if item.copy:
            node.meta[RERUN], node.meta[RERUN_OF] = item.copy, src.name
        env[id(item)] = node
    graph.eliminate_dead_code()  # originals of views whose users now read copies, and unread reruns (_tally)
    copies = [node for node in graph.nodes if node.meta.get(RERUN)]
    number = {k: j for j, k in enumerate(sorted({node.meta[RERUN] for node in copies}), 1)}
    for node in copies:  # numbered 1, 2, ... as the report counts them
        node.meta[RERUN] = number[node.meta[RERUN]]
    graph.lint()
    return new_module(bw, graph)

