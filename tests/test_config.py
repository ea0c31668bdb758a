"""The z-lab draft format: config fields, derived layer ids, strict weights,
and the draft forward pass against a direct computation."""

import json

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import (
    DraftConfigError,
    DraftWeightsError,
    IncompatibleDraftError,
    check_compatible,
    load_draft,
)
from dflash_mlx.models.config import DFlashConfig, default_layer_ids
from tiny import make_draft


def test_default_layer_ids():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(36, 1) == [18]
    assert default_layer_ids(6, 2) == [1, 3]


def test_draft_without_layer_ids(target_folder, tmp_path):
    folder = make_draft(tmp_path / "d", target_folder("qwen3"), layers=2, with_layer_ids=False)
    cfg = json.loads((folder / "config.json").read_text())
    assert "target_layer_ids" not in cfg["dflash_config"]
    draft = load_draft(str(folder))
    assert draft.config.target_layer_ids == default_layer_ids(6, 2)
    assert draft.fc.weight.dtype == mx.float32  # bf16 on disk, float32 on CPU


def test_weights_are_bf16_on_disk(target_folder, tmp_path):
    folder = make_draft(tmp_path / "d", target_folder("qwen3"))
    w = mx.load(str(folder / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in w.values())
    assert "fc.weight" in w and "layers.0.self_attn.q_norm.weight" in w
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in w)


def test_config_errors(target_folder, tmp_path):
    folder = make_draft(tmp_path / "d", target_folder("qwen3"))
    cfg = json.loads((folder / "config.json").read_text())
    for bad, msg in [
        ({**cfg, "hidden_size": "64"}, "hidden_size"),
        ({k: v for k, v in cfg.items() if k != "dflash_config"}, "mask_token_id"),
        ({**cfg, "layer_types": ["sliding_attention"]}, "layer_types"),
    ]:
        with pytest.raises(DraftConfigError, match=msg):
            DFlashConfig.from_dict(bad)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(DraftConfigError, match="not valid JSON"):
        load_draft(str(folder))


def test_weight_errors(target_folder, tmp_path):
    folder = make_draft(tmp_path / "d", target_folder("qwen3"))
    w = mx.load(str(folder / "model.safetensors"))
    w.pop("norm.weight")
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    with pytest.raises(DraftWeightsError, match="missing norm.weight"):
        load_draft(str(folder))
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(DraftWeightsError, match="not a readable"):
        load_draft(str(folder))


def test_compatibility(loaded, tmp_path):
    model, _, folder = loaded("qwen3")
    too_deep = make_draft(tmp_path / "a", folder, dflash_config={"mask_token_id": 300, "target_layer_ids": [1, 9]})
    with pytest.raises(IncompatibleDraftError, match="layers"):
        check_compatible(load_draft(str(too_deep)), model)
    bad_mask = make_draft(tmp_path / "b", folder, mask_token_id=10_000)
    with pytest.raises(IncompatibleDraftError, match="mask_token_id"):
        check_compatible(load_draft(str(bad_mask)), model)


def test_sliding_window_layers(loaded, tmp_path):
    """A sliding layer with a window wider than the context matches a full one."""
    model, tok, folder = loaded("qwen3")
    full = load_draft(str(make_draft(tmp_path / "f", folder, seed=3)))
    slide = load_draft(str(make_draft(
        tmp_path / "s", folder, seed=3,
        layer_types=["sliding_attention", "full_attention"], sliding_window=4096,
    )))
    narrow = load_draft(str(make_draft(
        tmp_path / "n", folder, seed=3,
        layer_types=["sliding_attention", "full_attention"], sliding_window=3,
    )))
    feats = mx.random.normal((1, 12, 2 * 64))
    x = mx.random.normal((1, 4, 64))
    outs = []
    for d in (full, slide, narrow):
        outs.append(np.array(d(x, feats, d.make_cache())))
    np.testing.assert_allclose(outs[0], outs[1], atol=1e-5)
    assert np.abs(outs[0] - outs[2]).max() > 1e-3


