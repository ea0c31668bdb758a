"""block_size="auto": each round's length is chosen by dflash_mlx.policy. The
output stays exactly the target's; the choices follow the cost model and the
draft's record, and the cost model is measured once and cached."""

import copy
import json
import warnings

import pytest

from conftest import ARCHS
from dflash_mlx import GenerationArgumentError, stream_generate
from dflash_mlx.engine import policy as pol
from dflash_mlx.engine.policy import Costs, Policy
from dflash_mlx.engine.target import Target
from test_draft_vocab import vocab_draft
from test_sampling import TEMP, TOP_K, target_law, tv
from util import mlx_run, mlx_tokens, runs

PROMPTS = ["def foo(x):\n    return", "import os\n", "class A:\n"]
# Drafting costs something: a draft pass is 0.3 plain steps, 16 tokens 1.5.
COSTS = Costs(draft=0.3, verify={1: 1.0, 16: 1.5})


def auto_run(model, draft, tok, prompt, **kw):
    """(tokens, text, rounds): each round as (verified, accepted, drafted),
    drafted meaning a draft pass ran."""
    calls, propose = [0], draft.propose
    draft.propose = lambda *a: calls.__setitem__(0, calls[0] + 1) or propose(*a)
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
def test_auto_is_lossless(arch, loaded, draft_for):
    """An echo draft is right along runs of its token and wrong elsewhere:
    auto drafts in runs and backs off to plain steps outside; a random draft
    mostly gets plain steps. Every output is the target's."""
    model, tok, folder = loaded(arch, tied=True)
    plain = gained = False
    for prompt in PROMPTS[:2]:
        ref, text = mlx_run(model, tok, prompt, 60)
        drafts = [draft_for(folder)] + [draft_for(folder, mask_token_id=t, echo=True) for t in runs(ref)[:1]]
        for draft in drafts:
            out, got, rounds = auto_run(model, draft, tok, prompt, max_tokens=60, costs=COSTS)
            assert out == ref and got == text, (arch, prompt)
            for verified, accepted, drafted in rounds:
                assert 1 <= accepted <= verified <= draft.block_size
                assert drafted or verified == 1
                plain |= not drafted
                gained |= accepted > 1
    assert plain and gained


def test_useless_draft_takes_plain_steps(loaded, draft_for):
    """Random draft weights, drafting not free: after the first failed
    rounds, plain steps, with probes at growing intervals."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    prompt = PROMPTS[0]
    out, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=80, costs=COSTS)
    assert out == mlx_tokens(model, tok, prompt, 80)
    probes = [i for i, r in enumerate(rounds) if r[2]]
    assert len(probes) <= 8 and len(rounds) > 60
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] >= 16, gaps
    assert all(v == 1 for v, _, d in rounds if not d)


def test_right_draft_takes_full_blocks(loaded, draft_for):
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, "class A:\n", 60)
    assert len(set(ref)) == 1, "the tiny target no longer repeats one token here"
    draft = draft_for(folder, mask_token_id=ref[0], echo=True)
    out, _, rounds = auto_run(model, draft, tok, "class A:\n", max_tokens=60, costs=COSTS)
    assert out == ref
    # 1 token from the prefill, a short probe, then full blocks up to the max_tokens cut.
    assert rounds == [(4, 4, True)] + [(16, 16, True)] * 3 + [(7, 7, True)]


@pytest.mark.parametrize("own_vocab", [False, True])
def test_draft_that_becomes_right_is_used_again(loaded, draft_for, tmp_path, own_vocab):
    """The echo token only starts repeating after a while: plain steps with
    probes first, then full blocks once a probe finds the draft right (also
    with a draft vocabulary: its guesses are compared as target ids)."""
    model, tok, folder = loaded("qwen3", tied=True)
    prompt = "import os\n"
    ref = mlx_tokens(model, tok, prompt, 60)
    late = runs(ref)[-1]
    start = ref.index(late)
    assert start > 8 and set(ref[start:]) == {late}
    if own_vocab:
        vocab = [late] + [i for i in range(Target(model).vocab_rows) if i not in ref][:40]
        draft = vocab_draft(tmp_path / "d", folder, vocab[::-1], mask_token_id=late, echo=True)
    else:
        draft = draft_for(folder, mask_token_id=late, echo=True)
    out, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=60, costs=COSTS)
    assert out == ref
    first = next(i for i, (_, a, _) in enumerate(rounds) if a > 1)
    assert any(not d for _, _, d in rounds[:first])
    # Probes verify a few tokens; once 4 plain steps separate them, they run
    # the draft pass beside a plain step (nothing verified) and are judged by
    # the tokens that follow. One finds the draft right: then full blocks.
    probes = [r for r in rounds[:first] if r[2]]
    assert probes[:3] == [(4, 1, True)] * 3 and probes[3:] and set(probes[3:]) == {(1, 1, True)}, rounds
    assert rounds[first] == (16, 16, True) and all(a == v and d for v, a, d in rounds[first:])


@pytest.mark.parametrize("kw, shadow", [({}, True), ({"temperature": 0.7, "seed": 1}, True),
                                        ({"temperature": 0.7}, False)])
def test_probes_beside_plain_steps(loaded, draft_for, kw, shadow):
    """A useless draft's probes, once 4 plain steps separate them, run its
    draft pass beside a plain step and verify nothing, where the target's
    choice is the token itself (greedy, seeded noise); the p/q rule of
    unseeded sampled drafts needs a verify."""
    model, tok, folder = loaded("qwen3")
    out, _, rounds = auto_run(model, draft_for(folder), tok, PROMPTS[0], max_tokens=80, costs=COSTS, **kw)
    if not kw:
        assert out == mlx_tokens(model, tok, PROMPTS[0], 80)
    probes = [v for v, _, d in rounds if d]
    assert len(probes) >= 6 and all(v > 1 for v in probes[:3]), rounds
    assert all((v == 1) == shadow for v in probes[3:]), rounds


def test_expensive_verify_gives_short_rounds(loaded, draft_for, monkeypatch):
    """Verify cost growing with length (a CPU without a fast BLAS): a right
    but unsure draft is verified a few tokens at a time, mostly without
    waiting for its confidences."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, "class A:\n", 80)
    draft = draft_for(folder, mask_token_id=ref[0], echo=True)
    steep = Costs(draft=0.3, verify={1: 1.0, 2: 1.2, 16: 12.0})
    seen, looks = [], Policy.looks
    monkeypatch.setattr(Policy, "looks", lambda self: seen.append(looks(self)) or seen[-1])
    out, _, rounds = auto_run(model, draft, tok, "class A:\n", max_tokens=80, costs=steep)
    assert out == ref
    assert max(v for v, _, _ in rounds) < 16
    # The probe and the next round look, later ones verify blind (the last
    # look: the probe after the draft stopped paying).
    assert seen[:2] == [True, True] and sum(seen) <= 3 and len(seen) > 20, seen
    assert sum(1 < v < 16 for v, _, _ in rounds[2:]) >= 4, rounds


