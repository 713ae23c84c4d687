"""Random small PyTorch programs: a seeded generator, and the program as Python source.

A program is a list of statements over a pool of values that all have the shape (B, T, D): each
op reads one to three values of the pool (and parameters, integer index inputs) and writes a new
one, so any op can be deleted by reading its first input instead of its output (what the shrinker
does). Blocks nest: ``checkpoint`` (a ``remat.checkpoint`` region), ``annotate`` (a
``remat.annotate`` block) and ``autocast`` (a bf16 ``torch.autocast`` region). The source written
by :func:`render` defines ``Model`` with two forwards over the same parameters: ``forward`` with the
regions, names and policies, and ``reference``, the same ops with no checkpointing and no remat
call at all, which the oracle compares against.

The generator only writes programs the docs call valid: the placeholder rule (a bare op in a region
never reads a SAVE autograd Function's output), the SAVE ``annotate`` rule (its block reads no SAVE
op's output), no ``preserve_rng_state=False`` over dropout, no dropout under the Inductor lowering
(whose random numbers are its own, so no eager run can draw the same masks), unique op names.
"""
from __future__ import annotations

import copy
import fnmatch
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union

POLICIES = ("SAVE", "RECOMPUTE", "OFFLOAD")

# op kind -> number of value inputs
ARITY = {
    "linear": 1, "matmul": 1, "bmm": 3, "conv1d": 1, "conv2d": 1,
    "layer_norm": 1, "rms_norm": 1, "batch_norm": 1, "softmax": 1, "log_softmax": 1,
    "sdpa": 3, "dropout": 1, "gelu": 1, "silu": 1, "tanh": 1, "relu": 1, "sigmoid": 1,
    "add": 2, "mul": 2, "residual_mlp": 1,
    "transpose": 1, "reshape": 1, "slice_cat": 1, "chunk": 1, "split": 1, "view_heads": 1,
    "roll_time": 1, "mean_expand": 1,
    "inplace_add": 2, "inplace_relu": 2, "inplace_slice": 1, "inplace_sigmoid": 1, "setitem": 2,
    "inplace_view": 1,
    "embedding": 1, "tied_proj": 1, "gather": 1, "index_select": 1,
    "fn_linear": 1, "fn_tanh": 1,
}
# ops that are one call of one function, so remat.native_op can wrap them
NATIVE = {"linear", "matmul", "layer_norm", "softmax", "sdpa", "dropout", "gelu", "silu", "tanh", "relu",
          "sigmoid", "add", "mul", "rms_norm", "conv1d"}
FUNCTIONS = {"fn_linear", "fn_tanh"}  # remat.auto_forward autograd Functions defined in the source
RANDOM_OPS = {"dropout"}
# a graph break inside remat.annotate under torch.compile fails in Dynamo (TypeError: 'function'
# object does not support the context manager protocol); the generator leaves it out until fixed
ANNOTATE_GRAPH_BREAKS = False  # and sdpa with dropout_p > 0


@dataclass
class Op:
    kind: str
    ins: List[int]
    out: int
    params: List[str] = field(default_factory=list)
    arg: Dict = field(default_factory=dict)
    wrap: Optional[List] = None  # [how ("native" | "fn"), name, policy] or None

    @property
    def random(self) -> bool:
        return self.kind in RANDOM_OPS or (self.kind == "sdpa" and self.arg.get("p", 0) > 0)


@dataclass
class Block:
    kind: str  # "checkpoint" | "annotate" | "autocast"
    name: str
    options: Dict = field(default_factory=dict)
    body: List["Stmt"] = field(default_factory=list)


@dataclass
class GraphBreak:
    pass


Stmt = Union[Op, Block, GraphBreak]

PARAM_SHAPES = {  # param kind -> shape, from (T, D, V)
    "w": lambda T, D, V: (D, D), "b": lambda T, D, V: (D,), "g": lambda T, D, V: (D,),
    "c1": lambda T, D, V: (D, D, 3), "c2": lambda T, D, V: (2, 1, 3, 3), "emb": lambda T, D, V: (V, D),
    "w2": lambda T, D, V: (D, 2 * D), "w3": lambda T, D, V: (2 * D, D),
}


