"""Tiny transformers models and synthetic packed batches for tests, examples and benchmarks.

Models are built from configs with random weights (no downloads). Requires ``transformers``.
"""

from __future__ import annotations

import torch

from cpcompile.inspect.batch import packed_batch

__all__ = ["FAMILIES", "HYBRID_FAMILIES", "MOE_FAMILIES", "tiny_config", "tiny_model", "packed_batch"]

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)

#: family name -> (transformers config class name, extra config fields)
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v projections with bias
    "mistral": ("MistralConfig", {"sliding_window": 6}),  # every layer windowed, window < chunk
    "gemma3": (  # sliding and global layers interleaved; window larger than a CP=4 chunk of the test batches
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            "sliding_window": 20,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "phi3": ("Phi3Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "granite": ("GraniteConfig", {}),
    # Mixture of experts: transformers' MoE dispatch sorts the tokens by expert and undoes the sort with an
    # arange over tokens x top_k (token bookkeeping, not positions). 4 experts, 2 per token.
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    # hybrid: a short causal conv layer (depthwise conv1d, kernel 3) before an attention layer
    "lfm2": ("Lfm2Config", {"layer_types": ["conv", "full_attention"]}),
}

# DeepSeek-V3-style routing (GLM-4-MoE shares it): routed and shared experts, a dense first layer, grouped top-k.
_SHARED_EXPERTS = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}

#: MoE families checked for exactness at CP=2 and 3 next to :data:`FAMILIES`' (tests/test_moe.py), with their
#: own routers (OLMoE, GraniteMoE), a dense first layer, shared experts and grouped routing (GLM-4-MoE), and
#: multi-head latent attention (DeepSeek-V3: K/V written into a buffer in place, value head dim != query's).
MOE_FAMILIES: dict[str, tuple[str, dict]] = {
    "olmoe": (
        "OlmoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    ),
    "granitemoe": ("GraniteMoeConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 16, **_SHARED_EXPERTS}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            **_SHARED_EXPERTS,
            "num_key_value_heads": 4,
            "q_lora_rank": None,
            "kv_lora_rank": 16,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
        },
    ),
}

#: A gated delta-net layer (2 key / 4 value heads of 16, conv kernel 4) before an attention layer, no cache (the
#: recurrence runs on the sequence): what every family of :data:`HYBRID_FAMILIES` shares.
_GATED_DELTA_NET = {
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "use_cache": False,
}
#: MoE feed-forwards of the Qwen hybrids: 4 experts, 2 per token, a shared expert.
_HYBRID_EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}

