"""Head-parallel regions found at compile time: a sequence mixer of the model's own code, written as a
module-level function or a method, runs on the whole sequence of some heads on each rank without a registration.

When the positions or the mixing pass refuses an op that a sequence mixer makes (a scan, a product over the
sequence, a token picked by its index, the local length used as a value, a mask over positions built by an op it
does not know) while a module-level function or a method (other than a ``forward``) ``fn`` of the model's code
runs (:attr:`cpcompile.UnsupportedMixingError.functions`), the backend (``regions="found"``, its default) does
what :func:`cpcompile.cores.register_head_parallel` asks the user to do, in three traces of the same frame:

1. **probe**: ``fn`` gets a replacement that calls it unchanged and notes, while Dynamo traces it, which graph
   value each of its arguments is (:func:`cpcompile._compat.note_traced`); Dynamo traces the frame again.
2. **classify** (:func:`classify`): in that graph, an argument whose value holds the sequence (followed from the
   sharded inputs, :func:`~cpcompile.passes.sequence_dims.sequence_dims`) and that ``fn`` reads is per-token, all
   of them at one dim. Each other dim of theirs (the batch dim first excepted) is tried as the head dim, with
   each size they have there (largest first) as the head count ``H``: a per-token argument of that size holds
   heads; one whose size there is a divisor ``G`` of it holds groups of heads (each group serving ``H / G``
   consecutive heads, as ``repeat_interleave`` pairs gated delta-net's key heads with its value heads and SSD's
   groups with its heads: split with the heads, ``G / N`` on each rank), or, failing that choice, is gathered
   whole, as any other per-token argument is; a tensor argument without the sequence whose dim 0 has size ``H``
   is per-head, any other shared (a gathered or shared one with a dim of that size elsewhere may hold heads: the
   choice is not taken). A choice is taken when the ops ``fn`` ran keep the heads apart (the head-parallel
   regions' proof, :func:`~cpcompile.passes.mixing.find._head_map_refusals`, which refuses a group repeated to
   the heads any other way), every value ``fn`` returns holds them at the same dim and the sequence at the same
   dim as the per-token arguments, ``fn`` reads no tensor with a dim of the head count besides its arguments (a
   module global would not be narrowed to the rank's heads), the CP size divides the heads and groups of every
   per-token argument (else the next choice is tried, and this one reported if none holds), and ``fn`` passes
   two tests. ``fn`` is run eagerly on random inputs of the traced shapes
   (:func:`_tested_refusal`): its outputs at its first ``k`` tokens must be the same when it runs on those tokens
   alone (``k`` = 1, half the tokens, all but the last), since a head-parallel ``fn`` runs on the padded sequence
   (padding last) and only a causal one keeps the padding from every real token; and its outputs on each rank's
   share of the heads, joined, must equal its outputs on all heads. These are tests on two draws of inputs, not
   proofs: causality is not proved at all; the split is proved, but the proof does not see how ``fn`` pairs the
   heads of its arguments when it derives that from their sizes (a gathered argument's groups repeated to the
   heads), which the second test does. A choice the tests refuse leaves the next one to be tried. The tests leave
   the global random state and the module of a method (attributes, buffers, submodules) as they were; a
   parameter the method changes in place refuses it.
3. **run**: ``fn`` is registered as found (:func:`cpcompile.cores.register_head_parallel`, its replacement put in
   place of the probe) and Dynamo traces the frame a third time; the mixing pass proves the region again, as it
   does every registered core's.

Every call of ``fn`` in the graph is classified alike (a layer per call); a tensor argument that ``fn`` does not
read (``**kwargs`` it drops) is shared. A function transformers binds to a kernel
(``use_kernel_func_from_hub_with_fallback``) is tried with its torch path, unless a fused kernel was bound.

When no classification holds, the refusal stands, with the reason added (of the choices tried, the first). The
functions are tried innermost first; each once per process (a later refusal in it keeps its first reason), but for
a reason that holds at one CP size only (:class:`ForCPSize`: classified again at its next refusal).
A method gets its probe and its replacement through :func:`cpcompile._compat.inline_method` (Dynamo does not
consult ``substitute_in_graph`` for a bound method), its ``self`` passed unchanged (noted as
:class:`cpcompile._compat.Held`; the eager tests call it on the module itself): a tensor it reads from ``self``
with a dim of the head count (a per-head parameter) refuses the choice, as a module global does (pass it as an
argument). A method refused has its probe taken away. A module's ``forward`` is not tried. Nor are functions the
user registered or that Dynamo already substitutes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools
import types
from collections.abc import Iterator

import torch
import torch.fx as fx

from cpcompile import _compat, cores
from cpcompile.passes.common import in_function, size_hint, source_line
from cpcompile.passes.common import node_value as _val
from cpcompile.passes.mixing.find import _HEADS, _head_map_refusals
from cpcompile.passes.positions import sequence_length
from cpcompile.passes.sequence_dims import is_nested, sequence_dims

__all__ = ["RESTART", "ForCPSize", "classify", "find"]

#: What :func:`find` returns when Dynamo must trace the frame again.
RESTART = "restart"

#: Each function tried: ``"probed"``, ``"found"``, or why it is not run head-parallel.
_TRIED: dict[str, str] = {}

#: How close :func:`_tested_refusal` asks outputs to stay: between a run on the first tokens and one on all of them
#: (a causal function's differ by rounding at most, a chunked scan's by its chunks' other padding; one that reads
#: later tokens by far more), and between a run on shares of the heads and one on all of them (equal but for
#: rounding in a map over heads).
_TEST_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _key(fn: types.FunctionType) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def _is_method(fn: types.FunctionType) -> bool:
    return fn.__qualname__ != fn.__name__


def _probe_replacement(original, key: str, names: tuple[str, ...], defaults: tuple[tuple[str, object], ...]):
    # plain tuples and strings in the closure: Dynamo traces the replacement as a polyfill
    def probed(*args, **kwargs):
        values = dict(defaults)
        values.update(zip(names, args))
        values.update(kwargs)
        for i, (name, value) in enumerate(values.items()):
            _compat.note_traced(key, i == 0, name, value)
        return original(**values)

    return probed


def find(error: Exception, gm: fx.GraphModule, chunk_len: int | None, cp_size: int) -> str:
    """The next step for the functions of a refusal (``error.functions``, innermost first): :data:`RESTART` when
    one was given a probe or registered (Dynamo must trace the frame again), else why none runs head-parallel
    (``""``: none this module tries)."""
    reasons = []
    for fn in getattr(error, "functions", ()):
        key = _key(fn)
        state = _TRIED.get(key)
        if state is None:
            if key in cores.CORES or _compat.substituted_in_graph(fn) or _compat.inlined_in_graph(fn):
                continue
            params = list(inspect.signature(fn).parameters.values())
            if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params):
                _TRIED[key] = "it takes *args or positional-only parameters"
            elif hasattr(fn, "__wrapped__") and cores._torch_path(fn) is None:
                _TRIED[key] = "transformers bound it to a fused kernel"
            else:
                _probe(fn, key, params)
                return RESTART
        elif state == "probed":
            found = classify(gm, fn, _compat.NOTED.get(key, []), chunk_len, cp_size)
            _compat.NOTED.pop(key, None)  # the graphs its notes hold are not kept
            if isinstance(found, ForCPSize):  # tried again at the next refusal, which may be at another CP size
                reasons.append(f"not {fn.__name__}, as {found}")
                continue
            _compat.NOTING.discard(key)
            if not isinstance(found, str):
                if _is_method(fn):
                    cores.register_found_method(fn, **found)
                else:
                    cores.register_head_parallel(fn, **found)
                    spec = cores._HEAD_SPECS[key] = dataclasses.replace(cores._HEAD_SPECS[key], groups_tested=True)
                    _compat.replace_substitution(fn, cores._registered_replacement(cores.traced_copy(fn), key, spec))
                _TRIED[key] = "found"
                return RESTART
            _TRIED[key] = found
            if _is_method(fn):  # its probe taken away (a module-level function's calls the original unchanged)
                _compat.inline_method(fn, key, None)
        if _TRIED.get(key, "found") not in ("found", "probed"):
            reasons.append(f"not {fn.__name__}, as {_TRIED[key]}")
    return "; ".join(reasons)


class ForCPSize(str):
    """A reason :func:`classify` gives that holds for this CP size only: the function stays probed, and is
    classified again at its next refusal."""


def _probe(fn: types.FunctionType, key: str, params: list[inspect.Parameter]) -> None:
    names = tuple(p.name for p in params if p.kind != p.VAR_KEYWORD)
    defaults = tuple((p.name, p.default) for p in params if p.default is not p.empty)
    _compat.NOTED.pop(key, None)
    _compat.NOTING.add(key)
    probe = _probe_replacement(cores.traced_copy(fn), key, names, defaults)
    if _is_method(fn):
        _compat.inline_method(fn, key, probe)
    else:
        torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(probe)
    _TRIED[key] = "probed"


def classify(gm: fx.GraphModule, fn: types.FunctionType, calls: list[dict[str, object]], chunk_len: int | None,
             cp_size: int) -> dict[str, object] | str:  # fmt: skip
    """The arguments of :func:`cpcompile.cores.register_head_parallel` that run ``fn`` head-parallel in every call
    of it in ``gm`` (traced through the probe, which noted the arguments of each call in ``calls``), or why there
    are none."""
    calls = [c for c in calls if all(n.graph is gm.graph for n in c.values() if isinstance(n, fx.Node))]
    if not calls:
        return "cpcompile did not see its arguments while tracing this graph"
    seq = sequence_length(gm, chunk_len, mixed=True)
    if seq is None:
        return "the graph's local sequence length is unknown"
    tags = sequence_dims(gm, seq)
    inside = {n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and in_function(n, fn)}
    seen = [_Call.of(call, tags, inside) for call in calls]
    for call in seen:
        if isinstance(call, str):
            return call
    if len({(c.per_token, c.seq_dim) for c in seen}) > 1:
        return "its calls hold the sequence in different arguments or dims"
    tokens, seq_dim = seen[0].per_token, seen[0].seq_dim
    ndim = max(len(c.shapes[name]) for c in seen for name in tokens)
    reasons = []  # of each dim and head count tried, the first (the likeliest heads) reported
    for head_dim in range(ndim):
        if head_dim == seq_dim or (head_dim == 0 and seq_dim != 0):
            continue
        sizes = {c.shapes[name][head_dim] for c in seen for name in tokens if len(c.shapes[name]) > head_dim}
        for count in sorted(sizes - {1}, reverse=True):
            choices = [{c.split(head_dim, count, grouped=True) for c in seen}]
            ungrouped = {c.split(head_dim, count, grouped=False) for c in seen}
            if ungrouped != choices[0]:  # arguments with fewer heads there: groups first, else gathered whole
                choices.append(ungrouped)
            for split in choices:
                if len(split) > 1:
                    reasons.append(
                        f"with dim {head_dim} as heads, its calls pass per-head tensors in different arguments"
                    )
                    continue
                per_token, per_head, shared, gathered, unclear = split.pop()
                if unclear:
                    reasons.append(
                        f"with {count} heads at dim {head_dim}, {list(unclear)} have a dim of {count} elsewhere"
                    )
                    continue
                refused = _heads_kept(gm, fn, seen, per_token, per_head, seq_dim, head_dim)
                if refused:
                    reasons.append(f"with dim {head_dim} of {list(per_token)} as heads, {refused}")
                    continue
                found = {"per_token": per_token, "per_head": per_head, "shared": shared, "gathered": gathered,
                         "seq_dim": seq_dim, "head_dim": head_dim}  # fmt: skip
                refused = _tested_refusal(fn, calls[0], found, seen[0].length, cp_size)
                if not refused:
                    return found
                reasons.append(refused)
    return reasons[0] if reasons else f"no dim of its per-token arguments {list(tokens)} holds heads"


@dataclasses.dataclass(frozen=True)
class _Call:
    """One traced call of a probed function: its tensor arguments (graph nodes), their sizes, and those that hold
    this rank's tokens (``per_token``, all at ``seq_dim``, of size ``length`` there)."""

    tensors: dict[str, fx.Node]
    shapes: dict[str, tuple[int, ...]]
    per_token: tuple[str, ...]
    seq_dim: int
    length: int

    @staticmethod
    def of(noted: dict[str, object], tags: dict, inside: set[fx.Node]) -> _Call | str:
        """The call whose arguments ``noted`` holds, read with the sequence ``tags`` of its graph, or why it cannot
        run head-parallel. A tensor argument that no op of the function (``inside``) reads (one its ``**kwargs``
        take and drop) is not per-token: it passes unchanged."""
        tensors = {k: n for k, n in noted.items() if isinstance(n, fx.Node) and isinstance(_val(n), torch.Tensor)}
        unknown = [k for k, n in noted.items() if n is _compat.OPAQUE or (isinstance(n, fx.Node) and k not in tensors)]
        if unknown:
            return f"its arguments {unknown} are neither tensors nor constants"
        seq_dims = {}
        for name, n in tensors.items():
            if not any(u in inside for u in n.users):
                continue
            t = tags.get(n)
            dims = [d for d, x in enumerate(t) if x is True] if isinstance(t, tuple) and not is_nested(t) else []
            if len(dims) > 1:
                return f"its argument {name!r} holds the sequence in more than one dim"
            if dims:
                seq_dims[name] = dims[0]
        if not seq_dims:
            return "none of its tensor arguments holds the sequence"
        if len(set(seq_dims.values())) > 1:
            return f"its per-token arguments hold the sequence at different dims ({seq_dims})"
        shapes = {name: tuple(size_hint(x) for x in _val(n).shape) for name, n in tensors.items()}
        per_token = tuple(seq_dims)
        seq_dim = seq_dims[per_token[0]]
        return _Call(tensors, shapes, per_token, seq_dim, shapes[per_token[0]][seq_dim])

    def split(self, head_dim: int, count: int, grouped: bool) -> tuple[tuple[str, ...], ...]:
        """``(per_token, per_head, shared, gathered, unclear)`` with ``count`` heads at ``head_dim``: a per-token
        argument with ``count`` there holds heads (and, when ``grouped``, one with a divisor of ``count`` there
        holds groups of them, listed after those with ``count``), any other is gathered whole; a tensor argument
        without the sequence whose dim 0 has ``count`` is per-head, any other shared; an argument gathered or
        shared is unclear if it has a dim of ``count`` (it may hold heads)."""

        def held(name: str) -> int:
            return self.shapes[name][head_dim] if len(self.shapes[name]) > head_dim else 0

        heads = tuple(n for n in self.per_token if held(n) == count)
        if grouped:
            heads += tuple(n for n in self.per_token if 1 < held(n) < count and count % held(n) == 0)
        gathered = tuple(n for n in self.per_token if n not in heads)
        others = [name for name in self.tensors if name not in self.per_token]
        per_head = tuple(name for name in others if self.shapes[name] and self.shapes[name][0] == count)
        shared = tuple(name for name in others if name not in per_head)
        unclear = tuple(name for name in gathered + shared if count in self.shapes[name])
        return heads, per_head, shared, gathered, unclear


