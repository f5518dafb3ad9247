"""``cpcompile.backend``: the torch.compile backend that makes a model context-parallel."""

from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Literal

import torch
import torch.distributed as dist
import torch.fx as fx

from cpcompile import _compat, dump
from cpcompile.passes.positions import PositionReport, positions_pass
from cpcompile.passes.sdpa_cp import SiteReport, cp_attention_pass
from cpcompile.runtime import check_group, current_plan

__all__ = ["BackendOptions", "CPBackend", "backend"]

_INNER = ("inductor", "aot_eager", "eager")
_ATTENTION = ("auto", "dense", "block")
_POSITIONS = ("rewrite", "off")
#: Environment variable that turns on graph dumps (the default of ``BackendOptions.dump_dir``).
DUMP_DIR_ENV = "CPCOMPILE_DUMP_DIR"


def _env_dump_dir() -> str | None:
    return os.environ.get(DUMP_DIR_ENV) or None


_backend_ids = itertools.count()


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class BackendOptions:
    """Options of :func:`backend`."""

    #: Compiler the rewritten graph is handed to: ``inductor`` (default), ``aot_eager`` or ``eager``.
    inner: Literal["inductor", "aot_eager", "eager"] = "inductor"
    #: Keep only the local K/V between forward and backward and all-gather them again in backward:
    #: per attention call, (N-1)/N of the gathered K/V memory saved for one more all-gather of K and V.
    #: Off by default (communication is usually the scarcer resource). Honoured by inner compilers that
    #: partition with AOTAutograd (``inductor``, ``aot_eager``).
    regather_kv_in_backward: bool = False
    #: Folder where every rank writes ``rank{r}/graph{n}_before.py``, ``graph{n}_after.py`` and ``summary.json``
    #: as graphs compile (``r``: global rank; see :mod:`cpcompile.dump`). Default: ``$CPCOMPILE_DUMP_DIR``, else off.
    dump_dir: str | None = dataclasses.field(default_factory=_env_dump_dir)
    #: Attention emitted for every SDPA site. ``"dense"``: SDPA under the plan's whole ``[c, N*c]`` mask (the
    #: reference). ``"block"``: ``cpcompile::cp_attention``, which computes only the not fully masked
    #: (query block, key block) pairs and never builds more than a block of the mask; with a CP group of size 1
    #: it also replaces the model's SDPA. ``"auto"``: ``"block"`` for CPU tensors, where it is exact, faster and
    #: bounds memory (BENCHMARKS.md), and ``"dense"`` elsewhere until the CUDA block path (flex_attention,
    #: flash-attn varlen) has been validated on a GPU.
    attention: Literal["auto", "dense", "block"] = "auto"
    #: Query and key block size of the block kernel (CPU).
    block_size: int = 128
    #: The model's transformers config (``model.config``), or ``None``. Gives every layer's sliding window
    #: (``sliding_window``, ``layer_types``), also where the mask is built outside the compiled graph, and
    #: lets the backend refuse a non-SDPA ``attn_implementation`` up front.
    config: object | None = None
    #: Positions the model computes from the local sequence length (``arange(T)``, ``table[:T]``; see
    #: :mod:`cpcompile.passes.positions`). ``"rewrite"`` (default): made global, or refused at compile time.
    #: ``"off"``: left as the model computes them, so every rank but the first gets the positions of tokens
    #: ``[0, c)``: silently wrong for such models; only for measuring what the rewrite changes.
    positions: Literal["rewrite", "off"] = "rewrite"

    def __post_init__(self) -> None:
        if self.inner not in _INNER:
            raise ValueError(f"inner={self.inner!r} is not a known inner compiler; choose one of {_INNER}")
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)) or not os.fspath(self.dump_dir):
                raise ValueError(f"dump_dir={self.dump_dir!r} must be a folder path (str or os.PathLike), or None")
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
        if self.attention not in _ATTENTION:
            raise ValueError(f"attention={self.attention!r} is not a known attention path; choose one of {_ATTENTION}")
        if not isinstance(self.block_size, int) or isinstance(self.block_size, bool) or self.block_size < 1:
            raise ValueError(f"block_size={self.block_size!r} must be a positive int (e.g. 128)")
        if self.positions not in _POSITIONS:
            raise ValueError(f"positions={self.positions!r} is not a known mode; choose one of {_POSITIONS}")
        if self.config is not None and not hasattr(self.config, "to_dict"):
            raise TypeError(
                f"config must be a transformers PretrainedConfig (model.config) or None, got "
                f"{type(self.config).__name__}"
            )


