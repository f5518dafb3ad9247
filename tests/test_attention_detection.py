"""What the pass does with each kind of attention, on captured Dynamo graphs (single process, no collectives).

The pass runs with ``cp_size=2`` on graphs captured from tiny transformers models: SDPA sites get their
sliding windows (from the graph and the config), attention that is not SDPA is refused naming the layer,
and graphs without attention pass through untouched.
"""

from __future__ import annotations

import copy

import pytest
import torch

from cpcompile import ops
from cpcompile.passes import sdpa_cp
from cpcompile.passes.sdpa_cp import UnsupportedAttentionError, config_window
from cpcompile.testing import packed_batch, tiny_config, tiny_model
from tests.harness import graphs as _graphs

BATCH_DOCS = [[24, 30, 10], [5, 50, 9]]


def capture(model, *args, **kwargs):
    """The Dynamo graph(s) of one call of ``model`` (nothing rewritten)."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=grab)(*args, **kwargs)
    return graphs


def capture_family(family, **overrides):
    (gm,) = capture(tiny_model(family, **overrides), **packed_batch(BATCH_DOCS), use_cache=False)
    return gm


def run_pass(gm, config=None, refuse="raise"):
    return _graphs.run_pass(gm, refuse=refuse, config=config)


def test_eager_attention_is_refused_naming_layer_and_fix():
    gm = capture_family("llama", attn_implementation="eager")
    assert not sdpa_cp.find_sdpa_sites(gm)  # no SDPA node: without detection it would run local-only
    with pytest.raises(UnsupportedAttentionError) as e:
        run_pass(gm)
    msg = str(e.value)
    assert "model.layers.0.self_attn" in msg and "set attn_implementation='sdpa'" in msg, msg
    # the config alone refuses it too, before looking at the graph
    with pytest.raises(UnsupportedAttentionError, match="attn_implementation='eager'"):
        run_pass(gm, config=tiny_config("llama", attn_implementation="eager"))
    reports = run_pass(gm, refuse="report")
    assert reports and all(r.action == "refused" for r in reports)
    # with CP of size 1 nothing is sharded, so nothing is refused
    assert _graphs.run_pass(gm, cp_size=1) == []


def test_attention_dropout_in_training_is_refused():
    gm = capture_family("llama", attention_dropout=0.1)
    with pytest.raises(UnsupportedAttentionError, match="dropout"):
        run_pass(gm)


def test_graph_without_attention_passes_through():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(2, 5, 8)
    (gm,) = capture(mlp, x)
    before = [str(n.format_node()) for n in gm.graph.nodes]
    assert run_pass(gm) == []
    assert [str(n.format_node()) for n in gm.graph.nodes] == before


def test_sliding_windows_per_layer_from_graph_and_config():
    # Gemma3: layer 0 sliding (window 20), layer 1 global
    gm = capture_family("gemma3")
    sites = sdpa_cp.find_sdpa_sites(gm)
    assert [sdpa_cp.graph_windows(s) for s in sites] == [{20}, set()]
    config = tiny_config("gemma3")
    assert [sdpa_cp.site_window(s, config, sdpa_cp.mask_proof(s)) for s in sites] == [(20, None), (None, None)]
    assert [sdpa_cp.site_window(s, None, sdpa_cp.mask_proof(s)) for s in sites] == [(20, None), (None, None)]
    # a config whose window disagrees with the mask the model builds is refused, naming both windows
    wrong = copy.deepcopy(config)
    wrong.sliding_window = 7
    window, reason = sdpa_cp.site_window(sites[0], wrong, sdpa_cp.mask_proof(sites[0]))
    assert window is None and "20" in reason and "7" in reason, reason
    with pytest.raises(UnsupportedAttentionError, match="sliding window of 20"):
        run_pass(gm, config=wrong)
    # the rewritten graph's plan op of each site carries the site's window (in its registered description)
    gm = capture_family("gemma3")
    run_pass(gm, config=config)
    specs = [ops.site_spec(n.args[-1]) for n in gm.graph.nodes if n.target is torch.ops.cpcompile.site_plan.default]
    assert [s.window for s in specs] == [20, None]
    assert [s.documents for s in specs] == [True, True]  # document masks


def test_mistral_window_on_every_layer():
    gm = capture_family("mistral")
    assert [sdpa_cp.graph_windows(s) for s in sdpa_cp.find_sdpa_sites(gm)] == [{6}, {6}]


def test_config_window_rules():
    # the source used when the mask is a graph input (one graph per layer under FSDP2)
    gemma = tiny_config("gemma3")
    assert config_window(gemma, "model.layers.0.self_attn") == (20, None)
    assert config_window(gemma, "model.layers.1.self_attn") == (None, None)
    assert config_window(gemma, "")[1] is not None  # layer unknown: refuse rather than guess
    assert config_window(tiny_config("mistral"), "anything") == (6, None)
    assert config_window(tiny_config("llama"), "model.layers.0.self_attn") == (None, None)
    assert config_window(tiny_config("qwen2"), "model.layers.0.self_attn") == (None, None)
    chunked = copy.deepcopy(gemma)
    chunked.layer_types = ["chunked_attention", "full_attention"]
    assert "chunked_attention" in config_window(chunked, "model.layers.0.self_attn")[1]


def test_sdpa_inside_activation_checkpointing_is_found():
    # checkpointed decoder layers are traced as nested graphs of a higher-order op; their SDPA calls must
    # be rewritten there, not left to run on the local chunk
    model = tiny_model("llama")
    model.gradient_checkpointing_enable()
    (gm,) = capture(model, **packed_batch(BATCH_DOCS), use_cache=False)
    sites = sdpa_cp.find_sdpa_sites(gm)
    assert len(sites) == 2 and all(s.node.graph is not gm.graph for s in sites)
    reports = run_pass(gm)
    assert [r.action for r in reports] == ["rewritten", "rewritten"]
    nested = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule) and m is not gm]
    plan_ops = [n for m in nested for n in m.graph.nodes if n.target is torch.ops.cpcompile.site_plan.default]
    assert len(plan_ops) == 2
