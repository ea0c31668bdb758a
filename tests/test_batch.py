"""Batched DFlash: every row's output is what it gets alone."""

import pytest
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.engine.batch import Batch, batch_generate
from dflash_mlx.engine.decoding import DraftCache
from dflash_mlx.engine.policy import Policy
from dflash_mlx.errors import UnsupportedModelError
from test_policy import modelled  # noqa: F401 (a fixture)
from util import dflash_tokens, mlx_tokens, runs

PROMPTS = ["def foo(x):\n    return", "import os\n", "class A:\n    def __init__(self):\n        self"]


def run(batch: Batch, keys):
    """Step ``batch`` to the end: each key's tokens and responses."""
    toks = {k: [] for k in keys}
    resp = {k: [] for k in keys}
    while len(batch):
        for k, r in batch.step():
            toks[k] += r.tokens
            resp[k].append(r)
    return toks, resp


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_batch_is_lossless_greedy(arch, loaded, draft_for):
    """Rows of different prompt lengths and max_tokens, with an echo draft
    accepted along runs of its token: rows accept different counts in one
    round and are rolled back by different amounts."""
    model, tok, folder = loaded(arch, tied=True)
    lengths = [60, 25, 47]
    refs = [mlx_tokens(model, tok, p, n) for p, n in zip(PROMPTS, lengths)]
    draft = draft_for(folder, mask_token_id=runs(refs[0])[0], echo=True)
    for bs in (1, 4, 16, "auto"):
        batch = Batch(model, draft, tok, bs)
        keys = [batch.add(p, n) for p, n in zip(PROMPTS, lengths)]
        toks, resp = run(batch, keys)
        assert [toks[k] for k in keys] == refs, bs
        assert all(resp[k][-1].finish_reason for k in keys)
        if bs != 1:
            acc = [r.accepted for k in keys for r in resp[k][1:]]
            assert max(acc) > 1 and 1 in acc, bs


@pytest.mark.parametrize("bs", [8, 1])
def test_rows_join_and_leave(loaded, draft_for, bs):
    """A row runs alone (block 1: pipelined plain steps), others join and
    leave, the last one goes on alone again."""
    model, tok, folder = loaded("qwen3", tied=True)
    refs = [mlx_tokens(model, tok, p, 40) for p in PROMPTS]
    draft = draft_for(folder, mask_token_id=runs(refs[0])[0], echo=True)
    batch = Batch(model, draft, tok, bs)
    a = batch.add(PROMPTS[0], 40)
    got = {a: []}

    def step():
        for k, r in batch.step():
            got[k] += r.tokens

    for _ in range(3):
        step()
    b = batch.add(PROMPTS[1], 40)
    got[b] = []
    for _ in range(2):
        step()
    c = batch.add(PROMPTS[2], 40)
    got[c] = []
    step()
    batch.remove(b)  # its client left
    while len(batch):
        step()
    assert got[a] == refs[0] and got[c] == refs[2]
    assert got[b] == refs[1][: len(got[b])] and 0 < len(got[b]) < 40


def test_a_row_joins_before_the_first_round(loaded):
    """The first row's prefill queued its first plain step (it was alone); a
    row joining before any round takes it back: both are mlx-lm's."""
    model, tok, _ = loaded("qwen3")
    refs = [mlx_tokens(model, tok, p, 12) for p in PROMPTS[:2]]
    batch = Batch(model, None, tok, 1)
    keys = [batch.add(p, 12) for p in PROMPTS[:2]]
    got = {k: [] for k in keys}
    while len(batch):
        for k, r in batch.step():
            got[k] += r.tokens
    assert [got[k] for k in keys] == refs


