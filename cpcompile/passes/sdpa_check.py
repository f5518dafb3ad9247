"""Check, for the SDPA pass (:mod:`cpcompile.passes.sdpa_cp`): whether an attention can be reproduced exactly
across CP ranks, and the one-line reason saying what to do when not.

* :func:`check_site`: the call's arguments (dropout, scale, shapes, the mask's form);
* :func:`site_window`: the site's mask proved (:func:`mask_proof`, :mod:`cpcompile.passes.mask_rules`) and its
  sliding window, from the mask built in the graph (:func:`graph_windows`) and the transformers config
  (:func:`config_window`);
* the kernel the backend was asked for on the query's device, a model config the pass cannot run (an attention
  implementation that is not SDPA, soft-capped logits), and attention that is not an SDPA call.

Refusal messages name the fix in the model's framework: transformers' settings for a transformers model (its
attention module comes from ``transformers`` or a config was given), plain torch calls otherwise.
"""

from __future__ import annotations

import numbers
import re

import torch
import torch.fx as fx

from cpcompile import _compat
from cpcompile.passes.mask_rules import MaskProof, prove_mask
from cpcompile.passes.sdpa_sites import SDPASite

__all__ = ["check_site", "mask_proof", "graph_windows", "config_window", "site_window"]


def qkv_reason(q: object, k: object, v: object, fix: str) -> str | None:
    """Why the query, key and value (recorded values) of an attention call, SDPA or flex_attention, cannot be
    rewritten, or ``None``: each must be a 4-D ``[B, H, T, D]`` tensor and the query as long as the key (``fix``:
    what to do about cross-attention or a KV cache)."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "query/key/value have no recorded shapes (not a Dynamo graph?)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"expected 4-D [B, H, T, D] query/key/value, got {q.dim()}-D/{k.dim()}-D/{v.dim()}-D"
    if not _compat.statically_true(q.shape[2] == k.shape[2]):
        return f"query length {q.shape[2]} differs from key length {k.shape[2]} (cross-attention or a KV cache); {fix}"
    return None


def check_site(site: SDPASite) -> str | None:
    """``None`` when the site can be rewritten exactly, else a one-line reason saying what to do."""
    no_dropout = "set the model's attention_dropout to 0.0" if site.transformers else "pass dropout_p=0.0"
    for name, arg in (("dropout_p", site.dropout_p), ("scale", site.scale)):
        value = arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, fx.Node) else None
        if isinstance(value, (torch.SymFloat, torch.SymInt)):
            # Dynamo makes float attributes (attention_dropout, scaling) symbolic under dynamic=True, and on the
            # recompile of a frame whose float changed (automatic dynamic: another model configuration compiled
            # in the same process through the same code)
            return (
                f"the attention's {name} is symbolic (now {value}): Dynamo makes a model's float attributes "
                "symbolic under torch.compile(dynamic=True), and when it recompiles code it already compiled for "
                "another value (a second model of another configuration, e.g. another head_dim, in the same "
                "process), so cpcompile cannot prove it is the same constant on every call; compile without "
                "dynamic=True (cpcompile.shard marks the sequence length dynamic itself), and call "
                "torch.compiler.reset() before compiling a model of another configuration"
            )
    if isinstance(site.dropout_p, fx.Node) or not isinstance(site.dropout_p, numbers.Number):
        return f"dropout_p is computed at run time; {no_dropout} (or call model.eval())"
    if site.dropout_p != 0.0:
        return f"attention dropout p={site.dropout_p} cannot be reproduced across ranks; {no_dropout}"
    if not isinstance(site.is_causal, bool) or not isinstance(site.enable_gqa, bool):
        return "is_causal/enable_gqa are computed at run time; cpcompile needs them as constants"
    if site.scale is not None and not isinstance(site.scale, numbers.Number):
        return "the softmax scale is a run-time value; cpcompile needs a constant scale"
    q, k, v = (site.meta(n) for n in (site.query, site.key, site.value))
    fix = "call the model with use_cache=False" if site.transformers else "call the model without a KV cache"
    reason = qkv_reason(q, k, v, f"{fix} and self-attention only")
    if reason is not None:
        return reason
    if site.attn_mask is None:
        if site.is_causal is not True:
            return (
                "non-causal attention without a mask (bidirectional); cpcompile supports causal attention "
                "(is_causal=True or a causal bool mask)"
            )
        return None
    if site.is_causal:
        return "both attn_mask and is_causal=True are given; SDPA rejects this combination"
    m = site.meta(site.attn_mask)
    if m is None:
        return "the attention mask has no recorded shape"
    if m.dtype != torch.bool:
        fix = (
            "use attn_implementation='sdpa' without a custom bias"
            if site.transformers
            else "pass a bool attn_mask or is_causal=True"
        )
        return (
            f"the attention mask is a {m.dtype} additive bias, which cpcompile cannot rebuild for keys of other "
            f"ranks; {fix}"
        )
    if m.dim() != 4 or not _compat.statically_true(m.shape[1] == 1):
        return (
            f"expected a [B, 1, T, T] bool mask, got shape {tuple(m.shape)} (per-head masks are not supported); "
            "pass a mask that is the same for every head as [B, 1, T, T], or expand it with mask.expand(B, H, T, T)"
        )
    return None


# -- sliding windows --------------------------------------------------------------------------------------
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def mask_proof(site: SDPASite, outer: dict | None = None) -> MaskProof:
    """What the subgraph that builds the site's mask applies (:func:`cpcompile.passes.mask_rules.prove_mask`):
    its sliding windows and whether it keeps documents apart, or why it cannot be proved. Nothing to prove
    without a mask built in the graph.
    ``outer`` (:func:`cpcompile.passes.mask_rules.outer_arguments`) follows a nested graph's mask input to where
    the calling graph builds it (a checkpointed layer)."""
    q = site.meta(site.query)
    if not isinstance(site.attn_mask, fx.Node) or q is None or q.dim() < 3:
        return MaskProof()
    return prove_mask(site.attn_mask, q.shape[-2], outer)


def graph_windows(site: SDPASite) -> set[int]:
    """Sliding windows written into the subgraph that builds the site's mask, in any spelling (transformers'
    ``kv > q - window``, ``(q - k) < window``, ...: :func:`mask_proof`). Empty when the mask is a graph input
    (e.g. one graph per decoder layer under FSDP2), has no window, or cannot be proved."""
    return set(mask_proof(site).windows)


def config_window(config: object, layer: str) -> tuple[int | None, str | None]:
    """``(window, None)`` for the layer at module path ``layer`` from a transformers config, or ``(None, reason)``.

    ``config.sliding_window`` applies to every layer unless ``config.layer_types`` says which layers are
    ``"sliding_attention"`` (Gemma3, Qwen2/3) and which ``"full_attention"``.
    """
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None, None
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return int(window), None
    m = _LAYER_INDEX.search(layer)
    if m is None:
        return None, (
            f"config.layer_types mixes attention types but the layer index of {layer or '<top level>'!r} is "
            "unknown; compile the model whose modules are named like 'model.layers.<i>'"
        )
    kind = layer_types[int(m.group(1))]
    if kind == "sliding_attention":
        return int(window), None
    if kind == "full_attention":
        return None, None
    return None, f"layer type {kind!r} is not supported (only 'full_attention' and 'sliding_attention')"


def site_window(site: SDPASite, config: object | None, proof: MaskProof) -> tuple[int | None, str | None]:
    """The sliding window of ``site`` (``None``: none) and ``None``, or ``(None, reason)`` to refuse.

    A mask built in the graph that :func:`mask_proof` cannot prove to be causal order, same document and a
    sliding window is refused. Sources: the window in the graph that builds the mask (:func:`graph_windows`)
    and, when given, the model config (:func:`config_window`). When both are known they must agree; the config
    is the only source when the mask is a graph input. Whatever the source, the runtime compares the model's
    local mask with the plan's on every step. ``proof``: the site's :func:`mask_proof` (the pass keeps it for the
    site's documents too).
    """
    if proof.reason:
        return None, proof.reason
    in_graph = set(proof.windows)
    if len(in_graph) > 1:
        return None, f"the mask combines several sliding windows {sorted(in_graph)}; cpcompile supports one per layer"
    graph_w = next(iter(in_graph), None)
    if config is None:
        window = graph_w
    else:
        window, reason = config_window(config, site.layer)
        if reason is not None:
            return None, reason
        if in_graph and window != graph_w:
            return None, (
                f"the mask built in the graph has a sliding window of {graph_w} tokens but the config gives "
                f"{window}; pass the config of the model being compiled"
            )
    if window is not None and site.attn_mask is None:
        return None, f"a sliding window of {window} tokens is configured but the call has no mask (is_causal only)"
    if window is not None and window < 1:
        return None, f"sliding window {window} must be at least 1"
    return window, None


# -- kernel, config, attention that is not an SDPA call ---------------------------------------------------
def _kernel_reason(site: SDPASite, kernel: str) -> str | None:
    """Why ``kernel`` cannot run this site (the CUDA library paths on another device), or ``None``."""
    q = site.meta(site.query)
    if kernel in ("flex", "flash_varlen") and q is not None and q.device.type not in ("cuda", "meta"):
        return (
            f"attention={kernel!r} runs on CUDA only, the query is on {q.device.type} (flex_attention has no "
            "CPU backward); use cpcompile.backend(..., attention='auto')"
        )
    return None


def _attn_implementation(config: object) -> str | None:
    return getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", None)


def _config_reason(config: object | None) -> str | None:
    """Why a transformers ``config`` cannot run under CP (non-SDPA attention, soft-capped logits), or ``None``."""
    if config is None:
        return None
    impl = _attn_implementation(config)
    if impl is not None and impl not in ("sdpa", "flex_attention"):
        return (
            f"the model config uses attn_implementation={impl!r}; set attn_implementation='sdpa' (or 'flex_attention')"
        )
    if impl != "flex_attention" and getattr(config, "attn_logit_softcapping", None):  # flex: a score_mod
        return (
            f"the model soft-caps attention logits (attn_logit_softcapping={config.attn_logit_softcapping}), "
            "which SDPA cannot express; set attn_logit_softcapping=None, or attn_implementation='flex_attention'"
        )
    return None


def _non_sdpa_reason(node: fx.Node, what: str, config: object | None) -> str:
    transformers = config is not None or _compat.node_module_class(node).startswith("transformers.")
    fix = (
        "set attn_implementation='sdpa'"
        if transformers
        else "compute this attention with torch.nn.functional.scaled_dot_product_attention"
    )
    return f"it is {what}, not a scaled_dot_product_attention call, and would only see this rank's tokens; {fix}"
