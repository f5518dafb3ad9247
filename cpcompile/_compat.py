"""Every use of a private or version-dependent torch API lives here (torch >= 2.11 supported).

Each helper names the torch releases it was checked against.

Why one module of about 570 lines: a torch upgrade is checked by reading this file alone; splitting it would
scatter the private APIs the package depends on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as _fc
from torch._dynamo.exc import ShortenTraceback as _ShortenTraceback

__all__ = [
    "autograd_inside_custom_op",
    "vmap_inside_custom_op",
    "free_symbols",
    "is_higher_order_op",
    "is_module_state",
    "custom_op_name",
    "op_argument_names",
    "op_overload_name",
    "sym_expr",
    "sym_hint",
    "flex_attention_with_lse",
    "flex_block_mask",
    "FLEX_NO_TABLES_BLOCK",
    "flex_no_tables_mask",
    "is_sliced_block_mask",
    "trace_flex_attention_on_cpu",
    "SDPA_TARGETS",
    "FLEX_ATTENTION_TARGETS",
    "PassThroughCompileError",
    "all_gather_into",
    "all_gather_seq",
    "all_gather_start",
    "all_gather_wait",
    "pending_collectives",
    "fake_process_group",
    "flatten_mesh",
    "forbid_eager_fallback_on_recompile_limit",
    "group_name_of",
    "guard_equal",
    "group_timeout_s",
    "has_fake_tensor",
    "gloo_worker_threads",
    "new_gloo_backend",
    "register_backend_once",
    "is_comm_error",
    "is_peer_exit_error",
    "init_fake_process_group",
    "inline_in_graph",
    "inline_method",
    "INLINED",
    "inlined_in_graph",
    "is_non_member_group",
    "lookup_inner_backend",
    "mark_seq_dynamic",
    "NOTED",
    "NOTING",
    "OPAQUE",
    "Held",
    "note_traced",
    "node_module_class",
    "node_module_path",
    "replace_substitution",
    "resolve_group",
    "restart_trace",
    "must_recompute_meta",
    "statically_true",
    "structured_trace_enabled",
    "trace_artifact",
    "unset_fake_mode",
]

#: Callables under which Dynamo records ``F.scaled_dot_product_attention`` (torch 2.11-2.13: the C function).
SDPA_TARGETS = frozenset({torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention})


def _flex_targets() -> frozenset:
    targets = set()
    hop = getattr(getattr(torch.ops, "higher_order", None), "flex_attention", None)
    if hop is not None:
        targets.add(hop)
    try:
        from torch.nn.attention.flex_attention import flex_attention

        targets.add(flex_attention)
    except ImportError:  # pragma: no cover - torch without flex attention
        pass
    return frozenset(targets)


#: Callables under which ``flex_attention`` appears in Dynamo graphs (torch 2.11-2.13: the higher-order op).
FLEX_ATTENTION_TARGETS = _flex_targets()


def _tracing() -> bool:
    # torch 2.11-2.13: private helper telling whether functional collectives are being traced.
    return _fc._are_we_tracing()


def _all_gather_op():
    # torch 2.13: `_c10d_functional.all_gather_into_tensor` carries autograd (backward: sum reduce-scatter),
    # and inductor lowers it as a collective. torch 2.11-2.12: only `_c10d_functional_autograd` has autograd.
    # Prefer the first: inductor on torch 2.13 miscompiles the second (wrong results on CPU).
    name = "_c10d_functional::all_gather_into_tensor"
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, "Autograd"):
        return torch.ops._c10d_functional.all_gather_into_tensor
    return torch.ops._c10d_functional_autograd.all_gather_into_tensor


class PassThroughCompileError(_ShortenTraceback):
    """Base of errors a backend raises at compile time that must reach the user unchanged.

    Dynamo wraps any other exception a backend raises in ``torch._dynamo.exc.BackendCompilerFailed``, so
    ``except cpcompile.UnsupportedAttentionError`` would never match. Subclasses of ``ShortenTraceback`` are
    re-raised as they are (torch 2.13 ``OutputGraph.call_user_compiler``; inductor's ``TritonMissing`` relies on
    the same rule). Still a ``RuntimeError``.
    """

    def __init__(self, *args: object) -> None:
        super().__init__(*args, first_useful_frame=None)


def all_gather_start(t: torch.Tensor, cp_size: int, group_name: str) -> torch.Tensor:
    """Issue an all-gather of ``[B, H, c, D]`` ``t`` along the sequence dim; finish with :func:`all_gather_wait`.

    Split in two so that a graph can issue the collective as soon as ``t`` exists and wait only where the
    result is used, leaving the work in between to overlap with the transfer. Autograd: the backward of the
    pair is a sum reduce-scatter (``wait_tensor`` passes the gradient through).
    """
    seq_first = t.permute(2, 0, 1, 3).contiguous()  # [c, B, H, D]: chunks concatenate along dim 0
    out = _all_gather_op()(seq_first, cp_size, group_name)
    # Traced (AOTAutograd), the wait is an explicit node; eagerly, an AsyncCollectiveTensor waits on first use.
    return out if _tracing() else _fc._maybe_wrap_tensor(out)


def all_gather_wait(started: torch.Tensor) -> torch.Tensor:
    """Wait for :func:`all_gather_start` and return the gathered ``[B, H, N*c, D]`` tensor (a view)."""
    if _tracing():
        started = torch.ops._c10d_functional.wait_tensor(started)
    return started.permute(1, 2, 0, 3)


def all_gather_seq(t: torch.Tensor, dim: int, cp_size: int, group_name: str) -> torch.Tensor:
    """All-gather ``t`` along ``dim`` over the group: every rank's chunk, rank-major (``cp_size * t.shape[dim]``).

    The functional all-gather of :func:`all_gather_start` (its autograd: a sum reduce-scatter in backward), for a
    tensor of any rank, waited for at once.
    """
    moved = t.movedim(dim, 0).contiguous()
    out = _all_gather_op()(moved, cp_size, group_name)
    out = torch.ops._c10d_functional.wait_tensor(out) if _tracing() else _fc._maybe_wrap_tensor(out)
    return out.movedim(0, dim)


def pending_collectives() -> int:
    """How many functional collectives of this process were issued and not yet waited for (torch 2.11-2.13: the
    private ``_get_work_registry_size`` of c10d's work registry, the count behind the "unwaited collective calls"
    warning at exit)."""
    return torch._C._distributed_c10d._get_work_registry_size()


def all_gather_into(out: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Eager all-gather of contiguous ``t`` into ``out`` along dim 0.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` (the old name warns); 2.11-2.12
    only have the old name.
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, t, group=group)


def group_name_of(group: dist.ProcessGroup) -> str:
    """The registered name of a process group (torch 2.11-2.13: ``ProcessGroup.group_name``)."""
    return group.group_name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """The process group registered in this process under ``name`` (:func:`group_name_of`), or ``None``.

    torch 2.11-2.13: ``distributed_c10d._resolve_process_group`` (private; raises ``RuntimeError`` for an unknown
    name).
    """
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return _resolve_process_group(name)
    except RuntimeError:
        return None


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout, in seconds, of the collectives of ``group`` (what ``new_group(timeout=)`` or
    ``ProcessGroup.set_timeout`` set; ``new_group``'s default is 30 min for gloo, 10 min for NCCL).

    Read from the backend's options (torch 2.11-2.13: ``ProcessGroup._get_backend(device).options._timeout``,
    private); ``torch.distributed.default_pg_timeout`` where no backend exposes it.
    """
    for device in ("cpu", "cuda"):
        try:
            timeout = group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
        return timeout.total_seconds()
    return dist.default_pg_timeout.total_seconds()


