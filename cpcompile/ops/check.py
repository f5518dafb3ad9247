"""Checks: the ops that run what can fail at a site, before the site communicates anything.

``cpcompile::site_check`` finds the active plan and holds the site's control rounds (its first call, then the
model's own mask against the plan's local rule on every new batch: :func:`_check_site`, :func:`mask_mismatch`);
``cpcompile::exact_input`` refuses a per-token input of a flex site's mods that holds this rank's values only.
"""

from __future__ import annotations

import sys

import torch
import torch.fx as fx

from cpcompile import _compat, failsafe
from cpcompile.errors import MaskMismatchError, UnsupportedAttentionError
from cpcompile.ops.sites import SiteSpec, after_placeholders, site_context, site_name, site_spec
from cpcompile.plan import CPPlan
from cpcompile.runtime.context import Active, active_context, is_exact, is_proved_mask

#: Query rows of the model's mask compared at a time (bounds the memory of the mask check).
MASK_CHECK_ROWS = 1024


#: Sites that ran their first-call control round (written only by _check_site and exchange_round).
_VERIFIED: set[str] = set()


#: Sites whose assumed document condition the step check saw on some batch (written only by _check_site).
_DOCUMENTS_SEEN: set[str] = set()


@torch.library.custom_op("cpcompile::site_check", mutates_args=())
def site_check(like: torch.Tensor, model_mask: torch.Tensor | None, site: str) -> torch.Tensor:
    """The checks of the site ``site``, run before its K/V exchange is issued; returns an empty tensor that the
    site's plan op takes (so the check stays in the graph, ahead of the exchange).

    ``like`` is the first of the site's K and V to be final (detached; only its rows and local length are read).
    The active shard context must be the one the site was compiled for, and the site's control round runs
    (:func:`_check_site`): when ``model_mask`` (the mask the model built on its local inputs) is given, it is
    compared with :meth:`CPPlan.local_rule_mask` on every new batch and :class:`MaskMismatchError` is raised when
    they differ. A check that fails raises on every rank with none of the site's collectives in flight, and a
    peer that failed elsewhere is seen in the round instead of in a collective.
    """
    spec = site_spec(site)
    _check_site(spec, site_context(spec, like), model_mask)
    return like.new_empty((0,))


@site_check.register_fake
def _(like, model_mask, site):
    return like.new_empty((0,))


def _check_site(spec: SiteSpec, context: Active, model_mask: torch.Tensor | None) -> None:
    """The site's control rounds, decided together with the other CP ranks (:func:`cpcompile.failsafe.agree`).

    One round on the site's first call, then one per step for every distinct model mask tensor and attention
    form (the layers of a transformers model share one mask: one round per step for the whole model):

    * ranks that reach different attention calls (a data-dependent branch, a recompile on one rank) meet in
      different rounds and raise :class:`~cpcompile.failsafe.RanksDivergedError` at once, instead of waiting in
      different collectives;
    * the model's own mask is compared with the mask its rule gives on the local inputs
      (:meth:`CPPlan.local_rule_mask`) on every step, so a mask that ignores the documents or depends on another
      input is caught on the batch where it starts to differ: every rank raises the same
      :class:`MaskMismatchError`, naming the ranks whose mask differs.
    """
    form = (spec.documents, spec.window)
    if spec.site in _VERIFIED and _mask_checked(context, model_mask, form):
        return
    layer = site_name(spec)
    seen = None
    if model_mask is None:
        error, what = None, f"the step check of the CP attention at {layer} (no model mask)"
    else:
        error, what = mask_mismatch(spec, context.plan, model_mask), f"the mask check of the CP attention at {layer}"
        proved = is_proved_mask(context, model_mask)  # proved with documents by the graph that handed it on
        if error is None and spec.documents_assumed and spec.site not in _DOCUMENTS_SEEN and not proved:
            seen = context.plan.documents_in_blocks(spec.window)
            error = _hidden_documents(spec) if seen == "hidden" else None
    failsafe.agree(context.group, "site", error, what=what, kinds=(MaskMismatchError,), stats=context.comm)
    _VERIFIED.add(spec.site)
    if seen == "shown":  # every rank passed a check that a mask without the condition would have failed
        _DOCUMENTS_SEEN.add(spec.site)
    if model_mask is None:
        context.checked_forms.add(form)
    else:
        context.checked_masks.add(model_mask, form)


