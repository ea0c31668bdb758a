# dflash_mlx: `make demo` runs SmolLM2-135M-Instruct with its embedded draft,
# `make test` runs the tests.
# Both create .venv and install what they need (on Linux also the system
# OpenBLAS, which makes MLX's CPU backend ~30x faster than its bundled BLAS).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BLAS = $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0 /usr/lib64/libopenblas.so.0))
RUN = $(if $(BLAS),LD_PRELOAD=$(BLAS) )$(PY)

.PHONY: install blas test demo bench clean

install: $(VENV)/.installed blas

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

# Best effort: Debian/Ubuntu as root. Elsewhere MLX still works, only slower.
blas:
	@if [ "$$(uname)" = "Linux" ] && [ -z "$(BLAS)" ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		(apt-get update -qq && apt-get install -y -qq libopenblas0-pthread) >/dev/null 2>&1 \
		|| echo "note: could not install libopenblas0-pthread; MLX-CPU will be slow"; \
	fi

test: install
	$(MAKE) --no-print-directory _test

# Two worker processes (pytest-xdist); TEST_WORKERS=0 runs in one process.
# worksteal: each worker starts on its half of the (slowest-first) order and
# an idle one takes from the other's queue, so the two-rank launches run one
# after the other on one worker instead of competing for the two cores.
# One BLAS thread per worker: two workers on two cores already fill them
# (measured 2026-12-03: 6m26s -> 5m08s for the suite, 321 tests).
TEST_WORKERS ?= 2
_test:
	$(if $(filter 0,$(TEST_WORKERS)),,OPENBLAS_NUM_THREADS=1 )$(RUN) -m pytest -q tests -n $(TEST_WORKERS) --dist worksteal

demo: install
	$(MAKE) --no-print-directory _demo

_demo:
	$(RUN) -m dflash_mlx.generate --compare

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# `make bench BENCH_ARGS="--max-samples 4"` passes extra flags.
bench: install
	$(MAKE) --no-print-directory _bench

_bench:
	$(RUN) -m dflash_mlx.benchmark --out bench_out/results.json $(BENCH_ARGS)

# Rebuild the embedded SmolLM2 draft (stages and timings: dflash_mlx/smollm2/STAGES.md);
# SMOLLM2_ARGS="--stages train --minutes 30 --init dflash_mlx/smollm2/draft" adds a stage.
.PHONY: smollm2-draft _smollm2-draft
smollm2-draft: install
	$(MAKE) --no-print-directory _smollm2-draft

_smollm2-draft:
	$(RUN) -m dflash_mlx.smollm2.build $(SMOLLM2_ARGS)

# Rebuild the toy demo pair (a test fixture) from scratch (~2.3 h on 2 cores);
# DEMO_ARGS=--fast for a reduced build.
.PHONY: demo-pair _demo-pair
demo-pair: install
	$(MAKE) --no-print-directory _demo-pair

_demo-pair:
	$(RUN) -m dflash_mlx.demo.build $(DEMO_ARGS)
