"""block_size="auto": each round's length is chosen by dflash_mlx.engine.policy,
a bandit over plain steps and block lengths on the loop's own wall clock.
The output stays exactly the target's whatever it chooses."""

import math
import random

import pytest

from conftest import ARCHS
from dflash_mlx import GenerationArgumentError, stream_generate
from dflash_mlx.engine import decoding, policy as pol
from dflash_mlx.engine.draft import DFlashDraft
from dflash_mlx.engine.policy import Policy
from dflash_mlx.engine.target import Target
from dflash_mlx.engine.timing import RETIME, RoundTimer
from test_draft_vocab import vocab_draft
from test_sampling import TEMP, TOP_K, target_law, tv
from util import mlx_run, mlx_tokens, runs

PROMPTS = ["def foo(x):\n    return", "import os\n", "class A:\n"]


@pytest.fixture
def modelled(monkeypatch):
    """The loop's clock made of modelled costs, so the choices do not depend
    on this machine: a target forward of L tokens takes 1 + 0.1 (L - 1)
    units, a draft pass 0.5, the rest nothing (plain steps not pipelined, so
    that each costs in its own round, as it is computed there)."""
    now = [0.0]
    forward, propose = Target.forward, DFlashDraft.propose

    def timed_forward(self, tokens, *a, **k):
        now[0] += 1 + 0.1 * (tokens.shape[-1] - 1)
        return forward(self, tokens, *a, **k)

    def timed_propose(self, *a, **k):
        now[0] += 0.5
        return propose(self, *a, **k)

    monkeypatch.setattr(Target, "forward", timed_forward)
    monkeypatch.setattr(DFlashDraft, "propose", timed_propose)
    monkeypatch.setattr(pol, "clock", lambda: now[0])
    monkeypatch.setattr(decoding, "PIPELINE", False)
    return now


def prefill_cost(n: int) -> float:
    """A prompt of ``n`` tokens on the modelled clock: all but the last in
    one forward, then the last alone (as mlx-lm's loop runs a prompt)."""
    return 1 + (1 + 0.1 * (n - 2) if n > 1 else 0)


def auto_run(model, draft, tok, prompt, **kw):
    """(tokens, text, rounds): each round as (verified, accepted, drafted),
    drafted meaning a draft pass ran."""
    calls, propose = [0], draft.propose
    draft.propose = lambda *a, **k: calls.__setitem__(0, calls[0] + 1) or propose(*a, **k)
    tokens, text, rounds, seen = [], "", [], 0
    try:
        for r in stream_generate(model, draft, tok, prompt, **{"block_size": "auto", **kw}):
            tokens += r.tokens
            text += r.text
            if r.rounds:
                rounds.append((r.verified, r.accepted, calls[0] > seen))
            seen = calls[0]
    finally:
        del draft.propose
    return tokens, text, rounds


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_is_lossless(arch, modelled, loaded, draft_for):
    """An echo draft is right along runs of its token and wrong elsewhere:
    auto drafts in runs and backs off to plain steps outside; a random draft
    mostly gets plain steps. Every output is the target's. (On the modelled
    clock: on the real one a loaded machine could time drafting out.)"""
    model, tok, folder = loaded(arch, tied=True)
    plain = gained = False
    for prompt in PROMPTS[:2]:
        ref, _ = mlx_run(model, tok, prompt, 60)
        t = runs(ref)[0]
        start = next(i for i in range(len(ref)) if ref[i : i + 3] == [t] * 3)
        ids = tok.encode(prompt) + ref[:start]  # the answer now opens with the run
        ref, text = mlx_run(model, tok, ids, 60)
        for draft in [draft_for(folder), draft_for(folder, mask_token_id=t, echo=True)]:
            out, got, rounds = auto_run(model, draft, tok, ids, max_tokens=60)
            assert out == ref and got == text, (arch, prompt)
            for verified, accepted, drafted in rounds:
                assert 1 <= accepted <= verified <= draft.block_size
                assert drafted or verified == 1
                plain |= not drafted
                gained |= accepted > 1
    assert plain and gained