def has_fake_tensor(values) -> bool:
    """Whether any of ``values`` is a fake tensor: a compiled graph run at compile time, not in a step (torch
    2.11-2.13: ``torch._subclasses.fake_tensor.FakeTensor``, private; Dynamo's DDPOptimizer runs each compiled
    bucket of a graph it split on fake inputs, to trace the next bucket)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(v, FakeTensor) for v in values)


def register_backend_once(name: str, creator, devices: list[str]) -> None:
    """Register ``creator`` as torch.distributed backend ``name`` (extended API: it gets the group's
    ``_DistributedBackendOptions``) unless this process already did (torch 2.11-2.13: ``Backend._plugins``, private,
    holds the registered ones; registering a name twice raises)."""
    if name.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(name, creator, extended_api=True, devices=devices)


def new_gloo_backend(opts, threads: int) -> dist.ProcessGroupGloo:
    """The gloo backend of a group being created, running its collectives on ``threads`` worker threads; ``opts``
    is what a registered backend's creator gets (torch 2.11-2.13: ``ProcessGroupGloo._Options``, private, with
    ``_threads``, ``_timeout`` and ``_devices``; stock gloo groups get 2 threads and ``new_group`` drops any
    ``pg_options`` passed for gloo)."""
    options = dist.ProcessGroupGloo._Options()
    options._threads = threads
    options._timeout = opts.timeout
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options.global_ranks_in_group = list(opts.global_ranks_in_group)
    options.group_name = opts.group_id
    return dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, options)


def gloo_worker_threads(group: dist.ProcessGroup) -> int | None:
    """How many worker threads run ``group``'s CPU collectives on gloo, or ``None`` when gloo does not run them
    (torch 2.11-2.13: ``ProcessGroup._get_backend(device).options._threads``, private)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    if not isinstance(backend, dist.ProcessGroupGloo):
        return None
    return int(backend.options._threads)


