"""The SmolLM2 answers kept in the package: written back byte-for-byte,
restored into a work folder without duplicates, and none of them answers a
held-out prompt."""

import gzip
import json
from pathlib import Path

from dflash_mlx.smollm2 import build
from dflash_mlx.training.train import REGEN

HELDOUT = Path(build.__file__).parent / "heldout.jsonl"


def _line(i: int) -> str:
    return json.dumps({"tokens": [1, 2, i, 7], "start": 2})


def test_keep_and_restore(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "ANSWERS", tmp_path / "answers.jsonl.gz")
    work = tmp_path / "work"
    (work / "draft").mkdir(parents=True)
    made = work / "draft" / REGEN
    made.write_text("".join(_line(i) + "\n" for i in range(3)) + '{"tokens": [1, 2')  # killed mid-line
    assert build.keep_answers(work) == 3
    first = build.ANSWERS.read_bytes()
    assert build.keep_answers(work) == 3 and build.ANSWERS.read_bytes() == first  # same bytes again
    made.write_text(_line(1) + "\n" + _line(5) + "\n")
    assert build.keep_answers(work) == 4  # new ones appended, old ones kept
    kept = gzip.decompress(build.ANSWERS.read_bytes()).decode().splitlines()
    assert kept == [_line(i) for i in (0, 1, 2, 5)]

    fresh = tmp_path / "fresh"
    assert build.restore_answers(fresh) == 4
    assert build.restore_answers(fresh) == 0  # nothing twice
    assert (fresh / "draft" / REGEN).read_text().splitlines() == kept


def test_committed_answers_leave_out_the_heldout_prompts():
    from dflash_mlx import load

    _, tok = load("smollm2")
    held = [json.loads(l)["prompt"] for l in HELDOUT.read_text().splitlines() if l.strip()]
    rows = [json.loads(l) for l in gzip.decompress(build.ANSWERS.read_bytes()).decode().splitlines()]
    assert rows
    prompts = [tok.decode(r["tokens"][: r["start"]]) for r in rows]
    for h in held:
        assert not any(h in p for p in prompts), h