#: The per-step key of :func:`exchange_round` in ``Active.checked_forms`` (apart from the attention forms).
_EXCHANGE_FORM = ("exchange",)


def exchange_round(context: Active, site: str, kind: str) -> None:
    """The control round of a mixing exchange at ``site`` (a head-parallel or state-passing core, a causal region),
    held before its first collective is issued: on the site's first call on the CP group, then once per step for
    every such site together, decided with the other CP ranks (:func:`cpcompile.failsafe.agree`), as an attention
    site's step check without a model mask is.

    A peer that failed before reaching the exchange (its graph refused at compile time, an error in its own code
    between graphs) or that reaches another round raises here, on every rank, instead of leaving this rank waiting
    in the exchange's collective. The round names ``kind`` (``"the head-parallel exchange"``) and the site as every
    rank names it (:func:`_same_on_every_rank`). Nothing is held in the autograd engine's backward (activation
    checkpointing runs the forward again there, after the step's backward round).
    """
    # per group: a core's site is its function, the same in every backend, and a rank may have run it on another
    # group that its peers in this one are not part of
    verified = f"{context.plan.group_name}|{site}"
    if _compat.in_backward() or (verified in _VERIFIED and _EXCHANGE_FORM in context.checked_forms):
        return
    what = f"the step check of {kind} at {_same_on_every_rank(site)}"
    failsafe.agree(context.group, "site", None, what=what, stats=context.comm)
    _VERIFIED.add(verified)
    context.checked_forms.add(_EXCHANGE_FORM)


def _same_on_every_rank(site: str) -> str:
    """``site`` without the parts that differ between ranks: its digest (after ``#``) and the backend and graph it
    was compiled in (``backend3/graph0:``), which count what each process compiled before."""
    site = site.rsplit("#", 1)[0]
    head, sep, rest = site.partition(":")
    return rest if sep and "/graph" in head else site


def _mask_checked(context: Active, model_mask: torch.Tensor | None, form: tuple) -> bool:
    """Whether this step already held the round for ``model_mask`` (still alive, unwritten: a tensor that took a
    freed mask's address is a new mask) under the attention form ``form``, or for a site of that form without a
    model mask. Decided by what the program did, never by where the allocator put a tensor, so every rank holds
    the same rounds."""
    if model_mask is None:
        return form in context.checked_forms
    return context.checked_masks.contains(model_mask, form)


def _hidden_documents(spec: SiteSpec) -> MaskMismatchError:
    """The error of a site whose document condition was assumed (:attr:`SiteSpec.documents_assumed`) on a batch
    whose documents the step check cannot see, before any batch showed them."""
    return MaskMismatchError(
        f"the attention mask of the CP attention at {spec.layer or spec.site} was made outside the compiled graphs "
        "(in eager code, or in a graph that cpcompile did not compile), so whether it keeps packed documents apart "
        "was not proved when the site was compiled, and the step check, which compares each rank's own block of "
        "the mask with the same-document rule, cannot tell on this batch: every rank's tokens lie within one "
        "document in every row (the documents end at chunk edges), where a mask without that condition looks "
        "the same; cpcompile refuses to guess, since the two differ on the keys other ranks hold. Build the mask "
        "inside the compiled model (compile the module that builds it, with no graph break or "
        "torch.compiler.disable between it and the attention), or run first a batch whose documents cross a "
        "chunk edge: once the check has seen the condition there, batches like this one run"
    )