#: Fragments of the messages of a failed collective (checked on torch 2.13, gloo: a peer's connection closed,
#: an operation timed out; NCCL raises ``torch.distributed.DistBackendError``).
_COMM_ERROR_MARKERS = (
    "Connection closed by peer",
    "timeout caused pair closure",
    "Connection reset by peer",
    "Timed out waiting",
    "Operation timed out",
    "gloo/transport",
    "NCCL error",
)


def is_comm_error(exc: BaseException) -> bool:
    """True when ``exc`` comes from a collective that failed (a peer died, or the collective timed out).

    torch 2.13: ``torch.distributed.DistError`` and its subclasses (NCCL, store and network errors); gloo raises a
    plain ``RuntimeError``: "[.../gloo/transport/tcp/pair.cc] Connection closed by peer" when a peer's
    process exits; on its collective timeout either "[.../unbound_buffer.cc] Timed out waiting ...ms" or
    "Application timeout caused pair closure" (both seen on the same test, depending on timing).
    """
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _COMM_ERROR_MARKERS)


def is_peer_exit_error(message: str) -> bool:
    """True for the message of a collective that failed because a peer's process exited (torch 2.13, gloo:
    "Connection closed by peer" or "Connection reset by peer", seen within about 1 s of a ``SIGKILL``)."""
    return "Connection closed by peer" in message or "Connection reset by peer" in message


def unset_fake_mode():
    """A context in which tensors are real, also inside a backend call (torch 2.11-2.13:
    ``torch._subclasses.fake_tensor.unset_fake_temporarily``, private)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Initialise a default process group of the "fake" backend: one process acts as ``rank`` of ``world_size``.

    No collective moves data (outputs are left as they are), so it only suits tests that compile graphs or
    check errors raised before any result is used. The backend is registered by a private testing module
    (torch 2.11-2.13: ``torch.testing._internal.distributed.fake_pg``).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def is_non_member_group(group: object) -> bool:
    """True for the value ``new_group`` returns on ranks outside the group (torch 2.11-2.13: the int ``-100``
    ``GroupMember.NON_GROUP_MEMBER``)."""
    sentinel = getattr(dist.GroupMember, "NON_GROUP_MEMBER", None)
    return sentinel is not None and type(group) is type(sentinel) and group == sentinel


def lookup_inner_backend(name: str):
    """The compiler function registered under ``name`` (torch 2.11-2.13: ``torch._dynamo.backends.registry``)."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def node_module_path(node: torch.fx.Node) -> str:
    """The qualified module path of the module that made ``node`` (Dynamo's ``nn_module_stack`` metadata).

    Dynamo names modules like ``L['self'].model.layers[0].self_attn`` (``torch.compile(fn)``) or
    ``L['args'][0].model.layers[0].self_attn`` (``torch.compile(module)`` in torch 2.13, which traces the
    module as the first argument of its call); both give ``model.layers.0.self_attn``.
    Returns ``""`` when the node carries no module stack.
    """
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return _clean_module_path(str(path))


