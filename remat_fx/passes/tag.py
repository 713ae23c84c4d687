"""Tag: every forward node of the joint graph becomes SAVE or RECOMPUTE, must or prefer.

Precedence (first that applies):
  1. random ops are saved (MUST_SAVE): recomputing them would draw fresh randomness;
  2. the backend's ``save``/``recompute`` option globs (MUST);
  3. the enclosing region's ``save``/``offload``/``recompute`` globs (MUST);
     a glob selects the nodes whose names it matches, and, for a module path it matches where it
     matches none of that module's node names (``*.qkv``), the module's output (select below); a
     glob that selects nothing in a graph is warned about once, with the closest names;
  4. a region's outputs (MUST_SAVE): as in eager mode, their consumers outside the region hold them
     (an output that is a view of what the region computes: that, the storage it views);
  5. inside a checkpoint region, the policy written at the call site: remat.op / native_op /
     annotate (MUST); outside one it decides nothing, as in eager mode;
  6. inside a remat.checkpoint region: PREFER_RECOMPUTE, as non-reentrant AC recomputes it;
  7. otherwise no tag: the min-cut partitioner chooses.
Over all of these: a forward op that reads a graph input the forward later changes in place (through
views) is MUST_SAVE: recomputed in backward it would read the new value (_keep_readers_of_mutated_inputs).
A SAVE op's inputs follow their own producers' tags, as on the eager tape, where a SAVE op's
backward input made by a recomputed op is handed over again by the recompute.
Backward nodes carry the forward's annotations in the joint graph and are never tagged.
"""
from __future__ import annotations

import difflib
import fnmatch
import functools
import operator
import warnings
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy as TorchPolicy

from remat_fx.naming import META_KIND, META_NAME, META_POLICY, META_REGION, META_REGION_GLOBS, NameGlobs, \
    close_globs, shadowed_message
from remat_fx.options import BackendOptions
from remat_fx.passes.capture import JointGraph, is_multi_output, is_random, module_outputs


@dataclass(frozen=True)
class Tag:
    policy: TorchPolicy
    reason: str
    offload_as_save: bool = False  # marked OFFLOAD, kept as SAVE: compiler mode does not offload (_must)

    @property
    def saves(self) -> bool:
        return self.policy in (TorchPolicy.MUST_SAVE, TorchPolicy.PREFER_SAVE)


_MUST = {"SAVE": TorchPolicy.MUST_SAVE, "OFFLOAD": TorchPolicy.MUST_SAVE, "RECOMPUTE": TorchPolicy.MUST_RECOMPUTE}


def region_globs(custom: dict) -> Optional[NameGlobs]:
    """The globs of the checkpoint region a node was traced in (its ``custom`` meta), or None."""
    raw = custom.get(META_REGION_GLOBS)
    return _globs_of(tuple(map(tuple, raw))) if raw and any(raw) else None


@functools.lru_cache(maxsize=64)
def _globs_of(raw: tuple) -> NameGlobs:  # one matcher per region's globs
    save, offload, recompute = raw
    return NameGlobs(save=save, offload=offload, recompute=recompute)


# what a glob selected a node as: (kind, the module whose output it is, or None for a name match)
Selected = Tuple[str, Optional[str]]


