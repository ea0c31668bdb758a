import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_draft, make_target  # noqa: E402

# Modules that hold the longest tests run first: with `pytest -n 2 --dist
# worksteal` (make test) the first worker starts on them, the second on the
# short half, then takes from the first's queue, so neither finishes alone.
SLOW_FIRST = ["test_distributed", "test_smollm2", "test_long_run", "test_variants", "test_sampling", "test_soak"]


def pytest_collection_modifyitems(config, items):
    rank = {m: i for i, m in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: same order inside


def pytest_configure(config):
    """A worker of `pytest -n N` decodes with one OpenBLAS thread: the workers
    already share the cores (and single-threaded the tiny models decode as fast)."""
    import os

    if os.environ.get("PYTEST_XDIST_WORKER"):
        import ctypes

        try:
            ctypes.CDLL(None).openblas_set_num_threads(1)
        except (OSError, AttributeError):  # no OpenBLAS preloaded
            pass


ARCHS = ["qwen3", "llama", "qwen3_5", "qwen3_next", "qwen3_4bit", "gpt_oss"]
HYBRID = ["qwen3_5", "qwen3_next"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def target_folder(tiny_dir):
    """target_folder(arch, tied=False, layers=6) -> a saved tiny target folder."""
    made = {}

    def get(arch: str, tied: bool = False, layers: int = 6) -> Path:
        key = (arch, tied, layers)
        if key not in made:
            name = f"{arch}{'_tied' if tied else ''}{'' if layers == 6 else f'_{layers}l'}"
            made[key] = make_target(tiny_dir / name, arch, tied=tied, layers=layers)
        return made[key]

    return get


@pytest.fixture(scope="session")
def loaded(target_folder):
    """loaded(arch, tied=False, layers=6) -> (model, tokenizer, folder), loaded once."""
    from dflash_mlx import load

    cache = {}

    def get(arch: str, tied: bool = False, layers: int = 6):
        key = (arch, tied, layers)
        if key not in cache:
            folder = target_folder(arch, tied, layers)
            cache[key] = (*load(str(folder)), folder)
        return cache[key]

    return get


@pytest.fixture
def draft_for(tmp_path):
    """draft_for(target_folder, **kw) -> a loaded z-lab-format draft."""
    from dflash_mlx import load_draft

    count = [0]

    def get(folder: Path, **kw):
        count[0] += 1
        return load_draft(str(make_draft(tmp_path / f"draft{count[0]}", folder, **kw)))

    return get


@pytest.fixture(autouse=True)
def _saved_policies(tmp_path, monkeypatch):
    """Runs of the command line keep what "auto" learnt (dflash_mlx.engine.saved):
    here in each test's own folder, never in the user's cache."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