def mask_mismatch(spec: SiteSpec, plan: CPPlan, model_mask: torch.Tensor) -> MaskMismatchError | None:
    """The error describing where ``model_mask`` differs from :meth:`CPPlan.local_rule_mask`, or ``None``.

    Both rules give every query ``i`` an interval of local keys ``[first_i, i]`` (:meth:`CPPlan.local_first_visible`),
    so no mask of the rule is built: the model's mask is read eight keys at a time (:func:`_rows_differ`) and
    compared with the words the intervals give. The dense rows are made only for the error's first difference.
    """
    # With several runs per rank, a mask built from document ids or per-document positions keeps a document
    # whole across the runs: the whole-sequence mask among this rank's tokens (no new document at a run
    # boundary). The model's mask must be one of the two rules on every row.
    several_runs = plan.runs() > 1
    kwargs = {"documents": spec.documents, "window": spec.window}
    bad = _rows_differ(model_mask, plan.local_first_visible(**kwargs))
    if not bad.any():
        return None
    if several_runs and not _rows_differ(model_mask, plan.local_first_visible(**kwargs, whole_sequence=True)).any():
        return None
    i = int(bad.nonzero()[0, -1])
    ours = plan.local_rule_mask(**kwargs, rows=slice(i, i + 1))
    theirs = model_mask[..., i : i + 1, :].to(torch.bool).expand_as(ours)
    return _mismatch_error(spec, theirs, ours, i, plan.layout if several_runs else None)


#: ``_BYTES_UP_TO[n]``: an int64 word whose first ``n`` bytes (in memory order) are 1, the others 0.
_BYTES_UP_TO = [sum(1 << (8 * (k if sys.byteorder == "little" else 7 - k)) for k in range(n)) for n in range(9)]


def _rows_differ(mask: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``[..., c]`` bool: the rows of a bool ``[..., c, c]`` mask (``[B or 1, 1, c, c]``) that differ from the
    intervals ``[first_i, i]`` (``first`` ``[B, c]``).

    The mask's bytes are read as int64 words of eight keys and compared with the words the intervals give: whole
    words of ones inside an interval, zeros outside, two partial words at its ends. One pass over ``c^2 / 8``
    words per comparison instead of several passes over ``c^2`` bools; :data:`MASK_CHECK_ROWS` query rows at a
    time bound the memory. A mask whose rows cannot be viewed as words (a length not a multiple of 8, an odd
    offset) is copied into zero-padded rows first.
    """
    c = mask.shape[-1]
    words = -(-c // 8)
    j = torch.arange(words, device=mask.device)
    table = torch.tensor(_BYTES_UP_TO, dtype=torch.int64, device=mask.device)
    first = first.to(mask.device)[:, None, :]  # [B, 1, c]
    out = []
    for start in range(0, mask.shape[-2], MASK_CHECK_ROWS):
        block = mask[..., start : start + MASK_CHECK_ROWS, :].to(torch.bool)
        try:
            w = block.view(torch.int64)
        except RuntimeError:  # not viewable as words: zero-padded contiguous rows
            w = torch.nn.functional.pad(block, (0, words * 8 - c)).contiguous().view(torch.int64)
        lo = first[..., start : start + block.shape[-2]]
        hi = torch.arange(start + 1, start + 1 + block.shape[-2], device=mask.device)  # one past the query
        lo, hi = torch.broadcast_tensors(lo, hi)
        full = (j >= (lo[..., None] + 7) // 8) & (j < hi[..., None] // 8)
        expected = -full.to(torch.int64) & _BYTES_UP_TO[8]  # whole words of ones inside the interval
        for edge in (lo // 8, (hi - 1) // 8):  # the words holding the interval's ends (may be the same word)
            a = torch.maximum(lo, edge * 8) - edge * 8
            b = torch.minimum(hi, edge * 8 + 8) - edge * 8
            expected.scatter_(-1, edge[..., None], (table[b] - table[a])[..., None])
        out.append((w != expected).any(-1))
    return torch.cat(out, -1)


def _mismatch_error(
    spec: SiteSpec, theirs: torch.Tensor, ours: torch.Tensor, first_row: int, plan_layout: str | None = None
) -> MaskMismatchError:
    """The :class:`MaskMismatchError` naming the first differing entry of a block of query rows (``plan_layout``:
    the layout, when it gives this rank several runs of tokens)."""
    b, _, i, j = (theirs != ours).nonzero()[0].tolist()
    form = (
        "global causal"
        + (" same-document" if spec.documents else "")
        + (f" sliding-window({spec.window})" if spec.window is not None else "")
    )
    return MaskMismatchError(
        f"the attention mask built by the model at {spec.layer or spec.site} differs from the {form} mask "
        f"cpcompile applies, as the model's rule gives it on this rank's tokens (first difference: row {b}, "
        f"local query {first_row + i}, key {j}: model {bool(theirs[b, 0, i, j])}, expected "
        f"{bool(ours[b, 0, i, j])}); cpcompile refuses to run attention under a different mask. Build a causal "
        "mask (packed documents marked by position ids that restart at 0; with transformers: "
        "attn_implementation='sdpa' and use_cache=False), or run this model without context parallelism"
        + (
            f"; this rank holds several runs of tokens (the {plan_layout!r} layout), and neither the local "
            "rule nor the whole-sequence mask among this rank's tokens matches: a mask the model builds from "
            "per-token inputs in another way cannot be checked across runs, so call cpcompile.shard(..., "
            "layout='contiguous')"
            if plan_layout is not None
            else ""
        )
    )


def emit_site_check(
    graph: fx.Graph, ready: list[tuple[fx.Node, fx.Node]], model_mask: fx.Node | None, spec: SiteSpec
) -> fx.Node:
    """Insert ``cpcompile::site_check`` as early as it can run: right after the first of the site's K and V to be
    final (``ready``: each with the node after which it is; K and V may be one tensor) and the model's mask;
    returns its output, which the site's exchange must come after (:func:`.emit_gather_start` with
    ``ready=last_of([..., check])``) and its plan op takes."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, final = min(ready, key=lambda pair: order[pair[1]])
    after = max([final] + ([model_mask] if isinstance(model_mask, fx.Node) else []), key=order.__getitem__)
    with graph.inserting_after(after_placeholders(graph, after)):
        ref = graph.call_method("detach", (first,))
    with graph.inserting_after(ref):
        return graph.call_function(torch.ops.cpcompile.site_check.default, (ref, model_mask, spec.site))