def select(joint: JointGraph, globs: NameGlobs, nodes: Iterable[fx.Node]) -> Tuple[Dict[fx.Node, Selected],
                                                                                  List[Tuple[str, str, list]]]:
    """What ``globs`` select among the forward ``nodes``: {node: (kind, module or None)}, and the
    (kind, glob, shadowed) triples of the globs that decide nothing: ``shadowed`` is empty where the glob
    matches nothing, else the (node, kind) pairs of a stronger kind that took everything it matches.
    A glob selects the nodes whose name it matches and, for
    each module path it matches while matching none of that module's node names (``*.qkv`` against
    ``layers.0.qkv``, whose nodes are ``layers.0.qkv.addmm``, ``layers.0.qkv.view``), that module's
    output (capture.module_outputs). When several kinds select a node, RECOMPUTE > OFFLOAD > SAVE,
    as NameGlobs.match."""
    nodes = [n for n in nodes if n in joint.names]
    members: Dict[str, set] = {}
    for node in nodes:
        for path in joint.paths.get(node, ()):
            members.setdefault(path, set()).add(node)
    chosen: Dict[fx.Node, Selected] = {}
    unmatched: List[Tuple[str, str, list]] = []
    # a remat.annotate block's name, as the eager tape matches it (a glob 'blk' selects the block 'blk',
    # whose nodes are named 'blk.tanh.0': it matched none of them in compiler mode, a parity review)
    blocks = {n: joint.custom(n).get(META_NAME) for n in nodes if joint.custom(n).get(META_KIND) == "annotate"}
    for kind, patterns in (("RECOMPUTE", globs.recompute), ("OFFLOAD", globs.offload), ("SAVE", globs.save)):
        for pattern in patterns:
            named = {n for n in nodes if fnmatch.fnmatchcase(joint.names[n], pattern)
                     or (n in blocks and blocks[n] is not None and fnmatch.fnmatchcase(blocks[n], pattern))}
            found: Dict[fx.Node, Optional[str]] = dict.fromkeys(named)
            for path, inside in members.items():
                if fnmatch.fnmatchcase(path, pattern) and inside.isdisjoint(named):
                    for out in module_outputs(joint, inside):
                        found.setdefault(out, path)
            taken = [(node, chosen[node][0]) for node in found if node in chosen and chosen[node][0] != kind]
            if not found or len(taken) == len(found):
                unmatched.append((kind, pattern, taken))
            for node, module in found.items():
                chosen.setdefault(node, (kind, module))
    return chosen, unmatched


def tag_node(joint: JointGraph, node: fx.Node, options: BackendOptions,
             by_option: Optional[Selected] = None, by_region: Optional[Selected] = None) -> Optional[Tag]:
    """``by_option`` / ``by_region``: what the backend option globs / the region's globs selected
    the node as (see select), if they did."""
    custom = joint.custom(node)
    if is_random(node):
        return Tag(TorchPolicy.MUST_SAVE, "random op: saved so backward sees the forward's values")
    if by_option is not None:
        kind, module = by_option
        return _must(kind, f"backend option {kind.lower()} glob" + _output_of(module))
    if by_region is not None:
        kind, module = by_region
        return _must(kind, f"region '{custom.get(META_REGION)}' {kind.lower()} glob" + _output_of(module))
    region = node.meta.get("ac_graph_id")
    in_region = region is not None or custom.get(META_REGION) is not None
    if in_region and any(u in joint.forward and u.meta.get("ac_graph_id") != region for u in node.users):
        # as in eager mode, a region's outputs are held by their consumers outside it (autocast's cast of
        # a weight that a later region reads from the cast cache too: docs/differences.md)
        return Tag(TorchPolicy.MUST_SAVE, f"output of {_region(custom)}")
    written = custom.get(META_POLICY)
    if in_region and written is not None and custom.get(META_NAME) is not None \
            and not (_is_layout(node) and written != "RECOMPUTE"):
        # (outside a checkpoint region a call-site policy decides nothing, as on the eager tape)
        # (views and copies inside a SAVE op are free to redo from what they copy: that decides)
        return _must(written, f"{written} at the call site of '{custom[META_NAME]}'")
    if in_region:
        return Tag(TorchPolicy.PREFER_RECOMPUTE, f"inside {_region(custom)}")
    return None


def _region_of(joint: JointGraph, node: fx.Node) -> tuple:
    """The checkpoint region a node is in: (its torch.utils.checkpoint graph id, its remat region's name)."""
    return node.meta.get("ac_graph_id"), joint.custom(node).get(META_REGION)


def _region(custom: dict) -> str:
    """A region by its name; a torch.utils.checkpoint region has none (it was written '?')."""
    name = custom.get(META_REGION)
    return "a torch.utils.checkpoint region" if name is None else f"checkpoint region '{name}'"


def _must(kind: str, reason: str) -> Tag:
    """The tag a SAVE / OFFLOAD / RECOMPUTE decision makes. Compiler mode has no offload planning
    (docs/differences.md, Known gaps): an OFFLOAD is kept as SAVE, said in its reason and in one
    warning per compile (_warn_offload)."""
    if kind == "OFFLOAD":
        return Tag(_MUST[kind], reason + " (kept on the device as SAVE: compiler mode does not offload)", True)
    return Tag(_MUST[kind], reason)


def _output_of(module: Optional[str]) -> str:
    return "" if module is None else f" (the output of module '{module}')"


