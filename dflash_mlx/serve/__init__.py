"""The OpenAI-compatible HTTP server (server), its wire format (wire) and its
batching scheduler; run it with `python -m dflash_mlx.server`."""