def test_seeded_sampling_matches_single(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    kw = dict(temperature=0.9, top_p=0.95)
    for bs in (4, "auto"):
        want = [dflash_tokens(model, draft, tok, p, block_size=bs, max_tokens=30, seed=i, **kw)[0]
                for i, p in enumerate(PROMPTS)]
        got = [batch_generate(model, draft, tok, PROMPTS, 30, bs, seed=i, **kw)[i] for i in range(len(PROMPTS))]
        assert got == want, bs
    assert len({tuple(w) for w in want}) == len(want)


def test_seeded_row_ignores_its_companions(loaded, draft_for):
    """Under "auto" a round's length depends on all rows, but a seeded
    row's draws depend on positions only: its text is the one it gets alone."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, PROMPTS[0], 60)
    draft = draft_for(folder, mask_token_id=runs(ref)[0], echo=True)
    kw = dict(max_tokens=40, temperature=0.1, seed=1)
    want, rs = dflash_tokens(model, draft, tok, PROMPTS[0], block_size="auto", **kw)
    assert max(r.accepted for r in rs) > 1
    batch = Batch(model, draft, tok, "auto")
    key = batch.add(PROMPTS[0], **kw)
    others = [batch.add(p, 40) for p in PROMPTS * 3]
    sampled = [batch.add(p, 40, temperature=0.9, top_p=0.95) for p in PROMPTS]  # p/q rows
    toks, _ = run(batch, [key, *others, *sampled])
    assert toks[key] == want
    assert [toks[k] for k in others] == [mlx_tokens(model, tok, p, 40) for p in PROMPTS * 3]
    assert all(len(toks[k]) == 40 or toks[k][-1] in tok.eos_token_ids for k in sampled)


def test_a_batch_with_a_sampled_row_teaches_the_sampled_policy(loaded, draft_for):
    """Greedy and sampled generations have a policy each: batched rounds of
    greedy rows teach the greedy one; once a sampled row is in, the sampled one."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    greedy, sampled = Policy.of(draft), Policy.of(draft, sampled=True)

    def widths(p):
        return {w for w, _ in p.times}

    batch = Batch(model, draft, tok, "auto")
    run(batch, [batch.add(p, 30) for p in PROMPTS])
    assert 3 in widths(greedy) and not sampled.times
    keys = [batch.add(p, 30) for p in PROMPTS[:2]] + [batch.add(PROMPTS[2], 30, temperature=0.9, seed=0)]
    before = {k: list(v) for k, v in greedy.times.items() if k[0] == 3}
    run(batch, keys)
    assert 3 in widths(sampled) and {k: v for k, v in greedy.times.items() if k[0] == 3} == before


def test_prompt_cache_is_refilled(loaded, draft_for):
    """A row given a prompt cache leaves it holding the conversation: the next
    turn continues it, with the output of a fresh run."""
    model, tok, folder = loaded("qwen3", tied=True)
    draft = draft_for(folder)
    cache, dcache = make_prompt_cache(model), DraftCache(draft)
    batch = Batch(model, draft, tok, 4)
    key = batch.add(PROMPTS[0], 20, prompt_cache=cache, draft_cache=dcache)
    other = batch.add(PROMPTS[1], 35)
    toks, _ = run(batch, [key, other])
    ids = tok.encode(PROMPTS[0]) + toks[key]
    assert cache[0].offset == len(ids) - 1 and dcache.size == len(ids) - 1
    follow = tok.encode(" x = 1\n")
    fresh = dflash_tokens(model, draft, tok, ids + follow, block_size=4, max_tokens=20)[0]
    cont = dflash_tokens(model, draft, tok, ids[-1:] + follow, block_size=4, max_tokens=20,
                         prompt_cache=cache, draft_cache=dcache)[0]
    assert cont == fresh


def test_refuses_recurrent_targets(loaded, draft_for):
    model, tok, folder = loaded("qwen3_5")
    with pytest.raises(UnsupportedModelError, match="plain attention"):
        Batch(model, draft_for(folder), tok, 4)


def test_useless_draft_in_a_batch_takes_plain_steps(modelled, loaded, draft_for):
    """Random draft weights: the batch soon stops drafting and runs plain
    steps together."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    batch = Batch(model, draft, tok, "auto")
    keys = [batch.add(p, 60) for p in PROMPTS]
    toks, resp = run(batch, keys)
    assert [toks[k] for k in keys] == [mlx_tokens(model, tok, p, 60) for p in PROMPTS]
    late = [r.verified for k in keys for r in resp[k][30:]]
    assert late and sum(v == 1 for v in late) / len(late) > 0.85


def test_rows_near_their_end_teach_nothing_beyond(loaded, draft_for):
    """Under "auto", a row with fewer tokens left verifies fewer than the
    round's length: it is not counted as a miss at the depths it did not
    reach, so each round teaches the policy only the rows that verified it all."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, PROMPTS[0], 40)
    draft = draft_for(folder, mask_token_id=runs(ref)[0], echo=True)
    batch = Batch(model, draft, tok, "auto")
    keys = [batch.add(PROMPTS[0], 40), batch.add(PROMPTS[1], 7), batch.add(PROMPTS[2], 19)]
    calls, learn = [], batch.policy.learn
    batch.policy.learn = lambda length, accepted: calls.append((length, len(accepted))) or learn(length, accepted)
    short = 0
    while len(batch):
        calls.clear()
        out = batch.step()
        for length, n in calls:
            assert n == sum(r.verified == length for _, r in out), (calls, [r.verified for _, r in out])
        short += any(1 < r.verified < length for _, r in out for length, _ in calls)
    assert short  # some round had a row that verified fewer
    del batch.policy.learn
