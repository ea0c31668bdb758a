"""Training a DFlash draft (train) and its data (data); run it with
`python -m dflash_mlx.train`."""
