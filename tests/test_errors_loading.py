"""Loading failures: one clear DFlashError each, nothing half-written."""

import json
import os
import shutil
import warnings

import mlx.core as mx
import pytest

from dflash_mlx import (
    DraftConfigError,
    DraftWeightsError,
    IncompatibleDraftError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
    check_compatible,
    load,
    load_draft,
    save_draft,
)
from tiny import make_draft
from util import dflash_tokens, mlx_tokens


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def test_target_errors(target_folder, tmp_path, offline):
    src = target_folder("qwen3")
    with pytest.raises(ModelNotFoundError, match="neither a local folder"):
        load(str(tmp_path / "missing" / "model"))
    with pytest.raises(ModelNotFoundError, match="hub"):
        load("nobody/no-such-model")
    d = copy(src, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load(str(d))
    d = copy(src, tmp_path / "badjson")
    (d / "config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load(str(d))
    d = copy(src, tmp_path / "arch")
    edit_json(d / "config.json", model_type="not_a_model")
    with pytest.raises(UnsupportedModelError, match="model_type"):
        load(str(d))
    d = copy(src, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        load(str(d))
    d = copy(src, tmp_path / "trunc")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="corrupt"):
        load(str(d))
    d = copy(src, tmp_path / "badtype")
    edit_json(d / "config.json", hidden_size="sixty-four")
    with pytest.raises(ModelLoadError):
        load(str(d))


def test_draft_errors(target_folder, tmp_path, offline):
    src = make_draft(tmp_path / "src", target_folder("qwen3"))
    with pytest.raises(ModelNotFoundError, match="hub"):
        load_draft("z-lab/Qwen3-8B-DFlash-b16")
    d = copy(src, tmp_path / "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(DraftConfigError, match="No config.json"):
        load_draft(str(d))
    d = copy(src, tmp_path / "wrongtype")
    edit_json(d / "config.json", num_hidden_layers=2.5)
    with pytest.raises(DraftConfigError, match="num_hidden_layers"):
        load_draft(str(d))
    d = copy(src, tmp_path / "badids")
    edit_json(d / "config.json", dflash_config={"mask_token_id": 1, "target_layer_ids": "1,2"})
    with pytest.raises(DraftConfigError, match="target_layer_ids"):
        load_draft(str(d))
    d = copy(src, tmp_path / "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(DraftWeightsError, match="No model\\*.safetensors"):
        load_draft(str(d))
    d = copy(src, tmp_path / "trunc")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftWeightsError, match="not a readable"):
        load_draft(str(d))
    w = mx.load(str(src / "model.safetensors"))
    d = copy(src, tmp_path / "extra")
    mx.save_safetensors(str(d / "model.safetensors"), {**w, "lm_head.weight": w["norm.weight"]})
    with pytest.raises(DraftWeightsError, match="unexpected lm_head.weight"):
        load_draft(str(d))
    d = copy(src, tmp_path / "shape")
    mx.save_safetensors(str(d / "model.safetensors"), {**w, "norm.weight": mx.zeros((3,))})
    with pytest.raises(DraftWeightsError, match="shape"):
        load_draft(str(d))


def test_incompatible_drafts(loaded, tmp_path):
    model, tok, folder = loaded("qwen3")
    cases = [
        (dict(hidden_size=32, head_dim=8), "hidden_size"),
        (dict(vocab_size=1000), "vocab_size"),
        (dict(dflash_config={"mask_token_id": 3, "target_layer_ids": [2, 6]}), "layers"),
        (dict(mask_token_id=99_999), "mask_token_id"),
    ]
    for i, (kw, msg) in enumerate(cases):
        draft = load_draft(str(make_draft(tmp_path / f"d{i}", folder, **kw)))
        with pytest.raises(IncompatibleDraftError, match=msg):
            check_compatible(draft, model)
        with pytest.raises(IncompatibleDraftError):
            next(iter(dflash_tokens(model, draft, tok, "hi", max_tokens=5)))
    # a different target depth only warns, and decoding stays exact
    draft = load_draft(str(make_draft(tmp_path / "depth", folder, num_target_layers=36)))
    with pytest.warns(UserWarning, match="36-layer target"):
        out, _ = dflash_tokens(model, draft, tok, "import os\n", max_tokens=20)
    assert out == mlx_tokens(model, tok, "import os\n", 20)


def test_save_draft_leaves_nothing_half_written(target_folder, tmp_path):
    draft = load_draft(str(make_draft(tmp_path / "src", target_folder("qwen3"))))
    out = tmp_path / "out"
    draft.config.extra["not_serialisable"] = object()
    with pytest.raises(TypeError):
        save_draft(draft, str(out))
    assert os.listdir(out) == []
    del draft.config.extra["not_serialisable"]
    save_draft(draft, str(out))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_draft(str(out)).config.to_dict() == draft.config.to_dict()
