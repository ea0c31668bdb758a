"""Targets with published z-lab drafts (issue 35 item 3) as tiny real mlx-lm
configurations, saved as folders and loaded through dflash_mlx.load: gemma4
(sliding + global layers, rotating caches), kimi_k25 (DeepSeek-V3 multi-head
latent attention), qwen3_5_moe (gated DeltaNet + MoE), minimax (MiniMax-M2.5)."""

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

from dflash_mlx.engine.target import Target, _Tap
from util import dflash_tokens, mlx_run, runs

PUBLISHED = ["gemma4", "kimi_k25", "qwen3_5_moe", "minimax"]
PROMPTS = ["def foo(x):\n    return"]


@pytest.mark.parametrize("arch", PUBLISHED)
def test_greedy_is_lossless(arch, loaded, draft_for):
    """Token-identical to mlx-lm at block sizes 1, 4 and the draft's block,
    with an echo draft: accepted along a run of its token, rejected at once
    elsewhere and mid-block where the run ends (every rollback case)."""
    model, tok, folder = loaded(arch, tied=True)
    prompt = PROMPTS[0]
    ref, text = mlx_run(model, tok, prompt, 32)
    draft = draft_for(folder, mask_token_id=runs(ref)[0], echo=True)
    accepted = set()
    for bs in (1, 4, draft.block_size):
        out, rs = dflash_tokens(model, draft, tok, prompt, block_size=bs, max_tokens=32)
        assert out == ref, (arch, bs)
        assert "".join(r.text for r in rs) == text
        accepted |= {(bs, r.accepted) for r in rs[1:] if r.finish_reason is None}
    rejected = {(bs, 1) for bs in (4, draft.block_size)}
    assert rejected <= accepted and any(1 < a < bs for bs, a in accepted), accepted


@pytest.mark.parametrize("arch", PUBLISHED)
def test_draft_reads_the_targets_own_head(arch, loaded):
    """The head the draft projects with gives the target's greedy choices
    (Kimi-K2.5 keeps its untied lm_head under language_model)."""
    model, tok, _ = loaded(arch)
    target = Target(model)
    tokens = mx.array([tok.encode(PROMPTS[0])])
    ours = mx.argmax(target.head(target.inner(tokens)), axis=-1)
    assert mx.array_equal(ours, mx.argmax(model(tokens), axis=-1)).item()


def _first_layer_input(target, tokens):
    """What the target's first decoder layer receives in a full forward."""
    tap = _Tap(target.layers[0], "input")
    target.layers[0] = tap
    try:
        mx.eval(target.model(tokens))
    finally:
        target.layers[0] = tap.module
    return tap.value


def _check_reads_as_target(model, tokens):
    target = Target(model)
    assert mx.array_equal(target.embed(tokens), _first_layer_input(target, tokens)).item()
    logits, h = model(tokens), target.inner(tokens)
    assert mx.array_equal(target.head(h), logits).item()
    ids = mx.array([1, 7, 42])
    assert mx.allclose(target.head_over(ids)(h), logits[..., ids], rtol=1e-5, atol=1e-4).item()
    return target


@pytest.mark.parametrize("arch", PUBLISHED)
def test_draft_reads_embeddings_and_logits_as_the_target_uses_them(arch, loaded):
    """The draft's embedding of a token is what the target's first layer
    receives for it, and its logits of a hidden state are the target's own:
    Gemma 4 scales its embedding by sqrt(hidden_size) before its layers and
    softcaps its logits after the head, and the z-lab Gemma 4 drafts were
    trained on both (vLLM PR 41703)."""
    model, tok, _ = loaded(arch)
    _check_reads_as_target(model, mx.array([tok.encode(PROMPTS[0])]))


SMALL = dict(
    hidden_size=64, num_hidden_layers=6, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, vocab_size=100,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
)
SCALED = {  # the same kind of model: embedding scaled outside embed_tokens, logits softcapped
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=16, final_logit_softcapping=30.0),
    "gemma3_text": dict(sliding_window=8),
}


@pytest.mark.parametrize("arch", [*SCALED, "qwen3"])
def test_other_archs_read_as_the_target_uses_them(arch):
    """Gemma 1-3 too; a target that feeds embed_tokens' output straight to its
    layers keeps the embedding module itself (no extra work per block)."""
    config = dict(SMALL, model_type=arch, **SCALED.get(arch, {}))
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    target = _check_reads_as_target(model, mx.array([[3, 5, 7, 5, 3, 9]]))
    assert (target.embed is target.embed_tokens) == (arch == "qwen3")