def test_useless_draft_takes_plain_steps(modelled, loaded, draft_for):
    """Random draft weights: after the first failed rounds, plain steps, with
    a drafting round now and then, and what those lose stays within the
    policy's budget of the time."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    prompt = PROMPTS[0]
    out, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=200)
    assert out == mlx_tokens(model, tok, prompt, 200)
    assert all(v == 1 for v, _, d in rounds if not d)
    drafting = [i for i, r in enumerate(rounds) if r[2]]
    assert drafting[:3] == [0, 1, 2] and len(drafting) >= 5, drafting  # the full block is timed first
    gaps = [b - a for a, b in zip(drafting[3:], drafting[4:])]
    assert min(gaps) >= 10, drafting
    # A plain step costs 1 unit (the modelled clock), so the generation's
    # time after the prefill over its plain steps' is the loss: the three first
    # full blocks (3 units each, a token each), then the budget's share and
    # the one probe that may go over it (a round of 2: 1.6 units).
    prefill = prefill_cost(len(tok.encode(prompt)))
    loss = modelled[0] - prefill - sum(a for _, a, _ in rounds)
    assert loss <= 3 * (3.0 - 1) + Policy.of(draft).budget * modelled[0] + 1.6, (loss, modelled)


def test_useless_draft_costs_the_budget_in_every_generation(modelled, loaded, draft_for):
    """Generation after generation with a useless draft, what its drafting
    rounds lose stays within the budget (a generation's last plain steps,
    never timed, must not widen it)."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    prompt = PROMPTS[0]
    auto_run(model, draft, tok, prompt, max_tokens=60)  # the full block and plain steps are timed
    start, made = modelled[0], 0
    for _ in range(12):
        _, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=60)
        made += sum(a for _, a, _ in rounds)
    prefill = prefill_cost(len(tok.encode(prompt)))
    spent = modelled[0] - start
    loss = spent - 12 * prefill - made
    assert loss <= Policy.of(draft).budget * spent + 1.6, (loss, spent)


def test_steps_slowed_by_a_probe_count_against_the_budget(modelled, loaded, draft_for, monkeypatch):
    """As on MLX-CPU, the target runs slower right after a draft pass (here
    the probe's forward costs 2 units more and the plain step after it 4
    more): a useless draft's probes still lose no more than the budget,
    slowdown included."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    cold, forward, propose = [], Target.forward, DFlashDraft.propose

    def slowed_forward(self, *a, **k):
        modelled[0] += cold.pop(0) if cold else 0
        return forward(self, *a, **k)

    def chilling_propose(self, *a, **k):
        cold[:] = [2, 4]
        return propose(self, *a, **k)

    monkeypatch.setattr(Target, "forward", slowed_forward)
    monkeypatch.setattr(DFlashDraft, "propose", chilling_propose)
    prompt = PROMPTS[0]
    auto_run(model, draft, tok, prompt, max_tokens=60)  # the full block and plain steps are timed
    start, made, probes = modelled[0], 0, 0
    for _ in range(8):
        cold.clear()
        _, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=100)
        made += sum(a for _, a, _ in rounds)
        probes += sum(d for _, _, d in rounds)
    prefill = prefill_cost(len(tok.encode(prompt)))
    spent = modelled[0] - start
    loss = spent - 8 * prefill - made
    # Over its window the budget may have been unspent when this began, and
    # one probe (6.6 units: 1.6 + 3 x 2 - 1) may go over it.
    policy = Policy.of(draft)
    assert probes >= 2, probes  # the draft is still tried now and then
    assert loss <= policy.budget * (spent + policy.window) + 6.6, (loss, spent, probes)


def test_plain_steps_are_timed_at_their_steady_cost(modelled, loaded, draft_for, monkeypatch):
    """As on MLX-CPU, the first plain step after a drafting round (or the
    prompt) costs more (here 2 units more): the plain step's time must still be
    what a step costs in a run of them (1 unit), not what the first steps
    after a switch cost, or drafting wins on a plain step timed too dear."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    last, forward = [0], Target.forward

    def cold_forward(self, tokens, *a, **k):
        modelled[0] += 2 * (tokens.shape[-1] == 1 < last[0])
        last[0] = tokens.shape[-1]
        return forward(self, tokens, *a, **k)

    monkeypatch.setattr(Target, "forward", cold_forward)
    policy = Policy.of(draft)
    for _ in range(4):
        _, _, rounds = auto_run(model, draft, tok, PROMPTS[0], max_tokens=60)
        assert sum(d for _, _, d in rounds) < len(rounds) / 2, rounds  # mostly plain steps
        assert policy.seconds(1) == pytest.approx(1.0, rel=0.01), policy.seconds(1)


