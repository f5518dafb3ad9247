"""Tiny models of the spellings the backend must handle: attention and mask forms (:mod:`.attention`), KV-head
expansions (:mod:`.kv_heads`), ops that mix tokens (:mod:`.mixing`) and position computations of model libraries
(:mod:`.positions`). transformers families come from :data:`cpcompile.testing.FAMILIES`."""
