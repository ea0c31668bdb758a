"""DFlash2 drafts (``DFlash2DraftModel``): a tiny checkpoint in the published
layout (z-lab/dflash tests/fixtures/dflash2-config.json and
dflash2-safetensors-header.json: nested dflash_config, rope_parameters,
``dtype``, bf16 weights, codebooks without ``.weight``) loaded through
load_draft and decoded token-identically to mlx-lm."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from dflash_mlx import DraftConfigError, load_draft
from dflash_mlx.engine.dflash2 import DFlash2Draft
from dflash_mlx.models.config import DFlashConfig
from util import dflash_tokens, mlx_run, runs

PROMPT = "def foo(x):\n    return"


def dflash2_config(target_folder: Path, block_size: int = 16, **dflash) -> dict:
    text = json.loads((target_folder / "config.json").read_text())
    text = text.get("text_config", text)
    T, V = text["num_hidden_layers"], text["vocab_size"]
    return {
        "architectures": ["DFlash2DraftModel"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "is_causal": False,
        "dflash_config": {
            "block_size": block_size,
            "conv_group_size": 16,
            "conv_kernel_size": 2,
            "final_logit_softcapping": 20.0,
            "mask_token_id": V - 16,
            "output_multiplier": 0.5,
            "selector_rank": 8,
            "selector_top_k": 4,
            "target_layer_ids": [1, 3],
            **dflash,
        },
        "dtype": "bfloat16",
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": text["hidden_size"],
        "intermediate_size": 96,
        "layer_types": ["sliding_attention", "sliding_attention"],
        "max_position_embeddings": 4096,
        "model_type": "qwen3",
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "num_target_layers": T,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 6,
        "tie_word_embeddings": False,
        "use_sliding_window": True,
        "vocab_size": V,
    }


def make_dflash2(folder: Path, target_folder: Path, echo: bool = False, seed: int = 2, **kw) -> Path:
    """Write a random DFlash2 draft. With ``echo`` the residual branches are
    zero and the codebooks small, so it proposes the mask token (mostly)."""
    cfg = dflash2_config(target_folder, **kw)
    mx.random.seed(seed)
    draft = DFlash2Draft(DFlashConfig.from_dict(cfg))
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            conv.base_kernel = 0.5 + 0.3 * mx.random.normal(conv.base_kernel.shape)
        if echo:
            layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    sel = draft.candidate_selector
    scale = 0.05 if echo else 1.0
    sel.predecessor_codebook = scale * mx.random.normal(sel.predecessor_codebook.shape)
    sel.successor_codebook = scale * mx.random.normal(sel.successor_codebook.shape)
    from mlx.utils import tree_flatten

    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(draft.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def test_checkpoint_has_the_published_layout(target_folder, tmp_path):
    folder = make_dflash2(tmp_path / "d", target_folder("qwen3"))
    w = mx.load(str(folder / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in w.values())
    H = 64
    assert w["layers.0.attention_conv.base_kernel"].shape == (2, 2, H)
    assert w["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * H // 16, H)
    assert w["candidate_selector.hidden_projection.weight"].shape == (8, H)
    V = json.loads((folder / "config.json").read_text())["vocab_size"]
    assert w["candidate_selector.predecessor_codebook"].shape == (V, 8)
    assert w["candidate_selector.successor_codebook"].shape == (V, 8)
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in w)
    draft = load_draft(str(folder))
    assert isinstance(draft, DFlash2Draft) and draft.block_size == 16
    assert draft.config.rope_theta == 10000.0 and draft.config.dtype == "bfloat16"
    assert draft.fc.weight.dtype == mx.float32


@pytest.mark.parametrize("echo", [True, False])
def test_greedy_is_lossless(loaded, tmp_path, echo):
    """Token-identical to mlx-lm at block sizes 1, 4 and the draft's block
    (16); the echo draft is accepted along a run of its token, rejected at
    once and mid-block elsewhere. A random draft's selector picks other
    tokens than the argmax (its full block only, to stay fast)."""
    model, tok, folder = loaded("qwen3", tied=True)
    n = 32 if echo else 12
    ref, text = mlx_run(model, tok, PROMPT, n)
    mask = runs(ref)[0] if echo else None
    kw = {"mask_token_id": mask} if echo else {}
    draft = load_draft(str(make_dflash2(tmp_path / "d", folder, echo=echo, **kw)))
    accepted = set()
    for bs in (1, 4, draft.block_size) if echo else (draft.block_size,):
        out, rs = dflash_tokens(model, draft, tok, PROMPT, block_size=bs, max_tokens=n)
        assert out == ref, bs
        assert "".join(r.text for r in rs) == text
        accepted |= {(bs, r.accepted) for r in rs[1:] if r.finish_reason is None}
    if echo:
        assert {(4, 1), (16, 1)} <= accepted and any(1 < a < bs for bs, a in accepted), accepted


def _walk(logits, hidden, anchor, sel):
    """The selector's greedy walk, written out with numpy."""
    lg, h = np.array(logits), np.array(hidden[0])
    P, S = np.array(sel.predecessor_codebook), np.array(sel.successor_codebook)
    proj = h @ np.array(sel.hidden_projection.weight).T
    prev, out = anchor, []
    for i in range(lg.shape[0]):
        cand = np.argsort(-lg[i])[: sel.top_k]
        score = lg[i, cand] + (P[prev] * proj[i]) @ S[cand].T
        prev = int(cand[np.argmax(score)])
        out.append(prev)
    return out


