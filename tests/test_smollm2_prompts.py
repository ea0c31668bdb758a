"""The offline SmolLM2 training prompts and the hand-written held-out set (no models)."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from dflash_mlx.smollm2.prompts import MIX, training_prompts

HELDOUT = Path(__file__).parents[1] / "dflash_mlx" / "smollm2" / "heldout.jsonl"


def key(rec):
    return tuple(m["content"] for m in rec["messages"])


@pytest.fixture(scope="module")
def recs():
    return training_prompts(5000, seed=0)


def test_count_and_distinct(recs):
    assert len(recs) == 5000
    assert len({key(r) for r in recs}) == 5000
    assert len(training_prompts(7, seed=3)) == 7
    assert training_prompts(0) == []


def test_deterministic():
    a, b, c = training_prompts(300, seed=1), training_prompts(300, seed=1), training_prompts(300, seed=2)
    assert a == b
    assert a != c
    assert len({key(r) for r in a} & {key(r) for r in c}) < 100


def test_proportions(recs):
    counts = Counter(r["category"] for r in recs)
    assert set(counts) == set(MIX)
    for cat, share in MIX.items():
        assert abs(counts[cat] / len(recs) - share) < 0.02, (cat, counts)
    first = Counter(r["category"] for r in recs[:500])  # shuffled, not in blocks
    assert all(abs(first[c] / 500 - s) < 0.06 for c, s in MIX.items()), first


def test_messages_valid(recs):
    for r in recs:
        assert set(r) == {"messages", "category"}
        msgs = r["messages"]
        assert len(msgs) % 2 == 1
        for i, m in enumerate(msgs):
            assert set(m) == {"role", "content"}
            assert m["role"] == ("user" if i % 2 == 0 else "assistant")
            assert isinstance(m["content"], str) and m["content"].strip() == m["content"] != ""
            assert "{" not in m["content"] or "```" in m["content"], m["content"]  # no unfilled slot
        assert (len(msgs) == 3) == (r["category"] == "chat")


def test_variety(recs):
    firsts = [r["messages"][0]["content"] for r in recs]
    sentences = [p.split("```")[0].count(". ") + p.count("? ") + 1 for p in firsts]
    assert min(sentences) == 1 and max(sentences) >= 4
    assert len({p.split()[0] for p in firsts}) > 30  # many ways to start
    code = " ".join(p for r, p in zip(recs, firsts) if r["category"] == "code")
    assert code.count("Python") > code.count("JavaScript") > 0


def test_cli(tmp_path):
    out = tmp_path / "p.jsonl"
    cmd = [sys.executable, "-m", "dflash_mlx.smollm2.prompts", "--n", "50", "--seed", "4", "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == training_prompts(50, seed=4)


def test_heldout_well_formed():
    rows = [json.loads(line) for line in HELDOUT.read_text().splitlines()]
    assert len(rows) == 48
    assert len({r["id"] for r in rows}) == 48 and len({r["prompt"] for r in rows}) == 48
    assert Counter(r["category"] for r in rows) == {"math": 16, "code": 16, "chat": 16}
    for r in rows:
        assert set(r) == {"id", "category", "prompt"}
        assert r["id"].startswith(r["category"] + "-") and r["prompt"].strip()


def test_heldout_not_generated(recs):
    held = [json.loads(line)["prompt"] for line in HELDOUT.read_text().splitlines()]
    turns = {m["content"] for r in recs for m in r["messages"] if m["role"] == "user"}
    for h in held:
        assert not any(h in t or t in h for t in turns), h
