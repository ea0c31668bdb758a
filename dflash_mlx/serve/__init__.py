"""The OpenAI-compatible HTTP server (server) and its batching scheduler;
run it with `python -m dflash_mlx.server`."""