def test_a_long_run_of_plain_steps_is_timed_as_it_goes(monkeypatch):
    """A run of plain steps books its time every RETIME steps, not only when a
    drafting round ends it: a run the machine slowed (or whose first steps were
    timed lucky) must not keep plain steps winning on an old time."""
    now = [0.0]
    monkeypatch.setattr(pol, "clock", lambda: now[0])
    policy = Policy(8)
    timer = RoundTimer(policy)
    timer.start()
    for cost in [1.0] * 8 + [3.0] * 3 * RETIME:
        now[0] += cost
        timer.learn(1, 0)
    assert policy.seconds(1) == pytest.approx(3.0, rel=0.05), policy.seconds(1)


def test_a_plain_step_booked_too_slow_buys_no_run_of_probes(monkeypatch):
    """Plain steps booked slower than they run (5 ms, where they take 4) make
    the plain rounds next to a probe look like gains, which buy the next
    probe at once. With two plain steps after each probe, those runs were
    never timed, so the booked time held: a probe every third round (a
    benchmark pass with a random draft ran seven prompts at 0.57-0.65x
    mlx-lm, 2026-12-07). Four plain steps after a probe time one of them."""
    now = [0.0]
    monkeypatch.setattr(pol, "clock", lambda: now[0])
    p = Policy(16)
    for _ in range(3):
        p.learn(16, [0])
    p.time(16, 10.0)
    p.time(2, 6.0)
    p.time(1, 5.0, rounds=4)
    timer = RoundTimer(p)
    timer.start()
    kinds = []
    for _ in range(400):
        n = p.choose()
        now[0] += {1: 4.0, 2: 6.0}.get(n, 10.0)
        timer.learn(n, 0)
        kinds.append(n)
    assert p.seconds(1) == pytest.approx(4.0, rel=0.05), p.seconds(1)
    assert kinds[-200:].count(2) <= 4, kinds[-200:].count(2)


def test_counts_fade_over_plain_steps_so_rare_probes_find_a_good_draft(monkeypatch):
    """Rounds that accepted nothing made plain steps win; then the draft is
    right again. The probes that could tell are rare (the plain rounds next to
    them run slower and spend the budget), and while the counts faded only with
    drafting rounds, each probe weighed 1/60 against that stretch
    (`heldout_draft2_early`: about one probe a generation for eight
    generations in a row, where rounds of 4 made 1.1x plain steps, 2026-12-07).
    Fading over plain steps too (down to 8 rounds' worth, see the useless
    draft's budget above), the draft is drafting again within a few hundred
    rounds (here 335, against 921 before)."""
    now = [0.0]
    monkeypatch.setattr(pol, "clock", lambda: now[0])
    p = Policy(4)
    for _ in range(60):
        p.learn(4, [0])
    for n, t in ((4, 6.0), (4, 6.0), (2, 5.0)):
        p.time(n, t)
    p.time(1, 4.0, rounds=4)
    assert p.plain_wins()
    timer = RoundTimer(p)
    timer.start()
    kinds, last = [], 1
    for _ in range(1500):
        n = p.choose()
        # a plain round after a drafting one computes two steps (MLX-CPU's pipeline)
        now[0] += (8.0 if last > 1 else 4.0) if n == 1 else (7.0 if last == 1 else 6.0)
        timer.learn(n, n - 1)
        kinds.append(n)
        last = n
    start = next(i for i in range(len(kinds)) if 1 not in kinds[i : i + 100])
    assert start < 600, start


