"""Newer z-lab draft config forms (issue 35 item 1): drafts mixing sliding and
full attention layers (Qwen3.6-27B's: 4 sliding + 1 full), transformers >= 5
spellings (rope_parameters, dtype, dflash_config.block_size) against the flat
ones, and forms that cannot run refused in one line."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import DraftConfigError, load_draft, stream_generate
from dflash_mlx.models.config import DFlashConfig
from test_config import _reference
from tiny import make_draft
from util import dflash_tokens, mlx_run, runs

PROMPT = "def foo(x):\n    return"
MIXED = dict(layers=5, layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=6, torch_dtype="bfloat16")


def _nested(flat, folder):
    """The same draft, its config spelt as transformers >= 5 writes it."""
    shutil.copytree(flat, folder)
    cfg = json.loads((flat / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_theta": cfg.pop("rope_theta"), "rope_type": "default"}
    cfg.pop("rope_scaling")
    cfg["dflash_config"]["block_size"] = cfg.pop("block_size")
    cfg["dtype"] = cfg.pop("torch_dtype")
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_mixed_layers_forward_matches_reference(target_folder, tmp_path):
    """4 sliding + 1 full layers with context arriving over three rounds,
    some of it already outside the window when it arrives."""
    draft = load_draft(str(make_draft(tmp_path / "d", target_folder("qwen3"), seed=5, **MIXED)))
    assert [draft.config.is_sliding(i) for i in range(5)] == [True] * 4 + [False]
    mx.random.seed(6)
    feats = mx.random.normal((1, 23, len(draft.config.target_layer_ids) * 64))
    cache = draft.make_cache()
    for a, b in ((0, 12), (12, 19)):
        draft(mx.random.normal((1, 4, 64)), feats[:, a:b], cache)
    x = mx.random.normal((1, 4, 64))
    got = draft(x, feats[:, 19:], cache)
    np.testing.assert_allclose(np.array(got), np.array(_reference(draft, x, feats)), atol=1e-4)


def test_mixed_layers_decode_losslessly(loaded, tmp_path):
    """Qwen3.6-27B's draft shape, window 6 (shorter than the prompt), bf16 and
    nested spellings: token-identical to mlx-lm at block 1, 4 and 16."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref, text = mlx_run(model, tok, PROMPT, 32)
    flat = make_draft(tmp_path / "flat", folder, mask_token_id=runs(ref)[0], echo=True, **MIXED)
    draft = load_draft(str(_nested(flat, tmp_path / "nested")))
    accepted = set()
    for bs in (1, 4, 16):
        out, rs = dflash_tokens(model, draft, tok, PROMPT, block_size=bs, max_tokens=32)
        assert out == ref, bs
        assert "".join(r.text for r in rs) == text
        accepted |= {(bs, r.accepted) for r in rs[1:] if r.finish_reason is None}
    assert {(4, 1), (16, 1)} <= accepted and any(1 < a < bs for bs, a in accepted), accepted


def test_nested_and_flat_spellings_accept_the_same(loaded, tmp_path):
    """rope_parameters / dflash_config.block_size / dtype against rope_theta /
    block_size / torch_dtype: the same draft, round for round."""
    model, tok, folder = loaded("qwen3", tied=True)
    flat = make_draft(tmp_path / "flat", folder, seed=7, **MIXED)
    nested = _nested(flat, tmp_path / "nested")
    assert "rope_theta" not in json.loads((nested / "config.json").read_text())
    a, b = load_draft(str(flat)), load_draft(str(nested))
    assert (a.block_size, a.config.rope_theta, a.config.dtype) == (b.block_size, b.config.rope_theta, b.config.dtype)
    rounds = [[(r.tokens, r.accepted) for r in stream_generate(model, d, tok, PROMPT, block_size=16, max_tokens=24)]
              for d in (a, b)]
    assert rounds[0] == rounds[1]


def test_forms_that_cannot_run_are_refused(target_folder, tmp_path):
    cfg = json.loads((make_draft(tmp_path / "d", target_folder("qwen3"), **MIXED) / "config.json").read_text())
    for bad, msg in [
        ({**cfg, "layer_types": ["sliding_attention"] * 4 + ["linear_attention"]}, "'linear_attention'"),
        ({**cfg, "dtype": "float8"}, "'dtype' must be one of"),
        ({**cfg, "dtype": "bfloat16", "torch_dtype": "float16"}, "must agree"),
        ({**cfg, "block_size": 8, "dflash_config": {**cfg["dflash_config"], "block_size": 16}}, "must agree"),
        ({**cfg, "hidden_act": "gelu"}, "hidden_act"),
        ({**cfg, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
        ({**cfg, "rope_parameters": {"sliding_attention": {"rope_theta": 1e4}}}, "per layer type"),
        ({**cfg, "sliding_window": None}, "sliding_window"),
    ]:
        with pytest.raises(DraftConfigError, match=msg):
            DFlashConfig.from_dict(bad)