def _heads_kept(gm, fn, seen: list[_Call], per_token, per_head, seq_dim, head_dim) -> str:
    """``""`` when ``fn`` reads no tensor with a dim of a head count besides its arguments, the ops it ran keep
    ``head_dim`` of ``per_token`` (dim 0 of ``per_head``) apart and every value it returns holds the heads at
    ``head_dim`` and this rank's tokens at ``seq_dim``, in every call of ``seen``, else what does not."""
    seeds = {}
    for call in seen:
        for name in per_token + per_head:
            n, dim = call.tensors[name], head_dim if name in per_token else 0
            seeds[n] = tuple(d == dim for d in range(_val(n).dim()))
    inside = {n for n in gm.graph.nodes if n.op in ("call_function", "call_method") and in_function(n, fn)}
    region = inside | set(seeds)
    counts = {call.shapes[per_token[0]][head_dim] for call in seen}
    for n in inside:
        for i in n.all_input_nodes:
            value = _val(i)
            if i not in region and isinstance(value, torch.Tensor) and counts & {size_hint(x) for x in value.shape}:
                return (
                    f"it reads {i.name} ({source_line(n) or n.op}), a tensor with a dim of its head count that is "
                    "none of its arguments: pass it as an argument"
                )
    refusals = _head_map_refusals(gm, region, seeds, {})
    if refusals:
        first = refusals[0]
        return f"{first.what} ({source_line(first.node) or first.op})"
    nodes = [n for n in gm.graph.nodes if n in region]
    heads = sequence_dims(gm, _HEADS, seeds, nodes)
    lengths = {call.length for call in seen}
    outputs = [n for n in nodes if n in inside and any(u not in region for u in n.users)]
    for n in outputs:
        value, held = _val(n), heads.get(n)
        if not isinstance(value, torch.Tensor):
            continue
        at = [d for d, x in enumerate(held) if x is True] if isinstance(held, tuple) and not is_nested(held) else []
        if at != [head_dim] or value.dim() <= seq_dim or size_hint(value.shape[seq_dim]) not in lengths:
            return (
                f"it returns {n.name} ({source_line(n) or n.op}) with heads at dims {at} and shape "
                f"{list(value.shape)}, not as its per-token arguments hold them (heads at {head_dim}, the sequence "
                f"at {seq_dim})"
            )
    return ""