@dataclass
class Program:
    seed: int
    mode: str  # "eager" (the named tape) | "compile" (backend="remat")
    B: int
    T: int
    D: int
    H: int
    V: int
    params: Dict[str, str]  # name -> param kind
    body: List[Stmt]
    options: Dict = field(default_factory=dict)  # backend options (compile mode)

    def copy(self) -> "Program":
        return copy.deepcopy(self)

    # -- walks ---------------------------------------------------------------
    def ops(self) -> List[Op]:
        return [s for s, _ in walk(self.body) if isinstance(s, Op)]

    def blocks(self) -> List[Block]:
        return [s for s, _ in walk(self.body) if isinstance(s, Block)]

    @property
    def has_random(self) -> bool:
        return any(o.random for o in self.ops())

    @property
    def has_autocast(self) -> bool:
        return any(b.kind == "autocast" for b in self.blocks())

    def size(self) -> int:
        return len(list(walk(self.body))) + len(self.options)

    def summary(self) -> str:
        kinds = sorted({o.kind for o in self.ops()})
        blocks = [f"{b.kind}:{b.name}" for b in self.blocks()]
        return (f"seed {self.seed} {self.mode} {len(self.ops())} ops {kinds} blocks {blocks} options "
                f"{self.options}")


def walk(body, parents=()):
    """(statement, enclosing blocks) for every statement, in program order."""
    for s in body:
        yield s, parents
        if isinstance(s, Block):
            yield from walk(s.body, parents + (s,))


# -- the generator ----------------------------------------------------------------------------------