def _reference(draft, x, ctx_feats):
    """The doc's draft forward written out, block after all context: a
    sliding layer's block query at position p sees context positions
    > p - window and the whole block; a full layer sees everything."""
    cfg = draft.config
    c = draft.hidden_norm(draft.fc(ctx_feats))
    S, L, hd = c.shape[1], x.shape[1], cfg.head_dim
    qpos, kpos = np.arange(S, S + L), np.arange(S + L)

    def rope(t, offset):
        return mx.fast.rope(t, hd, traditional=False, base=cfg.rope_theta, scale=1.0, offset=offset)

    for i, layer in enumerate(draft.layers):
        at = layer.self_attn
        a = layer.input_layernorm(x)
        q = rope(at.q_norm(at.q_proj(a).reshape(1, L, -1, hd)).transpose(0, 2, 1, 3), S)
        kv = mx.concatenate([c, a], axis=1)
        k = rope(at.k_norm(at.k_proj(kv).reshape(1, S + L, -1, hd)).transpose(0, 2, 1, 3), 0)
        v = at.v_proj(kv).reshape(1, S + L, -1, hd).transpose(0, 2, 1, 3)
        rep = q.shape[1] // k.shape[1]
        k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
        s = (q @ k.transpose(0, 1, 3, 2)) * hd**-0.5
        if cfg.is_sliding(i):
            ok = (kpos[None] >= S) | (qpos[:, None] - kpos[None] < cfg.sliding_window)
            s = mx.where(mx.array(ok), s, -mx.inf)
        o = (mx.softmax(s, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(1, L, -1)
        x = x + at.o_proj(o)
        h = layer.post_attention_layernorm(x)
        x = x + layer.mlp.down_proj(mx.sigmoid(layer.mlp.gate_proj(h)) * layer.mlp.gate_proj(h) * layer.mlp.up_proj(h))
    return draft.norm(x)


def test_draft_forward_matches_reference(loaded, tmp_path):
    _, _, folder = loaded("qwen3")
    draft = load_draft(str(make_draft(tmp_path / "d", folder, seed=5)))
    feats = mx.random.normal((1, 11, 2 * 64))
    cache = draft.make_cache()
    # context arrives in two rounds, as in decoding; the block follows it
    draft(mx.random.normal((1, 4, 64)), feats[:, :7], cache)
    x = mx.random.normal((1, 4, 64))
    got = draft(x, feats[:, 7:], cache)
    np.testing.assert_allclose(np.array(got), np.array(_reference(draft, x, feats)), atol=1e-4)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048}])
def test_nested_rope_parameters_read_like_flat_ones(loaded, tmp_path, scaling):
    """transformers >= 5 nests rope settings in rope_parameters: the same
    settings spelt flat or nested load the same draft, round for round."""
    import shutil

    from dflash_mlx import stream_generate

    model, tok, folder = loaded("qwen3")
    flat = make_draft(tmp_path / "flat", folder, block_size=4)
    nested = tmp_path / "nested"
    shutil.copytree(flat, nested)
    cfg = json.loads((flat / "config.json").read_text())
    cfg["rope_theta"], cfg["rope_scaling"] = 12345.0, scaling
    (flat / "config.json").write_text(json.dumps(cfg))
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_theta": 12345.0, **(scaling or {"rope_type": "default"})}
    (nested / "config.json").write_text(json.dumps(cfg))
    a, b = load_draft(str(flat)), load_draft(str(nested))
    assert a.config.rope_theta == b.config.rope_theta == 12345.0
    assert (a.config.rope_scaling or {}).get("rope_type") == (b.config.rope_scaling or {}).get("rope_type")
    runs = [[(r.tokens, r.accepted) for r in stream_generate(model, d, tok, "def f(", block_size=4, max_tokens=24)]
            for d in (a, b)]
    assert runs[0] == runs[1]


def test_rope_forms_that_cannot_run_are_refused(target_folder, tmp_path):
    cfg = json.loads((make_draft(tmp_path / "d", target_folder("qwen3")) / "config.json").read_text())
    del cfg["rope_theta"]
    for bad, msg in [
        ({**cfg, "rope_theta": 1.0, "rope_parameters": {"rope_theta": 2.0}}, "must agree"),
        ({**cfg, "rope_parameters": {"rope_theta": 2.0, "rope_type": "fancy"}}, "rope type 'fancy'"),
        ({**cfg, "rope_scaling": {"type": "yarn"}}, "needs factor"),
        ({**cfg, "rope_parameters": [1]}, "rope_parameters"),
    ]:
        with pytest.raises(DraftConfigError, match=msg):
            DFlashConfig.from_dict(bad)
    assert DFlashConfig.from_dict({**cfg, "rope_parameters": {"rope_theta": 500.0}}).rope_theta == 500.0