def test_right_draft_takes_full_blocks(modelled, loaded, draft_for):
    """An always-right draft: the full block, once the plain step is timed."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, "class A:\n", 60)
    assert len(set(ref)) == 1, "the tiny target no longer repeats one token here"
    draft = draft_for(folder, mask_token_id=ref[0], echo=True)
    out, _, rounds = auto_run(model, draft, tok, "class A:\n", max_tokens=60)
    assert out == ref
    # The ends are timed first (the first two rounds after a switch not
    # counted): three full blocks, four plain steps; then the longest that fits.
    assert rounds[:7] == [(16, 16, True)] * 3 + [(1, 1, False)] * 4, rounds
    assert rounds[7:] and all(v == a and d == (v > 1) for v, a, d in rounds[7:]), rounds
    again = auto_run(model, draft, tok, "class A:\n", max_tokens=60)[2]
    # The 11 tokens left: the longest lengths that fit (a round of 11 made
    # no measurable difference on six pairs, session 48).
    assert again == [(16, 16, True)] * 3 + [(8, 8, True), (2, 2, True), (1, 1, False)], again


@pytest.mark.parametrize("own_vocab", [False, True])
def test_draft_that_becomes_right_is_used_again(modelled, loaded, draft_for, tmp_path, own_vocab):
    """The echo token only starts repeating after a while: plain steps with
    drafting rounds now and then first, then full blocks once one finds the
    draft right (also with a draft vocabulary: its guesses are compared as
    target ids)."""
    model, tok, folder = loaded("qwen3", tied=True)
    prompt = "import os\n"
    ref = mlx_tokens(model, tok, prompt, 100)
    late = runs(ref)[-1]
    start = ref.index(late)
    assert start > 8 and set(ref[start:]) == {late}
    if own_vocab:
        vocab = [late] + [i for i in range(Target(model).vocab_rows) if i not in ref][:40]
        draft = vocab_draft(tmp_path / "d", folder, vocab[::-1], mask_token_id=late, echo=True)
    else:
        draft = draft_for(folder, mask_token_id=late, echo=True)
    out, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=100)
    assert out == ref
    first = next(i for i, (_, a, _) in enumerate(rounds) if a > 1)
    assert sum(not d for _, _, d in rounds[:first]) >= 3, rounds
    assert max(v for v, _, _ in rounds[first:]) >= 8, rounds  # longer rounds as it is found right
    after = [(a, d) for _, a, d in rounds[first:]]
    assert sum(a for a, d in after if d) >= 0.5 * sum(a for a, _ in after), rounds


def test_a_probe_checks_its_drafts_beyond_its_block(modelled, loaded, draft_for):
    """A greedy probe drafts twice as far as it verifies, and the drafts beyond
    are checked against the target's next tokens: after a warm-up that found
    the deeper drafts wrong, a probe of 2 (which verifies only the first)
    counts an always-right draft's second and third drafts right."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, "class A:\n", 6)
    draft = draft_for(folder, mask_token_id=ref[0], echo=True)
    p = Policy.of(draft)
    timed(p, 16, 3.0, 0)  # the modelled clock's costs
    timed(p, 2, 1.6, 0)
    for _ in range(8):
        timed(p, 1, 1.0)
    p.hits[:], p.trials[:] = [1.0] + [0.0] * 14, [3.0] * 15  # a warm-up's bad stretch
    assert p.plain_wins() and p.choose() == 2
    out, _, rounds = auto_run(model, draft, tok, "class A:\n", max_tokens=6)
    assert out == ref and rounds[0] == (2, 2, True) and all(v == 1 for v, _, _ in rounds[1:]), rounds
    # the second draft against the probe's bonus token, the third against the next plain step's
    assert p.hits[1:3] == [1.0, 1.0] and p.trials[1:3] == [3 * p.memory + 1] * 2, (p.hits, p.trials)
    assert p.trials[3] == 3 * p.memory