#: The draws of random inputs :func:`_tested_refusal` runs a function on: ``(seed, scale of the floating-point
#: inputs, whether boolean inputs are drawn too (else all false))``.
_DRAWS = ((0, 0.5, False), (1, 0.5, True))


def _tested_refusal(fn, noted, found: dict, length: int, cp_size: int) -> str:
    """``""`` when ``fn`` passes the tests of :func:`_tested_on` on every draw of :data:`_DRAWS`, else why not."""
    for draw in _DRAWS:
        why = _tested_on(fn, noted, found, length, cp_size, *draw)
        if why:
            return why
    return ""


def _tested_on(fn, noted, found: dict, length: int, cp_size: int, seed: int, scale: float, flags: bool) -> str:
    """``""`` when ``fn``, run eagerly on random inputs of the traced shapes and dtypes (floating point: normal,
    times ``scale``; boolean: true with probability 1/4 when ``flags``; others: zeros; drawn from ``seed``), passes
    two tests, else why not:

    * causal: its outputs at its first ``k`` tokens are the same when it runs on those tokens alone (``k`` = 1,
      ``length // 2``, ``length - 1``): no later token, nor how many follow, changes them;
    * a map over the heads as ``found`` splits them: run on each of ``cp_size`` blocks of the heads (the per-token
      arguments narrowed at ``head_dim``, the per-head ones at dim 0, the shared ones whole), its outputs joined at
      ``head_dim`` equal its outputs on all heads."""
    per_token, per_head, gathered = found["per_token"], found["per_head"], found["gathered"]
    seq_dim, head_dim = found["seq_dim"], found["head_dim"]
    if length < 2:
        return "its causality cannot be tested on one token"
    gen = torch.Generator().manual_seed(seed)

    def random_like(value: torch.Tensor) -> torch.Tensor:
        shape = [size_hint(s) for s in value.shape]
        device = "cpu" if value.device.type == "meta" else value.device  # a model traced on meta: tested on CPU
        if value.dtype.is_floating_point:
            return (torch.randn(shape, generator=gen) * scale).to(value.dtype).to(device)
        if value.dtype == torch.bool and flags:
            return (torch.rand(shape, generator=gen) < 0.25).to(device)
        return torch.zeros(shape, dtype=value.dtype, device=device)

    modules = [n.value for n in noted.values() if isinstance(n, _compat.Held)]
    if any(t.is_meta for m in modules for t in itertools.chain(m.parameters(), m.buffers())):
        return (
            "it is a method of a module on the meta device, whose tensors it may read, so it could not be tested "
            "(cpcompile inspect: pass --device cpu)"
        )
    with _compat.unset_fake_mode(), torch.no_grad(), _kept(modules) as changed:
        base = {name: random_like(_val(n)) if isinstance(n, fx.Node) else n for name, n in noted.items()}
        base.update({name: n.value for name, n in noted.items() if isinstance(n, _compat.Held)})  # a method's self
        try:
            before = fn(**base)
        except Exception as e:  # noqa: BLE001 - reported as the reason
            return f"it raised {type(e).__name__} ({e}) on random inputs, so it could not be tested"
        for k in sorted({1, length // 2, length - 1}):
            prefix = dict(base)
            prefix.update({name: base[name].narrow(seq_dim, 0, k) for name in per_token + gathered})
            try:
                after = fn(**prefix)
            except Exception as e:  # noqa: BLE001 - reported as the reason
                return f"it raised {type(e).__name__} ({e}) on its first {k} tokens, so it could not be tested"
            for a, b in zip(_tensors(before), _tensors(after), strict=True):
                if a.dim() <= seq_dim:
                    continue
                if not torch.isfinite(a).all():
                    return "it returns non-finite values on random inputs, so it could not be tested"
                if b.shape[seq_dim] != k or not torch.allclose(a.narrow(seq_dim, 0, k), b, **_TEST_TOLERANCE):
                    return (
                        f"it is not causal: its outputs at its first {k} tokens change when tokens follow them, and "
                        "a head-parallel run would let the padding after the last token reach them"
                    )
        count = base[per_token[0]].shape[head_dim]
        padded = -(-count // cp_size) * cp_size  # heads a CP size does not divide: zero heads, as the run pads them
        wide = dict(base)
        for n in per_token:  # groups the ranks cannot hold whole: repeated to their heads, as the run does
            groups = base[n].shape[head_dim]
            if groups != count and (groups % cp_size or padded != count):
                wide[n] = base[n].repeat_interleave(count // groups, dim=head_dim)
        wide.update(
            {n: cores._padded(wide[n], padded, head_dim) for n in per_token if wide[n].shape[head_dim] == count}
        )
        wide.update({n: cores._padded(base[n], padded, 0) for n in per_head})
        per = {name: wide[name].shape[head_dim if name in per_token else 0] // cp_size for name in per_token + per_head}
        parts = []
        for r in range(cp_size):
            share = dict(base)
            share.update({name: wide[name].narrow(head_dim, r * per[name], per[name]) for name in per_token})
            share.update({name: wide[name].narrow(0, r * per[name], per[name]) for name in per_head})
            try:
                parts.append(_tensors(fn(**share)))
            except Exception as e:  # noqa: BLE001 - reported as the reason
                return f"it raised {type(e).__name__} ({e}) on a share of the heads"
        for i, whole in enumerate(_tensors(before)):
            joined = torch.cat([p[i] for p in parts], dim=head_dim) if all(len(p) > i for p in parts) else None
            if joined is not None and joined.dim() > head_dim and joined.shape[head_dim] == padded > count:
                joined = joined.narrow(head_dim, 0, count)  # the padding heads' outputs, cut off as the run does
            if joined is None or joined.shape != whole.shape or not torch.allclose(joined, whole, **_TEST_TOLERANCE):
                return (
                    f"on random inputs its outputs from {cp_size} shares of the heads (dim {head_dim}) differ from "
                    "its outputs from all of them: it is not a map over those heads"
                )
    if changed:
        return f"it changes {changed[0]} of its module in place, so it could not be tested"
    return ""


@contextlib.contextmanager
def _kept(modules: list[torch.nn.Module]) -> Iterator[list[str]]:
    """Run the tests of :func:`_tested_refusal` without a trace on the model: the global random state (of the CPU
    and of the devices the modules' tensors are on) and every module's attributes and buffers come back as they
    were; the parameters a run changed in place (which cannot come back) are listed in what it yields."""
    subs = [m for module in modules for m in module.modules()]
    attrs = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in subs]
    buffers = [(b, b.clone()) for m in subs for b in m._buffers.values() if isinstance(b, torch.Tensor)]
    params = [(name, p, p._version) for module in modules for name, p in module.named_parameters()]
    devices = sorted({b.device for b, _ in buffers} | {p.device for _, p, _ in params}, key=str)
    changed: list[str] = []
    with torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]):
        try:
            yield changed
        finally:
            for m, d, parameters, bufs, children in attrs:
                vars(m).clear()
                vars(m).update(d)
                for held, saved in ((m._parameters, parameters), (m._buffers, bufs), (m._modules, children)):
                    held.clear()
                    held.update(saved)
            for b, saved in buffers:
                if not torch.equal(b, saved):
                    b.copy_(saved)
            changed.extend(f"the parameter {name}" for name, p, version in params if p._version != version)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    return []
