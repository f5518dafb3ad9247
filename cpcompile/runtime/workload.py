"""The compiled-workload registry: which attention forms the layers compiled for each CP group have.

The attention pass (:mod:`cpcompile.passes.sdpa_cp`) records every site it rewrites
(:func:`record_attention_form`, at compile time); :func:`cpcompile.shard`'s balanced layout reads the sum
(:func:`compiled_workload`) to even out the attention work of the batch over the ranks, keeping documents whole
(``Workload.split_keys``) once a site exchanges only the keys its queries see (``exchange="selective"``).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from cpcompile.layouts import AttentionForm, Workload

__all__ = ["compiled_workload", "record_attention_form", "workload_of"]


#: What was compiled per CP group: group name -> ((documents, window) -> layer names, block sizes of the kernel,
#: layers with a selective exchange). Written by :func:`record_attention_form` (the pass, for every site it
#: rewrites), read by :func:`shard`.
_FORMS: dict[str, tuple[dict[tuple[bool, int | None], set[str]], set[int], set[str]]] = {}
_FORMS_LOCK = threading.Lock()


def record_attention_form(
    group_name: str, layer: str, documents: bool, window: int | None, block_size: int, selective: bool = False
) -> None:
    """Note that ``layer``, compiled for the CP group ``group_name``, attends in this form with this block size
    (``selective``: it receives only the keys its queries see)."""
    with _FORMS_LOCK:
        forms, blocks, selective_layers = _FORMS.setdefault(group_name, ({}, set(), set()))
        forms.setdefault((documents, window), set()).add(layer)
        blocks.add(block_size)
        if selective:
            selective_layers.add(layer)


def compiled_workload(group_name: str) -> Workload:
    """The :class:`~cpcompile.plan.Workload` of the layers compiled for ``group_name`` so far (default before).

    Every form counts its distinct layers; the block size is the smallest the compiled sites use; documents are
    kept whole (``split_keys``) when some site has a selective exchange.
    """
    with _FORMS_LOCK:
        forms, blocks, selective = _FORMS.get(group_name, ({}, set(), set()))
        layers = {key: set(names) for key, names in forms.items()}
        block = min(blocks, default=Workload.block_size)
        split = bool(selective)
    return workload_of(layers, block, split_keys=split)


def workload_of(
    layers: Mapping[tuple[bool, int | None], set[str]], block_size: int, *, split_keys: bool = False
) -> Workload:
    """The workload of attention ``layers`` by form (``(documents, window)`` -> layer names, each counted once)
    in blocks of ``block_size``; the default forms when there are none. ``split_keys``: prefer layouts that keep
    documents whole (a selective exchange then moves fewer keys).

    Sorted: every rank builds the same workload whatever order its graphs compiled in.
    """
    if not layers:
        return Workload(block_size=block_size, split_keys=split_keys)
    ordered = sorted(layers.items(), key=lambda kv: (not kv[0][0], kv[0][1] is not None, kv[0][1] or 0))
    forms = tuple(AttentionForm(d, w, len(n)) for (d, w), n in ordered)
    return Workload(forms=forms, block_size=block_size, split_keys=split_keys)
