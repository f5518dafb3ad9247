"""Context parallelism in Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

Main API::

    from cpcompile.integrations.transformers import CPTrainer, ContextParallelMixin

    trainer = CPTrainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorWithFlattening(), cp_size=2)
    trainer.train()                                                 # torchrun --nproc-per-node 2 train.py

    class CPSFTTrainer(ContextParallelMixin, SFTTrainer): ...      # TRL: SFTConfig(padding_free=True, ...)

The mixin keeps the Trainer's own machinery (DDP or FSDP from accelerate, gradient accumulation, clipping,
logging, checkpoints) and changes four things, each an override of a public Trainer method:

- ranks: the world is a ``(dp, cp)`` mesh (:func:`cpcompile.init_dp_cp_mesh`: rank ``r`` is CP rank ``r % cp``
  of data-parallel replica ``r // cp``);
- data (:meth:`~ContextParallelMixin.get_train_dataloader`): the training batches are split over the ``dp``
  replicas only, so every CP rank of a replica loads the same batch (``per_device_train_batch_size`` is the batch of
  one CP group); every step checks that the CP ranks hold the same batch (``shard(check_batch=True)``);
- model and step (:meth:`~ContextParallelMixin.training_step`): the model is compiled in place with
  ``cpcompile.backend(cp_group)`` before its first step, and forward and backward run inside
  ``cpcompile.shard`` on this rank's chunk of every sequence;
- loss denominator (:meth:`~ContextParallelMixin.get_cp_size`): the Trainer counts the supervised tokens of the
  step on every rank and sums the counts over all ranks; dividing by the CP size (every CP rank counted the same
  batch) gives the token count of the global batch.

Why the gradients come out right: with ``average_tokens_across_devices`` (the Trainer's default, required here)
every rank's loss is ``(sum of its chunk's token losses) / (global token count) * world_size``, and DDP (or FSDP,
which has not run with CP yet: it warns) averages the gradients over all ``world_size = dp * cp`` ranks. The
factor and the average cancel: every gradient is the SUM of all ranks' parts, which is the gradient of the global
batch's mean loss. A CP rank's part is a partial sum over its own tokens, so it is added to the other CP ranks'
parts, never averaged with them. The gradients are then the same on every rank (DDP) or sharded (FSDP), so the
Trainer's clipping sees the single-process norm, and its logged loss (the mean over ranks of the scaled per-rank
losses) is the global batch's mean loss.

Batches must be padding-free: documents packed into rows with ``position_ids`` restarting at 0 per document
(``transformers.DataCollatorWithFlattening``, TRL's ``padding_free=True`` or ``packing=True``) or rows without
padding. A padded ``attention_mask`` is refused by :func:`cpcompile.shard`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
import torch.distributed as dist
import transformers

import cpcompile
from cpcompile.fsdp import CP, DP

__all__ = ["ContextParallelMixin", "CPTrainer"]

#: Batch keys that describe the layout of the whole packed row for varlen attention kernels (TRL's padding-free
#: collator adds them). They are wrong for a chunk, and SDPA models do not read them, so they are dropped.
GLOBAL_LAYOUT_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class ContextParallelMixin:
    """Mix into a ``transformers.Trainer`` subclass (before it) to train with context parallelism.

    ``class CPSFTTrainer(ContextParallelMixin, SFTTrainer): ...``; :class:`CPTrainer` is the mixin on ``Trainer``.
    See the module docstring for what it changes and why the gradients equal a single-process run's.

    Keyword arguments (all other arguments go to the Trainer):
        cp_size: ranks per CP group (every sequence is split into ``cp_size`` chunks); must divide the world size.
            The remaining factor ``world_size // cp_size`` is the data-parallel size.
        cp_backend_kwargs: keyword arguments of :func:`cpcompile.backend` (``inner``, ``attention``,
            ``regather_kv_in_backward``, ...). ``config`` defaults to ``model.config``.

    Launch one process per rank (``torchrun --nproc-per-node N train.py``). Training only: evaluation and prediction
    with a CP model are refused (``eval_strategy`` must be ``"no"``).
    """

    def __init__(self, *args, cp_size: int, cp_backend_kwargs: Mapping | None = None, **kwargs) -> None:
        if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"cp_size must be a positive int (ranks per context-parallel group), got {cp_size!r}")
        if cp_backend_kwargs is not None and not isinstance(cp_backend_kwargs, Mapping):
            raise TypeError(
                f"cp_backend_kwargs must be a dict of cpcompile.backend keyword arguments, got "
                f"{type(cp_backend_kwargs).__name__}"
            )
        self._cp_size = cp_size
        self._cp_backend_kwargs = dict(cp_backend_kwargs or {})
        if "cp_group" in self._cp_backend_kwargs:
            raise ValueError("cp_backend_kwargs must not contain cp_group: the mixin passes its own CP group")
        self._cp_compiled = None
        super().__init__(*args, **kwargs)  # sets up torch.distributed (accelerate) from the launcher's environment
        self._check_cp_arguments()
        world = dist.get_world_size()
        self._cp_mesh = cpcompile.init_dp_cp_mesh(world // cp_size, cp_size)
        self.cp_group = self._cp_mesh.get_group(CP)
        self.dp_group = self._cp_mesh.get_group(DP)
        if self.is_fsdp_enabled:
            warnings.warn(
                f"{type(self).__name__}: the Trainer's FSDP with cpcompile context parallelism has not been run yet "
                "(accelerate enables FSDP only on accelerator devices, and the tests run on CPU, where the Trainer "
                "uses DDP); the gradient contract is the same as with DDP (FSDP2 averages over all ranks), but check "
                "the first steps against a run without CP",
                stacklevel=2,
            )

    # -- checks -------------------------------------------------------------------------------------------
    def _check_cp_arguments(self) -> None:
        args = self.args
        cls = type(self).__name__
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                f"{cls} needs torch.distributed, one process per rank; launch the script with "
                f"`torchrun --nproc-per-node N script.py` (N a multiple of cp_size={self._cp_size})"
            )
        world = dist.get_world_size()
        if world % self._cp_size:
            raise ValueError(
                f"cp_size={self._cp_size} does not divide the world size {world}; launch a multiple of cp_size "
                f"processes or choose a cp_size that divides {world}"
            )
        problems = []
        if not args.average_tokens_across_devices:
            problems.append(
                "average_tokens_across_devices=False: the loss denominator must be the global token count; "
                "set average_tokens_across_devices=True (the default)"
            )
        if self.compute_loss_func is not None:
            problems.append(
                "compute_loss_func is set: it would see this rank's chunk of the logits next to the whole "
                "sequence's labels; use the model's own loss (drop compute_loss_func)"
            )
        if self.label_smoother is not None:
            problems.append(
                f"label_smoothing_factor={args.label_smoothing_factor}: the label smoother reads the whole "
                "sequence's labels next to this rank's chunk of the logits; set label_smoothing_factor=0"
            )
        if not self.model_accepts_loss_kwargs:
            problems.append(
                f"{type(self.model).__name__}.forward takes no **kwargs, so it cannot receive the global token "
                "count (num_items_in_batch) and the pre-shifted labels (shift_labels); use a transformers causal LM"
            )
        if args.torch_compile:
            problems.append(
                "torch_compile=True would compile the model a second time with another backend; set "
                "torch_compile=False (the mixin compiles the model with cpcompile.backend)"
            )
        eval_strategy = str(getattr(args.eval_strategy, "value", args.eval_strategy))
        if eval_strategy != "no":
            problems.append(
                f"eval_strategy={eval_strategy!r}: evaluation under context parallelism is not supported "
                "yet; set eval_strategy='no' and evaluate the saved model without CP"
            )
        if args.train_sampling_strategy == "batch_rebalance":
            problems.append(
                "train_sampling_strategy='batch_rebalance' assigns batches per rank of the whole world; use "
                "'random', 'sequential' or 'group_by_length'"
            )
        if args.n_gpu > 1:
            problems.append(
                f"n_gpu={args.n_gpu} (torch.nn.DataParallel in one process); launch one process per GPU instead"
            )
        if args.accelerator_config.dispatch_batches:
            problems.append(
                "accelerator_config.dispatch_batches=True splits each batch over all ranks; set it to False"
            )
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and (pc.cp_enabled or getattr(pc, "sp_enabled", False)):
            problems.append(
                "accelerate's parallelism_config enables its own context/sequence parallelism; drop "
                "parallelism_config (cpcompile splits the sequences)"
            )
        if problems:
            raise ValueError(
                f"{cls} (context parallelism, cp_size={self._cp_size}) cannot run with: " + "; ".join(problems)
            )

    # -- Trainer overrides --------------------------------------------------------------------------------
    def get_cp_size(self) -> int:
        """The CP size: every CP rank counts the same batch's tokens, so the Trainer divides its sum by this."""
        return self._cp_size

    def get_train_dataloader(self):
        """The Trainer's training dataloader, its batches split over the data-parallel replicas only."""
        loader = super().get_train_dataloader()
        _split_over_dp(loader, self._cp_mesh)
        return loader

    def training_step(self, model, inputs, num_items_in_batch=None):
        """The Trainer's training step (forward, backward) inside ``cpcompile.shard`` on this rank's chunk."""
        self._compile_for_cp()
        inputs = self._prepare_inputs(inputs)
        if num_items_in_batch is None:
            raise ValueError(
                "the batch has no 'labels', so the Trainer did not count the supervised tokens of the step; context "
                "parallelism needs that count for the loss denominator: give the batches labels (the collators "
                "DataCollatorWithFlattening and DataCollatorForLanguageModeling add them)"
            )
        batch = {k: v for k, v in inputs.items() if k not in GLOBAL_LAYOUT_KEYS}
        with cpcompile.shard(batch, self.cp_group, num_items_in_batch=num_items_in_batch, check_batch=True) as local:
            return super().training_step(model, local, num_items_in_batch)

    def _track_num_input_tokens(self, inputs) -> None:
        # every CP rank holds (and the Trainer counts) the whole batch of its replica: count it once
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (self.state.num_input_tokens_seen - before) // self._cp_size

    def floating_point_ops(self, inputs) -> int:
        """The Trainer's estimate for the whole batch, divided by the CP size (each CP rank does its share)."""
        return super().floating_point_ops(inputs) // self._cp_size

    def evaluate(self, *args, **kwargs):
        raise NotImplementedError(_NO_EVAL)

    def predict(self, *args, **kwargs):
        raise NotImplementedError(_NO_EVAL)

    # -- helpers ------------------------------------------------------------------------------------------
    def _compile_for_cp(self) -> None:
        """Compile ``self.model`` in place with the cpcompile backend (once per model object)."""
        model = self.model
        if self._cp_compiled is model:
            return
        options = dict(self._cp_backend_kwargs)
        config = getattr(_unwrap(model), "config", None)
        if "config" not in options and hasattr(config, "to_dict"):
            options["config"] = config
        # In place: the Trainer, DDP/FSDP and checkpoints keep the same module (same state_dict keys).
        model.compile(backend=cpcompile.backend(self.cp_group, **options))
        self._cp_compiled = model


