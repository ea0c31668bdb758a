"""A long generation stays exact, and its memory grows only by the KV caches."""

import mlx.core as mx

from dflash_mlx import stream_generate
from util import mlx_tokens, runs

N = 2048


def test_long_run_memory_is_flat(loaded, draft_for):
    model, tok, folder = loaded("qwen3", tied=True)
    prompt = "import os\n"
    ref = mlx_tokens(model, tok, prompt, N)
    draft = draft_for(folder, mask_token_id=runs(ref)[-1], echo=True)
    mx.clear_cache()
    out, active = [], {}
    for r in stream_generate(model, draft, tok, prompt, block_size=16, max_tokens=N):
        out += r.tokens
        for mark in (512, 2000):
            if mark not in active and len(out) >= mark:
                active[mark] = mx.get_active_memory()
    assert out == ref
    # KV bytes per token: target 6 layers x (k, v) x 2 heads x 16 dims, and the
    # draft's context 2 layers x (k, v) x 2 x 16, all float32.
    per_token = (6 + 2) * 2 * 2 * 16 * 4
    grew = active[2000] - active[512]
    assert grew < 3 * per_token * (2000 - 512) + (8 << 20), grew
    print(f"active memory +{grew / 1e6:.1f} MB from 512 to 2000 tokens; peak {r.peak_memory:.3f} GB")