def node_module_class(node: torch.fx.Node) -> str:
    """The qualified class name (``transformers.models.llama.modeling_llama.LlamaAttention``) of the module that
    made ``node``, from Dynamo's ``nn_module_stack`` (torch 2.11-2.13: ``(path, class)`` pairs), or ``""``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    _path, cls = list(stack.values())[-1]
    if isinstance(cls, type):
        return f"{cls.__module__}.{cls.__qualname__}"
    return str(cls)


def _clean_module_path(path: str) -> str:
    import re

    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    path = re.sub(r"^L\['self'\]\.?|^L\['args'\]\[0\]\.?", "", path)
    path = re.sub(r"^L\['([^']+)'\]", r"\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.lstrip(".")


def must_recompute_meta() -> dict:
    """Node metadata that makes AOTAutograd's partitioner recompute a node in backward instead of saving its
    output (torch 2.11-2.13: ``CheckpointPolicy`` tags, copied onto traced nodes via ``_COPY_META_FIELDS``)."""
    from torch.utils.checkpoint import CheckpointPolicy

    return {"recompute": CheckpointPolicy.MUST_RECOMPUTE, "ac_graph_id": 0}


#: The per-frame recompile limit under CP: enough for the variants an RL step compiles legitimately (each model
#: instance, FSDP2 giving every wrapped instance a class of its own; grad and no-grad; train and eval; a first
#: and a dynamic length), which Dynamo's default of 8 turns into a hard failure once fallback is forbidden.
RECOMPILE_LIMIT_UNDER_CP = 64


def forbid_eager_fallback_on_recompile_limit() -> None:
    """Make Dynamo raise instead of running a frame uncompiled once its recompile limit is hit, and raise that
    limit to :data:`RECOMPILE_LIMIT_UNDER_CP` (a larger limit the user set is kept).

    An uncompiled frame would run attention on the local chunk only: silently wrong under CP (or a hang when
    only some ranks fall back). torch 2.11-2.13: ``torch._dynamo.config.fail_on_recompile_limit_hit`` and
    ``recompile_limit``.
    """
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT_UNDER_CP)


def statically_true(expr: object) -> bool:
    """True when a (possibly symbolic) boolean is known true without adding a guard (torch 2.11-2.13)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(expr))


def guard_equal(a: object, b: object) -> bool:
    """Make the graph being compiled serve only calls in which the sizes ``a`` and ``b`` (ints or SymInts of its
    inputs' shapes) are equal, when they are equal at this compilation: a shape guard ``a == b`` (a call where
    they differ recompiles). True when the equality holds from now on for every call of the graph; False when no
    guard can say so: the sizes differ here, a size has no value here (unbacked), or the shape env defers such
    checks to run time instead of guarding (export) or takes no more guards (frozen).

    Must run while the backend compiles: Dynamo turns the shape env's guards into the graph's guards after the
    backend returns. torch 2.11-2.13: ``torch._check`` of a SymBool over backed symbols adds a guard
    (``SymNode.expect_true`` -> ``guard_bool``); ``ShapeEnv.prefer_deferred_runtime_asserts_over_guards`` and
    ``ShapeEnv.frozen``; ``free_unbacked_symbols``.
    """
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    if statically_true(a == b):
        return True
    sym = next((x for x in (a, b) if isinstance(x, torch.SymInt)), None)
    if sym is None or sym_hint(a) is None or sym_hint(a) != sym_hint(b):
        return False
    if free_unbacked_symbols(a) or free_unbacked_symbols(b):
        return False
    env = sym.node.shape_env
    if env is None or env.prefer_deferred_runtime_asserts_over_guards or getattr(env, "frozen", False):
        return False
    torch._check(a == b)
    return statically_true(a == b)


def in_backward() -> bool:
    """Whether the calling code runs inside the autograd engine's backward pass (an op recomputed there for the
    backward: ``regather_kv_in_backward``). torch 2.11-2.13: ``torch._C._current_graph_task_id()`` is -1 outside."""
    return torch._C._current_graph_task_id() != -1


def current_shape_env():
    """The ``ShapeEnv`` of the frame Dynamo is compiling, or ``None`` outside a compilation (torch 2.11-2.13:
    ``TracingContext.try_get().fake_mode.shape_env``)."""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    return None if ctx is None or ctx.fake_mode is None else ctx.fake_mode.shape_env


def at_trace_time(fn) -> None:
    """Call ``fn(ctx)`` while Dynamo traces this line (``torch._dynamo.comptime``; ``fn`` a module-level function:
    Dynamo cannot call a closure made while tracing); nothing enters the graph."""
    from torch._dynamo.comptime import comptime

    comptime(fn)


