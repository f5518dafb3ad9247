"""The options of :func:`cpcompile.shard`: checked against each other and the batch, and what pads each key.

:class:`ShardOptions` holds the options that change what a rank holds (the batch check compares them across the
CP ranks, :mod:`cpcompile.runtime.batch_check`); :func:`validate_options` checks them before any collective.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.distributed as dist

from cpcompile.layouts import Workload, check_layout
from cpcompile.plan import IGNORE_INDEX
from cpcompile.runtime.workload import compiled_workload

__all__ = ["OWN_PADDING", "RECURRENCES", "ShardOptions", "default_pad_value", "validate_options"]

#: How a recurrent core that supports both runs under CP (``shard(recurrence=...)``, :mod:`cpcompile.cores`):
#: ``"state"`` (each rank runs it on its own tokens and the ranks all-gather fixed-size state summaries) or
#: ``"heads"`` (head-parallel: an all-to-all gives each rank the whole sequence for its heads).
RECURRENCES = ("state", "heads")

#: Keys whose padding cpcompile decides (``pad_token_id`` for ``input_ids``, the ignore index for ``labels``).
OWN_PADDING = ("input_ids", "position_ids", "labels", "attention_mask")


def default_pad_value(dtype: torch.dtype) -> int | float | bool:
    """The value :func:`shard` pads an extra key of ``dtype`` with: ``False`` (bool), ``-100`` (integers: the
    ignore index of pre-shifted targets), ``0.0`` (floats: a loss mask or advantage of 0 adds nothing)."""
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        return 0.0
    return IGNORE_INDEX


def _pad_values(batch: Mapping[str, object], pad_values: Mapping[str, object] | None) -> dict[str, object]:
    """Check ``shard(pad_values=...)`` against the batch (before any collective); return it as a dict."""
    if pad_values is None:
        return {}
    if not isinstance(pad_values, Mapping):
        raise TypeError(
            f"pad_values must be a dict of batch key -> pad value, got {type(pad_values).__name__}; "
            'e.g. pad_values={"targets": -100}'
        )
    extra = sorted(k for k, v in batch.items() if isinstance(v, torch.Tensor) and k not in OWN_PADDING)
    for key, pad in pad_values.items():
        if key in OWN_PADDING:
            raise ValueError(
                f"pad_values[{key!r}]: cpcompile pads {key!r} itself (input_ids with pad_token_id, labels with "
                f"-100, position_ids as a separate document); pad_values applies to the other keys: {extra}"
            )
        if key not in extra:
            raise ValueError(
                f"pad_values names {key!r}, which is not a tensor of the batch; the extra keys are {extra}"
            )
        dtype = batch[key].dtype
        ok = (
            isinstance(pad, bool)
            if dtype == torch.bool
            else isinstance(pad, (int, float)) and not isinstance(pad, bool)
            if dtype.is_floating_point
            else isinstance(pad, int) and not isinstance(pad, bool)
        )
        if not ok:
            kind = "a bool" if dtype == torch.bool else "a number" if dtype.is_floating_point else "an int"
            raise TypeError(f"pad_values[{key!r}] = {pad!r} does not fit batch[{key!r}] of dtype {dtype}; pass {kind}")
    return dict(pad_values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardOptions:
    """The options of one :func:`shard` call that change what a rank holds (compared across the CP ranks)."""

    layout: str
    workload: Workload | None
    num_items_in_batch: int | torch.Tensor | None
    dp_group: dist.ProcessGroup | None
    pad_token_id: int
    hf_kwargs: bool
    dynamic: bool
    pad_values: Mapping[str, int | float | bool] | None
    recurrence: str = "heads"

    def summary(self) -> dict:
        """What every CP rank must pass alike, JSON-serialisable (the workload is added by the caller)."""
        items = self.num_items_in_batch
        if isinstance(items, torch.Tensor):
            items = "a tensor" if items.numel() != 1 else items.item()
        return {
            "layout": self.layout,
            "num_items_in_batch": items,
            # each CP rank belongs to its own DP group: compare its size, not its name
            "dp_group": None if self.dp_group is None else f"a group of {dist.get_world_size(self.dp_group)}",
            "pad_token_id": self.pad_token_id,
            "hf_kwargs": self.hf_kwargs,
            "dynamic": self.dynamic,
            "pad_values": None if self.pad_values is None else repr(sorted(dict(self.pad_values).items())),
            "recurrence": self.recurrence,
        }


def validate_options(
    batch: Mapping[str, object], group_name: str, options: ShardOptions
) -> tuple[Workload | None, dict[str, object]]:
    """Check the options of :func:`shard` against each other and the batch; return the workload and pad values."""
    if options.dp_group is not None and options.num_items_in_batch is not None:
        raise ValueError(
            f"cpcompile.shard got both num_items_in_batch={options.num_items_in_batch!r} and dp_group: pass either "
            "a precomputed global count or dp_group (to sum this batch's count over the DP ranks), not both"
        )
    check_layout(options.layout)
    if options.recurrence not in RECURRENCES:
        raise ValueError(
            f'recurrence={options.recurrence!r} is not a known mode; choose one of {RECURRENCES} ("state": state '
            'passing for the gated delta rule, "heads": every recurrent core head-parallel)'
        )
    workload = options.workload
    if workload is None and options.layout == "balanced":
        workload = compiled_workload(group_name)
    return workload, _pad_values(batch, options.pad_values)
