"""Getting models in: loading targets and drafts, the draft's config, short
model names (registry), GGUF conversion, and multi-machine (distributed) runs."""