class _Gen:
    def __init__(self, rng: random.Random, mode: str, lower: str):
        self.rng, self.mode, self.lower = rng, mode, lower
        self.next_value = 2  # v0, v1: the inputs
        self.params: Dict[str, str] = {}
        self.names = 0
        self.regions = 0
        # value id -> the outermost checkpoint block in which a bare op must not read it
        # (the output of a SAVE/OFFLOAD autograd Function, a placeholder in recompute)
        self.placeholder: Dict[int, Block] = {}
        # value id -> the outermost checkpoint block in which a SAVE annotate block must not read it
        self.saved_output: Dict[int, Block] = {}
        self.pool: List[int] = [0, 1]

    def param(self, kind: str, tie: float = 0.25) -> str:
        same = [n for n, k in self.params.items() if k == kind]
        if same and self.rng.random() < tie:
            return self.rng.choice(same)  # a tied parameter: read by two ops
        name = f"{kind}{sum(1 for k in self.params.values() if k == kind)}"
        self.params[name] = kind
        return name

    def name(self) -> str:
        self.names += 1
        return f"op{self.names}"

    def readable(self, stack, bare: bool, save_annotate: bool) -> List[int]:
        outer = next((b for b in stack if b.kind == "checkpoint"), None)

        def ok(v):
            if bare and v in self.placeholder and self.placeholder[v] is outer:
                return False
            if save_annotate and v in self.saved_output and self.saved_output[v] is outer:
                return False
            return True

        return [v for v in self.pool if ok(v)]

    def op(self, stack) -> Optional[Op]:
        rng = self.rng
        in_autocast = any(b.kind == "autocast" for b in stack)
        save_annotate = any(b.kind == "annotate" and b.options.get("policy") in ("SAVE", "OFFLOAD") for b in stack)
        kinds = list(ARITY)
        if in_autocast:  # custom Functions' backward would see a bf16 gradient against an fp32 weight
            kinds = [k for k in kinds if k not in FUNCTIONS]
        if self.lower == "inductor":
            kinds = [k for k in kinds if k not in RANDOM_OPS]
        kind = rng.choice(kinds)
        wrap = None
        if kind in FUNCTIONS:
            if rng.random() < 0.7:
                wrap = ["fn", self.name(), rng.choice(POLICIES + ("RECOMPUTE", None))]
        elif kind in NATIVE and rng.random() < 0.3 and not save_annotate:
            wrap = ["native", self.name(), rng.choice(POLICIES + ("RECOMPUTE", None))]
        bare = wrap is None or wrap[0] != "fn"
        if wrap is not None and wrap[0] == "native":
            bare = False  # a native_op may read a placeholder (it is the documented fix)
        pool = self.readable(stack, bare=bare, save_annotate=save_annotate)
        if not pool:
            return None
        ins = [rng.choice(pool[-3:] if rng.random() < 0.6 else pool) for _ in range(ARITY[kind])]
        o = Op(kind, ins, self.next_value, wrap=wrap)
        self.next_value += 1
        D = self.D
        if kind in ("linear", "residual_mlp", "fn_linear", "matmul"):
            if kind == "residual_mlp":
                o.params = [self.param("w2"), self.param("w3")]
            else:
                o.params = [self.param("w")]
            if kind == "linear" and rng.random() < 0.7:
                o.params.append(self.param("b", tie=0.0))
        elif kind == "conv1d":
            o.params = [self.param("c1")]
        elif kind == "conv2d":
            o.params = [self.param("c2")]
        elif kind in ("layer_norm", "batch_norm"):
            o.params = [self.param("g", tie=0.1), self.param("b", tie=0.1)]
        elif kind == "rms_norm":
            o.params = [self.param("g", tie=0.1)]
        elif kind in ("embedding", "tied_proj"):
            o.params = [self.param("emb", tie=0.8)]
        elif kind == "inplace_view":
            o.params = [self.param("g", tie=0.3)]
        if kind == "sdpa":
            o.arg = {"p": rng.choice([0.0, 0.0, 0.1, 0.3]) if self.lower != "inductor" else 0.0,
                     "causal": rng.random() < 0.5}
        elif kind == "dropout":
            o.arg = {"p": rng.choice([0.1, 0.25, 0.5])}
        elif kind in ("slice_cat", "split", "inplace_slice"):
            o.arg = {"k": rng.randrange(1, D)}
        self.pool.append(o.out)
        outer = next((b for b in stack if b.kind == "checkpoint"), None)
        if wrap is not None and wrap[2] in ("SAVE", "OFFLOAD") and outer is not None:
            self.saved_output[o.out] = outer
            if wrap[0] == "fn":
                self.placeholder[o.out] = outer
        if save_annotate and outer is not None:
            self.saved_output[o.out] = outer
        return o

    def body(self, stack, n_ops: int, blocks_left: List[int]) -> List[Stmt]:
        rng = self.rng
        out: List[Stmt] = []
        while n_ops > 0:
            r = rng.random()
            if r < 0.3 and blocks_left[0] > 0 and n_ops >= 2:
                blocks_left[0] -= 1
                block = self.block(stack)
                inner = rng.randint(1, n_ops)
                block.body = self.body(stack + (block,), inner, blocks_left)
                n_ops -= inner
                if block.body:
                    out.append(block)
            elif r < 0.22 and self.mode == "compile":
                out.append(GraphBreak())
            else:
                o = self.op(stack)
                n_ops -= 1
                if o is not None:
                    out.append(o)
        return out

    def block(self, stack) -> Block:
        rng = self.rng
        r = rng.random()
        in_autocast = any(b.kind == "autocast" for b in stack)
        if r < 0.55:
            self.regions += 1
            return Block("checkpoint", f"r{self.regions}", {})  # options filled in once the body is known
        if r < 0.8 or in_autocast:
            options = {"policy": rng.choice(POLICIES + (None,))}
            if self.mode == "compile" and rng.random() < 0.2:
                options["memory_budget"] = rng.choice([0.0, 0.5, 1.0])
            return Block("annotate", self.name(), options)
        return Block("autocast", "bf16")


def _drop_graph_breaks(body) -> None:
    body[:] = [s for s in body if not isinstance(s, GraphBreak)]
    for s in body:
        if isinstance(s, Block):
            _drop_graph_breaks(s.body)


