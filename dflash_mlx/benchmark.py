"""`python -m dflash_mlx.benchmark` and the `dflash-bench` script: DFlash
against plain mlx-lm decoding.

The benchmark itself lives in :mod:`dflash_mlx.bench.benchmark` (its report in
:mod:`dflash_mlx.bench.report`, its prompt sets in
:mod:`dflash_mlx.bench.datasets`); this module is only the entry point.
"""

import sys

from .bench.benchmark import main

if __name__ == "__main__":
    from .blas import preload

    preload("dflash_mlx.benchmark", sys.argv[1:])
    raise SystemExit(main())
