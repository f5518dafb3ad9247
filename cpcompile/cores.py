"""Recurrent mixer cores under CP: known core functions run head-parallel, or by state passing.

A recurrent mixer (a gated delta-net's chunked delta rule) carries a state along the sequence, so on a rank's
``c`` tokens it is wrong, and its traced ops are specialised to the local length (the chunk loop is unrolled).
For the core functions listed in :data:`CORES`, cpcompile gives Dynamo a replacement
(``torch.compiler.substitute_in_graph``) that, while a :func:`cpcompile.shard` context of more than one rank is
active (for the gated delta rule unless ``shard(recurrence="state")`` asks for state passing, below), sends every
per-head argument through ``cpcompile::heads_from_sequence`` (this rank's ``c`` tokens of
all ``H`` heads -> all ``N * c`` tokens in global order, padding last, of heads ``[r * H/N, (r + 1) * H/N)``),
runs the library's own function on the whole sequence, and brings the output back with
``cpcompile::sequence_from_heads``. The core's inputs get a layout whose ``[B, H, S, ...]`` transpose is contiguous
(queries and keys first repeated to the value heads, as the core would), so that a graph traced at one length runs
at every other one (:func:`_heads_major`). Dynamo traces the core at the symbolic length ``N * c``, with the guards the
one-process model at that length would have. Outside a shard context (or with one rank) the replacement calls the
original function (the gated delta rule's inputs laid out heads-major, values unchanged: see
:func:`_heads_major`); Dynamo guards on which of the two it traced (:data:`HEADS_GROUP`), so a graph traced
under CP is never reused without it and the other way round. Eager calls never see the replacement.

Known cores (a registry, not a general mechanism: it chooses which functions are substituted; the mixing pass
proves that each traced region is a map over the heads, :mod:`cpcompile.passes.mixing`; a user adds a function of
their own with :func:`register_head_parallel`): transformers'
``torch_chunk_gated_delta_rule`` of Qwen3-Next,
Qwen3.5, Qwen3.5-MoE and OLMo-Hybrid (one function, defined in each model's module: ``query``, ``key``
``[B, S, Hk, Dk]``, ``value`` ``[B, S, Hv, Dv]``, ``g``, ``beta`` ``[B, S, Hv]``; output ``[B, S, Hv, Dv]``), on
its torch fallback path only (not when transformers resolved it to flash-linear-attention); and transformers'
``mamba2_chunk_scan`` (Mamba2's SSD) of Mamba2, Bamba, Granite-4 hybrid, Falcon-H1, Nemotron-H and Zamba2 (one
function: ``hidden_states`` ``[B, S, H, P]``, ``dt`` ``[B, S, H]``, ``A`` ``[H]``, ``B``, ``C`` ``[B, S, G, N]``,
``D``, ``dt_bias`` ``[H]``), on its torch path (not when ``mamba-ssm`` is installed); and transformers'
``mamba_selective_scan`` (Mamba's selective scan) of Mamba, FalconMamba, Jamba and Zamba (``hidden_states``,
``dt``, ``z`` ``[B, I, S]``, ``A`` ``[I, N]``, ``B``, ``C`` ``[B, N, S]``, ``D``, ``delta_bias`` ``[I]``), on its
torch path. The scan is diagonal, so every channel is a head of its own: ``hidden_states``, ``dt`` and ``z`` are
exchanged by channels, ``B`` and ``C`` (shared by every channel) reach every rank whole (the heads exchange of
``N`` copies: an all-gather), ``A``, ``D`` and ``delta_bias`` are narrowed to the rank's channels. Its torch path
needs a concrete length (transformers' associative scan, or its loop over tokens), so Dynamo specialises the
graph to the local length: one compile per chunk length. And transformers' ``RecurrentGemmaRglru._rnn_scan``
(RecurrentGemma's RG-LRU recurrence, a method: ``hidden_states``, ``recurrent_gate`` ``[B, S, W]``, ``reset``
``[B, S, 1]``, true where the layer's ``position_ids`` are 0, ``recurrent_states``), diagonal too:
``hidden_states`` and ``recurrent_gate`` are exchanged by channels, ``reset`` reaches every rank whole (an
all-gather of each token's flag, so a document restarts at its first token wherever that token lies, and a
document that spans a rank edge carries its state across it), the loop over tokens runs on the whole sequence
(one compile per chunk length, as for the selective scan). It returns no final state under CP (the layer stores
it, and reads it only with a cache, which is refused). Dynamo does not consult ``substitute_in_graph`` for a method
called as ``self._rnn_scan(...)``, so this one replacement is given to Dynamo through the function's
``_torchdynamo_inline`` attribute (:func:`cpcompile._compat.inline_in_graph`; eager calls and the class are
unchanged), and runs a copy of the library's function. And transformers' ``rwkv_linear_attention`` (RWKV's WKV
recurrence: ``time_decay``, ``time_first`` ``[C]``, ``key``, ``value`` ``[B, S, C]``), per channel: ``key`` and
``value`` are exchanged by channels, ``time_decay`` and ``time_first`` narrowed to the rank's channels, and a copy
of the library's function runs on the whole sequence (its torch loop, unless transformers loaded its CUDA kernel),
one compile per chunk length. And transformers' ``MiniMaxLightningAttention.forward`` (MiniMax's lightning
attention layer, a method given to Dynamo as the RG-LRU's is): its block loop is inline in the layer, between the
per-token projections and an RMS norm across heads, so no core function can be exchanged by heads; the whole layer
runs on the whole sequence on every rank instead (its input all-gathered in global token order, blocks counted from
the sequence's first token as in one process), and each rank keeps its own tokens' output: exact, at ``N`` times
the layer's work and ``T x hidden`` of memory per layer. Refused under CP: a cache, a padding mask. A user runs a
layer of their own that way with :func:`register_replicated`.
Gated delta rule: key head ``j // (Hv / Hk)`` serves value head ``j``: when ``N`` divides ``Hk`` a rank takes whole
groups (its key heads and their value heads); otherwise queries and keys are repeated to the value heads first (as
the core does itself). SSD: ``hidden_states``, ``dt``, ``B`` and ``C`` are exchanged, group ``j // (H / G)`` serving
head ``j`` (whole groups on a rank when ``N`` divides ``G``, else ``B`` and ``C`` repeated to the heads first);
``A``, ``D`` and ``dt_bias`` are narrowed to the rank's heads (``HEADS_GROUP``'s rank), so each rank's gradient of
them covers its heads and the sum over the CP group, which every parameter's gradient gets, is the whole. Heads that
``N`` does not divide are padded with zero heads to the next multiple of ``N`` (per-head parameters too), which the
core maps to zero outputs that are cut off after the exchange back: exact, at ``ceil(H / N) * N / H`` of the core's
work. Refused while Dynamo traces, on every rank, by the op ``cpcompile::heads_refusal`` (Dynamo raises its
``TorchRuntimeError`` with the message, which names the core and the fix): ``Hk`` not dividing ``Hv`` (``G`` not
dividing ``H``), a recurrent state in or out (a cache: ``initial_state(s)``, ``output_final_state``,
``return_final_states``, ``return_last_state``, the RG-LRU's ``recurrent_states``, WKV's ``state`` and
``return_state``), ``cu_seqlens``/``seq_idx``.

State passing (the gated delta rule, Mamba2's SSD and the RG-LRU under ``shard(recurrence="state")``;
:data:`STATE_RUNS`): all three are affine in their state, so no heads are exchanged. Every run of consecutive global
tokens a rank holds gets a slot (the rank's tokens with the other runs' made identity steps: zero tokens for the
gated delta rule and the SSD, a gate of one and a zero input for the RG-LRU), the library's function runs once on
all slots from the state ``[0 | I]`` on the values ``[v | 0]``, which gives each run's zero-state output, the rows
that map a start state to its outputs, and a fixed-size summary (its state from zero and the product of its
transitions); ``cpcompile::state_gather`` all-gathers the summaries of every rank (:mod:`cpcompile.ops.state`),
each rank folds them in global token order in fp32 and corrects its runs' outputs by the state each run starts from
(:func:`_gated_delta_rule_state`, :func:`_ssd_state`, :func:`_rg_lru_state`, all through :func:`_passed`). Exact
under every layout and whatever ``T`` (padding comes last), with any number of heads (no padding); bytes independent
of ``T``; the core runs once per slot with ``dv + dk`` value columns (the SSD: ``P + N`` channels per head, its head
dim and state size; the RG-LRU: twice its channels). The RG-LRU's document restarts (``reset``) are applied to the
gate first, as the library applies them, so a restart inside a run stops the incoming state there. Same refusals as
head-parallel, except the head counts need only ``Hk`` dividing ``Hv`` (``G`` dividing ``H``). Dynamo guards on
:data:`STATE_RUNS` (the mode and the number of slots). State passing is not implemented for the other cores, which
run head-parallel whatever ``recurrence`` says: the selective scan's state is diagonal (one decay per channel and
state entry) and its output sums over the state entries, so no start state of the library's function gives the rows
that map a start state to the outputs (the ``[0 | I]`` start needs a state dim of its own to hold ``I``); WKV's
(a ratio of two recurrences, rescaled by a running maximum) and the lightning layer's (inline in the layer) forms
were not attempted.

The substitution is registered for every core whose model module is imported when a backend for a CP group of
more than one rank is made and when :func:`cpcompile.shard` is entered (:func:`register_known_cores`); it is
process-wide and permanent, and inert without a CP context. A graph Dynamo traced before the registration (the
model's module imported after the backend was made, and the compiled model called outside ``shard`` first) holds
the library's core and no guard on :data:`HEADS_GROUP`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import weakref
from collections.abc import Sequence

import torch

from cpcompile import _compat

__all__ = [
    "CORES",
    "HEADS_GROUP",
    "STATE_RUNS",
    "traced_copy",
    "in_core",
    "register_head_parallel",
    "register_found_method",
    "register_replicated",
    "register_known_cores",
    "registered_cores",
    "replicated",
    "traced_in_core",
]

#: ``(group_name, cp_size, rank)`` of the active :func:`cpcompile.shard` context when its group has more than one
#: rank, else ``None``. Read by the replacements while Dynamo traces them (Dynamo guards on its value).
HEADS_GROUP: tuple[str, int, int] | None = None

#: The number of run slots per rank the state-passing cores run with (:func:`_gated_delta_rule_state`):
#: the active plan's largest number of runs of consecutive tokens on one rank, while a shard context of more than
#: one rank with ``recurrence="state"`` is active, else ``None`` (head-parallel). Read by the replacement while
#: Dynamo traces it (Dynamo guards on its value, so a graph traced under one mode, or for another number of runs,
#: is never reused).
STATE_RUNS: int | None = None

_GDN = "transformers.models.{0}.modeling_{0}.torch_chunk_gated_delta_rule"
_MAMBA2 = "transformers.models.{0}.modeling_{0}.mamba2_chunk_scan"
_SELECTIVE = "transformers.models.{0}.modeling_{0}.mamba_selective_scan"
_RG_LRU = "transformers.models.recurrent_gemma.modeling_recurrent_gemma.RecurrentGemmaRglru._rnn_scan"
_WKV = "transformers.models.rwkv.modeling_rwkv.rwkv_linear_attention"
_LIGHTNING = "transformers.models.minimax.modeling_minimax.MiniMaxLightningAttention.forward"

#: ``"module.function"`` (``"module.Class.method"`` for a method) -> the form of that core: the cores
#: :func:`register_known_cores` substitutes. Forms: ``"gated_delta_rule"`` (:func:`_gated_delta_rule_replacement`),
#: ``"mamba2_chunk_scan"`` (:func:`_mamba2_chunk_scan_replacement`), ``"selective_scan"``
#: (:func:`_selective_scan_replacement`), ``"rg_lru_scan"`` (:func:`_rg_lru_scan_replacement`, a method), ``"wkv"``,
#: ``"lightning_layer"``, ``"registered"`` for the cores a user registers (:func:`register_head_parallel`), and
#: ``"replicated"`` for the layers a user registers to run whole (:func:`register_replicated`).
CORES: dict[str, str] = {
    **{_GDN.format(m): "gated_delta_rule" for m in ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid")},
    **{
        _MAMBA2.format(m): "mamba2_chunk_scan"
        for m in ("mamba2", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba2")
    },
    **{_SELECTIVE.format(m): "selective_scan" for m in ("mamba", "falcon_mamba", "jamba", "zamba")},
    _RG_LRU: "rg_lru_scan",
    _WKV: "wkv",
    _LIGHTNING: "lightning_layer",
}
#: Forms whose core is a method (``self._rnn_scan(...)``): Dynamo traces their replacement through
#: :func:`cpcompile._compat.inline_in_graph`, as it does not consult ``substitute_in_graph`` for a bound method.
_METHOD_FORMS = frozenset({"rg_lru_scan", "lightning_layer"})
#: Forms whose core is a plain function (no fused-kernel wrapper): the replacement runs a copy of it.
_PLAIN_FORMS = frozenset({"wkv"})
#: Forms whose replacement runs the library's layer on the whole sequence on every rank (its input all-gathered as
#: ``N`` copies through the heads exchange, each rank keeping its own tokens' output) instead of a share of the heads:
#: the mixing pass reports them ``replicated`` (:func:`replicated`).
_REPLICATED_FORMS = frozenset({"lightning_layer", "replicated"})
#: Forms a user registers: their replacement is given to Dynamo by the registration itself.
_USER_FORMS = frozenset({"registered", "replicated"})

_REGISTERED: dict[str, object] = {}


def replicated(site: str) -> bool:
    """Whether the core ``site`` (a :data:`CORES` key, the ``site`` its exchanges carry) runs whole on every rank
    rather than head-parallel."""
    return CORES.get(site) in _REPLICATED_FORMS


def registered_cores() -> dict[str, object]:
    """``"module.function"`` -> the function object substituted so far."""
    return dict(_REGISTERED)


def in_core(where: str) -> bool:
    """Whether ``where`` (Dynamo's ``code  # path/file.py:line in function`` of a shape guard) is a line of a
    substituted core's function (or of a function defined inside it). Such a decision was taken on the whole
    sequence's padded length ``N * c`` of the head-parallel call, not on the local one: the core is causal and the
    padding comes last, so a branch the padded length takes (one more chunk of padding) changes no value of a real
    token."""
    place = where.rpartition("  # ")[2].strip()
    path, _, rest = place.partition(".py:")
    line = rest.split(" ", 1)[0]
    if not line.isdigit():
        return False
    for fn in _REGISTERED.values():
        if fn is None:
            continue
        module_name = getattr(getattr(fn, "__wrapped__", fn), "__module__", None) or ""
        first, last = _source_lines(fn)
        if path.endswith(module_name.replace(".", "/")) and first <= int(line) <= last:
            return True  # the core's own lines and those of functions defined in it (a scan's combine_fn)
    return False


@functools.cache
def _source_lines(wrapped) -> tuple[int, int]:
    """The first and last line of the library function behind ``wrapped`` in its module (0, -1 if unknown)."""
    original = getattr(wrapped, "__wrapped__", wrapped)
    try:
        lines, first = inspect.getsourcelines(original)
    except (OSError, TypeError):
        return 0, -1
    return first, first + len(lines) - 1


#: ``ShapeEnv`` -> the ``(first, end)`` index ranges of its guards recorded while Dynamo traced a head-parallel
#: core (:func:`guard_in_core`), and the start of the core being traced.
_CORE_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CORE_START: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _enter_core(ctx=None) -> None:
    env = _compat.current_shape_env()
    if env is not None:
        _CORE_START[env] = len(env.guards)


def _leave_core(ctx=None) -> None:
    env = _compat.current_shape_env()
    if env is not None and env in _CORE_START:
        _CORE_GUARDS.setdefault(env, []).append((_CORE_START.pop(env), len(env.guards)))


def guard_in_core(index: int) -> bool:
    """Whether guard ``index`` of the frame Dynamo is compiling (:func:`cpcompile._compat.shape_guards`) was
    recorded while it traced a head-parallel core, in any function the core calls (a scan's ``combine_fn``,
    torch's own ``vmap``): such a decision was taken on the whole sequence, as :func:`in_core` says of the core's
    lines."""
    env = _compat.current_shape_env()
    return env is not None and any(a <= index < b for a, b in _CORE_GUARDS.get(env, ()))


def traced_in_core(n) -> bool:
    """Whether the FX node ``n`` was traced inside a head-parallel replacement (its stack passes through this
    module): it runs on the whole sequence of this rank's heads, at the padded length ``N * c``, in global token
    order, so a size or position it derives from that length is a global one."""
    return f'File "{__file__}"' in (n.meta.get("stack_trace") or "")


def set_heads_group(value: tuple[str, int, int] | None) -> None:
    """Set :data:`HEADS_GROUP` (the shard context does, on entry and exit)."""
    global HEADS_GROUP
    HEADS_GROUP = value


def set_state_runs(value: int | None) -> None:
    """Set :data:`STATE_RUNS` (the shard context does, on entry and exit)."""
    global STATE_RUNS
    STATE_RUNS = value


def _torch_path(wrapped) -> object | None:
    """The torch function behind transformers' ``use_kernel_func_from_hub_with_fallback`` wrapper when the wrapper
    runs it (no fused package resolved), else ``None``."""
    original = getattr(wrapped, "__wrapped__", None)
    if original is None:
        return None
    cells = dict(zip(wrapped.__code__.co_freevars, wrapped.__closure__ or ()))
    implementation = cells.get("implementation")
    if implementation is not None and implementation.cell_contents is not original:
        return None
    return original


def _fused_kernel(wrapped) -> tuple[object, object, tuple[str, ...]] | None:
    """``(torch function, fused kernel, the kernel's parameter names)`` of transformers'
    ``use_kernel_func_from_hub_with_fallback`` wrapper when it resolved a fused package's kernel (``mamba_ssm``,
    ``fla``) instead of its torch path, else ``None``."""
    original = getattr(wrapped, "__wrapped__", None)
    cells = dict(zip(wrapped.__code__.co_freevars, wrapped.__closure__ or ()))
    implementation, params = cells.get("implementation"), cells.get("applicable_params")
    if original is None or implementation is None or params is None or implementation.cell_contents is original:
        return None
    return original, implementation.cell_contents, tuple(params.cell_contents)


def _fused_replacement(replacement, kernel, params: tuple[str, ...]):
    """A core whose wrapper resolved a fused kernel: outside CP the kernel, called as the wrapper calls it (but for
    ``torch.export``, where the wrapper takes its torch path too); under CP ``replacement``, the form's replacement
    of the torch path (a fused kernel is opaque to the mixing pass, or cut off from the graph, where it would run on
    this rank's tokens only)."""

    def fused_core(*args, **kwargs):
        if HEADS_GROUP is None and not torch.compiler.is_exporting():  # HEADS_GROUP: Dynamo guards on its value
            return kernel(*args, **{k: v for k, v in kwargs.items() if k in params})
        return replacement(*args, **kwargs)

    return fused_core


def register_known_cores() -> None:
    """Substitute every core of :data:`CORES` whose module is imported and not substituted yet. A core whose
    transformers wrapper resolved a fused kernel runs it outside CP and the torch path under CP
    (:func:`_fused_replacement`), as does any other function of a transformers model bound to a fused kernel
    (:func:`cpcompile.fused.register_fused_functions`)."""
    for key, form in CORES.items():
        if form in _USER_FORMS:  # substituted by its registration
            continue
        if form in _METHOD_FORMS:
            _register_method(key, form)
            continue
        module_name, _, fn_name = key.rpartition(".")
        module = sys.modules.get(module_name)
        if key in _REGISTERED or module is None:
            continue
        wrapped = getattr(module, fn_name, None)
        fused = None
        if form in _PLAIN_FORMS:
            original = _copy(wrapped) if isinstance(wrapped, types.FunctionType) else None
        else:
            original = _torch_path(wrapped) if isinstance(wrapped, types.FunctionType) else None
            fused = _fused_kernel(wrapped) if original is None and isinstance(wrapped, types.FunctionType) else None
        if original is None and fused is None:
            _REGISTERED[key] = None  # an unknown form: left alone
            continue
        if not _compat.substituted_in_graph(wrapped):  # once per process, even when this module's state is reset
            if fused is None:
                torch.compiler.substitute_in_graph(wrapped)(_FORMS[form](original, key))
            else:
                torch_path, kernel, params = fused
                replacement = _fused_replacement(_FORMS[form](torch_path, key), kernel, params)
                torch.compiler.substitute_in_graph(wrapped, skip_signature_check=True)(replacement)
        _REGISTERED[key] = wrapped
    from cpcompile import fused

    fused.register_fused_functions()


def _register_method(key: str, form: str) -> None:
    """Give Dynamo the replacement of the method core ``key`` (``"module.Class.method"``) if its module is
    imported. The replacement runs a copy of the library's function (same code, globals and defaults), so that
    tracing it does not lead back to the replacement."""
    module_name, cls_name, fn_name = key.rsplit(".", 2)
    module = sys.modules.get(module_name)
    if key in _REGISTERED or module is None:
        return
    fn = getattr(module, cls_name, object).__dict__.get(fn_name)
    if not isinstance(fn, types.FunctionType):
        _REGISTERED[key] = None  # not the function this form was written for: left alone
        return
    # the form's factory sets the module global its replacement reads (the library's copy) every time, so a reset
    # of this module's state (``_REGISTERED`` and that global) cannot leave the replacement given to Dynamo
    # before without its library function
    replacement = _FORMS[form](_copy(fn), key)
    if not _compat.inlined_in_graph(fn):  # once per process, even when this module's state is reset
        _compat.inline_in_graph(fn, replacement)
    _REGISTERED[key] = fn


def _copy(fn: types.FunctionType) -> types.FunctionType:
    """A function with ``fn``'s code, globals and defaults: what a replacement calls for the library's own code
    (calling ``fn`` itself would lead Dynamo back to the replacement)."""
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def traced_copy(fn: types.FunctionType) -> types.FunctionType:
    """What a replacement of the module-level function ``fn`` calls: the torch function behind transformers'
    kernel binding when ``fn`` is that wrapper running it, else a copy of ``fn`` (:func:`_copy`)."""
    return (_torch_path(fn) or _copy(fn)) if hasattr(fn, "__wrapped__") else _copy(fn)


def _gathered(x, order, group_name, site, n, seq_dim, head_dim):
    """Every token of ``x`` (sequence at ``seq_dim``, no heads) in global order, as ``n`` copies exchanged by the
    heads exchange at ``head_dim`` (one copy per rank)."""
    copies = x.unsqueeze(head_dim)
    shape = list(copies.shape)
    shape[head_dim] = n
    whole = _to_heads(copies.expand(shape), order, group_name, site, seq_dim + (head_dim <= seq_dim), head_dim)
    return whole.squeeze(head_dim)


def _own_tokens(y, order, group_name, site, rank, seq_dim):
    """This rank's tokens of ``y``, a value of the whole sequence (padding last, sequence at ``seq_dim``) that every
    rank computed alike: each rank's copy goes through the exchange back as one head at ``seq_dim + 1``, so rank
    ``j``'s copy arrives as head ``j``, and this rank keeps its own."""
    back = _to_sequence(y.unsqueeze(seq_dim + 1), order, group_name, site, seq_dim, seq_dim + 1)
    return back[(slice(None),) * (seq_dim + 1) + (rank,)]


def _refuse(like, site: str, what: str, fix: str, kind: str = "head-parallel core") -> None:
    torch.ops.cpcompile.heads_refusal(like, f"the {kind} {site} under context parallelism {what}; {fix}")


def _to_heads(x, order, group_name, site, seq_dim=1, head_dim=2):
    return torch.ops.cpcompile.heads_from_sequence(x, order, seq_dim, head_dim, group_name, site, x.requires_grad)


def _to_sequence(y, order, group_name, site, seq_dim=1, head_dim=2):
    return torch.ops.cpcompile.sequence_from_heads(y, order, seq_dim, head_dim, group_name, site, y.requires_grad)


def _padded(x, heads: int, dim: int = 2, fill: float = 0.0):
    """``x`` with its head dim (2 for per-token inputs ``[B, S, H, ...]``, 0 for per-head parameters) extended to
    ``heads`` by ``fill``: heads a CP size does not divide are padded to the next multiple. A padded head's inputs
    are zeros, so the core gives it zero outputs, which are cut off after the exchange back."""
    extra = heads - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, fill)], dim=dim)