@torch.library.custom_op("cpcompile::exact_input", mutates_args=())
def exact_input(t: torch.Tensor, site: str, what: str) -> torch.Tensor:
    """A copy of the graph input ``t``, a per-token tensor a flex site's mods read, after checking that it holds
    the whole-sequence run's values at this rank's tokens: the local batch :func:`cpcompile.shard` made, or what
    a compiled graph of the CP group computed from such tensors (:func:`~cpcompile.runtime.context.is_exact`).

    A tensor computed in eager code from this rank's tokens (document ids from a ``cumsum`` of the local
    positions, torchtitan's masks made by its trainer) holds this rank's values only, which no all-gather makes
    the whole sequence's: :class:`~cpcompile.errors.UnsupportedAttentionError`, on every rank (each rank runs
    the same code on its own tokens), before the site communicates anything.
    """
    context = active_context(f"the flex_attention site {site}")
    if t.is_inference():  # no version counter: an in-place write since it was computed could not be seen
        raise UnsupportedAttentionError(
            f"cpcompile cannot run the flex_attention call at {site_name(site_spec(site))} across CP ranks under "
            f"torch.inference_mode: its {what} reads a tensor of shape {tuple(t.shape)} handed on from another graph "
            "or from eager code, and an inference tensor keeps no record of in-place writes, so cpcompile cannot "
            "tell that it still holds what the compiled model computed. Fix: run forward-only calls under "
            "torch.no_grad() instead of torch.inference_mode()"
        )
    if not is_exact(context, t):
        raise UnsupportedAttentionError(
            f"cpcompile cannot run the flex_attention call at {site_name(site_spec(site))} across CP ranks: its "
            f"{what} reads a tensor of "
            f"shape {tuple(t.shape)} with this rank's tokens that was computed outside the compiled model (in eager "
            "code, or from such a tensor), so it holds this rank's values only, not the whole sequence's. Fix: "
            "compute it inside the compiled model from the batch cpcompile.shard passes (document ids as "
            "(position_ids == 0).cumsum(-1), which cpcompile runs on the whole sequence), and build the BlockMask "
            "there too"
        )
    return t.clone()


@exact_input.register_fake
def _(t, site, what):
    return torch.empty_like(t)


def emit_exact_input(graph: fx.Graph, t: fx.Node, spec: SiteSpec, what: str) -> fx.Node:
    """Insert :func:`exact_input` of the graph input ``t`` before the first op of ``graph`` (before any
    collective of the graph); returns the checked copy."""
    first = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        return graph.call_function(torch.ops.cpcompile.exact_input.default, (t, spec.site, what))