class CPBackend:
    """A ``(GraphModule, example_inputs) -> callable`` compiler; build it with :func:`backend`.

    Every Dynamo graph goes through :func:`cpcompile.passes.cp_attention_pass`,
    :func:`cpcompile.passes.positions_pass` (CP > 1) and then the inner compiler. ``reports`` lists what was done with
    every SDPA site of every graph compiled so far, ``position_reports`` with every position source.
    """

    def __init__(self, cp_group: dist.ProcessGroup, options: BackendOptions) -> None:
        self.cp_size, _, self.group_name = check_group(cp_group)
        self.cp_group = cp_group
        self.cp_rank = dist.get_rank(cp_group)
        if self.cp_size > 1:
            _compat.forbid_eager_fallback_on_recompile_limit()
        self.options = options
        self.reports: list[SiteReport] = []
        self.position_reports: list[PositionReport] = []
        self._id = next(_backend_ids)
        self._graphs = itertools.count()
        self._dump = (
            None if options.dump_dir is None else dump.writer_for(options.dump_dir, dist.get_rank(), self.cp_size)
        )

    def __deepcopy__(self, memo: dict) -> CPBackend:
        """The backend itself: it is a handle on a process group and on the reports of what it compiled.

        Wrappers that deep-copy ``torch.compile``'s arguments (Lightning's, which litgpt imports) would otherwise
        fail on the process group (``TypeError: cannot pickle 'ProcessGroup'``).
        """
        return self

    def __call__(self, gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
        graph_id = next(self._graphs)
        if self._dump is not None:
            title = f"rank {self._dump.rank}, backend {self._id}, graph {graph_id}"
            before, grad_flags = dump.graph_source(gm, f"{title}: as Dynamo traced it"), dump.site_grad_flags(gm)
        reports = cp_attention_pass(
            gm,
            group_name=self.group_name,
            cp_size=self.cp_size,
            graph_id=graph_id,
            site_prefix=f"backend{self._id}/graph{graph_id}",
            regather_kv=self.options.regather_kv_in_backward,
            attention=self.options.attention,
            cp_rank=self.cp_rank,
            block_size=self.options.block_size,
            config=self.options.config,
        )
        self.reports += reports
        positions: list[PositionReport] = []
        if self.cp_size > 1 and self.options.positions == "rewrite":  # after attention: its refusals come first
            plan = current_plan()
            prefix = f"backend{self._id}/graph{graph_id}"
            chunk_len = plan.chunk_len if plan is not None else None
            positions = positions_pass(gm, chunk_len=chunk_len, graph_id=graph_id, site_prefix=prefix)
            self.position_reports += positions
        if self._dump is not None:
            after = dump.graph_source(gm, f"{title}: after the cpcompile cp_attention and positions passes")
            self._dump.add_graph(before, after, reports, grad_flags, positions=positions)
        if self.options.inner == "eager":
            return gm.forward
        return _compat.lookup_inner_backend(self.options.inner)(gm, example_inputs)


def backend(
    cp_group: dist.ProcessGroup,
    *,
    inner: Literal["inductor", "aot_eager", "eager"] = "inductor",
    regather_kv_in_backward: bool = False,
    dump_dir: str | os.PathLike | None = None,
    attention: Literal["auto", "dense", "block"] = "auto",
    block_size: int = 128,
    config: object | None = None,
    positions: Literal["rewrite", "off"] = "rewrite",
) -> CPBackend:
    """A torch.compile backend that runs every SDPA call of the model as context-parallel attention and makes
    the positions the model computes from the local sequence length global (or refuses them).

    ``model = torch.compile(model, backend=cpcompile.backend(cp_group))``, then call the model inside
    ``with cpcompile.shard(batch, cp_group) as local: model(**local)``.

    With a CP group of more than one rank this also sets Dynamo's ``fail_on_recompile_limit_hit``: a frame
    that exceeds the recompile limit raises instead of silently running uncompiled (local-only attention).

    Args:
        cp_group: the context-parallel process group (the ranks that share one sequence).
        inner: compiler the rewritten graph is handed to (``inductor``, ``aot_eager`` or ``eager``).
        regather_kv_in_backward: see :attr:`BackendOptions.regather_kv_in_backward`.
        config: the model's transformers config (``model.config``), optional: the per-layer sliding windows
            (needed when the mask is built outside the compiled graph, e.g. one graph per layer under FSDP2;
            otherwise read from the graph and checked against the config) and an early refusal of a
            non-SDPA attention implementation.
        dump_dir: write every graph before and after the pass, and a summary of its SDPA sites, to
            ``dump_dir/rank{r}/`` (``graph{n}_before.py``, ``graph{n}_after.py``, ``summary.json``) as it
            compiles. Default: the ``CPCOMPILE_DUMP_DIR`` environment variable, else no dump.
        attention: ``auto``, ``dense`` or ``block`` (see :attr:`BackendOptions.attention`).
        block_size: block size of the block attention kernel.
        positions: ``"rewrite"`` (default) makes positions the model computes from the local sequence length
            global, or refuses them at compile time; ``"off"`` leaves them as they are (silently wrong for such
            models; see :attr:`BackendOptions.positions`).
    """
    options: dict = {
        "inner": inner,
        "regather_kv_in_backward": regather_kv_in_backward,
        "config": config,
        "attention": attention,
        "block_size": block_size,
        "positions": positions,
    }
    if dump_dir is not None:  # else BackendOptions reads $CPCOMPILE_DUMP_DIR
        options["dump_dir"] = dump_dir
    return CPBackend(cp_group, BackendOptions(**options))


_registry_backends: dict[str, CPBackend] = {}


def _registry_backend(gm: fx.GraphModule, example_inputs: list[torch.Tensor]):
    """``torch.compile(model, backend="cpcompile")``: CP over the default (world) process group, inductor."""
    if not dist.is_initialized():
        raise RuntimeError(
            'backend="cpcompile" uses the default process group as the CP group, but torch.distributed is not '
            "initialized; call torch.distributed.init_process_group first, or pass "
            "backend=cpcompile.backend(cp_group)"
        )
    world = dist.group.WORLD
    key = _compat.group_name_of(world)
    if key not in _registry_backends:
        _registry_backends[key] = backend(world)
    return _registry_backends[key](gm, example_inputs)