def tag_joint(joint: JointGraph, options: BackendOptions) -> Dict[fx.Node, Tag]:
    """Tag the forward nodes and write the tags where the min-cut partitioner reads them."""
    by_option: Dict[fx.Node, Selected] = {}
    if options.globs:
        by_option, unmatched = select(joint, options.globs, joint.forward)
        _warn_unmatched(joint, joint.forward, unmatched, "backend option", options.warned)
    by_region: Dict[fx.Node, Selected] = {}
    regions: Dict[tuple, List[fx.Node]] = {}
    for node in joint.forward:
        custom = joint.custom(node)
        if region_globs(custom) is not None:
            raw = tuple(map(tuple, custom[META_REGION_GLOBS]))
            regions.setdefault((custom.get(META_REGION), raw), []).append(node)
    selected, decided = {}, set()
    for (region, raw), inside in regions.items():
        chosen, unmatched = select(joint, _globs_of(raw), inside)
        by_region.update(chosen)
        selected[(region, raw)] = unmatched
        missed = {u[:2] for u in unmatched}
        decided |= {(kind, p) for kind, patterns in zip(("SAVE", "OFFLOAD", "RECOMPUTE"), raw) for p in patterns
                    if (kind, p) not in missed}
    # a glob given to every layer's region that selects in some of them ("L[0246].fc1": the even
    # layers) is not said once for each region it finds nothing in (a review: 4 warnings a graph)
    for (region, raw), unmatched in selected.items():
        _warn_unmatched(joint, regions[(region, raw)], [u for u in unmatched if u[:2] not in decided],
                        f"region '{region}'", options.warned)
    _warn_conflicting_names(joint, options.warned)
    tags: Dict[fx.Node, Tag] = {}
    for node in joint.forward:
        tag = tag_node(joint, node, options, by_option.get(node), by_region.get(node))
        if tag is not None:
            tags[node] = tag
    _save_masks_of_random_ops(joint, tags)
    # a region's output that is a view (a Linear over a 3-d input ends in a view of its addmm) is free
    # to redo from its base, and the min-cut redoes it so: its base, computed inside the region, is
    # kept with it, or the region's boundary was lost and the whole forward recomputed at once in
    # backward (the eager tape holds the region's outputs)
    for node in [n for n, t in tags.items() if t.policy is TorchPolicy.MUST_SAVE and _is_view(n)
                 and t.reason.startswith("output of ")]:
        base, region = node, _region_of(joint, node)
        while _is_view(base) and base.args and isinstance(base.args[0], fx.Node) and base.args[0] in joint.forward:
            base = base.args[0]
            held = tags.get(base)
            # inside the region only: a view of the region's input, or of what it read, is not its to keep
            if _region_of(joint, base) == region and (held is None or held.policy is TorchPolicy.PREFER_RECOMPUTE):
                tags[base] = tags[node]  # the storage the region's output views
            else:
                break
    _keep_readers_of_mutated_inputs(joint, tags)
    _keep_region_boundaries(joint, tags)
    # a tuple cannot be saved: a multi-output op stays banned from recompute and its getitem
    # outputs are what gets saved (a getitem left to recompute would need the banned tuple)
    for node in [n for n, t in tags.items() if t.saves and is_multi_output(n)]:
        for user in node.users:
            if user in joint.forward and user.target is operator.getitem:
                tags[user] = tags[node]
    for node, tag in tags.items():
        node.meta["recompute"] = tag.policy
    _warn_offload(joint, tags, options.warned)
    return tags


def _save_masks_of_random_ops(joint: JointGraph, tags: Dict[fx.Node, Tag]) -> None:
    """A random op is saved so that backward sees the forward's draw (tag_node); where what the
    forward makes of the draw is smaller than the draw itself, that is kept instead: dropout
    decomposes to ``rand_like(x) > p``, and the float32 draw was saved for the bool mask that
    backward reads, 4x its bytes (a review, 8 layers with dropout: 116,736 bytes saved, 67,584 now;
    PyTorch's own min-cut keeps the mask). The draw stays banned from recompute: it is
    saved still where backward reads it itself, or where a user's glob recomputes the mask."""
    from remat_fx.passes.peak import storage_bytes

    for node in [n for n in tags if is_random(n) and not is_multi_output(n)]:  # (each MUST_SAVE: tag_node)
        users = list(node.users)
        if not users or any(u not in joint.forward or u.op != "call_function" or is_random(u) or is_multi_output(u)
                            or _is_view(u) or (u in tags and tags[u].policy is not TorchPolicy.PREFER_RECOMPUTE)
                            for u in users):
            continue
        made, drawn = sum(storage_bytes(u) for u in users), storage_bytes(node)
        if not 0 < made < drawn:
            continue
        name = joint.names.get(node, node.name)
        for user in users:
            tags[user] = Tag(TorchPolicy.MUST_SAVE, f"made from random op '{name}': saved in its place ({made:,} "
                                                    f"bytes against {drawn:,}) so backward sees the forward's draw")