#: Hybrid families whose recurrent mixer runs head-parallel under CP (:mod:`cpcompile.cores`), checked in
#: tests/test_hybrids_parity.py.
HYBRID_FAMILIES: dict[str, tuple[str, dict]] = {
    # the gated delta-net layer before a gated attention layer, MoE feed-forwards
    "qwen3_next": ("Qwen3NextConfig", {**_GATED_DELTA_NET, **_HYBRID_EXPERTS, "head_dim": 16}),
    # Qwen3.5 (text): the same layers, dense feed-forwards
    "qwen3_5": ("Qwen3_5TextConfig", {**_GATED_DELTA_NET, "head_dim": 16}),
    # Qwen3.5-MoE (text): the same layers, MoE feed-forwards
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", {**_GATED_DELTA_NET, **_HYBRID_EXPERTS, "head_dim": 16}),
    # OLMo-Hybrid: the same core (beta doubled: negative eigenvalues allowed), dense feed-forwards; its default
    # special token ids exceed the tiny vocabulary
    "olmo_hybrid": ("OlmoHybridConfig", {**_GATED_DELTA_NET, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
}
#: A Mamba2 (SSD) mixer of 8 heads of 16 in 2 groups (heads x head dim = expand x hidden), state 8, conv kernel 4,
#: chunks of 16 tokens, no cache: the Mamba2-core families of :data:`HYBRID_FAMILIES`. Weights are drawn with std
#: 0.1: at transformers' 0.02 the state a token carries in from earlier ones moves the logits by ~1e-6, below what a
#: parity check can tell apart from rounding.
_SSD_INIT = {"initializer_range": 0.1}
_SSD = {
    **_SSD_INIT,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 2,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "use_cache": False,
}
HYBRID_FAMILIES.update(
    {
        # Bamba: a Mamba2 layer before an attention layer, dense feed-forwards
        "bamba": ("BambaConfig", {**_SSD, "attn_layer_indices": [1]}),
        # Granite-4 hybrid: the same layers, MoE feed-forwards with a shared expert
        "granitemoehybrid": (
            "GraniteMoeHybridConfig",
            {
                **_SSD,
                "layer_types": ["mamba", "attention"],
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "shared_intermediate_size": 64,
            },
        ),
        # Falcon-H1: attention and a Mamba2 mixer side by side in every layer
        "falcon_h1": ("FalconH1Config", {**_SSD, "mamba_d_ssm": 128}),
        # Mamba2: Mamba2 layers only (no attention)
        "mamba2": (
            "Mamba2Config",
            {
                **_SSD_INIT,
                "num_heads": 8,
                "head_dim": 16,
                "n_groups": 2,
                "state_size": 8,
                "expand": 2,
                "conv_kernel": 4,
                "chunk_size": 16,
                "use_cache": False,
            },
        ),
        # Zamba2: a Mamba2 layer, then a hybrid layer (a shared attention block on the hidden states next to the
        # embeddings, then a Mamba2 layer)
        "zamba2": (
            "Zamba2Config",
            {
                **_SSD_INIT,
                "num_key_value_heads": 4,
                "mamba_d_state": 8,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_ngroups": 2,
                "mamba_headdim": 16,
                "n_mamba_heads": 8,
                "chunk_size": 16,
                "layers_block_type": ["mamba", "hybrid"],
                "hybrid_layer_ids": [1],
                "use_shared_attention_adapter": False,
                "num_mem_blocks": 1,
                "attention_head_dim": 16,
                "use_cache": False,
            },
        ),
        # Nemotron-H: a Mamba2 layer, an attention layer and an MLP layer
        "nemotron_h": (
            "NemotronHConfig",
            {
                **_SSD_INIT,
                "mamba_num_heads": 8,
                "mamba_head_dim": 16,
                "n_groups": 2,
                "ssm_state_size": 8,
                "conv_kernel": 4,
                "expand": 2,
                "chunk_size": 16,
                "use_cache": False,
                "head_dim": 16,
                "num_hidden_layers": 3,
                "layers_block_type": ["linear_attention", "full_attention", "mlp"],
            },
        ),
    }
)
#: A Mamba (selective scan) mixer of 128 channels (expand 2 x hidden), state 8, conv kernel 4, time-step rank 8,
#: no cache: the selective-scan families of :data:`HYBRID_FAMILIES`. Weights drawn with std 0.1, as for the SSD.
_SELECTIVE = {**_SSD_INIT, "use_cache": False, "use_mambapy": False}
HYBRID_FAMILIES.update(
    {
        # Mamba: Mamba layers only (no attention)
        "mamba": ("MambaConfig", {**_SELECTIVE, "state_size": 8, "expand": 2, "conv_kernel": 4, "time_step_rank": 8}),
        # FalconMamba: the same layers, RMS-normalised B, C and dt
        "falcon_mamba": (
            "FalconMambaConfig",
            {**_SELECTIVE, "state_size": 8, "expand": 2, "conv_kernel": 4, "time_step_rank": 8},
        ),
        # Jamba: a Mamba layer with a dense feed-forward, then an attention layer with MoE feed-forwards
        "jamba": (
            "JambaConfig",
            {
                **_SELECTIVE,
                "mamba_d_state": 8,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_dt_rank": 8,
                "attn_layer_period": 2,
                "attn_layer_offset": 1,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "expert_layer_period": 2,
                "expert_layer_offset": 1,
            },
        ),
        # Zamba: a Mamba layer of 2 Mamba heads (one scan call per head), then a hybrid layer (a shared attention
        # block, then a Mamba layer)
        "zamba": (
            "ZambaConfig",
            {
                **_SELECTIVE,
                "n_mamba_heads": 2,
                "mamba_d_state": 8,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_dt_rank": 8,
                "attention_head_dim": 16,
                "num_key_value_heads": 4,
                "layers_block_type": ["linear_attention", "hybrid"],
            },
        ),
    }
)
#: RecurrentGemma: an RG-LRU layer (a conv of kernel 4, then a diagonal recurrence over 64 channels that restarts at
#: every document's first token, ``position_ids == 0``), then a sliding-window attention layer (window 16); no cache.
HYBRID_FAMILIES["recurrent_gemma"] = (
    "RecurrentGemmaConfig",
    {
        "lru_width": 64,
        "attention_window_size": 16,
        "conv1d_width": 4,
        "block_types": ["recurrent", "attention"],
        "use_cache": False,
    },
)
#: RWKV (v4): two blocks of a token shift (``nn.ZeroPad2d((0, 0, 1, -1))``) and the WKV recurrence over 64 channels
#: (``rwkv_linear_attention``), then a token-shifted feed-forward; no attention, no cache.
HYBRID_FAMILIES["rwkv"] = (
    "RwkvConfig",
    {"attention_hidden_size": 64, "context_length": 128, "use_cache": False},
)
#: MiniMax: a lightning-attention layer (4 heads of 16, blocks of 16 tokens), then an attention layer, MoE
#: feed-forwards (4 experts, 2 per token); no cache.
HYBRID_FAMILIES["minimax"] = (
    "MiniMaxConfig",
    {
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "block_size": 16,
        "use_cache": False,
    },
)
#: Families without attention layers: built without an attention implementation.
NO_ATTENTION = frozenset({"mamba2", "mamba", "falcon_mamba", "rwkv"})
_ALL_FAMILIES = {**FAMILIES, **MOE_FAMILIES, **HYBRID_FAMILIES}


def tiny_config(family: str, **overrides):
    """A small config of ``family`` (:data:`FAMILIES`, :data:`MOE_FAMILIES`, :data:`HYBRID_FAMILIES`): 2 layers,
    hidden 64, 4/2 heads, SDPA.

    ``overrides`` replace config fields; ``attn_implementation="eager"`` builds the non-SDPA variant.
    """
    import transformers

    if family not in _ALL_FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(_ALL_FAMILIES)}")
    cls_name, extra = _ALL_FAMILIES[family]
    fields = {**_COMMON, **extra, **overrides}
    config = getattr(transformers, cls_name)(**fields)
    if family not in NO_ATTENTION:
        config._attn_implementation = overrides.get("attn_implementation", "sdpa")
    return config


def tiny_model(family: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised causal LM of ``family`` (same weights for the same ``seed``), in train mode."""
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    attention = {} if family in NO_ATTENTION else {"attn_implementation": config._attn_implementation}
    model = transformers.AutoModelForCausalLM.from_config(config, **attention)
    return model.to(dtype).train()
