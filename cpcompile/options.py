"""The options of :func:`cpcompile.backend`, validated once and passed down to the pass as one frozen object."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal

from cpcompile.layouts import DEFAULT_BLOCK_SIZE

__all__ = [
    "ATTENTION_PATHS",
    "DUMP_DIR_ENV",
    "EXCHANGES",
    "INNER_COMPILERS",
    "MIXING_MODES",
    "REGION_MODES",
    "TOKEN_MIXING",
    "POSITION_MODES",
    "BackendOptions",
]

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
ATTENTION_PATHS = ("auto", "block", "dense", "flex", "flash_varlen")
POSITION_MODES = ("rewrite", "off")
MIXING_MODES = ("exact", "off")
REGION_MODES = ("found", "registered")
EXCHANGES = ("all_gather", "selective")
TOKEN_MIXING = ("required", "none")
#: Environment variable that turns on graph dumps (the default of ``BackendOptions.dump_dir``).
DUMP_DIR_ENV = "CPCOMPILE_DUMP_DIR"


def _env_dump_dir() -> str | None:
    return os.environ.get(DUMP_DIR_ENV) or None


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class BackendOptions:
    """Options of :func:`cpcompile.backend`."""

    #: Compiler the rewritten graph is handed to: ``inductor`` (default), ``aot_eager`` or ``eager``.
    inner: Literal["inductor", "aot_eager", "eager"] = "inductor"
    #: Keep only the local K/V between forward and backward and all-gather them again in backward:
    #: per attention call, (N-1)/N of the gathered K/V memory saved for one more all-gather of K and V.
    #: Off by default (communication is usually the scarcer resource). Honoured by inner compilers that
    #: partition with AOTAutograd (``inductor``, ``aot_eager``), at all-gathered sites (a halo or selective
    #: exchange keeps its receive buffer).
    regather_kv_in_backward: bool = False
    #: Folder where every rank writes ``rank{r}/graph{n}_before.py``, ``graph{n}_after.py`` and ``summary.json``
    #: as graphs compile (``r``: global rank; see :mod:`cpcompile.dump`). Default: ``$CPCOMPILE_DUMP_DIR``, else off.
    dump_dir: str | None = dataclasses.field(default_factory=_env_dump_dir)
    #: Attention emitted for every SDPA site. ``"auto"`` (default) and ``"block"``: ``cpcompile::cp_attention``'s
    #: loop in plain torch on every device, which computes only the not fully masked (query block, key block)
    #: pairs and never builds more than a block of the mask (with a CP group of size 1, ``"block"`` also
    #: replaces the model's SDPA). ``"dense"``: SDPA under the plan's whole ``[c, N*c]`` mask (the reference;
    #: memory grows with ``c x T``). ``"flex"`` and ``"flash_varlen"``: ``cp_attention`` through flex_attention
    #: or flash-attn's varlen kernel, CUDA only (``benchmarks/gpu_attention.py`` checks them on the GPU at hand).
    attention: Literal["auto", "block", "dense", "flex", "flash_varlen"] = "auto"
    #: Query and key block size of the block kernel, and the block the balanced layout counts work in.
    block_size: int = DEFAULT_BLOCK_SIZE
    #: Sliding-window sites receive only the keys their queries can see from other ranks (a halo of at most
    #: ``window - 1`` keys before each run of local tokens, :mod:`cpcompile.ops`) instead of all-gathering the
    #: whole sequence, when the halo is smaller than the all-gather. ``False``: all-gather at every site.
    halo: bool = True
    #: How full-attention sites get the keys of other ranks. ``"all_gather"`` (default): every rank's K/V, started
    #: as soon as K/V exist so the transfer overlaps the work before attention. ``"selective"``: only the keys
    #: its queries see on other ranks (:meth:`cpcompile.plan.CPPlan.keys_needed`: other documents and later
    #: tokens never travel), exchanged in one all-to-all when attention needs them, with only their gradients
    #: sent back in backward (:mod:`cpcompile.ops`). flex_attention sites take it too, routed by their
    #: ``mask_mod`` evaluated at global indices (:func:`cpcompile.ops.flex_routing`). Pair it with
    #: ``cpcompile.shard(..., workload=cpcompile.Workload(split_keys=True))`` so that the balanced layout keeps
    #: documents whole.
    exchange: Literal["all_gather", "selective"] = "all_gather"
    #: Key slots per rank of a selective exchange: the static size of the receive buffer (K and V each
    #: ``[B, H_kv, slots, D]``, kept for backward). ``None`` (default): ``(N - 1) * c``, the all-gather's, which
    #: every batch fits. A smaller bound keeps less memory; a batch where a rank needs more keys raises
    #: ``ValueError`` (every rank, before anything is sent).
    exchange_slots: int | None = None
    #: Positions the model computes from the local sequence length (``arange(T)``, ``table[:T]``; see
    #: :mod:`cpcompile.passes.positions`). ``"rewrite"`` (default): made global, or refused at compile time.
    #: ``"off"``: left as the model computes them, so every rank but the first gets the positions of tokens
    #: ``[0, c)``: silently wrong for such models; only for measuring what the rewrite changes.
    positions: Literal["rewrite", "off"] = "rewrite"
    #: Ops other than attention that mix tokens along the sequence (convolutions, cumulative sums, shifts,
    #: reductions; see :mod:`cpcompile.passes.mixing`). ``"exact"`` (default): causal ones run on the whole
    #: sequence, sums over tokens are checked to be partial sums of the loss, the rest is refused at compile time.
    #: ``"off"``: left as the model computes them, on this rank's tokens only: silently wrong for such models;
    #: only for measuring what the pass changes.
    mixing: Literal["exact", "off"] = "exact"
    #: Sequence mixers of the model's own code. ``"found"`` (default): a module-level function in which a pass
    #: refuses a sequence mixer's op (a scan, a product over the sequence, a token picked by its index, the local
    #: length used as a value) is classified and, when it is a causal map over some dim of its per-token
    #: arguments, run head-parallel as if it were registered (:mod:`cpcompile.regions`; Dynamo traces the frame up
    #: to twice more); otherwise the refusal stands, with the reason. ``"registered"``: only the known cores and
    #: those registered with :func:`cpcompile.cores.register_head_parallel` run head-parallel; the refusal names
    #: the registration.
    regions: Literal["found", "registered"] = "found"
    #: Whether the model mixes tokens. ``"required"`` (default): a :func:`cpcompile.shard` step that ran graphs of
    #: this backend and none of them held rewritten attention or another op made exact across ranks (a gathered
    #: causal region) raises :class:`~cpcompile.UnsupportedAttentionError` on every rank when the step ends,
    #: naming the graphs that ran: the model's attention ran outside the compiled graphs (a
    #: ``torch.compiler.disable`` function, a graph break around it) on this rank's tokens only. ``"none"``: the
    #: model truly has no token mixing (token-wise layers and a loss only), and such steps are exact.
    token_mixing: Literal["required", "none"] = "required"
    #: Custom ops (``"namespace::name"``) that compute every token's outputs from that token's inputs, added to
    #: :data:`cpcompile.passes.vocabulary.PER_TOKEN_OPS`. Any other custom op that takes sequence-sharded
    #: tensors is refused.
    per_token_ops: tuple[str, ...] = ()
    #: The model's transformers config (``model.config``), or ``None``. Gives every layer's sliding window
    #: (``sliding_window``, ``layer_types``), also where the mask is built outside the compiled graph, and
    #: lets the backend refuse a non-SDPA ``attn_implementation`` up front.
    config: object | None = None

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"inner={self.inner!r} is not a known inner compiler; choose one of {INNER_COMPILERS}")
        if self.regather_kv_in_backward and self.inner == "eager":
            raise ValueError(
                "regather_kv_in_backward=True needs an inner compiler that partitions forward and backward "
                "(inner='aot_eager' or 'inductor'); inner='eager' runs the graph as traced and would keep the gathered "
                "K/V anyway"
            )
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)) or not os.fspath(self.dump_dir):
                raise ValueError(f"dump_dir={self.dump_dir!r} must be a folder path (str or os.PathLike), or None")
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(
                f"attention={self.attention!r} is not a known attention path; choose one of {ATTENTION_PATHS}"
            )
        if self.positions not in POSITION_MODES:
            raise ValueError(f"positions={self.positions!r} is not a known mode; choose one of {POSITION_MODES}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r} is not a known exchange; choose one of {EXCHANGES}")
        if self.exchange_slots is not None and (
            not isinstance(self.exchange_slots, int) or isinstance(self.exchange_slots, bool) or self.exchange_slots < 1
        ):
            raise ValueError(
                f"exchange_slots={self.exchange_slots!r} must be a positive int (key slots per rank) or None (the "
                "all-gather's (N - 1) * c)"
            )
        if self.token_mixing not in TOKEN_MIXING:
            raise ValueError(
                f'token_mixing={self.token_mixing!r} is not a known mode; choose one of {TOKEN_MIXING} ("none" only '
                "for a model without attention or any other op that mixes tokens)"
            )
        if self.mixing not in MIXING_MODES:
            raise ValueError(f"mixing={self.mixing!r} is not a known mode; choose one of {MIXING_MODES}")
        if self.regions not in REGION_MODES:
            raise ValueError(f"regions={self.regions!r} is not a known mode; choose one of {REGION_MODES}")
        if isinstance(self.per_token_ops, str) or not isinstance(self.per_token_ops, (tuple, list)):
            raise TypeError(
                f"per_token_ops must be a tuple of 'namespace::name' strings, got {self.per_token_ops!r}; e.g. "
                'per_token_ops=("mylib::fused_norm",)'
            )
        bad = [op for op in self.per_token_ops if not isinstance(op, str) or op.count("::") != 1 or op.startswith("::")]
        if bad:
            raise ValueError(
                f"per_token_ops holds {bad!r}; every entry must name a custom op as 'namespace::name' (the name "
                'torch.library.custom_op was given), e.g. per_token_ops=("mylib::fused_norm",)'
            )
        from cpcompile.passes.vocabulary import attention_op_fix

        attention = [(op, attention_op_fix(op)) for op in self.per_token_ops if attention_op_fix(op) is not None]
        if attention:
            op, fix = attention[0]
            raise ValueError(
                f"per_token_ops lists {op!r}, an attention op: its outputs mix every token's keys and values, so "
                f"under context parallelism it cannot run on one rank's tokens; {fix}"
            )
        object.__setattr__(self, "per_token_ops", tuple(self.per_token_ops))
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be a positive int (e.g. 128)")
        if self.config is not None and not hasattr(self.config, "to_dict"):
            raise TypeError(
                f"config must be a transformers PretrainedConfig (model.config) or None, got "
                f"{type(self.config).__name__}"
            )