def _keep_region_boundaries(joint: JointGraph, tags: Dict[fx.Node, Tag]) -> None:
    """What PyTorch's min-cut partitioner does to the tags before it cuts (``cleanup_recompute_tags``,
    read on torch 2.13 and 2.14.1, the same): a node tagged to recompute whose user, also tagged to
    recompute, is in a later checkpoint region (a larger ``ac_graph_id``) is made MUST_SAVE, the
    boundary between two regions.
    Unglobbed, such a node is a region's output and MUST_SAVE already (tag_node); a recompute glob
    (``recompute=['*']``) left it to the partitioner, so the budget's 0-1 program counted it recomputed
    and the partition saved it: over the target the solver met (fuzz seed 8997: 1,536 bytes saved
    against 1,075). Tagged here, the program and the plan's reasons see it."""
    recompute = (TorchPolicy.MUST_RECOMPUTE, TorchPolicy.PREFER_RECOMPUTE)
    for node, tag in list(tags.items()):
        graph_id = node.meta.get("ac_graph_id")
        if tag.policy not in recompute or graph_id is None:
            continue
        later = [u for u in node.users if u in tags and tags[u].policy in recompute
                 and u.meta.get("ac_graph_id") is not None and u.meta["ac_graph_id"] > graph_id]
        if later:
            tags[node] = Tag(TorchPolicy.MUST_SAVE, f"region boundary: read by a later checkpoint region, whose "
                                                    f"recompute starts from it (PyTorch's partitioner saves it; "
                                                    f"tagged {tag.policy.name}: {tag.reason})")


def _keep_readers_of_mutated_inputs(joint: JointGraph, tags: Dict[fx.Node, Tag]) -> None:
    """A graph input the forward changes in place (``z.add_(...)``, a buffer's ``copy_``, spectral
    norm's vectors) is written back at the forward's end (AOTAutograd's ``copy_`` into the input): a
    forward op that read its old value, recomputed in backward, would read the new one (silently
    wrong gradients under a budget or a recompute glob; a helper's review). Such readers, reached
    through views, are kept (MUST_SAVE), whatever else tagged them."""
    mutated = {n.args[0] for n in joint.gm.graph.nodes
               if n.target is torch.ops.aten.copy_.default and n.args and isinstance(n.args[0], fx.Node)
               and n.args[0].op == "placeholder"}
    for placeholder in mutated:
        stack, seen = [placeholder], set()
        while stack:
            node = stack.pop()
            for user in node.users:
                if user in seen or user not in joint.forward or user.target is torch.ops.aten.copy_.default:
                    continue
                seen.add(user)
                if _is_view(user):
                    stack.append(user)
                elif not is_random(user):
                    tags[user] = Tag(TorchPolicy.MUST_SAVE, f"reads input '{placeholder.name}' before the forward "
                                     f"changes it in place: a recompute in backward would read the new value")


def _warn_offload(joint: JointGraph, tags: Dict[fx.Node, Tag], warned: set) -> None:
    """One warning per compile where values marked OFFLOAD are kept as SAVE: the user's offloader is
    never called and those bytes stay on the device, which a step sized for offloading may not fit."""
    names = sorted({joint.names.get(n, n.name) for n, tag in tags.items() if tag.offload_as_save})
    if not names or "offload" in warned:
        return
    warned.add("offload")
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    warnings.warn(f"remat_fx: compiler mode does not offload: {len(names)} value(s) marked OFFLOAD ({shown}) are "
                  f"kept on the device as SAVE and no offloader is called. Run the region eagerly (the named tape "
                  f"offloads them) or mark them SAVE.", UserWarning, stacklevel=3)