def _region_options(rng: random.Random, program: Program, block: Block) -> Dict:
    options: Dict = {}
    names = [o.wrap[1] for o, _ in walk(block.body) if isinstance(o, Op) and o.wrap]
    names += [b.name for b, _ in walk(block.body) if isinstance(b, Block) and b.kind == "annotate"]
    # a save/offload glob must not make an autograd Function SAVE (its output is a placeholder for
    # the bare ops after it) nor a block read by a SAVE annotate block: it selects native ops only
    functions = [o.wrap[1] for o, _ in walk(block.body) if isinstance(o, Op) and o.wrap and o.wrap[0] == "fn"]
    # a bare Function is named by the tape: 'forward#k', k counting the region's unnamed ops and regions
    unnamed = sum(1 for o, _ in walk(block.body) if (isinstance(o, Op) and o.kind in FUNCTIONS and not o.wrap)
                  or (isinstance(o, Block) and o.kind == "checkpoint"))
    functions += [f"forward#{k}" for k in range(1, unnamed + 1)]
    save_block = any(isinstance(b, Block) and b.kind == "annotate" and b.options.get("policy") in ("SAVE", "OFFLOAD")
                     for b, _ in walk(block.body))
    for key in ("save", "offload", "recompute"):
        if names and rng.random() < 0.15:
            glob = rng.choice(names + ["op*", "*1", "nothing_matches"])
            if key != "recompute" and (save_block or any(fnmatch.fnmatchcase(n, glob) for n in functions)):
                continue
            if any(glob in options[k] for k in options):  # the same glob in two lists is refused (naming.NameGlobs)
                continue
            options[key] = [glob]
    random_inside = any(isinstance(o, Op) and o.random for o, _ in walk(block.body))
    if not random_inside and rng.random() < 0.15:
        options["preserve_rng_state"] = False
    if rng.random() < 0.1:
        options["determinism_check"] = "none"
    return options


def _compile_options(rng: random.Random, program: Program, lower: str) -> Dict:
    options: Dict = {"lower": lower}
    r = rng.random()
    if r < 0.35:
        options["memory_budget"] = rng.choice([0.0, 0.1, 0.3, 0.5, 0.7, 1.0, round(rng.random(), 3)])
    elif r < 0.55:
        options["memory_budget"] = rng.choice([rng.randrange(2, 200_000), "4KiB", "16KiB", "64KiB", "1MiB", "50%"])
    if rng.random() < 0.15:
        options["peak_budget"] = rng.choice([0.0, 0.5, 1.0, rng.randrange(10_000, 400_000), "64KiB", "1MiB"])
    names = [o.wrap[1] for o in program.ops() if o.wrap] + [b.name for b in program.blocks() if b.kind == "annotate"]
    globs = names + ["*mm*", "*addmm*", "*gelu*", "*softmax*", "*mul*", "*add*", "*tanh*", "*conv*", "*"]
    for key in ("save", "recompute"):
        if rng.random() < 0.15:
            options[key] = rng.sample(globs, k=min(len(globs), rng.randint(1, 2)))
    if "save" in options and "recompute" in options:  # the same glob in both is refused (naming.NameGlobs)
        options["recompute"] = [g for g in options["recompute"] if g not in options["save"]] or None
        if options["recompute"] is None:
            del options["recompute"]
    for key, values in (("rerun", [True, False, "auto"]), ("peak_slack", [0.0, 0.03, 0.2]),
                        ("solver", ["ilp", "greedy"]), ("schedule", [True, False]),
                        ("cost_model", ["auto", "roofline", "flops"])):
        if rng.random() < 0.1:
            options[key] = rng.choice(values)
    if "peak_budget" in options:  # peak_slack would do nothing there, and is refused (options.parse_options)
        options.pop("peak_slack", None)
    return options


def generate(seed: int, *, mode: Optional[str] = None, inductor_share: float = 0.05) -> Program:
    """The program of case ``seed``: the same seed always gives the same program."""
    rng = random.Random(seed)
    mode = mode or rng.choice(["eager", "compile"])
    lower = "inductor" if mode == "compile" and rng.random() < inductor_share else "eager"
    T, D = rng.choice([4, 6, 8]), rng.choice([4, 8, 12, 16])
    g = _Gen(rng, mode, lower)
    g.D = D
    n_ops = rng.randint(2, 14)
    if rng.random() < 0.5:  # everything in one region, with 0-2 more inside
        g.regions += 1
        outer = Block("checkpoint", f"r{g.regions}", {})
        outer.body = g.body((outer,), n_ops, [rng.choice([0, 1, 1, 2])])
        body = [outer] if outer.body else []
    else:
        body = g.body((), n_ops, [rng.choice([0, 1, 2, 2, 3, 3])])
    program = Program(seed=seed, mode=mode, B=2, T=T, D=D, H=rng.choice([1, 2]), V=11, params=g.params, body=body)
    for block in program.blocks():
        if block.kind == "checkpoint":
            block.options = _region_options(rng, program, block)
    if mode == "compile":  # a graph break in a region runs the region eagerly: with eager random draws
        for block in program.blocks():  # the compiled reference cannot make
            if block.kind == "checkpoint" and any(isinstance(o, Op) and o.random for o, _ in walk(block.body)):
                _drop_graph_breaks(block.body)
            if block.kind == "annotate" and not ANNOTATE_GRAPH_BREAKS:  # a known bug: tests/test_fuzz.py
                _drop_graph_breaks(block.body)
    if mode == "compile":
        program.options = _compile_options(rng, program, lower)
    return program