def shape_guards() -> list[tuple[object, str]]:
    """The shape guards recorded so far for the frame Dynamo is compiling, as ``(sympy boolean, the model's source
    line or "")``: every decision the traced code took on a dynamic size (``if T > 24:`` not taken is ``T <= 24``).
    Empty outside a compilation. torch 2.11-2.13: ``TracingContext.try_get().fake_mode.shape_env.guards`` of
    ``ShapeGuard(expr, sloc, ...)``, ``sloc.maybe_user_loc`` (the source text, ``# file:line in function``)."""
    env = current_shape_env()
    if env is None:
        return []
    return [(g.expr, getattr(g.sloc, "maybe_user_loc", None) or "") for g in env.guards]


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[dist.ProcessGroup]:
    """A default process group of ``world_size`` in which this one process is ``rank``; no communication.

    Collectives on it return without moving data, so one process can trace what rank ``rank`` of a CP
    group would compile. Uses the ``"fake"`` backend and ``FakeStore`` from
    ``torch.testing._internal.distributed.fake_pg`` (private; torch 2.11-2.13). The group is destroyed on exit.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "a default torch.distributed process group is already initialized in this process; cpcompile "
            "inspect traces every rank in one process with its own fake group, so run it in a separate "
            "process (the `cpcompile inspect` command), or use the backend's dump_dir option inside training"
        )
    init_fake_process_group(rank, world_size)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def flatten_mesh(mesh, name: str):
    """The 1-D mesh over all ranks of the (sub)mesh ``mesh``, registered on its root mesh as ``name``.

    torch 2.11-2.13: ``DeviceMesh._flatten`` (private; creates the flattened process group once, later calls
    return the cached mesh, and ``root_mesh[name]`` finds it).
    """
    return mesh._flatten(name)


def autograd_inside_custom_op():
    """A context manager that re-enables autograd inside a ``torch.library.custom_op`` implementation.

    A custom op's implementation runs with the autograd dispatch keys excluded (torch 2.11-2.13), so
    ``torch.autograd.grad`` there fails with "does not require grad". Used by the CUDA attention path to
    recompute flex_attention's forward under autograd in the op's backward. Checked on torch 2.13 (CPU).
    """
    import contextlib

    keys = torch._C.DispatchKey
    stack = contextlib.ExitStack()
    stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(keys.AutogradFunctionality, False))
    stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(keys.ADInplaceOrView, False))
    stack.enter_context(torch.enable_grad())
    return stack


def vmap_inside_custom_op():
    """A context manager that re-enables ``torch.vmap`` inside a ``torch.library.custom_op`` implementation.

    Called from a compiled graph (aot_eager, inductor), a custom op's implementation runs with functorch's
    dispatch keys excluded (torch 2.13), and ``vmap`` then fails with "NYI: querying is_contiguous inside of
    vmap". The flex kernel vmaps the model's mask_mod/score_mod over blocks, as flex itself does. Checked on
    torch 2.13 (CPU).
    """
    keys = torch._C.DispatchKey
    stack = contextlib.ExitStack()
    for name in (
        "FuncTorchDynamicLayerFrontMode",
        "FuncTorchDynamicLayerBackMode",
        "FuncTorchBatched",
        "FuncTorchVmapMode",
        "PythonTLSSnapshot",
    ):
        stack.enter_context(torch._C._SetExcludeDispatchKeyGuard(getattr(keys, name), False))
    return stack


def flex_attention_with_lse(q, k, v, block_mask, scale, enable_gqa):
    """``flex_attention(..., return_lse=True)`` -> ``(out, lse)``, compiled once per process.

    torch 2.11-2.13 accept ``return_lse=True`` (newer releases prefer ``return_aux=AuxRequest(lse=True)``).
    flex_attention is only efficient (and on CUDA only supports backward) when compiled. Compiled with automatic
    dynamic shapes (``dynamic=None``): a second chunk length recompiles once with symbolic lengths, later ones
    reuse it (``dynamic=False`` recompiled for every length and hit the recompile limit).
    """
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = torch.compile(flex_attention, dynamic=None)
    return _compiled_flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=True)


_compiled_flex = None


def trace_flex_attention_on_cpu() -> None:
    """Let Dynamo trace ``flex_attention`` on CPU when its inputs require grad (idempotent, process-wide).

    torch 2.11-2.13: ``flex_attention``'s private ``_validate_device`` raises "FlexAttention does not support
    backward on CPU" for such inputs; under Dynamo that makes the whole frame fall back to eager (a graph
    break Dynamo cannot resume from), so a training step on CPU never reaches a backend. The replacement skips
    that refusal only while Dynamo traces (``torch.compiler.is_compiling()``): cpcompile's flex pass replaces
    every flex call of the graphs it compiles by its own kernel. Eager calls keep the check.
    """
    from torch.nn.attention import flex_attention as module

    original = module._validate_device
    if getattr(original, "_cpcompile", False):
        return

    def _validate_device(query, key, value):
        if torch.compiler.is_compiling() and query.device.type == "cpu":
            return None
        return original(query, key, value)

    _validate_device._cpcompile = True
    module._validate_device = _validate_device


def flex_block_mask(mask_mod, batch_size: int, q_len: int, kv_len: int, device):
    """``create_block_mask`` without materialising the ``[q_len, kv_len]`` mask (``_compile=True``, a private
    keyword of torch 2.11-2.13)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(mask_mod, batch_size, None, q_len, kv_len, device=device, _compile=True)