def _warn_conflicting_names(joint: JointGraph, warned: set) -> None:
    """One warning per name given, in one checkpoint region of this graph, to ops whose call sites
    wrote different policies (``native_op(..., "mm", policy=SAVE)`` and another ``"mm"`` with
    RECOMPUTE). The eager tape refuses a name used twice in one region call; the joint graph cannot
    tell two calls of a nested region apart (a check refusing every repeat refused valid nested
    regions), but one name with two policies is at fault either way: each op keeps its own policy,
    and the plan files both under the one name."""
    policies: Dict[tuple, set] = {}
    for node in joint.forward:
        custom = joint.custom(node)
        name, written = custom.get(META_NAME), custom.get(META_POLICY)
        if name is not None and written is not None and custom.get(META_KIND) in ("op", "native", "annotate"):
            policies.setdefault((custom.get(META_REGION), node.meta.get("ac_graph_id"), name), set()).add(written)
    for (region, _, name), written in policies.items():
        key = ("conflicting names", region, name)
        if len(written) < 2 or key in warned:
            continue
        warned.add(key)
        where = "a torch.utils.checkpoint region" if region is None else f"checkpoint region '{region}'"
        warnings.warn(f"remat_fx: the name '{name}' is given in {where} to ops with different policies "
                      f"({', '.join(sorted(written))}); each op keeps its own, but the plan files them under the one "
                      f"name, and the eager runtime refuses a name used twice in one region. Give each call its "
                      f"own name (e.g. with the layer index).", UserWarning, stacklevel=3)


def _warn_unmatched(joint: JointGraph, nodes: Iterable[fx.Node], unmatched: List[Tuple[str, str, list]],
                    where: str, warned: set) -> None:
    """One warning per glob that decides nothing in this graph (it matches nothing, or only what a
    stronger kind's glob took), once per compile (``warned``: the options' record; the step planner
    partitions a graph again with copies of the same options)."""
    if not unmatched:
        return
    order = {n: i for i, n in enumerate(joint.gm.graph.nodes)}
    nodes = sorted((n for n in nodes if n in joint.names), key=order.__getitem__)
    names = list(dict.fromkeys(joint.names[n] for n in nodes))
    paths = list(dict.fromkeys(p for n in nodes for p in joint.paths.get(n, ())))
    for kind, pattern, taken in unmatched:
        key = (where, kind, pattern)
        if key in warned:
            continue
        warned.add(key)
        if taken:
            shown = list(dict.fromkeys(joint.names[n] for n, _ in sorted(taken, key=lambda t: order[t[0]])))
            text = shadowed_message(f"{where} {kind.lower()}", pattern, shown, taken[0][1], " in this graph")
        else:
            text = unmatched_message(pattern, f"{where} {kind.lower()}", names, paths)
        warnings.warn(text, UserWarning, stacklevel=3)


def unmatched_message(pattern: str, what: str, names: List[str], paths: List[str]) -> str:
    """The warning for a glob that selects nothing: the glob, up to 3 close globs that do match (or
    close names), and how names are formed."""
    suggestions = close_globs(pattern, names + paths)
    if suggestions:
        hint = "; did you mean " + ", ".join(
            f"'{g}'" + ("" if hits == [g] else f" ({', '.join(hits[:2])}{', ...' if len(hits) > 2 else ''})")
            for g, hits in suggestions) + "?"
        first = suggestions[0][1][0]
        example = next((n for n in _computing(names) if n == first or n.startswith(first + ".")), None)
    else:
        close = difflib.get_close_matches(pattern, names + paths, n=3, cutoff=0.5)
        hint = f"; the closest names: {', '.join(close)}." if close else "."
        example = None
    example = example or next((n for n in _computing(names) if "." in n), None)
    return (f"remat_fx: {what} glob '{pattern}' matched no node in this graph{hint} Node names are "
            f"<module path>.<op>{f', e.g. {example}' if example else ''} (or the name given to remat.op, "
            f"native_op or annotate); a glob that matches a module path (*.qkv) selects that module's output.")


_LAYOUT_OPS = {"view", "_unsafe_view", "reshape", "permute", "t", "transpose", "expand", "clone", "alias",
               "squeeze", "unsqueeze", "slice", "select", "split", "chunk", "getitem"}


def _computing(names: List[str]) -> List[str]:
    """Names of ops that compute (``layers.0.qkv.addmm``) before those that only reshape (``.view``)."""
    return sorted(names, key=lambda n: n.rsplit(".", 1)[-1] in _LAYOUT_OPS)


def _is_view(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _is_layout(node: fx.Node) -> bool:
    """Views, plain copies (decompositions add clones for contiguity) and casts: no compute to save
    (the eager tape does not cache a cast in a SAVE block either: it runs again in the recompute)."""
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target is torch.ops.aten.clone.default
                                                          or _is_cast(node))


def _is_cast(node: fx.Node) -> bool:
    return node.target in (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)