_NO_EVAL = (
    "evaluation and prediction are not supported under context parallelism yet (the model is compiled for CP "
    "chunks); evaluate the saved model in a run without context parallelism"
)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _split_over_dp(loader, mesh) -> None:
    """Make an accelerate-prepared ``loader`` give batches by data-parallel replica instead of by rank.

    accelerate shards a map-style dataset with a ``BatchSamplerShard`` and an iterable one with an
    ``IterableDatasetShard``, both over all ranks (``num_processes``, ``process_index``). They are pointed at the
    ``dp`` replicas instead (the Trainer does the same to its rank-aware ``BatchRebalanceSampler``); every CP rank
    of a replica then iterates over the same batches, in the same order (accelerate synchronises the shuffling
    generator over all ranks).
    """
    from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

    world, rank = dist.get_world_size(), dist.get_rank()
    dp_size, dp_rank = mesh.size(0), mesh.get_local_rank(DP)
    if isinstance(loader, DataLoaderDispatcher):
        raise ValueError(
            "the training dataloader dispatches slices of one batch to all ranks (accelerate dispatch_batches=True); "
            "context parallelism needs whole batches per CP group: set accelerator_config={'dispatch_batches': False}"
        )
    shards = [
        s
        for s in (getattr(loader, "batch_sampler", None), getattr(loader, "dataset", None))
        if isinstance(s, (BatchSamplerShard, IterableDatasetShard))
    ]
    if world == 1:
        return
    if not shards:
        raise ValueError(
            f"cannot give the CP ranks of a data-parallel replica the same batches: the training dataloader "
            f"({type(loader).__name__} over {type(getattr(loader, 'dataset', None)).__name__}) is not sharded by an "
            "accelerate BatchSamplerShard or IterableDatasetShard (a datasets.IterableDataset with several shards is "
            "split by shard); use a map-style dataset, or an iterable one with a single shard"
        )
    for shard in shards:
        if (shard.num_processes, shard.process_index) != (world, rank):
            raise ValueError(
                f"the training dataloader is sharded as process {shard.process_index} of {shard.num_processes}, "
                f"expected {rank} of {world} (accelerate's default); a custom sharding cannot be combined with "
                "context parallelism"
            )
        shard.num_processes, shard.process_index = dp_size, dp_rank


class CPTrainer(ContextParallelMixin, transformers.Trainer):
    """``transformers.Trainer`` with context parallelism; takes ``cp_size=`` (see :class:`ContextParallelMixin`)."""
