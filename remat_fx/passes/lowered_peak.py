"""Lowered peak: a graph's peak as Inductor runs it, read from Inductor's own schedule.

remat plans with a liveness model of the FX graphs (passes/peak.py), which follows Inductor's
rules for what it computes inside other kernels but not every fusion it makes: on an 8-layer
Llama the model's estimate was 1.2-1.8 MiB (3-10%) under the measured peak at every byte
``peak_budget`` tried, so each limit was exceeded. Once Inductor has fused the graph's kernels
and ordered them, its scheduler knows every buffer it will allocate, its size and the kernel that
last reads it (``torch._inductor.memory``, the model Inductor's own ``reorder_for_peak_memory``
uses), and its code generator which kernels write their output over an input that dies there
(the wrapper's in-place ``reuses``) and which buffers it never allocates (``removed_buffers``:
local to one fused kernel). :func:`reading_schedules` reads them, for each graph compiled inside
it, and counts as passes/peak.py does: a forward's inputs (parameters, the batch) exist before
the step and are not counted, a backward's saved activations and tangents are, each freed after
the kernel that last reads it (a tangent on CUDA at the backward's end: passes/peak.py
``held_to_end``). On the 8-layer Llama this equals the measured step peak at memory
budgets 1 / 0.5 / 0.3 / 0.15 / 0 (the FX estimate: 3.4 MiB over to 1.6 MiB under):
passes/lower.py checks a byte ``peak_budget`` against it.

Private torch surface, all of it here: ``Scheduler.codegen`` (wrapped for the length of one
compile), ``torch._inductor.memory`` (``get_freeable_input_buf``,
``assign_memory_planning_info_for_scheduler_buffers`` / ``_nodes``, ``compute_memory_timeline``),
``V.graph.graph_inputs`` / ``get_output_names``, and ``torch._functorch.config.
force_non_lazy_backward_lowering`` (passes/lower.py: the backward compiled with the forward, so
both schedules are known before the first step runs). Checked on torch 2.13.0 and 2.14.1
(tests/test_lowered_peak.py); where a name is missing the figure is None and nothing is checked.
The wrap of ``Scheduler.codegen`` is process-wide while it lasts: a graph another thread
schedules meanwhile would be read as this compile's (remat compiles on the calling thread).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Set, Tuple

log = logging.getLogger("remat_fx")


@dataclass(frozen=True)
class Schedule:
    """One graph as Inductor scheduled it: the bytes its own buffers hold at each kernel, and each
    graph input's bytes and the kernel that last reads it (or that last reads what is written over it)."""

    live: Tuple[int, ...]  # bytes of the graph's own buffers at each step (kernel) 0..n
    inputs: Dict[str, Tuple[int, int]]  # input name -> (bytes, last step reading it; -1: a graph output)
    kernels: int

    def peak(self, counted: Set[str] = frozenset()) -> int:
        """The highest bytes alive, with the inputs named in ``counted`` alive from the start until
        their last reader."""
        delta = [0] * (len(self.live) + 1)
        for name in counted:
            if name in self.inputs:
                nbytes, last = self.inputs[name]
                delta[0] += nbytes
                delta[len(self.live) if last == -1 else last + 1] -= nbytes
        best, acc = 0, 0
        for i, own in enumerate(self.live):
            acc += delta[i]
            best = max(best, own + acc)
        return best


def _timeline(scheduler):
    """(buffer infos of ``torch._inductor.memory`` for the graph's own buffers, {graph input: (bytes,
    last step reading it)}, the kernel count). Inputs are read here rather than from Inductor's
    freeable inputs, which leave out tangents and every name starting with ``arg`` or ``primals_``."""
    from torch._inductor import memory
    from torch._inductor.virtualized import V

    nodes = list(scheduler.nodes)
    outputs = set(V.graph.get_output_names())
    graph_inputs = set(V.graph.graph_inputs.keys())
    freeable = memory.get_freeable_input_buf(nodes, graph_inputs)
    memory.assign_memory_planning_info_for_scheduler_buffers(nodes, scheduler.name_to_buf)
    memory.assign_memory_planning_info_for_scheduler_nodes(nodes, scheduler.name_to_fused_node,
                                                           scheduler.name_to_buf, freeable)
    infos, _, _ = memory.compute_memory_timeline(nodes, freeable, outputs)
    own = [i for i in infos if not (_name(i) in freeable and i.buffer is freeable[_name(i)])]
    # a backward's incoming gradients on CUDA are alive to its end (passes/peak.py held_to_end)
    held = {name for name in graph_inputs if name.startswith("tangents") and _on_cuda(V.graph.graph_inputs[name])}
    inputs: Dict[str, Tuple[int, int]] = {}
    for step, node in enumerate(nodes):
        for dep in node.read_writes.reads:
            if dep.name in graph_inputs:
                nbytes = max(inputs.get(dep.name, (0, 0))[0], V.graph.get_dep_size_hint(dep))
                inputs[dep.name] = (nbytes, -1 if dep.name in outputs or dep.name in held else step)
    return own, inputs, len(nodes)