# -- the source -------------------------------------------------------------------------------------

_HEADER = '''\
import torch
import torch.nn.functional as F

import remat_fx as remat

P = remat.CheckpointPolicy


class FnLinear(torch.autograd.Function):
    @staticmethod
    @remat.auto_forward("x", "w")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad @ w.t(), (x.reshape(-1, x.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1]))


class FnTanh(torch.autograd.Function):
    @staticmethod
    @remat.auto_forward("y")
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)
'''


def _policy(p) -> str:
    return "None" if p is None else f"P.{p}"


def _call(o: Op, fn: str, args: str, plain: bool) -> str:
    """``fn(args)``, or the same call through remat.native_op / remat.op."""
    if plain or o.wrap is None:
        return f"{fn}({args})"
    how, name, policy = o.wrap
    wrapper = "remat.native_op" if how == "native" else "remat.op"
    return f"{wrapper}({fn}, {name!r}, {_policy(policy)})({args})"


def _op_lines(p: Program, o: Op, plain: bool) -> List[str]:
    B, T, D, H = p.B, p.T, p.D, p.H
    v = [f"v{i}" for i in o.ins]
    a = v[0]
    out = f"v{o.out}"
    w = [f"self.{n}" for n in o.params]
    k = o.arg.get("k", 1)
    kind = o.kind

    def call(fn, args):
        return [f"{out} = {_call(o, fn, args, plain)}"]

    if kind == "linear":
        return call("F.linear", ", ".join([a] + w))
    if kind == "matmul":
        return call("torch.matmul", f"{a}, {w[0]}")
    if kind == "bmm":
        return [f"{out} = torch.bmm(torch.bmm({a}, {v[1]}.transpose(1, 2)).mul({D ** -0.5:.4f}).softmax(-1), {v[2]})"]
    if kind == "conv1d":
        return [f"{out} = {_call(o, 'F.conv1d', f'{a}.transpose(1, 2), {w[0]}, padding=1', plain)}.transpose(1, 2)"]
    if kind == "conv2d":
        return [f"{out} = F.conv2d({a}.unsqueeze(1), {w[0]}, padding=1).sum(1)"]
    if kind == "layer_norm":
        return call("F.layer_norm", f"{a}, ({D},), {w[0]}, {w[1]}")
    if kind == "rms_norm":
        return call("F.rms_norm", f"{a}, ({D},), {w[0]}")
    if kind == "batch_norm":
        return [f"{out} = F.batch_norm({a}.transpose(1, 2), None, None, {w[0]}, {w[1]}, training=True).transpose(1, 2)"]
    if kind == "softmax":
        return call("torch.softmax", f"{a}, -1")
    if kind == "log_softmax":
        return [f"{out} = {a}.log_softmax(-1)"]
    if kind == "sdpa":
        heads = [f"{x}.reshape({B}, {T}, {H}, {D // H}).transpose(1, 2)" for x in v]
        args = f"{', '.join(heads)}, dropout_p={o.arg['p']}, is_causal={o.arg['causal']}"
        return [f"{out} = {_call(o, 'F.scaled_dot_product_attention', args, plain)}.transpose(1, 2).reshape({B}, {T}, {D})"]
    if kind == "dropout":
        # on a contiguous input: its mask is drawn in memory order, and a compiled run may lay a value out
        # otherwise than eager (a checkpoint region split by graph breaks returns eager's strides, the
        # reference's graph a contiguous tensor): the same random stream, another mask (case 11748)
        return call("F.dropout", f"{a}.contiguous(), p={o.arg['p']}, training=True")
    if kind in ("gelu", "silu", "relu"):
        return call(f"F.{kind}", a)
    if kind in ("tanh", "sigmoid"):
        return call(f"torch.{kind}", a)
    if kind in ("add", "mul"):
        return call(f"torch.{kind}", f"{a}, {v[1]}")
    if kind == "residual_mlp":
        return [f"{out} = {a} + F.gelu({a} @ {w[0]}) @ {w[1]}"]
    if kind == "transpose":
        return [f"{out} = {a}.transpose(1, 2).contiguous().transpose(1, 2) * 1.5"]
    if kind == "reshape":
        return [f"{out} = {a}.reshape({B}, {T * D}).mul(0.5).reshape({B}, {T}, {D})"]
    if kind == "slice_cat":
        return [f"{out} = torch.cat([{a}[..., :{k}] * 2, {a}[..., {k}:].tanh()], -1)"]
    if kind == "chunk":
        return [f"{out}_c = {a}.chunk(2, -1)", f"{out} = torch.cat([{out}_c[1], {out}_c[0] * {out}_c[1]], -1)"]
    if kind == "split":
        return [f"{out}_s = {a}.split([{k}, {D - k}], -1)", f"{out} = torch.cat([{out}_s[1].sigmoid(), {out}_s[0]], -1)"]
    if kind == "view_heads":
        return [f"{out} = {a}.reshape({B}, {T}, 2, {D // 2}).transpose(2, 3).reshape({B}, {T}, {D})"]
    if kind == "roll_time":
        return [f"{out} = torch.cat([{a}[:, 1:], {a}[:, :1]], 1)"]
    if kind == "mean_expand":
        return [f"{out} = {a} - {a}.mean(1, keepdim=True).expand({B}, {T}, {D})"]
    if kind == "inplace_add":
        return [f"{out} = {a} * 0.5", f"{out}.add_({v[1]})"]
    if kind == "inplace_relu":
        return [f"{out} = {a} + {v[1]}", f"{out}.relu_()"]
    if kind == "inplace_slice":
        return [f"{out} = {a}.clone()", f"{out}[..., :{k}].mul_(2.0)"]
    if kind == "inplace_sigmoid":
        return [f"{out} = {a} * 2", f"{out}.sigmoid_()"]
    if kind == "setitem":
        return [f"{out} = {a} * 1.0", f"{out}[:, 0] = {v[1]}[:, 0]"]
    if kind == "inplace_view":
        return [f"{out} = ({a} + 1).contiguous()", f"{out}.view({B * T}, {D}).mul_({w[0]})"]
    if kind == "embedding":
        return [f"{out} = {a} + F.embedding(idx, {w[0]})"]
    if kind == "tied_proj":
        return [f"{out} = ({a} @ {w[0]}.t()).softmax(-1) @ {w[0]}"]
    if kind == "gather":
        return [f"{out} = torch.gather({a}, -1, gidx)"]
    if kind == "index_select":
        return [f"{out} = {a}.index_select(1, tidx) * {a}"]
    if kind == "fn_linear":
        return call("FnLinear.apply", f"{a}, {w[0]}")
    if kind == "fn_tanh":
        return call("FnTanh.apply", a)
    raise ValueError(f"unknown op kind {kind!r}")


