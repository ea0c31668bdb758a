"""`python -m dflash_mlx.train` and the `dflash-train` script: train a DFlash
draft for an mlx-lm target.

The training itself lives in :mod:`dflash_mlx.training.train` (its data in
:mod:`dflash_mlx.training.data`); this module is only the entry point.
"""

import sys

from .training.train import main

if __name__ == "__main__":
    from dflash_mlx.blas import preload

    preload("dflash_mlx.train", sys.argv[1:])
    sys.exit(main())
