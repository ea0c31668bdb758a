"""User prompts written by the target itself.

The template prompts (:mod:`.prompts`) cover a few hundred request shapes;
a draft trained only on their answers reached tau ~1.9 on unseen template
prompts but ~1.4 on the hand-written held-out set. SmolLM2-Instruct has
seen many real conversations, so sampling the user's turn from it gives
requests of far more kinds, for free. About half start from an opening
phrase that steers them toward the categories people ask most (math,
code, explanations); the rest are free.
"""

import random
from typing import List

OPENERS = [
    "Write a Python function", "Write a function in", "How do I", "How can I", "Why does", "Why is",
    "Can you explain", "What is the difference between", "Explain", "A store", "If a", "Solve",
    "Calculate", "I have a", "What are", "Give me", "Help me", "Write a short", "Is it",
]

MARK = "\u2063"  # a character no template writes: where the user's text goes


def turn_prefix(tokenizer) -> str:
    """The chat template's text before the content of a first user turn
    (the default system prompt included)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": MARK}], tokenize=False)
    return text[: text.index(MARK)]


def written_prompts(model, tokenizer, n: int, seed: int = 0, max_tokens: int = 96,
                    batch: int = 64, progress=None) -> List[dict]:
    """Up to ``n`` distinct one-turn chat records whose user text the target
    sampled (temperature 1.0, top-p 0.95, seeded). Texts the target did not
    finish within ``max_tokens`` or of fewer than three words are dropped."""
    import mlx.core as mx
    from mlx_lm.sample_utils import make_sampler

    from ..training.data import regenerate

    r = random.Random(seed)
    mx.random.seed(seed)
    prefix = turn_prefix(tokenizer)
    heads = [r.choice(OPENERS) if r.random() < 0.5 else "" for _ in range(n)]
    prompts = [list(tokenizer.encode(prefix + h, add_special_tokens=False)) for h in heads]
    eos = set(tokenizer.eos_token_ids)
    seqs = regenerate(model, prompts, max_tokens, eos, batch, progress,
                      sampler=make_sampler(temp=1.0, top_p=0.95))
    out, seen = [], set()
    for h, s in zip(heads, seqs):
        made = s.tokens[s.start :]
        if not made or made[-1] not in eos:
            continue
        text = (h + tokenizer.decode(made[:-1])).strip()
        if len(text.split()) < 3 or text in seen:
            continue
        seen.add(text)
        out.append({"messages": [{"role": "user", "content": text}], "category": "written"})
    return out