#: Block size of a BlockMask without block tables (one block as long as any sequence): what flex makes when a call
#: passes no BlockMask, and a size flex checks no sequence length against. torch 2.11-2.13:
#: ``flex_attention._LARGE_SPARSE_BLOCK_SIZE``.
FLEX_NO_TABLES_BLOCK = 1 << 30


def flex_no_tables_mask(mask_mod, rows: int, heads: int, device):
    """A BlockMask of ``mask_mod`` for ``rows`` x ``heads`` over one block of :data:`FLEX_NO_TABLES_BLOCK`
    tokens, with the lengths flex's own table-less mask has (``seq_lengths=(1, 1)``), so that no guard ties it to
    the length of the queries it is used with."""
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(
        kv_num_blocks=torch.ones((rows, heads, 1), dtype=torch.int32, device=device),
        kv_indices=torch.zeros((rows, heads, 1, 1), dtype=torch.int32, device=device),
        BLOCK_SIZE=FLEX_NO_TABLES_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(1, 1),
    )


def is_sliced_block_mask(mask) -> bool:
    """Whether ``mask`` was sliced (``block_mask[...]``), which drops its mask_mod. torch 2.13: the mask_mod is
    then the private ``flex_attention._sliced_mask_mod_error``."""
    from torch.nn.attention import flex_attention

    sliced = getattr(flex_attention, "_sliced_mask_mod_error", None)
    return sliced is not None and mask.mask_mod is sliced


def mark_seq_dynamic(t: torch.Tensor, dim: int = 1) -> None:
    """Ask Dynamo to compile ``t``'s ``dim`` as a symbolic size from the first compile on.

    torch 2.11-2.13: ``torch._dynamo.maybe_mark_dynamic`` (a hint, not a constraint: no error if the graph
    specialises the size).
    """
    torch._dynamo.maybe_mark_dynamic(t, dim)


def structured_trace_enabled() -> bool:
    """Whether torch's structured trace log (``TORCH_TRACE=dir``, read by ``tlparse``) is being written.

    torch 2.11-2.13: ``torch._logging._internal.trace_log`` gets a handler only when the trace is on.
    """
    from torch._logging._internal import trace_log

    return bool(trace_log.handlers)


def trace_artifact(name: str, encoding: str, payload_fn) -> None:
    """Write an artifact named ``name`` to the structured trace (a no-op when it is off).

    ``encoding``: ``"string"`` (``payload_fn`` returns text) or ``"json"`` (it returns a JSON-ready object).
    Inside a compilation the record carries Dynamo's compile id, so ``tlparse`` lists it under that frame.
    torch 2.11-2.13: ``torch._logging.trace_structured("artifact", ...)`` (a private module).
    """
    torch._logging.trace_structured(
        "artifact", metadata_fn=lambda: {"name": name, "encoding": encoding}, payload_fn=payload_fn
    )


def free_symbols(value: object) -> frozenset:
    """The sympy symbols a SymInt/SymFloat/SymBool, a tensor's sizes or a nest of them depend on (``frozenset()``
    for plain values). torch 2.11-2.13: ``torch.fx.experimental.symbolic_shapes.free_symbols``."""
    from torch.fx.experimental.symbolic_shapes import free_symbols as _free_symbols

    if not isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, torch.Tensor, list, tuple)):
        return frozenset()
    return frozenset(_free_symbols(value))


