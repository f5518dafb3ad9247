"""Plumbing every cpcompile pass shares: the per-compilation context, the counters and the node helpers.

Main API: :class:`PassContext` (what a pass knows about one compilation besides the graph), :data:`counters`
(rewrite statistics of every pass), :func:`graph_modules` (a graph and its nested graphs), :func:`node_value`
(the fake value Dynamo recorded for a node), :func:`shape_of` (its shape), :func:`size_hint` (a size's value at
this compilation), :func:`dim_set` (a ``dim`` argument as a set of dims), :func:`index_dims` (the dim each entry
of an index reads), :func:`arg` (an argument by position or keyword), :func:`node_where`, :func:`node_located`
and :class:`FoundAt` (a node's layer and name, after its model code, for messages), :func:`source_line` (the
model code that made a node), :func:`mixer_function` and :func:`mixer_functions` (the module-level
functions of the model's code that made a node), :func:`in_function` (whether a function was running when a
node was made), :func:`registration_fix` (a refusal's fix for a mixer in a module-level function of the model's
code), :func:`finish` (the lint-and-recompile ending).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import types
from collections import Counter
from collections.abc import Sequence
from typing import Literal, NamedTuple

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.options import BackendOptions

__all__ = [
    "FoundAt",
    "IndexDim",
    "PassContext",
    "arg",
    "counters",
    "dim_set",
    "finish",
    "graph_modules",
    "in_function",
    "index_dims",
    "mixer_function",
    "mixer_functions",
    "node_located",
    "node_value",
    "node_where",
    "registration_fix",
    "shape_of",
    "size_hint",
    "source_line",
]

#: Rewrite statistics, summed over every graph any cpcompile backend compiled in this process. Attention pass:
#: ``sdpa_found``, ``sdpa_rewritten``, ``sdpa_refused``, ``graphs``, ``graphs_without_sdpa``,
#: ``non_sdpa_attention`` (attention computed some other way, refused when CP > 1). flex_attention pass:
#: ``flex_found``, ``flex_rewritten``, ``flex_refused``. Positions pass:
#: ``position_sources_*``. Mixing pass: ``mixing_*``.
counters: Counter[str] = Counter()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassContext:
    """What a pass needs to know about one compilation besides the graph."""

    options: BackendOptions
    #: CP process group (registered name), its size and this process's rank in it.
    group_name: str
    cp_size: int
    cp_rank: int
    #: Counter of the graph within its backend.
    graph_id: int
    #: Prefix of the site ids of this graph: with the site's layer, node and description, unique in the process.
    site_prefix: str
    #: ``"raise"``: refuse with the pass's error; ``"report"``: only record (for inspection).
    refuse: Literal["raise", "report"] = "raise"


def graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the graph modules nested in it (bodies of higher-order ops such as activation checkpointing)."""
    return [m for _, m in gm.named_modules() if isinstance(m, fx.GraphModule)]