def test_sampled_generations_do_not_steer_greedy_ones(modelled, loaded, draft_for):
    """A sampled round accepts less and costs more than a greedy one, so each
    kind of generation has its own policy: sampled ones on which a draft
    fails do not keep greedy ones on which it is right from full blocks."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, "class A:\n", 40)
    assert len(set(ref)) == 1
    draft = draft_for(folder, mask_token_id=ref[0], echo=True)  # it always guesses ref[0]
    for seed in range(3):
        _, _, rounds = auto_run(model, draft, tok, "import os\n", max_tokens=40, temperature=1.0, seed=seed)
    assert Policy.of(draft, sampled=True).best() == 1 and sum(v > 1 for v, _, _ in rounds) <= 2, rounds  # probes
    out, _, rounds = auto_run(model, draft, tok, "class A:\n", max_tokens=40)
    assert out == ref and rounds[:2] == [(16, 16, True)] * 2, rounds


def test_auto_sampling_is_reproducible(modelled, loaded, draft_for):
    """A seed repeats its text while the policy carries what it learnt from
    one generation to the next: a useless draft drafts less the second time."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    kw = dict(max_tokens=40, temperature=0.3, top_p=0.95)
    a, _, ra = auto_run(model, draft, tok, "class A:\n", seed=3, **kw)
    b, _, rb = auto_run(model, draft, tok, "class A:\n", seed=3, **kw)
    c, _, _ = auto_run(model, draft, tok, "class A:\n", seed=4, **kw)
    assert a == b and a != c
    assert sum(d for _, _, d in rb) < sum(d for _, _, d in ra), (ra, rb)


def test_auto_sampling_follows_the_target_law(modelled, loaded, draft_for):
    """Three tokens at temperature 1, top-k 3, the echo draft sure of the
    likeliest token: rounds that draft and plain steps, whatever auto
    chooses, draw the target's law. The seeds are fixed, so the distance is too.
    The 2-layer target of test_sampling's law tests (half the time a draw)."""
    model, tok, folder = loaded("qwen3", tied=True, layers=2)
    prompt = tok.encode("import os\n")
    law = target_law(model, prompt)
    draft = draft_for(folder, mask_token_id=max(law, key=law.get)[1], echo=True)
    # 600 draws: a correct law's TV distance is 0.068 +- 0.012 (see
    # test_sampling: 27 outcomes), over 0.1 with probability ~1%; fewer
    # draws would need a looser bound.
    counts, verified, draws = {}, set(), 600
    for seed in range(draws):
        out, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=3, temperature=TEMP,
                                  top_k=TOP_K, seed=seed)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        verified |= {v for v, _, _ in rounds}
    assert verified == {1, 2}  # drafted rounds and plain steps
    assert tv(law, counts, draws) < 0.1


