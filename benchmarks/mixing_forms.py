"""What cpcompile does with the token-mixing forms of transformers' hybrid and recurrent families.

Builds a tiny model of every family below from its config (random weights, no download), compiles it with
``cpcompile.backend`` on a fake CP group of 2 (this process is rank 0: the graphs are traced and rewritten as on a
real rank, no data moves), runs one training forward under ``cpcompile.shard`` on a packed batch, and prints one
row per family: the ops outside attention the mixing pass found and what became of each (``gathered``: run on
the whole sequence; ``partial_sum``, ``dispatch``, ``per_token``: accounted for), or the refusal, and the graph
breaks Dynamo reported (code it left to eager, which no pass sees). Whether the accepted forms are exact is
measured by the parity tests (``tests/test_mixing_parity.py``, ``tests/test_moe.py``,
``tests/test_layouts_parity.py``), not here.

    python benchmarks/mixing_forms.py [--family NAME ...]
"""

from __future__ import annotations

import argparse
import collections
import re
import warnings

import torch
import torch.distributed as dist

import cpcompile
from benchmarks._common import print_table
from cpcompile import _compat
from cpcompile.testing import packed_batch, tiny_config

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)
_SSM2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
             mamba_chunk_size=16)  # fmt: skip

#: family -> (transformers class of the model, config class, config fields). The configs keep each family's layer
#: kinds (one of each where the family interleaves them) at the smallest sizes its code accepts.
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "lfm2": ("AutoModelForCausalLM", "", {}),  # cpcompile.testing.tiny_config("lfm2")
    "lfm2_moe": ("AutoModelForCausalLM", "Lfm2MoeConfig", {
        **_SMALL, **_ATTN, "layer_types": ["conv", "full_attention"], "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "num_dense_layers": 1}),
    "mamba": ("MambaForCausalLM", "MambaConfig", {
        **_SMALL, "state_size": 8, "expand": 2, "conv_kernel": 4, "use_mambapy": False}),
    "falcon_mamba": ("FalconMambaForCausalLM", "FalconMambaConfig", {
        **_SMALL, "state_size": 8, "expand": 2, "conv_kernel": 4, "use_mambapy": False}),
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config", {
        **_SMALL, "state_size": 8, "num_heads": 8, "head_dim": 16, "n_groups": 1, "expand": 2, "conv_kernel": 4,
        "chunk_size": 16}),
    "jamba": ("JambaForCausalLM", "JambaConfig", {
        **_SMALL, **_ATTN, "attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2,
        "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2, "mamba_d_state": 8, "mamba_d_conv": 4,
        "mamba_expand": 2, "use_mamba_kernels": False}),
    "bamba": ("BambaForCausalLM", "BambaConfig", {**_SMALL, **_ATTN, **_SSM2, "attn_layer_indices": [1]}),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", {
        **_SMALL, **_ATTN, **_SSM2, "layer_types": ["mamba", "attention"], "num_local_experts": 4,
        "num_experts_per_tok": 2, "shared_intermediate_size": 64}),
    "falcon_h1": ("FalconH1ForCausalLM", "FalconH1Config", {
        **_SMALL, **_ATTN, **_SSM2, "head_dim": 16, "mamba_d_ssm": 128}),
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", {
        **_SMALL, **_ATTN, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}),
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig", {
        **_SMALL, "num_attention_heads": 4, "lru_width": 64, "attention_window_size": 16, "conv1d_width": 4,
        "block_types": ["recurrent", "attention"]}),
    "rwkv": ("RwkvForCausalLM", "RwkvConfig", {
        "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2, "attention_hidden_size": 64,
        "intermediate_size": 128, "context_length": 128}),
    "minimax": ("MiniMaxForCausalLM", "MiniMaxConfig", {
        **_SMALL, **_ATTN, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
        "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 16}),
    "llama_seq_cls": ("LlamaForSequenceClassification", "", {"num_labels": 2, "pad_token_id": 0}),
}  # fmt: skip

#: Families without attention layers (no attention implementation to choose).
NO_ATTENTION = frozenset({"mamba", "falcon_mamba", "mamba2", "rwkv"})

DOCS = [[10, 22], [5, 27]]  # T = 32: chunks of 16 at CP = 2, documents that cross the chunk edge


def build(family: str) -> torch.nn.Module:
    import transformers

    model_cls, config_cls, fields = FAMILIES[family]
    if not config_cls:  # a family of cpcompile.testing, or its sequence-classification head
        config = tiny_config("llama" if family == "llama_seq_cls" else family, **fields)
    else:
        config = getattr(transformers, config_cls)(**fields)
        if family not in NO_ATTENTION:
            config._attn_implementation = "sdpa"
    cls = getattr(transformers, model_cls)
    torch.manual_seed(0)
    model = cls.from_config(config) if model_cls.startswith("Auto") else cls(config)
    return model.train()


def _short(e: BaseException, limit: int = 260) -> str:
    """The message's first line up to its fix, with package paths from ``site-packages/`` on."""
    text = re.sub(r"\S*site-packages/", "", str(e).splitlines()[0]).split(" Fix: ")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def survey(family: str, group) -> dict:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    row = {"family": family}
    try:
        model = build(family)
    except Exception as e:  # noqa: BLE001 - a config this transformers release rejects is reported, not fatal
        return {**row, "class": "", "outcome": f"not built: {type(e).__name__}: {str(e).splitlines()[0][:90]}"}
    row["class"] = type(model).__name__
    backend = cpcompile.backend(group, inner="eager")
    batch = packed_batch(DOCS)
    if family == "llama_seq_cls":
        batch = {k: v for k, v in batch.items() if k != "labels"}  # one label per row, not per token
    try:
        with warnings.catch_warnings(), cpcompile.shard(batch, group) as local:
            warnings.simplefilter("ignore")
            torch.compile(model, backend=backend)(**local)
        outcome = "compiled"
    except (cpcompile.UnsupportedMixingError, cpcompile.UnsupportedAttentionError) as e:
        outcome = f"refused ({type(e).__name__}): {_short(e)}"
    except cpcompile.UnsupportedPositionError as e:
        outcome = f"refused (UnsupportedPositionError): {_short(e)}"
    except Exception as e:  # noqa: BLE001 - anything else is a finding of its own
        outcome = f"error: {type(e).__name__}: {_short(e)}"
    found = collections.Counter(f"{r.op}: {r.action}" for r in backend.mixing_reports)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return {
        **row,
        "mixing ops found (op: action, count)": "; ".join(f"{k} x{v}" for k, v in sorted(found.items())) or "-",
        "attention sites rewritten": sum(r.action == "rewritten" for r in backend.reports),
        "graph breaks": breaks,
        "outcome": outcome,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: every family")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _compat.init_fake_process_group(rank=0, world_size=2)
    try:
        rows = [survey(f, dist.group.WORLD) for f in args.family or FAMILIES]
    finally:
        dist.destroy_process_group()
    print_table("mixing forms of transformers families at CP=2", rows)


if __name__ == "__main__":
    main()