def sym_hint(value: object) -> int | None:
    """The concrete value a SymInt had when the graph was traced (an int is its own hint; ``None`` when unknown).
    torch 2.11-2.13: ``torch.fx.experimental.symbolic_shapes.optimization_hint``."""
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, torch.SymInt):
        return None
    try:
        return int(optimization_hint(value))
    except Exception:  # noqa: BLE001 - an unbacked or hint-less symbol has no hint
        return None


def is_module_state(node: torch.fx.Node) -> bool:
    """True for a Dynamo graph input that is a parameter or buffer of an ``nn.Module`` (not a value passed by the
    caller). torch 2.11-2.13 (``inline_inbuilt_nn_modules``) lifts module state into placeholders and records
    ``_dynamo_static_input_type`` in their ``tensor_dict`` metadata; a ``Parameter`` example value is state too."""
    if node.op == "get_attr":
        return True
    if node.op != "placeholder":
        return False
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.nn.Parameter):
        return True
    return "_dynamo_static_input_type" in (node.meta.get("tensor_dict") or {})


def is_higher_order_op(target: object) -> bool:
    """True for a higher-order operator (a call of a nested graph, e.g. activation checkpointing's
    ``tag_activation_checkpoint``). torch 2.11-2.13: ``torch._ops.HigherOrderOperator``."""
    return isinstance(target, torch._ops.HigherOrderOperator)


def sym_expr(value: object) -> object:
    """The sympy expression of a SymInt/SymFloat/SymBool (torch 2.11-2.13: ``SymNode.expr``); other values as
    they are."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value.node.expr
    return value


def op_overload_name(target: object) -> str | None:
    """The operator name of an ``OpOverload`` graph target (``aten::index_select.default`` -> ``index_select``),
    else ``None``. torch 2.11-2.13: ``torch._ops.OpOverload`` and its ``_schema``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return None


def custom_op_name(target: object) -> str | None:
    """``"namespace::name"`` of an ``OpOverload`` or ``OpOverloadPacket`` graph target (``torch.ops.ns.name``),
    else ``None``. torch 2.11-2.13: ``torch._ops.OpOverload(Packet)``, ``_schema.name`` / ``_qualified_op_name``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def op_argument_names(target: object, namespace: str) -> tuple[str, ...] | None:
    """The argument names of an ``OpOverload`` graph target of ``namespace`` (e.g. a ``cpcompile::`` custom op),
    else ``None``. torch 2.11-2.13: ``OpOverload.namespace`` and ``_schema.arguments``."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == namespace:
        return tuple(a.name for a in target._schema.arguments)
    return None


def substituted_in_graph(fn: object) -> bool:
    """Whether Dynamo already traces a replacement for ``fn`` (``torch.compiler.substitute_in_graph`` ran for it in
    this process: a second registration raises)."""
    from torch._dynamo.variables import PolyfilledFunctionVariable

    return fn in PolyfilledFunctionVariable._get_polyfill_handlers()


def replace_substitution(fn: object, replacement: object) -> None:
    """Make Dynamo trace ``replacement`` for ``fn`` instead of the one ``torch.compiler.substitute_in_graph`` gave
    it. torch 2.13: the handler Dynamo finds for ``fn`` keeps the traced function in ``__torch_dynamo_polyfill__``
    and reads it each time it traces a call (a second ``substitute_in_graph`` raises)."""
    from torch._dynamo.variables import PolyfilledFunctionVariable

    PolyfilledFunctionVariable._get_polyfill_handlers()[fn].__torch_dynamo_polyfill__ = replacement


#: What :func:`note_traced` saw while Dynamo traced: ``key -> [{name: graph node, constant or OPAQUE}, ...]``, one
#: dict per traced call.
NOTED: dict[str, list[dict[str, object]]] = {}
#: What :func:`note_traced` notes for a value that is neither a tensor, a module nor a constant.
OPAQUE = object()


@dataclasses.dataclass(frozen=True)
class Held:
    """What :func:`note_traced` notes for an ``nn.Module`` (a method's ``self``): the module itself."""

    value: object


#: The keys :func:`note_traced` notes values for (any other key: nothing is kept).
NOTING: set[str] = set()


