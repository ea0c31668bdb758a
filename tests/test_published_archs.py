"""Targets with published z-lab drafts (issue 35 item 3) as tiny real mlx-lm
configurations, saved as folders and loaded through dflash_mlx.load: gemma4
(sliding + global layers, rotating caches), kimi_k25 (DeepSeek-V3 multi-head
latent attention), qwen3_5_moe (gated DeltaNet + MoE), minimax (MiniMax-M2.5)."""

import mlx.core as mx
import pytest

from dflash_mlx.engine.target import Target
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