def _heads_major(x):
    """``x`` (``[B, S, H, ...]``) with the same values and strides that make ``x.transpose(1, 2)`` contiguous.

    The torch core transposes its inputs to ``[B, H, S, ...]`` and asks for a contiguous float32 copy, which is no
    copy for a float32 input (the transposed view is kept), then pads the sequence to a multiple of the chunk size
    by ``pad_size = (chunk - S % chunk) % chunk``. Traced with a symbolic ``S``, the pad's fake tensor is
    contiguous, but at run time a pad of 0 returns the input's (transposed) strides, and a ``view`` the graph took
    from the traced strides fails (``view size is not compatible with input tensor's size and stride``) whenever
    ``S`` is a multiple of the chunk size with two chunks or more (pytorch/pytorch#144187: the meta function of
    ``constant_pad_nd`` is only fixed for static pads). With inputs already in this layout the transposed view is
    contiguous, so the pad's output is contiguous for every ``S`` and the traced strides hold. The core's own
    repeat of the key heads to the value heads would give a fresh sequence-major tensor, so the replacement does
    that repeat (the same op) before this layout."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def _run_core(original, *args, **kwargs):
    """The call of the library's core on the whole sequence of this rank's heads (a global of this module: the
    negative controls of the tests replace it)."""
    return original(*args, **kwargs)


def _core_call(original, *args, seq_dim=None, **kwargs):
    """:func:`_run_core`, with the shape guards Dynamo records while tracing it marked as the core's
    (:func:`guard_in_core`). ``seq_dim``: the core's traced shape arithmetic gives its output a length that
    Dynamo cannot prove equal to its input's (transformers' associative scan on CPU), so the output is cut to the
    input's length along ``seq_dim`` while the core's guards are recorded (a no-op at run time)."""
    _compat.at_trace_time(_enter_core)
    out = _run_core(original, *args, **kwargs)
    if seq_dim is not None:
        out = out.narrow(seq_dim, 0, args[0].shape[seq_dim])
    _compat.at_trace_time(_leave_core)
    return out


def _gated_delta_rule_replacement(original, site: str):
    def chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
        packed = kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None
        if heads is None:
            if packed:  # as the library's wrapper does on its torch path (Dynamo runs the wrapper, which raises)
                raise ValueError(f"`{site}` can't keep packed sequences apart without `flash-linear-attention`")
            hk, hv = key.shape[2], value.shape[2]
            if hk != hv and hv % hk == 0:  # the core's own repeat, before the layout (see _heads_major)
                query, key = (t.repeat_interleave(hv // hk, dim=2) for t in (query, key))
            return original(
                _heads_major(query),
                _heads_major(key),
                _heads_major(value),
                _heads_major(g),
                _heads_major(beta),
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )
        group_name, n, _ = heads
        runs = STATE_RUNS  # a global of this module: Dynamo guards on its value
        if packed:
            _refuse(value, site, "got cu_seqlens", "pass no cu_seq_lens (the torch path does not keep documents apart)")
        if initial_state is not None or output_final_state:
            _refuse(value, site, "got a recurrent state (a cache)", "train with use_cache=False")
        hk, hv = key.shape[2], value.shape[2]
        if hv % hk != 0:
            _refuse(
                value, site, f"has {hk} key heads for {hv} value heads", "use key heads that divide the value heads"
            )
        if runs is not None:
            core = functools.partial(original, chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            return _gated_delta_rule_state(core, heads, runs, site, query, key, value, g, beta), None
        if hk % n != 0:  # groups cannot stay whole on a rank: every rank gets the key heads of its value heads
            query = query.repeat_interleave(hv // hk, dim=2)
            key = key.repeat_interleave(hv // hk, dim=2)
        padded = -(-hv // n) * n  # heads a CP size does not divide: zero heads up to the next multiple
        order = torch.ops.cpcompile.heads_order(value.detach(), 1, n, site)
        q, k, v, gg, b = (
            _to_heads(_padded(t, padded) if t.shape[2] == hv else t, order, group_name, site)
            for t in (query, key, value, g, beta)
        )
        if k.shape[2] != v.shape[2]:  # the core's own grouping, done here so that the layout below reaches it
            q, k = (t.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for t in (q, k))
        q, k, v, gg, b = (_heads_major(t) for t in (q, k, v, gg, b))
        out, _ = _core_call(
            original, q, k, v, gg, b, chunk_size=chunk_size, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel
        )
        return _to_sequence(out, order, group_name, site)[:, :, :hv], None

    return chunk_gated_delta_rule


def _gated_delta_rule_state(core, heads, runs: int, site: str, query, key, value, g, beta):
    """The gated delta rule under CP by state passing: ``core`` (the library's function) runs on this rank's
    tokens only, once per run slot, and the state each run starts from comes from the other runs' summaries.

    The rule is affine in its ``[dk, dv]`` state: ``S_t = A_t S_{t-1} + B_t`` (``A_t`` the token's decayed delta
    transition, multiplying on the left), output ``o_t = q_t^T S_t``. Run from the state ``[0 | I]`` (``[dk, dv +
    dk]``) on the values ``[v | 0]``, the core's columns evolve apart under the same transitions, so its output is
    ``[o_t(0) | q_t^T A_t ... A_1]`` (the output from a zero state, and the rows that map a start state to the
    output) and its final state ``[S_0 | M]`` (the state from zero and the product of the run's transitions).
    The runs of every rank are all-gathered (``cpcompile::state_gather``) and folded in global order in fp32
    (``S <- M S + S_0``, from a zero state before the first token), which gives each run its start state ``S_in``;
    a run's output is ``o_t(0) + (q_t^T A_t ... A_1) S_in``. Run slot ``j`` holds the tokens of the rank's run
    ``j`` and zeros elsewhere: a zero token (``k = q = v = 0``, ``g = beta = 0``) is an identity step with a zero
    output, so each slot's core sees its run alone, and the output is the sum over slots. Padding tokens come last
    in global order, so no real token's state includes them."""
    n = heads[1]
    hv, dv = value.shape[2:]
    slots, order = torch.ops.cpcompile.state_runs(value.detach(), 1, n, runs, site)
    if key.shape[2] != hv:  # the core's own repeat, done here so that the layout of the slots reaches it
        query, key = (t.repeat_interleave(hv // key.shape[2], dim=2) for t in (query, key))
    # each input as a contiguous copy whose gradient is a contiguous copy too (cpcompile::state_input)
    q, k, gg, bb, v = (
        _heads_major(_per_run(torch.ops.cpcompile.state_input(t, site), slots, runs))
        for t in (query, key, g, beta, value)
    )
    out, final = _from_identity(core, q, k, v, gg, bb)
    fixed = _passed(out, final, slots, order, runs, dv, heads, site)
    return torch.ops.cpcompile.state_output(fixed.to(query.dtype), site)


def _run_mask(slots, runs: int):
    """``[runs, c]`` bool: whether each of this rank's tokens is in run ``j`` (``slots`` of
    ``cpcompile::state_runs``)."""
    return slots.unsqueeze(0) == torch.arange(runs, device=slots.device).unsqueeze(1)


def _per_run(t, slots, runs: int):
    """``t`` (``[B, c, ...]``, this rank's tokens) as ``[runs * B, c, ...]`` in fp32: slot ``j`` keeps the tokens
    of the rank's run ``j`` (:func:`_run_mask`) and zeros elsewhere."""
    mask = _run_mask(slots, runs).float().reshape(runs, 1, t.shape[1], *([1] * (t.dim() - 2)))
    return (t.unsqueeze(0) * mask).flatten(0, 1)


def _passed(out, final, slots, order, runs: int, dv: int, heads, site: str):
    """This rank's outputs ``[B, c, H, dv]`` (fp32) from the core's outputs and final states of every run slot
    from the state ``[0 | I]`` (``out`` ``[runs * B, c, H, dv + dk]``, ``final`` ``[runs * B, H, dk, dv + dk]``,
    :func:`_from_identity`): the final states of every rank's runs all-gathered (``cpcompile::state_gather``),
    folded in global order (``order`` of ``cpcompile::state_runs``), and each slot's outputs corrected by the state
    its run starts from, summed over the slots."""
    group_name, _, rank = heads
    every = torch.ops.cpcompile.state_gather(final.unflatten(0, (runs, -1)), group_name, site, final.requires_grad)
    in_order = every.flatten(0, 1).index_select(0, order)  # [N * runs, B, H, dk, dv + dk], runs in global order
    starts = _fold(in_order, dv).index_select(0, torch.argsort(order)).narrow(0, rank * runs, runs)
    return _corrected(out.unflatten(0, (runs, -1)), starts, dv).sum(0)  # [runs, B, c, H, dv] summed over slots


def _from_identity(core, query, key, value, g, beta):
    """``core`` (a gated delta rule, ``[B, S, H, ...]`` inputs) run from the state ``[0 | I]`` on the values ``[v |
    0]``: ``(out [B, S, H, dv + dk], final [B, H, dk, dv + dk])`` (see :func:`_gated_delta_rule_state`)."""
    b, _, hv, dv = value.shape
    dk = key.shape[-1]
    value = _heads_major(torch.nn.functional.pad(value, (0, dk)))
    eye = torch.eye(dk, dtype=torch.float32, device=value.device)
    start = torch.cat([eye.new_zeros(dk, dv), eye], dim=-1).expand(b, hv, dk, dv + dk).contiguous()
    return _core_call(core, query, key, value, g, beta, initial_state=start, output_final_state=True)


def _fold(summaries, dv: int):
    """The state every run starts from, ``[K, B, H, dk, dv]``, given the final states ``[S_0 | M]`` of
    :func:`_from_identity` of ``K`` consecutive runs in global order (``[K, B, H, dk, dv + dk]``): zero for the
    first, then ``S <- M S + S_0`` run by run, in fp32."""
    state = summaries.new_zeros(summaries.shape[1:-1] + (dv,), dtype=torch.float32)
    starts = []
    for i in range(summaries.shape[0]):
        starts.append(state)
        summary = summaries[i].float()
        state = summary[..., dv:] @ state + summary[..., :dv]
    return torch.stack(starts)


def _corrected(out, starts, dv: int):
    """The outputs of runs started from ``starts`` (``[..., H, dk, dv]``), from their outputs from ``[0 | I]``
    (``out``, ``[..., S, H, dv + dk]`` of :func:`_from_identity`): ``o_t(0) + (q_t^T A_t ... A_1) S_in``."""
    return out[..., :dv].float() + torch.einsum("...thk,...hkv->...thv", out[..., dv:].float(), starts)


def _mamba2_chunk_scan_replacement(original, site: str):
    def mamba2_chunk_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        dt_bias=None,
        initial_states=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        **kwargs,
    ):
        heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
        packed = kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None
        if heads is None:
            if packed:  # as the library's wrapper does on its torch path (Dynamo runs the wrapper, which raises)
                raise ValueError(f"`{site}` can't keep packed sequences apart without `mamba-ssm`")
            return original(
                hidden_states,
                dt,
                A,
                B,
                C,
                chunk_size,
                D=D,
                dt_bias=dt_bias,
                initial_states=initial_states,
                dt_softplus=dt_softplus,
                dt_limit=dt_limit,
                return_final_states=return_final_states,
                **kwargs,
            )
        group_name, n, rank = heads
        if packed:
            _refuse(
                hidden_states,
                site,
                "got seq_idx or cu_seqlens",
                "pass no seq_idx/cu_seq_lens (the torch path does not keep documents apart)",
            )
        if initial_states is not None or return_final_states:
            _refuse(hidden_states, site, "got a recurrent state (a cache)", "train with use_cache=False")
        h, groups = hidden_states.shape[2], B.shape[2]
        if h % groups != 0:
            _refuse(hidden_states, site, f"has {groups} groups for {h} heads", "use groups that divide the heads")
        runs = STATE_RUNS  # a global of this module: Dynamo guards on its value
        if runs is not None:
            core = functools.partial(original, chunk_size=chunk_size, D=D, **kwargs)
            step = (dt_bias, dt_softplus, dt_limit)
            return _ssd_state(core, heads, runs, site, hidden_states, dt, A, B, C, step)
        if groups % n != 0:  # groups cannot stay whole on a rank: every rank gets the groups of its heads
            B = B.repeat_interleave(h // groups, dim=2)
            C = C.repeat_interleave(h // groups, dim=2)
        padded = -(-h // n) * n  # heads a CP size does not divide: zero heads up to the next multiple
        order = torch.ops.cpcompile.heads_order(hidden_states.detach(), 1, n, site)
        x, step, b, c = (
            _to_heads(_padded(t, padded) if t.shape[2] == h else t, order, group_name, site)
            for t in (hidden_states, dt, B, C)
        )
        per = padded // n

        def mine(p, fill=0.0):  # this rank's heads of a per-head parameter (its gradient is summed over the group)
            return None if p is None else _padded(p, padded, 0, fill).narrow(0, rank * per, per)

        out = _core_call(
            original,
            x,
            step,
            mine(A, -1.0),
            b,
            c,
            chunk_size,
            D=mine(D),
            dt_bias=mine(dt_bias),
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            **kwargs,
        )
        return _to_sequence(out, order, group_name, site)[:, :, :h]

    return mamba2_chunk_scan


def _ssd_state(core, heads, runs: int, site: str, x, dt, A, B, C, step):
    """Mamba2's SSD under CP by state passing (as :func:`_gated_delta_rule_state`): ``core`` (the library's
    function) runs on this rank's tokens only, once per run slot, and the state each run starts from comes from the
    other runs' summaries.

    Per head, the state ``h`` (``[P, N]``) moves by one scalar per token: ``h_t = a_t h_{t-1} + dt_t x_t B_t^T``
    with ``a_t = exp(dt_t A)``, output ``y_t = h_t C_t + D x_t``. The step sizes are discretised here as the
    library does (``step``: ``dt_bias`` added, softplus if asked, clamped to ``dt_limit``; the same ops in the same
    order) and the core gets them as they are, so that a zero token (``dt = 0``: decay 1, no input; ``C = 0``: no
    output) is an identity step. Run from the state ``[0 ; I]`` (``[P + N, N]``) on the inputs ``[x | 0]``, the
    core's outputs are ``[y_t(0) | a_1 ... a_t C_t]`` and its final state ``[S_0 ; a_1 ... a_c I]``: transposed, the
    gated delta rule's form with ``dv = P`` and ``dk = N``, which :func:`_passed` folds and corrects. The core runs
    once per slot with ``P + N`` columns per head."""
    n = heads[1]
    p = x.shape[-1]
    slots, order = torch.ops.cpcompile.state_runs(x.detach(), 1, n, runs, site)
    x, dt, B, C = (torch.ops.cpcompile.state_input(t, site) for t in (x, dt, B, C))
    x, dt, B, C = (_per_run(t, slots, runs) for t in (x, _ssd_steps(dt, step), B, C))
    out, final = _ssd_from_identity(core, x, dt, A, B, C)
    fixed = _passed(out, final.transpose(-1, -2), slots, order, runs, p, heads, site)
    return torch.ops.cpcompile.state_output(fixed.to(out.dtype), site)


def _ssd_steps(dt, step):
    """The step sizes ``dt`` as Mamba2's SSD discretises them before its scan: ``step`` is its ``(dt_bias,
    dt_softplus, dt_limit)``."""
    dt_bias, dt_softplus, dt_limit = step
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def _ssd_from_identity(core, x, dt, A, B, C):
    """``core`` (Mamba2's SSD, ``x`` ``[B, S, H, P]`` and ``dt`` already discretised) run from the state ``[0 ; I]``
    on the inputs ``[x | 0]``: ``(out [B, S, H, P + N], final [B, H, P + N, N])`` (see :func:`_ssd_state`)."""
    b, _, h, p = x.shape
    state = B.shape[-1]
    eye = torch.eye(state, dtype=torch.float32, device=x.device)
    start = torch.cat([eye.new_zeros(p, state), eye]).expand(b, h, p + state, state).contiguous()
    whole = (float("-inf"), float("inf"))  # dt is clamped already: the zero steps stay zero
    padded = torch.nn.functional.pad(x, (0, state))
    return _core_call(core, padded, dt, A, B, C, initial_states=start, dt_limit=whole, return_final_states=True)


def _selective_scan_replacement(original, site: str):
    def mamba_selective_scan(
        hidden_states,
        dt,
        A,
        B,
        C,
        D=None,
        z=None,
        delta_bias=None,
        delta_softplus=False,
        return_last_state=False,
        use_mambapy=False,
        use_associative_scan=False,
        **kwargs,
    ):
        heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
        flags = {"delta_softplus": delta_softplus, "use_mambapy": use_mambapy}
        flags["use_associative_scan"] = use_associative_scan
        if heads is None:
            return original(
                hidden_states,
                dt,
                A,
                B,
                C,
                D=D,
                z=z,
                delta_bias=delta_bias,
                return_last_state=return_last_state,
                **flags,
                **kwargs,
            )
        group_name, n, rank = heads
        if return_last_state:
            _refuse(hidden_states, site, "returns its recurrent state (a cache)", "train with use_cache=False")
        # [B, I, S]: channels on dim 1, tokens on dim 2; a diagonal scan, so every channel is a head of its own
        channels = hidden_states.shape[1]
        padded = -(-channels // n) * n  # channels a CP size does not divide: zero channels up to the next multiple
        order = torch.ops.cpcompile.heads_order(hidden_states.detach(), 2, n, site)

        def split(t):  # this rank's channels of every token
            return None if t is None else _to_heads(_padded(t, padded, 1), order, group_name, site, 2, 1)

        def whole(t):  # B and C ([B, N, S], shared by every channel): every token on every rank (an all-gather)
            shape = (t.shape[0], n, *t.shape[1:])
            return _to_heads(t.unsqueeze(1).expand(shape), order, group_name, site, 3, 1).squeeze(1)

        per = padded // n

        def mine(p, fill=0.0):  # this rank's channels of a per-channel parameter (gradient summed over the group)
            return None if p is None else _padded(p, padded, 0, fill).narrow(0, rank * per, per)

        out = _core_call(
            original,
            split(hidden_states),
            split(dt),
            mine(A, -1.0),
            whole(B),
            whole(C),
            D=mine(D),
            z=split(z),
            delta_bias=mine(delta_bias),
            seq_dim=2,
            **flags,
            **kwargs,
        )
        return _to_sequence(out, order, group_name, site, 2, 1)[:, :channels]

    return mamba_selective_scan


#: The copy of transformers' ``RecurrentGemmaRglru._rnn_scan`` that :func:`_rg_lru_scan` runs (set once per process
#: by :func:`_register_method`). A module global, not a closure: Dynamo guards a method replacement's closure
#: through the library function's own (closure-free) source.
_RG_LRU_LIBRARY = None


def _rg_lru_scan_replacement(original, site: str):
    global _RG_LRU_LIBRARY
    _RG_LRU_LIBRARY = original
    return _rg_lru_scan


def _rg_lru_scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
    original, site = _RG_LRU_LIBRARY, _RG_LRU
    heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
    if heads is None:
        return original(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
    group_name, n, _ = heads
    if recurrent_states is not None:
        _refuse(hidden_states, site, "got a recurrent state (a cache)", "train with use_cache=False")
    runs = STATE_RUNS  # a global of this module: Dynamo guards on its value
    if runs is not None:
        core = functools.partial(original, self, acc_dtype=acc_dtype)
        return _rg_lru_state(core, heads, runs, site, hidden_states, recurrent_gate, reset), None
    # [B, S, W]: tokens on dim 1, channels on dim 2; a diagonal recurrence, so every channel is a head of its own
    channels = hidden_states.shape[2]
    padded = -(-channels // n) * n  # channels a CP size does not divide: zero channels up to the next multiple
    order = torch.ops.cpcompile.heads_order(hidden_states.detach(), 1, n, site)

    def split(t):  # this rank's channels of every token
        return _to_heads(_padded(t, padded), order, group_name, site)

    # reset ([B, S, 1], true at a document's first token, from the position ids): every token on every rank (the
    # heads exchange of N copies: an all-gather), so documents restart where the one-process model restarts them
    flags = reset.to(hidden_states.dtype).expand(*reset.shape[:2], n)
    whole_reset = _to_heads(flags, order, group_name, site) > 0.5
    out, _ = _core_call(
        functools.partial(original, self), split(hidden_states), split(recurrent_gate), whole_reset, None, acc_dtype
    )
    # the layer keeps the state returned here (read only with a cache, refused): under CP no rank holds every
    # channel of the last token's state, so none is returned
    return _to_sequence(out, order, group_name, site)[:, :, :channels], None


def _rg_lru_state(core, heads, runs: int, site: str, x, gate, reset):
    """The RG-LRU's recurrence under CP by state passing (as :func:`_gated_delta_rule_state`): ``core`` (the
    library's scan) runs on this rank's tokens only, once per run slot, and the state each run starts from comes from
    the other runs' summaries.

    Per channel the state is one number, ``h_t = a_t h_{t-1} + x_t`` with ``a_t`` the gate (zero at a document's
    first token: ``reset``, applied here as the library applies it first; the core then gets no reset), and the
    output is ``h_t``. A token outside the slot's run gets ``a = 1`` and ``x = 0`` (an identity step). The channels
    are doubled: the core runs from the state ``[0 | 1]`` on ``[x | 0]``, so its outputs are ``[y_t(0) | a_1 ...
    a_t]`` and its final state ``[S_0 | a_1 ... a_c]``: per channel, the gated delta rule's form with ``dv = dk =
    1``, which :func:`_passed` folds and corrects. A reset inside a run zeroes its product, so the incoming state
    stops there, as in one process. The slot's outputs outside its run are not zero (the state is carried), so
    they are zeroed before the correction. Returns the outputs in ``x``'s dtype."""
    n = heads[1]
    slots, order = torch.ops.cpcompile.state_runs(x.detach(), 1, n, runs, site)
    x, gate = (torch.ops.cpcompile.state_input(t, site) for t in (x, gate))
    in_run = _run_mask(slots, runs)
    xs = _per_run(x, slots, runs)
    gs = torch.where(in_run[:, None, :, None], (gate * ~reset).float().unsqueeze(0), 1.0).flatten(0, 1)
    out, final = _rg_lru_from_identity(core, xs, gs)
    out = (out.unflatten(0, (runs, -1)) * in_run[:, None, :, None, None]).flatten(0, 1)  # zero outside the run
    fixed = _passed(out, final, slots, order, runs, 1, heads, site)
    return torch.ops.cpcompile.state_output(fixed.squeeze(-1).to(x.dtype), site)


def _rg_lru_from_identity(core, x, gate):
    """``core`` (the RG-LRU's scan, ``x`` and ``gate`` ``[B, S, W]`` in fp32, the resets already in ``gate``) run
    from the state ``[0 | 1]`` on ``[x | 0]`` with its channels doubled: ``(out [B, S, W, 2], final [B, W, 1, 2])``
    (see :func:`_rg_lru_state`)."""
    b, s, w = x.shape
    start = torch.cat([x.new_zeros(b, w), x.new_ones(b, w)], dim=-1)
    no_reset = torch.zeros(b, s, 1, dtype=torch.bool, device=x.device)
    out, final = _core_call(core, torch.cat([x, torch.zeros_like(x)], -1), gate.repeat(1, 1, 2), no_reset, start)
    return out.unflatten(-1, (2, w)).transpose(-1, -2), final.unflatten(-1, (2, w)).transpose(-1, -2).unsqueeze(-2)


#: The copy of transformers' ``MiniMaxLightningAttention.forward`` that :func:`_lightning_layer` runs.
_LIGHTNING_LIBRARY = None


def _lightning_layer_replacement(original, site: str):
    global _LIGHTNING_LIBRARY
    _LIGHTNING_LIBRARY = original
    return _lightning_layer


def _lightning_layer(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
    """MiniMax's lightning attention layer under CP: its block loop is inline in the layer's forward, between the
    per-token projections and an RMS norm across heads, so the whole layer runs on the whole sequence on every rank
    (its input all-gathered in global token order, as the exchange of ``N`` copies) and each rank takes its tokens'
    output back: ``N`` times the layer's work, exact."""
    original, site = _LIGHTNING_LIBRARY, _LIGHTNING
    heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
    if heads is None:
        return original(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
    group_name, n, rank = heads
    if cache is not None:
        _refuse(hidden_states, site, "got a cache", "train with use_cache=False")
    if attention_mask is not None:
        _refuse(hidden_states, site, "got a padding mask", "pack the documents and pass no attention_mask")
    order = torch.ops.cpcompile.heads_order(hidden_states.detach(), 1, n, site)
    whole = _gathered(hidden_states, order, group_name, site, n, 1, 2)  # every token, in global order, padding last
    out, _ = _core_call(lambda x: original(self, x, position_embeddings, None, **kwargs), whole)
    return _own_tokens(out, order, group_name, site, rank, 1), None


def _wkv_replacement(original, site: str):
    def rwkv_linear_attention(time_decay, time_first, key, value, state=None, return_state=False):
        heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
        if heads is None:
            return original(time_decay, time_first, key, value, state=state, return_state=return_state)
        group_name, n, rank = heads
        if state is not None or return_state:
            _refuse(key, site, "got a recurrent state (a cache)", "train with use_cache=False")
        # [B, S, C]: tokens on dim 1, channels on dim 2; the WKV recurrence is per channel, so every channel is a head
        channels = key.shape[2]
        padded = -(-channels // n) * n  # channels a CP size does not divide: zero channels up to the next multiple
        order = torch.ops.cpcompile.heads_order(key.detach(), 1, n, site)
        per = padded // n

        def mine(p):  # this rank's channels of a per-channel parameter (gradient summed over the group)
            return _padded(p, padded, 0).narrow(0, rank * per, per)

        k, v = (_to_heads(_padded(t, padded), order, group_name, site) for t in (key, value))
        decay, first = mine(time_decay), mine(time_first)
        out, _ = _core_call(lambda k, v: original(decay, first, k, v), k, v)  # the tokens first, as every core's
        return _to_sequence(out, order, group_name, site)[:, :, :channels], None

    return rwkv_linear_attention


@dataclasses.dataclass(frozen=True)
class _HeadSpec:
    """How :func:`register_head_parallel` runs a user's core: which arguments are exchanged by heads, narrowed to
    the rank's heads or passed unchanged, and where the sequence and head dims of the per-token ones are."""

    names: tuple[str, ...]
    defaults: tuple[tuple[str, object], ...]
    per_token: tuple[str, ...]
    per_head: tuple[str, ...]
    shared: tuple[str, ...]
    seq_dim: int
    head_dim: int
    gathered: tuple[str, ...] = ()
    #: Whether the pairing of groups with heads was tested (a core :mod:`cpcompile.regions` found): groups that the
    #: CP size does not divide are then repeated to their heads, inside which the region's proof no longer sees
    #: the function's own repeat; a registered core's are refused instead.
    groups_tested: bool = False


#: ``"module.function"`` -> the :class:`_HeadSpec` of each core registered by :func:`register_head_parallel`.
_HEAD_SPECS: dict[str, _HeadSpec] = {}


def register_head_parallel(
    fn,
    *,
    per_token: Sequence[str],
    per_head: Sequence[str] = (),
    shared: Sequence[str] = (),
    seq_dim: int = 1,
    head_dim: int = 2,
    gathered: Sequence[str] = (),
) -> None:
    """Run the module-level function ``fn``, a causal sequence mixer that is a map over heads, head-parallel under CP.

    While a :func:`cpcompile.shard` context of more than one rank is active, Dynamo traces a replacement of ``fn``
    (as it does the known cores of :data:`CORES`): each argument named in ``per_token`` (a tensor whose dim
    ``seq_dim`` is the sequence and dim ``head_dim`` the heads) goes through ``cpcompile::heads_from_sequence``
    (this rank's tokens of every head -> every token, in global order, of ``H / N`` heads: the ``r``-th block of
    them on rank ``r``; an argument with fewer heads, ``G``, whose each head serves a block of ``H / G``
    consecutive heads of the others, as ``repeat_interleave`` pairs them, gives the matching ``G / N`` on each
    rank (refused when ``N`` does not divide ``G`` and ``H``); heads that ``N`` does not divide are padded with
    zero heads, zero
    per-head values included, up to the next multiple, whose outputs are cut off after the exchange back), each
    argument named in ``per_head`` (a
    tensor whose dim 0 is the ``H`` heads) is narrowed to the rank's heads (its gradient summed over the group, as
    every parameter's is), the arguments named in
    ``shared`` pass unchanged, and each argument named in ``gathered`` (a tensor whose dim ``seq_dim`` is the
    sequence and that has no heads: the same for every head, as the selective scan's ``B`` and ``C``) is
    all-gathered, every token in global order on every rank (``N`` copies through the same exchange). ``fn`` runs
    on the whole sequence of those heads, and every tensor it returns (one,
    or a tuple or list of tensors and ``None``), laid out as the per-token arguments, is brought back to this
    rank's tokens. The mixing pass proves the traced region a map over the heads and refuses, at compile time on
    every rank, an op in it that combines heads, naming the op and the model's line. Outside a shard context, and
    in eager calls, ``fn`` runs unchanged. Exact under every layout, with packed documents as far as ``fn`` treats
    them as the one-process model does (it sees the whole sequence, in order), when ``fn`` is causal: a token's
    outputs read only tokens at or before it. ``fn`` runs on the padded sequence (padding tokens last, when ``T`` is
    not a multiple of the CP size), and causality, which is not checked, keeps the padding from every real token.

    Refused while tracing, on every rank: a tensor argument not named in any of the lists, and a per-token
    argument with fewer heads (groups) that do not divide the heads, or that the CP size does not divide with the
    heads (the region's proof sees the function pair them only when they are split). Register before the first
    compiled call under CP; registering ``fn`` again with the same arguments does nothing.

    ``**kwargs`` of ``fn`` pass through: a tensor in them is refused unless a list names it (as a ``fn`` that takes
    ``**kwargs`` may be given any keyword, a name that is not a parameter is taken for one). A function transformers
    binds to a kernel (``use_kernel_func_from_hub_with_fallback``) runs its torch path.

    Raises ``TypeError`` when ``fn`` is not a module-level Python function with named parameters (no ``*args`` or
    positional-only ones), and ``ValueError`` for a name that is not a parameter of ``fn`` (without
    ``**kwargs``), a name in two lists, an empty ``per_token``, equal or negative dims, or a second registration
    of ``fn`` with other arguments.
    """
    if not isinstance(fn, types.FunctionType) or fn.__qualname__ != fn.__name__:
        raise TypeError(
            f"register_head_parallel expects a module-level Python function, got {fn!r}; register the function "
            "the model calls (a method or a nested function cannot be substituted: call a module-level one from it)"
        )
    spec = _head_spec(
        fn, per_token=per_token, per_head=per_head, shared=shared, seq_dim=seq_dim, head_dim=head_dim, gathered=gathered
    )
    key = f"{fn.__module__}.{fn.__name__}"
    if not _new_registration(key, spec, "registered"):
        return
    if not _compat.substituted_in_graph(fn):
        torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(
            _registered_replacement(traced_copy(fn), key, spec)
        )
    _REGISTERED[key] = fn


def _new_registration(key: str, spec: _HeadSpec, form: str) -> bool:
    """Record a user's registration of the function ``key`` as ``form`` (:data:`CORES`): ``False`` when it is
    registered already with the same ``spec``; ``ValueError`` when with another."""
    if key in _HEAD_SPECS:
        if _HEAD_SPECS[key] != spec:
            raise ValueError(f"{key} is registered already with {_HEAD_SPECS[key]}; register it once per process")
        return False
    _HEAD_SPECS[key] = spec
    CORES[key] = form
    return True


def register_found_method(fn: types.FunctionType, **classified) -> None:
    """Run the method ``fn`` (a function defined in a class, called as ``self.fn(...)``) head-parallel as
    :func:`register_head_parallel` runs a module-level function (``classified``: its keyword arguments), with
    ``self`` passed unchanged: what
    :mod:`cpcompile.regions` does with a method it found. The replacement reaches Dynamo through
    :func:`cpcompile._compat.inline_method` (Dynamo does not consult ``substitute_in_graph`` for a bound method),
    replacing the one given before (the probe's). A tensor the method reads from ``self`` is not narrowed: the
    finding refuses one with a dim of the head count. Its groups of heads were tested, so groups that the CP size
    does not divide are repeated to their heads (``_HeadSpec.groups_tested``)."""
    spec = dataclasses.replace(_head_spec(fn, **classified), groups_tested=True)
    key = f"{fn.__module__}.{fn.__qualname__}"
    _HEAD_SPECS[key] = spec
    CORES[key] = "registered"
    _compat.inline_method(fn, key, _registered_replacement(_copy(fn), key, spec))
    _REGISTERED[key] = fn


def register_replicated(fn, *, per_token: Sequence[str], shared: Sequence[str] = (), seq_dim: int = 1) -> None:
    """Run ``fn``, a causal sequence mixer that cannot be split by heads, on the whole sequence on every rank under
    CP: a layer's ``forward`` whose scan is written inline between projections that combine heads
    (``MyLayer.forward``, a function defined in a class), or a module-level function.

    While a :func:`cpcompile.shard` context of more than one rank is active, Dynamo traces a replacement of ``fn``
    (as it does MiniMax's lightning-attention layer): each argument named in ``per_token`` (a tensor whose dim
    ``seq_dim`` is the sequence) is all-gathered, every token in global order with the padding last, on every rank
    (``N`` copies through ``cpcompile::heads_from_sequence``); the arguments named in ``shared`` pass unchanged;
    ``fn`` runs on the whole sequence, with ``self`` (a method's module, its parameters whole) unchanged; and every
    tensor it returns (one, or a tuple or list of tensors and other values, which pass unchanged), laid out with
    the sequence at ``seq_dim``, is cut back to this rank's tokens (``cpcompile::sequence_from_heads``). The mixing
    pass reports the call ``replicated``. Exact under every layout, with packed documents as ``fn`` treats them in
    one process (it sees the whole sequence, in order), when ``fn`` is causal: a token's outputs read only tokens
    at or before it, so the padding after the last token reaches no real one (not checked). The cost is ``N``
    times ``fn``'s work and the memory of its activations over the whole sequence on every rank, and two
    exchanges of ``N`` copies of each per-token input and output each way: prefer moving a scan that keeps the
    heads apart into a function of its own, which cpcompile finds and runs head-parallel. Outside a shard context,
    and in eager calls, ``fn`` runs unchanged. Each rank's gradients cover its own tokens' outputs, and the sum over
    the CP group that every parameter's gradient gets is the whole.

    Refused while tracing, on every rank: a tensor argument named in neither list, a returned tensor with fewer
    than ``seq_dim + 1`` dims. Register before the first compiled call under CP; registering ``fn`` again with the
    same arguments does nothing.

    Raises ``TypeError`` when ``fn`` is not a Python function defined at module level or in a class (a nested
    function cannot be substituted), or has ``*args`` or positional-only parameters, and ``ValueError`` for a name
    that is not a parameter of ``fn`` (without ``**kwargs``), a name in both lists, an empty ``per_token``, a
    negative ``seq_dim``, or a second registration of ``fn`` with other arguments.
    """
    if not isinstance(fn, types.FunctionType) or "<locals>" in fn.__qualname__:
        raise TypeError(
            f"register_replicated expects a function defined at module level or in a class (MyLayer.forward), got "
            f"{fn!r}; register the function or method the model calls"
        )
    if seq_dim < 0:
        raise ValueError(f"seq_dim={seq_dim}: expected the non-negative dim of the per-token arguments' sequence")
    spec = _head_spec(fn, per_token=per_token, shared=shared, seq_dim=seq_dim, head_dim=seq_dim + 1,
                      api="register_replicated")  # fmt: skip
    key = f"{fn.__module__}.{fn.__qualname__}"
    if not _new_registration(key, spec, "replicated"):
        return
    if fn.__qualname__ != fn.__name__:  # a method: Dynamo does not consult substitute_in_graph for a bound method
        _compat.inline_method(fn, key, _replicated_replacement(_copy(fn), key, spec))
    elif not _compat.substituted_in_graph(fn):
        torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(
            _replicated_replacement(traced_copy(fn), key, spec)
        )
    _REGISTERED[key] = fn


def _replicated_replacement(original, site: str, spec: _HeadSpec):
    # plain tuples and ints in the closure, as in _registered_replacement
    names, defaults, per_token, seq_dim = spec.names, spec.defaults, spec.per_token, spec.seq_dim
    classified = spec.per_token + spec.shared

    def replicated_core(*args, **kwargs):
        heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
        if heads is None:
            return original(*args, **kwargs)
        group_name, n, rank = heads
        values = _bound(names, defaults, args, kwargs)
        _refuse_unclassified(values, classified, site, "register_replicated", "per_token or shared")
        order = torch.ops.cpcompile.heads_order(values[per_token[0]].detach(), seq_dim, n, site)
        tokens = [_gathered(values[name], order, group_name, site, n, seq_dim, seq_dim + 1) for name in per_token]
        out = _core_call(lambda *ts: original(**{**values, **dict(zip(per_token, ts))}), *tokens)

        def back(t):
            if not isinstance(t, torch.Tensor):
                return t
            if t.dim() <= seq_dim:
                _refuse(
                    t,
                    site,
                    f"returned a tensor of {t.dim()} dims, without the sequence at seq_dim={seq_dim}",
                    "return only per-token values from the registered function",
                    kind="replicated layer",
                )
            return _own_tokens(t, order, group_name, site, rank, seq_dim)

        if isinstance(out, (tuple, list)):
            return type(out)(back(t) for t in out)
        return back(out)

    return replicated_core


def _bound(names: tuple[str, ...], defaults: tuple[tuple[str, object], ...], args, kwargs) -> dict:
    """A registered function's arguments by name: its defaults, then the positional and keyword arguments."""
    values = dict(defaults)
    values.update(zip(names, args))
    values.update(kwargs)
    return values


def _refuse_unclassified(values: dict, classified: tuple[str, ...], site: str, api: str, lists: str) -> None:
    """Refuse each tensor of ``values`` (a registered function's arguments by name) that its registration ``api``
    did not name in one of its ``lists``."""
    for name, value in values.items():
        if isinstance(value, torch.Tensor) and name not in classified:
            _refuse(
                value,
                site,
                f"got the tensor argument {name!r}, which {api} did not classify",
                f"name it in {lists} of cpcompile.cores.{api}",
                kind="head-parallel core" if api == "register_head_parallel" else "replicated layer",
            )


def _head_spec(
    fn, *, per_token, per_head=(), shared=(), seq_dim=1, head_dim=2, gathered=(), api="register_head_parallel"
) -> _HeadSpec:
    """The checked arguments of :func:`register_head_parallel` (``api``: the registration named in errors) for
    ``fn``."""
    params = inspect.signature(fn).parameters.values()
    odd = [p.name for p in params if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD)]
    if odd:
        raise TypeError(
            f"{api} needs {fn.__name__}'s parameters named, got *args or positional-only "
            f"parameters {odd}; give the core named parameters"
        )
    names = tuple(p.name for p in params if p.kind != p.VAR_KEYWORD)
    takes_kwargs = len(names) < len(params)
    lists = {
        "per_token": tuple(per_token),
        "per_head": tuple(per_head),
        "shared": tuple(shared),
        "gathered": tuple(gathered),
    }
    for kind, listed in lists.items():
        unknown = [x for x in listed if x not in names]
        if unknown and not takes_kwargs:
            raise ValueError(f"{kind}={listed!r} names {unknown}, not parameters of {fn.__name__}{names}")
    every = [x for listed in lists.values() for x in listed]
    if len(set(every)) != len(every):
        raise ValueError(f"a parameter of {fn.__name__} is named in two of the lists: {lists}")
    if not lists["per_token"]:
        raise ValueError(f"per_token is empty; name the arguments of {fn.__name__} that hold the tokens")
    if seq_dim < 0 or head_dim < 0 or seq_dim == head_dim:
        raise ValueError(
            f"seq_dim={seq_dim}, head_dim={head_dim}: expected two different non-negative dims of the per-token "
            "arguments (e.g. seq_dim=1, head_dim=2 for [B, S, H, ...])"
        )
    defaults = tuple((p.name, p.default) for p in params if p.default is not p.empty)
    return _HeadSpec(names, defaults, lists["per_token"], lists["per_head"], lists["shared"], seq_dim, head_dim,
                     lists["gathered"])  # fmt: skip


def _registered_replacement(original, site: str, spec: _HeadSpec):
    # plain tuples and ints in the closure: Dynamo traces the replacement as a polyfill, which cannot hold objects
    names, defaults, per_token, per_head = spec.names, spec.defaults, spec.per_token, spec.per_head
    gathered, groups_tested = spec.gathered, spec.groups_tested
    classified = spec.per_token + spec.per_head + spec.shared + spec.gathered
    seq_dim, head_dim = spec.seq_dim, spec.head_dim

    def registered_core(*args, **kwargs):
        heads = HEADS_GROUP  # a global of this module: Dynamo guards on its value
        if heads is None:
            return original(*args, **kwargs)
        group_name, n, rank = heads
        values = _bound(names, defaults, args, kwargs)
        first = values[per_token[0]]
        _refuse_unclassified(values, classified, site, "register_head_parallel", "per_token, per_head or shared")
        count = max(values[name].shape[head_dim] for name in per_token)
        padded = -(-count // n) * n  # heads a CP size does not divide: zero heads up to the next multiple
        for name in per_token:
            groups = values[name].shape[head_dim]
            if count % groups:
                _refuse(
                    values[name],
                    site,
                    f"has {groups} groups of heads (dim {head_dim} of {name!r}), which do not divide its {count} heads",
                    "give each group the same number of heads",
                )
            if groups != count and (groups % n or padded != count):  # ranks cannot hold whole groups
                if not groups_tested:
                    _refuse(
                        values[name],
                        site,
                        f"has {groups} groups of heads (dim {head_dim} of {name!r}) for {count} heads, which the CP "
                        f"size {n} does not divide",
                        "use a CP size that divides the groups and the heads",
                    )
                values[name] = values[name].repeat_interleave(count // groups, dim=head_dim)  # each its group's
        per = padded // n
        order = torch.ops.cpcompile.heads_order(first.detach(), seq_dim, n, site)
        for name in per_token:  # groups split as they are are never padded: padding needs no groups left
            wide = _padded(values[name], padded, head_dim) if values[name].shape[head_dim] == count else values[name]
            values[name] = _to_heads(wide, order, group_name, site, seq_dim, head_dim)
        for name in per_head:
            values[name] = _padded(values[name], padded, 0).narrow(0, rank * per, per)
        for name in gathered:
            values[name] = _gathered(values[name], order, group_name, site, n, seq_dim, head_dim)
        tokens = [values[name] for name in per_token]
        out = _core_call(lambda *ts: original(**{**values, **dict(zip(per_token, ts))}), *tokens)

        def back(t):
            if t is None:
                return None
            t = _to_sequence(t, order, group_name, site, seq_dim, head_dim)
            # a slice, as the known cores cut theirs (a narrow made here reads as a per-head parameter's)
            return t if padded == count else t[(slice(None),) * head_dim + (slice(None, count),)]

        if isinstance(out, (tuple, list)):
            return type(out)(back(t) for t in out)
        return back(out)

    return registered_core


_FORMS = {
    "gated_delta_rule": _gated_delta_rule_replacement,
    "mamba2_chunk_scan": _mamba2_chunk_scan_replacement,
    "selective_scan": _selective_scan_replacement,
    "rg_lru_scan": _rg_lru_scan_replacement,
    "wkv": _wkv_replacement,
    "lightning_layer": _lightning_layer_replacement,
}