def test_block_size_arguments(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    for bad in ("fast", "AUTO", 2.5):
        with pytest.raises(GenerationArgumentError, match="block_size"):
            next(stream_generate(model, draft, tok, "import os\n", block_size=bad))
    ref = mlx_tokens(model, tok, "import os\n", 20)
    for bs in (None, "auto"):
        Policy.forget(draft)  # each starts afresh, trying the full block first
        out, _, rounds = auto_run(model, draft, tok, "import os\n", block_size=bs, max_tokens=20)
        assert out == ref and {d for _, _, d in rounds} == {True, False}
    # An integer block size drafts and verifies that many every round.
    out, _, rounds = auto_run(model, draft, tok, "import os\n", block_size=4, max_tokens=20)
    assert out == ref
    done = 1  # the prefill's token
    for verified, accepted, drafted in rounds:
        assert verified == min(4, 20 - done) and drafted == (verified > 1)
        done += accepted


def test_cli_parsers_accept_auto():
    from dflash_mlx.bench import benchmark
    from dflash_mlx.generate import build_parser

    p = build_parser()
    assert p.parse_args([]).block_size == "auto"
    assert p.parse_args(["--block-size", "auto"]).block_size == "auto"
    assert p.parse_args(["--block-size", "4"]).block_size == 4
    p = benchmark.build_parser()  # a list of columns
    assert p.parse_args([]).block_size == ["auto"]
    assert p.parse_args(["--block-size", "4,auto,4"]).block_size == [4, "auto"]


def test_pipelined_plain_steps_leave_the_caches_whole(loaded, draft_for):
    """Plain steps run pipelined (the next step queued before this one's token
    is read). A generation closed early, or ended by max_tokens, leaves the
    prompt cache holding every token but the last, so continuing it gives
    exactly a fresh run's tokens; with a draft the draft cache matches."""
    from mlx_lm.models.cache import make_prompt_cache

    from dflash_mlx.engine.decoding import DraftCache

    model, tok, folder = loaded("qwen3")
    prompt = PROMPTS[0]
    ids = tok.encode(prompt)
    ref = mlx_tokens(model, tok, prompt, 24)
    for draft, bs in ((None, 1), (draft_for(folder), "auto")):
        cache = make_prompt_cache(model)
        dcache = DraftCache(draft) if draft is not None else None
        gen = stream_generate(model, draft, tok, ids, block_size=bs, max_tokens=24, prompt_cache=cache,
                              draft_cache=dcache)
        got = []
        for r in gen:
            got += r.tokens
            if len(got) >= 9:
                break
        gen.close()
        assert got == ref[: len(got)]
        assert cache[0].offset == len(ids) + len(got) - 1
        if dcache is not None:
            assert dcache.size == cache[0].offset
        rest = [t for r in stream_generate(model, draft, tok, got[-1:], block_size=bs, max_tokens=24 - len(got),
                                           prompt_cache=cache, draft_cache=dcache) for t in r.tokens]
        assert got + rest == ref


def test_backoff_carries_over_to_the_next_generation(modelled, loaded, draft_for):
    """A draft found useless is not tried afresh at the start of every
    generation: the next one goes on from the first one's policy, drafts
    less, and stays exact; another draft object starts afresh."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    prompt = PROMPTS[0]
    ref = mlx_tokens(model, tok, prompt, 40)
    first = auto_run(model, draft, tok, prompt, max_tokens=40)
    second = auto_run(model, draft, tok, prompt, max_tokens=40)
    assert first[0] == second[0] == ref
    drafting = [sum(d for _, _, d in r[2]) for r in (first, second)]
    assert drafting[1] < drafting[0], drafting
    assert first[2][0][2] and Policy.of(draft).lost > 0
    fresh = auto_run(model, draft_for(folder), tok, prompt, max_tokens=40)
    assert fresh[2][0] == (16, 1, True)  # the full block first, as the first draft did


def timed(p, length, seconds, accepted=None, width=1):
    """One round of ``length`` as the loop reports it to policy ``p``."""
    rows = [accepted] * width if isinstance(accepted, int) else accepted
    if length > 1:
        p.learn(length, rows)
    p.time(length, seconds, width)
    p.spend(seconds, 1 + sum(rows) / len(rows) if length > 1 else 1, width, drafted=length > 1)
    p.took(length, width)


def test_ends_are_timed_first_then_the_fastest_length_wins():
    p = Policy(16)
    assert p.lengths == [1, 2, 4, 8, 16]
    for _ in range(8):
        p.learn(16, [3])
    assert p.choose() == 16
    timed(p, 16, 0.010, 3)  # 4 tokens in 10 ms
    for _ in range(4):  # then four plain steps
        assert p.choose() == 1
        timed(p, 1, 0.004)  # plain: 1 token in 4 ms
    # Depths 0-2 always right, depth 3 wrong: E(4) = 4; 4 is interpolated
    # between 4 and 10 ms: 5.2 ms, so 4 tokens at 770/s beat 16's 400/s.
    assert p.tokens(4) == pytest.approx(4.0, abs=0.6) and p.choose() == 4
    for _ in range(5):
        timed(p, 4, 0.009, 3)  # measured slower than hoped: 444/s
    assert p.seconds(4) == pytest.approx(0.009)
    assert p.choose() in (4, 8)
    assert p.choose(limit=3) == 2 and p.choose(limit=1) == 1  # the longest that fits the tokens left


def test_the_choice_follows_every_change_of_times_and_counts():
    """best() is kept while nothing it depends on changes (a round asks it
    3-4 times), and answers afresh after new counts, times or a re-timing."""
    p = Policy(4)
    for _ in range(20):
        p.learn(4, [3])  # every draft right
    p.time(1, 0.010)
    p.time(4, 0.012)
    assert p.best() == 4  # 4 tokens in 12 ms against 1 in 10
    for _ in range(200):
        p.learn(4, [0])  # the draft turns useless
    assert p.tokens(4) < 1.1 and p.best() == 1
    for _ in range(p.window + 1):  # drafting rounds with no plain step: its time is dropped
        p.took(4)
    assert not p.timed(1) and p.best() > 1
    p.time(1, 0.010)
    assert p.best() == 1


def test_a_round_tells_what_shorter_ones_would_have_accepted():
    p = Policy(8)
    for _ in range(40):
        p.learn(8, [2])  # drafts 1 and 2 right, 3 wrong; deeper ones never seen
    c = p.chances()
    assert c[0] > 0.95 and c[1] > 0.95 and c[2] < 0.1
    assert p.trials[3] == 0 and c[3] < 0.1  # an unseen depth leans on the one before
    assert p.tokens(2) == pytest.approx(2.0, abs=0.05) and p.tokens(8) == pytest.approx(3.0, abs=0.1)


def test_probes_lose_at_most_the_budget():
    """Plain steps win (4 ms against 6 ms for a round of 2 that accepts
    nothing): the best drafting round still runs now and then, losing about
    the budget's share of the time; once such rounds gain, drafting wins."""
    p = Policy(16)
    for n in (16, 16, 1, 1, 2, 2):
        timed(p, n, 0.004 if n == 1 else 0.006 if n == 2 else 0.010, 0)
    kinds, total, lost = [], 0.0, 0.0
    for _ in range(2000):
        n = p.choose()
        kinds.append(n)
        seconds = 0.004 if n == 1 else 0.006
        timed(p, n, seconds, 0)
        total += seconds
        lost += seconds - 0.004
    assert {n for n in kinds if n > 1} == {2}  # the best drafting round: the cheapest
    # A probe runs whenever the loss is under the budget: about half a probe (2 ms a
    # window of 256 x 4 ms, 0.2%) over it.
    assert 0.5 * p.budget * total <= lost <= 1.2 * p.budget * total, (lost, total)
    probes = 0
    while p.choose() == 1 or probes == 0:  # the draft turns right
        n = p.choose()
        timed(p, n, 0.004 if n == 1 else 0.006, n - 1)
        probes += n > 1
    assert probes <= 3 and p.choose() > 1


def test_only_probes_are_charged_to_the_budget():
    """Rounds chosen because drafting won are not charged, even the one whose
    result makes plain steps win: a draft that pays only on some stretches
    would otherwise spend the budget at each bad stretch and probe no more
    (heldout_draft2_early locked into plain steps in 15 of 25 benchmark
    passes that way, 4 of 13 with this). A probe is charged."""
    p = Policy(8)
    timed(p, 8, 0.010, 7)
    timed(p, 8, 0.010, 7)
    while p.skip:
        timed(p, 1, 0.004)
    assert p.choose() == 8
    while not p.plain_wins():  # the draft goes bad
        timed(p, p.choose(), 0.010, 0)
    assert p.lost == 0
    while (n := p.choose()) == 1:
        timed(p, 1, 0.004)
    timed(p, n, 0.010, 0)  # a probe, as wrong
    assert p.lost > 0


def test_noisy_plain_steps_buy_no_probes():
    """As above, on a clock that jitters every round by +-25%: plain steps
    faster than their mean are not a gain that buys more probes (their noise,
    over the budget's window, is larger than the budget)."""
    probes = budgeted = 0.0
    for seed in range(4):
        rng, p = random.Random(seed), Policy(16)
        for n in (16, 16, 1, 1, 2, 2):
            timed(p, n, 0.004 if n == 1 else 0.006 if n == 2 else 0.010, 0)
        for _ in range(4000):
            n = p.choose()
            timed(p, n, (0.004 if n == 1 else 0.006) * math.exp(rng.gauss(0, 0.25)), 0)
            probes += n > 1
            budgeted += p.budget * 0.004 / 0.002 * (n == 1)  # a probe loses 2 ms
    # Over 40 seeds: 1.09x while the round that made plain steps win was charged too,
    # 1.15x with only probes charged; counting every plain round's loss: 1.35x.
    assert probes <= 1.25 * budgeted, (probes, budgeted)


def test_plain_steps_timed_in_a_slow_phase_are_timed_again():
    """Plain steps timed while the machine was slow (10 ms, where they take
    4): rounds of 2 that accept a draft one time in five (6 ms) look faster,
    and drafting wins. After ``window`` drafting rounds plain steps are timed
    again, and win (SmolLM2's demo drafted every round of 25 runs after one
    run's plain steps were timed beside another process, 2026-12-07)."""
    rng, p = random.Random(0), Policy(16)
    for n in (16, 16, 1, 1, 1, 1):
        timed(p, n, 0.010, 0)
    kinds = []
    for _ in range(3 * p.window):
        n = p.choose()
        timed(p, n, {1: 0.004, 2: 0.006}.get(n, 0.010), int(rng.random() < 0.2) if n > 1 else None)
        kinds.append(n)
    assert kinds[: p.window].count(1) == 0  # locked into drafting for a while
    assert kinds[-p.window :].count(1) > 0.9 * p.window, kinds[-p.window :]
    assert p.seconds(1) == pytest.approx(0.004)


def test_a_pause_weighs_like_a_slow_round_and_widths_count_apart():
    p = Policy(4)
    for _ in range(10):
        p.time(4, 0.01)
    p.time(4, 5.0)  # the machine paused
    assert p.seconds(4) < 0.02
    p.time(4, 0.05, width=3)
    assert p.seconds(4, 3) == pytest.approx(0.05) and p.seconds(4) < 0.02
    assert p.seconds(2, 5) is None


def test_policy_is_kept_per_draft(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    a, b = draft_for(folder), draft_for(folder)
    assert Policy.of(a) is Policy.of(a) and Policy.of(a) is not Policy.of(b)
    assert Policy.of(a, sampled=True) is Policy.of(a, sampled=True) is not Policy.of(a)
    kept = Policy.of(a), Policy.of(a, sampled=True)
    Policy.forget(a)
    assert Policy.of(a) is not kept[0] and Policy.of(a, sampled=True) is not kept[1]
    assert Policy.of(a).block_size == a.block_size