def test_auto_sampling_is_reproducible(loaded, draft_for):
    """A seed repeats its text while the policy carries what it learnt from
    one generation to the next: the second run of a useless draft starts
    with plain steps instead of a probe."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    kw = dict(max_tokens=30, temperature=0.3, top_p=0.95, costs=COSTS)
    a, _, ra = auto_run(model, draft, tok, "class A:\n", seed=3, **kw)
    b, _, rb = auto_run(model, draft, tok, "class A:\n", seed=3, **kw)
    c, _, _ = auto_run(model, draft, tok, "class A:\n", seed=4, **kw)
    assert a == b and a != c
    assert ra[0][2] and not rb[0][2]


def test_auto_sampling_follows_the_target_law(loaded, draft_for):
    """Three tokens at temperature 1, top-k 3: the prefill's token, then a
    round verifying 2 tokens (the echo draft is sure), and after a rejection
    a plain step. The seeds are fixed, so the distance is too."""
    model, tok, folder = loaded("qwen3", tied=True)
    prompt = tok.encode("import os\n")
    law = target_law(model, prompt)
    draft = draft_for(folder, mask_token_id=max(law, key=law.get)[1], echo=True)
    # 600 draws: a correct law's TV distance is 0.074 +- 0.012 (see
    # test_sampling: 27 outcomes), over 0.1 with probability ~2%; fewer
    # draws would need a looser bound.
    counts, verified, draws = {}, set(), 600
    for seed in range(draws):
        out, _, rounds = auto_run(model, draft, tok, prompt, max_tokens=3, temperature=TEMP,
                                  top_k=TOP_K, seed=seed, costs=COSTS)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        verified |= {v for v, _, _ in rounds}
    assert verified == {1, 2}  # drafted rounds, and plain steps after a rejection
    assert tv(law, counts, draws) < 0.1


def test_block_size_arguments(loaded, draft_for):
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    for bad in ("fast", "AUTO", 2.5):
        with pytest.raises(GenerationArgumentError, match="block_size"):
            next(stream_generate(model, draft, tok, "import os\n", block_size=bad))
    with pytest.raises(GenerationArgumentError, match="costs"):
        next(stream_generate(model, draft, tok, "import os\n", costs={1: 1.0}))
    for draft_cost, verify in ((-1.0, {1: 1.0}), (0.5, {}), (0.5, {0: 1.0}), (0.5, {1: 0.0})):
        with pytest.raises(ValueError, match="implausible costs"):
            Costs(draft_cost, verify)
    ref = mlx_tokens(model, tok, "import os\n", 20)
    for bs in (None, "auto"):
        out, _, rounds = auto_run(model, draft, tok, "import os\n", block_size=bs, max_tokens=20, costs=COSTS)
        assert out == ref and {d for _, _, d in rounds} == {True, False}
    # An integer block size drafts and verifies that many every round.
    out, _, rounds = auto_run(model, draft, tok, "import os\n", block_size=4, max_tokens=20, costs=COSTS)
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


def test_policy_rule():
    conf = [0.95] * 15
    assert Policy(COSTS, 16).length(conf, 16) == 4  # a probe: at most probe_limit
    sure = Policy(COSTS, 16)
    sure.probe = False  # drafting has paid: the rule alone
    assert sure.length(conf, 16) == 16 and sure.length(conf, 5) == 5
    steep = Costs(draft=0.5, verify={1: 1.0, 16: 16.0})
    assert steep.verify_at(4) == 4.0 and steep.verify_at(20) == 20.0
    # Verify 0.25 steps a token: the L-th token is worth verifying while its
    # chance to count (0.8^(L-1)) beats the rate drafting has been making
    # (tokens per step, at least plain's 1) times those 0.25 steps.
    slope = Costs(draft=0.5, verify={1: 1.0, 16: 4.75})
    steady = Policy(slope, 16)
    steady.probe = False
    assert steady.length([0.8] * 15, 16) == 7  # 0.8^6 > 0.25 > 0.8^7
    steady.made, steady.spent = 4.0, 2.0  # 2 tokens a step
    assert steady.length([0.8] * 15, 16) == 4  # 0.8^3 > 0.5 > 0.8^4
    assert Policy(COSTS, 16).length([0.01] * 15, 16) <= 2
    p, waits = Policy(COSTS, 16), []
    for _ in range(36):  # a draft that is never right: back off 1, 2, 4, ...
        if p.drafts():
            p.update(p.length([0.9] * 15, 16), 0, True)
            waits.append(p.wait)
        else:
            p.update(1, 0, False)
    assert waits == [1, 2, 4, 8, 16] and p.drafts()
    p.update(p.length([0.9] * 15, 16), 3, True)  # all 3 right again: draft every round
    assert p.wait == 0 and p.drafts() and p.length([0.9] * 15, 16) == 16


def test_costs_are_measured_once_and_cached(loaded, draft_for, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    measured, real = [], pol.measure_costs
    monkeypatch.setattr(pol, "measure_costs", lambda *a, **k: measured.append(1) or real(*a, **k))
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    first = pol.cached_costs(Target(model), draft)
    assert first.verify[1] >= 1.0 and set(first.verify) == {1, 2, 4, 8, 16} and first.draft > 0
    (path,) = (tmp_path / "costs").glob("*.json")
    stamp = path.stat().st_mtime_ns
    assert pol.cached_costs(Target(model), draft) == first
    ref = mlx_tokens(model, tok, "import os\n", 10)
    assert auto_run(model, draft, tok, "import os\n", max_tokens=10)[0] == ref
    assert measured == [1] and path.stat().st_mtime_ns == stamp

    for bad in ("{not json", json.dumps({"key": json.loads(path.read_text())["key"], "draft": -1, "verify": {}})):
        path.write_text(bad)
        with pytest.warns(UserWarning, match="unreadable cost cache"):
            again = pol.cached_costs(Target(model), draft)
        assert set(again.verify) == set(first.verify)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert pol.cached_costs(Target(model), draft) == again  # the file was rewritten
    assert len(measured) == 3
    assert not list((tmp_path / "costs").glob("*.tmp"))


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
                              draft_cache=dcache, costs=COSTS)
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
                                           prompt_cache=cache, draft_cache=dcache, costs=COSTS) for t in r.tokens]
        assert got + rest == ref


def test_backoff_carries_over_to_the_next_generation(loaded, draft_for):
    """A draft found useless is not probed afresh at the start of every
    generation: the second generation starts where the first one's back-off
    left off (plain steps first), and stays exact."""
    model, tok, folder = loaded("qwen3")
    draft = draft_for(folder)
    prompt = PROMPTS[0]
    ref = mlx_tokens(model, tok, prompt, 40)
    first = auto_run(model, draft, tok, prompt, max_tokens=40, costs=COSTS)
    second = auto_run(model, draft, tok, prompt, max_tokens=40, costs=COSTS)
    assert first[0] == second[0] == ref
    probes = [sum(d for _, _, d in r[2]) for r in (first, second)]
    assert first[2][0][2] and not second[2][0][2]  # the first round: a probe, then a plain step
    assert probes[1] < probes[0], probes
    fresh = auto_run(model, draft_for(folder), tok, prompt, max_tokens=40, costs=COSTS)
    assert fresh[2][0][2]  # another draft object starts afresh


def test_drafting_is_weighed_against_the_plain_step_the_loop_takes():
    """Costs are in pipelined plain steps; where the loop cannot pipeline
    (processors, several ranks) a plain step costs a synchronised forward,
    verify(1), and drafting that beats it is kept."""
    costs = Costs(0.3, {1: 1.3, 2: 2.3})
    pipelined, synced = Policy(costs, 2, plain=1.0), Policy(costs, 2)
    for p in (pipelined, synced):
        p.update(p.chose([0.5], 2), 1, True)  # 2 tokens for 0.3 + 2.3
    assert not pipelined.drafts() and synced.drafts()
    assert (pipelined.made, pipelined.spent) == (synced.made, synced.spent) == pytest.approx((2, 2.6))


def test_guesses_deeper_in_the_block_are_counted_apart():
    """At the same confidence the first guess is accepted every time and the
    second never: the policy learns both, where one statistic per
    confidence would put each at about a half."""
    p = Policy(COSTS, 16)
    p.probe = False
    for _ in range(30):
        p.chose([0.5] * 15, 16)
        p.update(16, 1, True)
    assert p.chance(0.5, 0) > 0.9 and p.chance(0.5, 1) < 0.1
    gain = p.expect([0.5] * 15, 16)
    assert gain[1] > 1.9 and gain[-1] - gain[1] < 0.1


def test_rounds_verify_blind_what_the_last_confidences_chose():
    """After a round that looked, the next verifies what its confidences
    chose without waiting for its own; those, read after its verify, set the
    next length while they choose as many tokens or more, else the next
    round looks."""
    p = Policy(COSTS, 16)
    p.update(p.length([0.95] * 15, 16), 3, True)  # the probe: 4 of 4
    fair = [0.95] * 4 + [0.05] * 11
    assert p.looks() and p.length(fair, 16) == 5 and not p.looks() and p.blind == 5
    p.update(5, 4, True)
    looking = copy.deepcopy(p)
    p.saw([0.95] * 15, 5)  # the draft grew surer: go on blind, longer
    assert p._seen == [0.95] * 4 and not p.looks()
    assert p.blind == looking.length([0.95] * 15, 16) == 16
    p.update(5, 4, True)
    p.saw([0.6, 0.3] + [0.01] * 13, 16)  # unsure: look again
    assert p.looks()


def test_right_draft_rounds_skip_the_confidence_sync(loaded, draft_for, monkeypatch):
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, "class A:\n", 60)
    draft = draft_for(folder, mask_token_id=ref[0], echo=True)
    seen, looks = [], Policy.looks
    monkeypatch.setattr(Policy, "looks", lambda self: seen.append(looks(self)) or seen[-1])
    out, _, rounds = auto_run(model, draft, tok, "class A:\n", max_tokens=60, costs=COSTS)
    assert out == ref and [v for v, _, _ in rounds] == [4, 16, 16, 16, 7]
    assert seen == [True, True, False, False, False]  # the probe, the first full block, then blind


def test_clock_corrects_the_plain_steps_cost():
    """Timed rounds: plain steps at 6 ms, drafting rounds at 5 ms per modelled
    unit, so a plain step costs 1.2 units, and drafting that makes 0.9 tokens
    a unit goes on, where the uncorrected model (1 a unit) would have stopped
    it. A pause of the machine moves it little; without the clock the times
    are ignored."""
    costs = Costs(0.3, {1: 1.0, 4: 1.8})
    timed, fixed = Policy(costs, 4, plain=1.0, clock=True), Policy(costs, 4, plain=1.0)
    for p in (timed, fixed):
        for _ in range(20):
            p.update(1, 0, False, 0.006)
            p.chose([0.9] * 3, 4)
            p.update(4, 1, True, 0.005 * 2.1)
    assert timed.unit() == pytest.approx(1.2) and fixed.unit() == 1.0
    for p in (timed, fixed):
        p.probe = False
        p.made, p.spent = 1.8, 2.1
        p.chose([0.9] * 3, 4)
        p.update(4, 1, True, 0.005 * 2.1)
    assert timed.drafts() and not fixed.drafts()
    timed.update(1, 0, False, 1.0)  # a second's pause in one plain step
    assert 1.2 < timed.unit() < 1.5


def test_clock_runs_only_with_measured_costs(loaded, draft_for, tmp_path, monkeypatch):
    """Costs measured for this machine are corrected by the rounds' wall
    times; costs given by the caller are kept as they are."""
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    model, tok, folder = loaded("qwen3")
    ref = mlx_tokens(model, tok, "import os\n", 40)
    for costs, clocked in ((None, True), (COSTS, False)):
        draft = draft_for(folder)
        assert auto_run(model, draft, tok, "import os\n", max_tokens=40, costs=costs)[0] == ref
        plain_steps = pol.memo(draft)["policy"]["timed"][1]
        assert (plain_steps > 0) == clocked