def note_traced(key: str, first: bool, name: str, value: object) -> None:
    """While Dynamo traces the caller (a replacement given to ``torch.compiler.substitute_in_graph``) and ``key``
    is in :data:`NOTING`, enter ``value`` in ``NOTED[key][-1][name]`` (``first``: in a new dict, for a new call):
    its graph node (a tensor), its value (a constant), :class:`Held` (a module) or :data:`OPAQUE` (anything
    else). Eagerly it does nothing.
    torch 2.13: ``torch._dynamo.comptime`` runs a function while tracing, with the tracer's view of the caller's
    locals; the function may have no free variables."""
    if torch.compiler.is_compiling():
        from torch._dynamo.comptime import comptime

        comptime(_note_local)


def _note_local(ctx) -> None:
    key = ctx.get_local("key").as_python_constant()
    if key not in NOTING:
        return
    name = ctx.get_local("name").as_python_constant()
    var = ctx.get_local("value")
    if var.is_python_constant():
        noted = var.as_python_constant()
    elif var.is_proxy() and isinstance(var.as_proxy(), torch.fx.Proxy):
        noted = var.as_proxy().node
    else:
        value = getattr(var._i_will_not_complain_if_bc_breaks_VariableTracker(), "value", None)
        noted = Held(value) if isinstance(value, torch.nn.Module) else OPAQUE
    calls = NOTED.setdefault(key, [])
    if ctx.get_local("first").as_python_constant() or not calls:
        calls.append({})
    calls[-1][name] = noted


def restart_trace(reason: str) -> None:
    """Make Dynamo trace the frame it is compiling again from its start (a backend calls this after it changed
    what Dynamo traces, e.g. with :func:`replace_substitution`); return without doing anything when no frame is
    being traced (the backend was called directly). torch 2.13: a backend's ``TensorifyScalarRestartAnalysis``
    reaches ``convert_frame``, which traces the frame again, after the speculation log of the first trace is
    cleared (else the second trace, which takes another path, is refused as a divergence)."""
    from torch._dynamo import exc
    from torch._dynamo.symbolic_convert import InstructionTranslator

    try:
        tx = InstructionTranslator.current_tx()
    except (AssertionError, AttributeError, IndexError):
        return
    if tx is None:
        return
    tx.speculation_log.clear()
    raise exc.TensorifyScalarRestartAnalysis(restart_reason=reason)


def inline_in_graph(fn: object, replacement: object) -> None:
    """Make Dynamo trace ``replacement`` wherever it would inline ``fn``, a function defined in a class and called
    as a method (``self.fn(...)``). torch 2.13: Dynamo does not consult ``torch.compiler.substitute_in_graph``'s
    handlers for a bound method (``UserMethodVariable`` inlines its function), but when it resolves a function
    found on an object's type it follows the function's ``_torchdynamo_inline`` attribute (what torch.jit and
    torch.compile's own wrappers set). Eager calls of ``fn`` and the class are unchanged."""
    fn._torchdynamo_inline = replacement  # type: ignore[attr-defined]


#: ``key -> replacement`` of each method given one by :func:`inline_method`.
INLINED: dict[str, object] = {}


def inline_method(fn: object, key: str, replacement: object | None) -> None:
    """:func:`inline_in_graph` for a ``replacement`` that may be a closure (``None``: take the replacement away).
    torch 2.13: Dynamo reads a function it follows from ``_torchdynamo_inline`` through the source of ``fn`` (its
    class's dict), so a guard on a closure cell of the replacement names ``fn.__closure__``, which ``fn`` does not
    have, and building the guards fails. ``fn`` is given a function of this module without a closure that calls
    ``INLINED[key]``: Dynamo reaches the replacement through this module's global."""
    if replacement is None:
        INLINED.pop(key, None)
        if "_torchdynamo_inline" in vars(fn):
            del fn._torchdynamo_inline  # type: ignore[attr-defined]
        return
    INLINED[key] = replacement
    namespace: dict[str, object] = {}
    exec(f"def inlined(*args, **kwargs):\n    return INLINED[{key!r}](*args, **kwargs)\n", globals(), namespace)
    inline_in_graph(fn, namespace["inlined"])


def inlined_in_graph(fn: object) -> bool:
    """Whether :func:`inline_in_graph` (or torch) already gave ``fn`` a replacement for Dynamo."""
    return hasattr(fn, "_torchdynamo_inline")