def _on_cuda(box) -> bool:
    get_device = getattr(box, "get_device", None)  # none on a symbolic size's input
    device = get_device() if get_device is not None else None
    return device is not None and device.type == "cuda"


def _schedule(infos, inputs: Dict[str, Tuple[int, int]], n: int, reuses: Dict[str, str],
              removed: Set[str] = frozenset()) -> Schedule:
    """The Schedule of the graph's own buffer ``infos`` and its ``inputs`` {name: (bytes, last step
    reading it, -1 for a graph output)}; ``reuses`` {output: input} are the kernels Inductor's code
    writes over an input that dies there (its wrapper's in-place reuses): the output takes no memory
    of its own, the input's lives on until the output's last reader; ``removed``: buffers its code
    never allocates (read and written only inside one fused kernel)."""
    end = {_name(i): i.end_step for i in infos}
    end.update({name: last for name, (_, last) in inputs.items()})
    reused = set(reuses.values())

    def last(name):  # where the memory of ``name`` is freed, following the buffers written over it
        seen = set()
        while name in reused and name not in seen:
            seen.add(name)
            name = next(o for o, i in reuses.items() if i == name)
        return end.get(name, -1)

    delta = [0] * (n + 2)
    for info in infos:
        name = _name(info)
        if name in reuses or name in removed:
            continue  # written over an input (its memory is counted with that input's), or never allocated
        delta[info.start_step] += info.size_alloc
        stop = last(name)
        if stop != -1:
            delta[stop + 1] -= info.size_free
    live, acc = [], 0
    for i in range(n + 1):
        acc += delta[i]
        live.append(acc)
    return Schedule(tuple(live), {name: (nbytes, last(name)) for name, (nbytes, _) in inputs.items()}, n)


def _name(info) -> str:
    buffer = info.buffer
    return buffer.get_name() if hasattr(buffer, "get_name") else buffer.name


def available() -> bool:
    """Whether this torch has every name :func:`reading_schedules` and passes/lower.py use."""
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import memory
        from torch._inductor.scheduler import Scheduler
    except ImportError:
        return False
    return hasattr(Scheduler, "codegen") and hasattr(functorch_config, "force_non_lazy_backward_lowering") \
        and all(hasattr(memory, f) for f in ("get_freeable_input_buf", "compute_memory_timeline",
                                             "assign_memory_planning_info_for_scheduler_buffers",
                                             "assign_memory_planning_info_for_scheduler_nodes"))


@contextlib.contextmanager
def reading_schedules(sink: List[Optional[Schedule]], check: Optional[Callable[[Schedule], None]] = None,
                      fx_graph_cache: bool = False):
    """Inside, each graph Inductor generates code for appends its :class:`Schedule` to ``sink``
    (None where it could not be read), and ``check(schedule)`` is called before Inductor compiles
    the generated kernels: an exception it raises ends the compile there. Inductor's FX graph cache
    is off inside unless ``fx_graph_cache`` (a graph loaded from it is not scheduled again, and
    appends nothing; its kernels' compiled code is cached either way)."""
    from torch._inductor import config
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.virtualized import V

    real = Scheduler.codegen

    def codegen(self, *args, **kwargs):
        try:
            timeline = _timeline(self)
        except Exception:  # a torch whose memory model differs: no figure, nothing checked
            log.warning("remat_fx: Inductor's schedule could not be read (peak_budget is checked on the FX "
                        "estimate alone for this graph)", exc_info=True)
            timeline = None
        out = real(self, *args, **kwargs)
        reuses = getattr(V.graph.wrapper_code, "reuses", None)
        removed = set(getattr(V.graph, "removed_buffers", ())) - set(V.graph.get_output_names())
        sink.append(None if timeline is None or reuses is None else _schedule(*timeline, dict(reuses), removed))
        if check is not None and sink[-1] is not None:
            check(sink[-1])
        return out

    Scheduler.codegen = codegen
    try:
        with config.patch(fx_graph_cache=config.fx_graph_cache and fx_graph_cache):
            yield sink
    finally:
        Scheduler.codegen = real