def test_selector_walks_the_top_k(target_folder, tmp_path):
    """Each row's argmax is the greedy bigram walk from the anchor over the
    top-k of the softcapped, scaled logits; only candidates are finite."""
    draft = load_draft(str(make_dflash2(tmp_path / "d", target_folder("qwen3"))))
    V, n = draft.config.vocab_size, 7
    mx.random.seed(4)
    hidden = mx.random.normal((1, n, 64))
    head = mx.random.normal((V, 64))
    logits = draft.logits(hidden, lambda h: h @ head.T)
    assert mx.abs(logits).max().item() <= 20.0  # softcapped
    np.testing.assert_allclose(
        np.array(logits), np.tanh(0.5 * np.array(hidden[0] @ head.T) / 20) * 20, atol=1e-4
    )
    rows = draft.select(logits, hidden, mx.array([5]))
    assert mx.argmax(rows, axis=-1).tolist() == _walk(logits, hidden, 5, draft.candidate_selector)
    assert (mx.isfinite(rows).sum(axis=-1) == draft.candidate_selector.top_k).all().item()


def test_forms_that_cannot_run_are_refused(target_folder):
    cfg = dflash2_config(target_folder("qwen3"))
    dc = cfg["dflash_config"]
    for bad, msg in [
        ({**cfg, "is_causal": True}, "causal block attention"),
        ({**cfg, "dflash_config": {k: v for k, v in dc.items() if k != "selector_rank"}}, "selector_rank"),
        ({**cfg, "dflash_config": {**dc, "conv_group_size": 48}}, "conv_group_size"),
        ({**cfg, "block_size": 8}, "must agree"),
        ({**cfg, "layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ]:
        with pytest.raises(DraftConfigError, match=msg):
            DFlashConfig.from_dict(bad)


def test_sampled_decoding_keeps_the_target_draws(loaded, tmp_path):
    """Seeded sampling draws each token by its position alone: with a DFlash2
    draft (proposals drawn from the selector's rows, or their argmax) the
    text is the draft-free one; unseeded, the p/q rule runs on those rows."""
    from dflash_mlx import stream_generate

    model, tok, folder = loaded("qwen3", tied=True)
    prompt = tok.encode("import os\n")
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, seed=3)
    ref, _ = dflash_tokens(model, None, tok, prompt, **kw)
    draft = load_draft(str(make_dflash2(tmp_path / "d", folder, echo=True, mask_token_id=ref[1])))
    for proposal in ("sample", "argmax"):
        out, _ = dflash_tokens(model, draft, tok, prompt, block_size=16, proposal=proposal, **kw)
        assert out == ref, proposal
    rs = list(stream_generate(model, draft, tok, prompt, block_size=16, max_tokens=16, temperature=1.0))
    assert sum(len(r.tokens) for r in rs) == 16