def _defined(body) -> List[int]:
    return [s.out for s, _ in walk(body) if isinstance(s, Op)]


def _read(body) -> List[int]:
    return [i for s, _ in walk(body) if isinstance(s, Op) for i in s.ins]


def _body_lines(p: Program, body, plain: bool, indent: str) -> List[str]:
    lines: List[str] = []
    for s in body:
        if isinstance(s, GraphBreak):
            lines.append(indent + "torch._dynamo.graph_break()")
        elif isinstance(s, Op):
            lines += [indent + line for line in _op_lines(p, s, plain)]
        elif s.kind == "checkpoint":
            defined = set(_defined(s.body))
            free = sorted({i for i in _read(s.body) if i not in defined})
            outs = sorted(defined)
            if not outs:  # nothing left in it (a shrunk case): its graph breaks only
                lines += _body_lines(p, s.body, plain, indent)
                continue
            fn = f"_{s.name}"
            lines.append(f"{indent}def {fn}({', '.join(f'v{i}' for i in free)}):")
            lines += _body_lines(p, s.body, plain, indent + "    ")
            lines.append(f"{indent}    return ({''.join(f'v{i}, ' for i in outs)})")
            args = ", ".join(f"v{i}" for i in free)
            if plain:
                call = f"{fn}({args})"
            else:
                opts = "".join(f", {k}={v!r}" for k, v in s.options.items())
                call = f"remat.checkpoint({s.name!r}{opts})({fn})({args})"
            lines.append(f"{indent}{''.join(f'v{i}, ' for i in outs)}= {call}")
        elif s.kind == "annotate" and not plain:
            opts = "".join(f", {k}={_policy(v) if k == 'policy' else repr(v)}" for k, v in s.options.items())
            lines.append(f"{indent}with remat.annotate({s.name!r}{opts}):")
            lines += _body_lines(p, s.body, plain, indent + "    ") or [indent + "    pass"]
        elif s.kind == "annotate":
            lines += _body_lines(p, s.body, plain, indent)
        else:  # autocast: the same in both forwards; its values leave it as float32
            lines.append(f'{indent}with torch.autocast("cpu", dtype=torch.bfloat16):')
            lines += _body_lines(p, s.body, plain, indent + "    ") or [indent + "    pass"]
            lines += [f"{indent}v{i} = v{i}.float()" for i in sorted(set(_defined(s.body)))]
    return lines


