"""Speculators-format DFlash drafts (vllm-project/speculators, e.g.
RedHatAI/Qwen3-8B-speculator.dflash): the layer shape under
transformer_layer_config, aux_hidden_state_layer_ids counted from the
embedding output, a reduced draft vocabulary with d2t/t2d maps and its
lm_head rows in the weights. A tiny checkpoint in that layout loads through
load_draft and decodes token-identically to mlx-lm."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from dflash_mlx import DraftConfigError, DraftWeightsError, load_draft
from dflash_mlx.engine.draft import DFlashDraft
from dflash_mlx.engine.target import Target
from dflash_mlx.models.config import DFlashConfig
from util import dflash_tokens, mlx_run, runs

PROMPT = "def foo(x):\n    return"


def speculators_config(text: dict, mask: int, draft_vocab: int, **top) -> dict:
    return {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "block_size": 8,
        "draft_vocab_size": draft_vocab,
        "mask_token_id": mask,
        "aux_hidden_state_layer_ids": [2, 4],
        "sliding_window_non_causal": False,
        "projector_type": "dflash",
        "sample_from_anchor": False,
        "target_hidden_size": None,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 7}],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "tiny/qwen3"},
        },
        "transformer_layer_config": {
            "model_type": "qwen3",
            "vocab_size": text["vocab_size"],
            "hidden_size": text["hidden_size"],
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "torch_dtype": "bfloat16",
        },
        **top,
    }


def make_speculators(folder: Path, target: Path, mask: int, vocab_ids=None, echo=False, **top) -> Path:
    """A random speculators DFlash draft (bf16, plus int64 d2t and bool t2d);
    ``vocab_ids``: the target ids of its draft vocabulary (all if None)."""
    text = json.loads((target / "config.json").read_text())
    V = text["vocab_size"]
    ids = np.arange(V) if vocab_ids is None else np.sort(np.array(vocab_ids))
    cfg = speculators_config(text, mask, len(ids), **top)
    mx.random.seed(3)
    draft = DFlashDraft(DFlashConfig.from_dict(cfg))
    if echo:
        for layer in draft.layers:
            layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
            layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    w = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(draft.parameters())}
    embed = mx.load(str(target / "model.safetensors"))["model.embed_tokens.weight"]  # a tied target's head
    w["lm_head.weight"] = embed[mx.array(ids)].astype(mx.bfloat16)
    if vocab_ids is not None:
        t2d = np.zeros(V, dtype=bool)
        t2d[ids] = True
        w["t2d"] = mx.array(t2d)
        w["d2t"] = mx.array(ids - np.arange(len(ids)), dtype=mx.int64)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def test_config_reads_as_the_z_lab_form(target_folder, tmp_path):
    target = target_folder("qwen3", tied=True)
    cfg = DFlashConfig.from_dict(speculators_config(json.loads((target / "config.json").read_text()), 300, 100))
    assert cfg.target_layer_ids == [1, 3]  # aux ids count the embedding output as 0
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.block_size, cfg.mask_token_id) == (64, 2, 8, 300)
    assert cfg.dtype == "bfloat16" and cfg.rope_theta == 10000.0


@pytest.mark.parametrize("reduced", [False, True])
def test_greedy_is_lossless(loaded, tmp_path, reduced):
    """Token-identical to mlx-lm at block sizes 1, 4 and 8 (the draft's),
    proposing from the whole vocabulary or from a reduced one mapped by
    d2t/t2d; the echo draft is accepted along a run and rejected elsewhere."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref, text = mlx_run(model, tok, PROMPT, 24)
    mask = runs(ref)[0]
    V = Target(model).vocab_rows
    ids = sorted({*range(0, V, 3), *ref}) if reduced else None
    draft = load_draft(str(make_speculators(tmp_path / "d", folder, mask, ids, echo=True)))
    assert draft.config.target_layer_ids == [1, 3]
    assert draft.config.draft_vocab == ids
    accepted = set()
    for bs in (1, 4, draft.block_size):
        out, rs = dflash_tokens(model, draft, tok, PROMPT, block_size=bs, max_tokens=24)
        assert out == ref, bs
        assert "".join(r.text for r in rs) == text
        accepted |= {r.accepted for r in rs[1:]}
    assert max(accepted) > 1


def test_what_cannot_run_is_refused(target_folder, tmp_path):
    target = target_folder("qwen3", tied=True)
    text = json.loads((target / "config.json").read_text())
    cfg = speculators_config(text, 300, 100)
    tl = cfg["transformer_layer_config"]
    for bad, msg in [
        ({**cfg, "mask_token_id": None}, "no mask_token_id"),
        ({**cfg, "aux_hidden_state_layer_ids": [0, 3]}, "embedding output"),
        ({**cfg, "speculators_model_type": "eagle3"}, "'eagle3'"),
        ({**cfg, "projector_type": "domino"}, "projector_type"),
        ({**cfg, "sample_from_anchor": True}, "sample_from_anchor"),
        ({k: v for k, v in cfg.items() if k != "transformer_layer_config"}, "transformer_layer_config"),
        ({**cfg, "transformer_layer_config": {**tl, "layer_types": ["sliding_attention", "full_attention"],
                                             "sliding_window": 8}}, "causal inside the block"),
    ]:
        with pytest.raises(DraftConfigError, match=msg):
            DFlashConfig.from_dict(bad)
    folder = make_speculators(tmp_path / "d", target, 300, list(range(0, 200, 2)))
    w = mx.load(str(folder / "model.safetensors"))
    w.pop("d2t")
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    with pytest.raises(DraftWeightsError, match="lack d2t"):
        load_draft(str(folder))
