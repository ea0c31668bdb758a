"""The benchmark against plain mlx-lm decoding (benchmark), its report and its
prompt sets (datasets); run it with `python -m dflash_mlx.benchmark`."""