def _forward(p: Program, name: str, plain: bool) -> List[str]:
    read = set(_read(p.body))
    sinks = [i for i in [0, 1] + _defined(p.body) if i not in read and i > 1] or [0]
    lines = [f"    def {name}(self, v0, v1, idx, gidx, tidx):"]
    lines += _body_lines(p, p.body, plain, "        ")
    loss = " + ".join(f"v{i}.float().sin().sum()" for i in sinks)
    lines.append(f"        return {loss}")
    return lines


def render(p: Program, *, main: bool = False) -> str:
    """The program as Python source: ``Model`` (``forward`` and ``reference``), ``inputs(seed)``,
    and, with ``main``, a ``__main__`` that runs the oracle on it."""
    lines = [f"# remat_fx fuzz case: seed {p.seed}, {p.mode} mode", _HEADER, "", "class Model(torch.nn.Module):",
             "    def __init__(self):", "        super().__init__()"]
    for name, kind in p.params.items():
        shape = PARAM_SHAPES[kind](p.T, p.D, p.V)
        scale = {"g": None, "b": 0.1}.get(kind, round(1.0 / (shape[-1] ** 0.5 if kind != "c1" else (3 * p.D) ** 0.5), 4))
        init = ("torch.ones" if kind == "g" else "torch.randn") + f"{shape}"
        if kind == "b":
            init += f" * {scale}"
        elif kind != "g":
            init += f" * {scale}"
        if kind == "g":
            init = f"1 + 0.1 * torch.randn{shape}"
        lines.append(f"        self.{name} = torch.nn.Parameter({init})")
    if not p.params:
        lines.append("        pass")
    lines += ["", *_forward(p, "forward", plain=False), "", *_forward(p, "reference", plain=True), ""]
    lines += ["", "def inputs(seed=0):", "    g = torch.Generator().manual_seed(seed)",
              f"    v0 = torch.randn({p.B}, {p.T}, {p.D}, generator=g)",
              f"    v1 = torch.randn({p.B}, {p.T}, {p.D}, generator=g)",
              f"    idx = torch.randint(0, {p.V}, ({p.B}, {p.T}), generator=g)",
              f"    gidx = torch.randint(0, {p.D}, ({p.B}, {p.T}, {p.D}), generator=g)",
              f"    tidx = torch.randperm({p.T}, generator=g)",
              "    return v0, v1, idx, gidx, tidx", "",
              f"MODE = {p.mode!r}", f"OPTIONS = {p.options!r}", f"SEED = {p.seed}", ""]
    if main:
        lines += ['if __name__ == "__main__":', "    from remat_fx.fuzz.oracle import check_source",
                  "    import sys", "", "    result = check_source(open(__file__).read())",
                  "    print(result)", "    sys.exit(0 if result.ok else 1)", ""]
    return "\n".join(lines)