def node_value(n: object) -> object:
    """The example (fake) value Dynamo recorded for ``n`` (``example_value``, or ``val`` after AOT), or ``None``."""
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def shape_of(n: object) -> tuple | None:
    """The shape of a node's tensor value, or ``None``."""
    v = node_value(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def size_hint(size: object, *, strict: bool = False) -> int:
    """The value of a (possibly symbolic) size at this compilation. A size without one (a data-dependent size) is
    ``-1``, or with ``strict`` a :class:`ValueError`."""
    value = size if isinstance(size, int) else _compat.sym_hint(size)
    if value is None and strict:
        raise ValueError(f"size {size} has no value at this compilation (a data-dependent size)")
    return -1 if value is None else int(value)


def dim_set(dims: object, ndim: int) -> set[int] | None:
    """A ``dim`` argument of an op on an ``ndim``-dim tensor as a set of non-negative dims; ``None`` for every
    dim (``None``, ``"all"``, an empty tuple) or a value that is not a dim."""
    if dims is None or dims == "all" or dims == () or dims == []:
        return None
    if isinstance(dims, int):
        dims = (dims,)
    if not isinstance(dims, (tuple, list)) or not all(isinstance(d, int) for d in dims):
        return None
    return {d % ndim for d in dims} if ndim else set()


class IndexDim(NamedTuple):
    """One dim of an index ``x[e0, e1, ...]`` (see :func:`index_dims`)."""

    #: The index entry: a slice, an int, a tensor node, ``None`` (a new dim) or ``...``.
    entry: object
    #: Its place among the entries; ``None`` for the dims after the entries.
    position: int | None
    #: The dim of ``x`` it reads; ``None`` for a ``None`` entry.
    dim: int | None
    #: The dim of the result it becomes under basic indexing (a slice, ``...`` and ``None`` keep or make one);
    #: ``None`` where the dim is dropped (an int, a tensor).
    out: int | None


def index_dims(entries: Sequence[object], ndim: int) -> list[IndexDim]:
    """Which dim of an ``ndim``-dim tensor each entry of an index reads, in order, and where it lands.

    ``...`` gives one row per dim it stands for (the dims no other entry reads), each with entry ``...``; an index
    without ``...`` reads the dims after its entries as if it ended with one (``x[0]`` keeps every dim after the
    first). Every entry but ``None`` and ``...`` reads one dim (a bool mask too)."""
    consumed = sum(1 for e in entries if e is not None and e is not Ellipsis)
    implicit = [] if any(e is Ellipsis for e in entries) else [(None, Ellipsis)]
    rows, d, o = [], 0, 0
    for position, e in [*enumerate(entries), *implicit]:
        if e is None:
            rows.append(IndexDim(e, position, None, o))
            o += 1
        elif e is Ellipsis:
            for _ in range(ndim - consumed):
                rows.append(IndexDim(e, position, d, o))
                d, o = d + 1, o + 1
        else:
            kept = isinstance(e, slice)
            rows.append(IndexDim(e, position, d, o if kept else None))
            d, o = d + 1, o + kept
    return rows


def arg(n: fx.Node, pos: int, name: str, default: object = None) -> object:
    """The argument of ``n`` passed as keyword ``name`` or at position ``pos``, else ``default``."""
    if name in n.kwargs:
        return n.kwargs[name]
    return n.args[pos] if len(n.args) > pos else default


def node_where(n: fx.Node) -> str:
    """A human-readable location of ``n``: the layer that made it and the graph node (``layers.0.conv (node x)``)."""
    return f"{_compat.node_module_path(n) or '<top level>'} (node {n.name})"


def node_located(n: fx.Node, where: str | None = None) -> str:
    """``where`` (default :func:`node_where`) after the model's source line that made ``n`` when the graph recorded
    it: ``file:line (code), layers.0.conv (node x)``."""
    where = node_where(n) if where is None else where
    line = source_line(n)
    return f"{line}, {where}" if line else where


class FoundAt:
    """Where a found op is, for messages: a mixin of the dataclasses that hold a graph ``node`` and the ``layer``
    (qualified module name) that made it."""

    node: fx.Node
    layer: str

    @property
    def where(self) -> str:
        """The layer and the graph node: ``layers.0.conv (node x)``."""
        return f"{self.layer or '<top level>'} (node {self.node.name})"

    @property
    def located(self) -> str:
        """:attr:`where`, after the model's source line (``file:line (code)``) when the graph recorded it."""
        return node_located(self.node, self.where)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _frames(node: fx.Node) -> list[tuple[str, str, str, str]]:
    """``(path, line, function, code)`` of every frame of ``node``'s recorded stack trace, outermost first."""
    lines = [x.strip() for x in (node.meta.get("stack_trace") or "").splitlines() if x.strip()]
    frames = []
    for i, line in enumerate(lines):
        if line.startswith('File "') and line.count('"') >= 2:
            path, _, rest = line[len('File "') :].partition('", line ')
            number, _, function = rest.partition(", in ")
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            frames.append((path, number.strip(), function.strip(), code))
    return frames


def _model_frame(node: fx.Node) -> tuple[str, str, str, str] | None:
    """The innermost frame of ``node``'s stack trace outside torch itself (``F.pad`` or ``flex_attention`` report
    the model's call, not torch's), or ``None`` when the graph has no stack trace."""
    frames = _frames(node)
    outside = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
    return outside[-1] if outside else None


def source_line(node: fx.Node) -> str:
    """``file:line (code)`` of the model code that made ``node`` (:func:`_model_frame`), or ``""`` when the graph
    has no stack trace."""
    frame = _model_frame(node)
    if frame is None:
        return ""
    path, number, _, code = frame
    return f"{path}:{number}" + (f" ({code})" if code else "")


def _module_function(path: str, name: str) -> types.FunctionType | None:
    """The module-level Python function ``name`` defined in the source file ``path`` of an imported module (the
    module's attribute: a decorator's wrapper, such as transformers' kernel binding, when it keeps the function in
    ``__wrapped__``), or ``None`` (a method, a nested function, a module not imported)."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or os.path.realpath(file) != os.path.realpath(path):
            continue
        fn = getattr(module, name, None)
        if isinstance(fn, types.FunctionType) and fn.__qualname__ == name:
            code = inspect.unwrap(fn).__code__
            if code.co_filename == path and code.co_name == name:
                return fn
    return None


def mixer_function(node: fx.Node) -> types.FunctionType | None:
    """The module-level function of the model's code that made ``node`` (the innermost frame of its stack trace
    outside torch), or ``None`` (a method, a nested function, no stack trace)."""
    frame = _model_frame(node)
    return _module_function(frame[0], frame[2]) if frame is not None else None


#: Methods :func:`mixer_functions` leaves out: a module's ``forward`` reads its parameters from ``self``.
_NOT_MIXER_METHODS = frozenset({"forward", "__call__"})


def mixer_functions(node: fx.Node) -> tuple[types.FunctionType, ...]:
    """Every module-level function and method (other than a ``forward``) of the model's code running when Dynamo
    made ``node`` (the frames of its stack trace outside torch), innermost first, each once."""
    found: list[types.FunctionType] = []
    for path, line, name, _ in reversed(_frames(node)):
        if path.startswith(_TORCH_DIR):
            continue
        fn = _module_function(path, name)
        if fn is None and name not in _NOT_MIXER_METHODS and line.isdigit():
            fn = _class_function(path, name, int(line))
        if fn is not None and fn not in found:
            found.append(fn)
    return tuple(found)


def _class_function(path: str, name: str, line: int) -> types.FunctionType | None:
    """The function ``name`` defined in a class of an imported module of source file ``path`` whose code holds
    ``line`` (a method), or ``None``."""
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or os.path.realpath(file) != os.path.realpath(path):
            continue
        for cls in list(vars(module).values()):
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            fn = cls.__dict__.get(name)
            if isinstance(fn, types.FunctionType) and fn.__code__.co_filename == path and _holds(fn, line):
                return fn
    return None


def _holds(fn: types.FunctionType, line: int) -> bool:
    """Whether ``line`` of its file is one of ``fn``'s own lines."""
    code = inspect.unwrap(fn).__code__
    lines = [x for _, _, x in code.co_lines() if x is not None]
    return code.co_firstlineno <= line <= max(lines, default=code.co_firstlineno)


