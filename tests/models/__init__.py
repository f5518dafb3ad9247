"""Tiny models of the spellings the backend must handle, all one model (:class:`.tiny.TinyLM`) with pluggable
parts: attention and mask forms (:mod:`.attention`), flex attention (:mod:`.flex`), KV-head expansions
(:mod:`.kv_heads`), ops that mix tokens (:mod:`.mixing`) and position computations of model libraries
(:mod:`.positions`, which also wraps torchtitan's and litgpt's own models). transformers families come from
:data:`cpcompile.testing.FAMILIES`."""
