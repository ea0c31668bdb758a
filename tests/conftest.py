import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_draft, make_target  # noqa: E402

ARCHS = ["qwen3", "llama", "qwen3_5", "qwen3_next", "qwen3_4bit", "gpt_oss"]
HYBRID = ["qwen3_5", "qwen3_next"]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def target_folder(tiny_dir):
    """target_folder(arch, tied=False) -> a saved tiny target folder."""
    made = {}

    def get(arch: str, tied: bool = False) -> Path:
        key = (arch, tied)
        if key not in made:
            made[key] = make_target(tiny_dir / f"{arch}{'_tied' if tied else ''}", arch, tied=tied)
        return made[key]

    return get


@pytest.fixture(scope="session")
def loaded(target_folder):
    """loaded(arch, tied=False) -> (model, tokenizer, folder), loaded once."""
    from dflash_mlx import load

    cache = {}

    def get(arch: str, tied: bool = False):
        key = (arch, tied)
        if key not in cache:
            folder = target_folder(arch, tied)
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