def in_function(node: fx.Node, fn: types.FunctionType) -> bool:
    """Whether ``fn`` (a module-level function or a method) was running when Dynamo made ``node``: a frame of its
    stack trace is at one of ``fn``'s lines."""
    path = os.path.realpath(inspect.unwrap(fn).__code__.co_filename)
    return any(
        f[2] == fn.__name__ and os.path.realpath(f[0]) == path and f[1].isdigit() and _holds(fn, int(f[1]))
        for f in _frames(node)
    )


def registration_fix(node: fx.Node) -> str:
    """The fix that runs the sequence mixer that made ``node`` exact under CP, naming the function and its
    parameters: when the model code that made it is a module-level function, its registration with
    :func:`cpcompile.cores.register_head_parallel`; when it is a module's ``forward`` (a scan inline between
    projections), moving the scan into a function of its own, or the registration of the ``forward`` with
    :func:`cpcompile.cores.register_replicated`; ``""`` otherwise (another method, no stack trace)."""
    fn = mixer_function(node)
    if fn is None:
        return _replicated_fix(node)
    name = f"{fn.__module__}.{fn.__name__}"
    params = ", ".join(inspect.signature(fn).parameters)
    return (
        f"if {name} is causal (a token's outputs read only tokens at or before it) and computes each head's "
        "(channel's) outputs from that head's inputs alone, register it before compiling: "
        f"cpcompile.cores.register_head_parallel({name}, per_token=(...), per_head=(...), shared=(...), "
        f"gathered=(...)), naming each of its tensor parameters ({params}) in one of the four; cpcompile then "
        "runs it on the whole "
        "sequence of some heads on each rank and proves that it keeps the heads apart"
    )


def _replicated_fix(node: fx.Node) -> str:
    """:func:`registration_fix` for a mixer inline in a module's ``forward`` (the innermost frame of the model's
    code), or ``""``."""
    frame = _model_frame(node)
    if frame is None or frame[2] != "forward" or not frame[1].isdigit():
        return ""
    fn = _class_function(frame[0], "forward", int(frame[1]))
    if fn is None:
        return ""
    name = f"{fn.__module__}.{fn.__qualname__}"
    params = ", ".join(p for p in inspect.signature(fn).parameters if p != "self")
    return (
        f"the op is inline in {name}: move the loop or product over the sequence into a function of its own, "
        "called with the per-head tensors, which cpcompile then finds and runs on the whole sequence of some heads "
        f"on each rank; or, if {name} is causal (a token's outputs read only tokens at or before it), register it "
        f"before compiling to run on the whole sequence on every rank (N times its work): "
        f"cpcompile.cores.register_replicated({name}, per_token=(...), shared=(...)), naming each of its tensor "
        f"parameters ({params}) in one of the two"
    )


def finish(gm: fx.GraphModule) -> None:
    """Check every graph of ``gm`` after a rewrite (``lint``) and regenerate its code (``recompile``)."""
    for g in graph_modules(gm):
        g.graph.lint()
        g.recompile()
