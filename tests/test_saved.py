"""What "auto" learnt carries over between runs of the command line."""

import json
import re
from pathlib import Path

import pytest

from dflash_mlx.engine import saved
from dflash_mlx.engine.policy import Policy, memo
from dflash_mlx.generate import main
from tiny import make_draft
from util import mlx_run, mlx_tokens

PROMPT = "class A:\n"


@pytest.fixture
def pair(loaded, tmp_path):
    """A right draft (it always guesses the one token the tiny target
    repeats after PROMPT), the CLI arguments for it, and the saved file's path
    getter."""
    model, tok, folder = loaded("qwen3", tied=True)
    ref = mlx_tokens(model, tok, PROMPT, 60)
    assert len(set(ref)) == 1, "the tiny target no longer repeats one token here"
    draft = make_draft(tmp_path / "draft", folder, mask_token_id=ref[0], echo=True)
    args = ["--model", str(folder), "--draft", str(draft), "--prompt", PROMPT,
            "--no-chat-template", "--max-tokens", "60"]
    _, want = mlx_run(model, tok, PROMPT, 60)

    def files():
        return list(saved.folder().glob("*.json"))

    return args, want, files


def run(args, capsys, err=None):
    """(text, mean acceptance length) of one CLI run; its stderr is appended to ``err``."""
    assert main(args) == 0
    out = capsys.readouterr()
    if err is not None:
        err.append(out.err)
    text, _, stats = out.out.rpartition("\n==========\n")
    return text, float(re.search(r"Mean acceptance length: ([0-9.]+)", stats)[1])


def plain_wins(block_size: int, regime: str = "greedy") -> dict:
    """A saved file in which, for ``regime``'s generations, plain steps win by
    far and probes spent their budget."""
    return {regime: {"block_size": block_size, "times": [[1, 1, 0.01, 10.0], [1, block_size, 100.0, 10.0]],
                     "counts": [[0.0] * (block_size - 1)] * 2, "spent": 1.0, "lost": 1.0}}


def test_a_run_starts_where_the_last_one_left(pair, capsys):
    args, want, files = pair
    text, tau = run(args, capsys)
    assert text == want and tau > 4  # fresh: full blocks
    (path,) = files()
    state = json.loads(path.read_text())
    assert list(state) == ["greedy"]
    assert state["greedy"]["block_size"] == 16 and any(n == 16 for _, n, _, _ in state["greedy"]["times"])

    path.write_text(json.dumps(plain_wins(16)))
    text, tau = run(args, capsys)
    assert text == want and tau == 1.0  # started from the saved state: plain steps
    # kept again, with this run's times
    assert json.loads(path.read_text())["greedy"]["times"] != plain_wins(16)["greedy"]["times"]

    path.write_text(json.dumps(plain_wins(16)))
    text, tau = run(args + ["--fresh"], capsys)
    assert text == want and tau > 4  # not read
    assert json.loads(path.read_text()) == plain_wins(16)  # nor written


def test_greedy_and_sampled_generations_learn_apart(pair, capsys):
    """A sampled run's policy (a sampled round accepts less and costs more)
    does not steer a greedy run, and each is kept beside the other."""
    args, want, files = pair
    run(args, capsys)
    (path,) = files()
    path.write_text(json.dumps(plain_wins(16, "sampled")))
    text, tau = run(args, capsys)
    assert text == want and tau > 4  # a fresh greedy policy: full blocks
    state = json.loads(path.read_text())
    assert state["sampled"] == plain_wins(16, "sampled")["sampled"] and state["greedy"]["block_size"] == 16


def damaged(**change) -> str:
    return json.dumps({"greedy": {**plain_wins(16)["greedy"], **change}})


@pytest.mark.parametrize("content", [
    "{not json", "[]", "{}", json.dumps(plain_wins(8)), '{"greedy": {"block_size": 16}}',
    json.dumps({**plain_wins(16), "other": plain_wins(16)["greedy"]}),
    damaged(times=plain_wins(16)["greedy"]["times"] + [[1, 99, 1.0, 1.0]]),  # accepted, plain steps would win
    damaged(times=[[1, 1, 0.0, 10.0], [1, 16, 100.0, 10.0]]),  # a zero time would divide
    damaged(counts=[[5.0] + [0.0] * 14, [1.0] + [0.0] * 14]), damaged(counts=[]), damaged(counts=[[0.0], [0.0]]),
    damaged(lost=2.0), damaged(lost=float("-inf")), damaged(spent=float("nan")),
    damaged(spent=10**400),
])
def test_a_broken_or_foreign_file_is_ignored_and_replaced(pair, capsys, content):
    args, want, files = pair
    run(args, capsys)
    (path,) = files()
    path.write_text(content)
    err = []
    text, tau = run(args, capsys, err)
    assert text == want and tau > 4  # a fresh start
    assert err == [""]
    assert json.loads(path.read_text())["greedy"]["block_size"] == 16


def test_a_saved_policy_chooses_as_the_one_it_was_saved_from(loaded, draft_for):
    _, _, folder = loaded("qwen3", tied=True)
    a, b = draft_for(folder), draft_for(folder)
    p, ps = Policy.of(a), Policy.of(a, sampled=True)
    assert p is not ps
    for n, acc, s in [(16, 5, 0.02), (16, 3, 0.02), (1, 0, 0.004), (4, 3, 0.008), (8, 2, 0.012), (2, 1, 0.006)]:
        if n > 1:
            p.learn(n, [acc])
            ps.learn(n, [acc // 2])
        p.time(n, s, rounds=2)
        ps.time(n, 2 * s)
        p.spend(s, acc + 1, drafted=n > 1)
    ps.spent, ps.lost = 1.0, -0.01  # plain steps next to a probe ran faster than their mean
    saved.keep(a, "k")
    assert not saved.recall(b, "another key") and not memo(b)
    assert saved.recall(b, "k")
    for was, now in [(p, Policy.of(b)), (ps, Policy.of(b, sampled=True))]:
        assert [now.times, now.hits, now.trials, now.spent, now.lost] == [was.times, was.hits, was.trials,
                                                                          was.spent, was.lost]
        assert [now.best(n) for n in range(2, 17)] == [was.best(n) for n in range(2, 17)]


def test_the_oldest_files_go_beyond_the_limit_and_failures_are_quiet(loaded, draft_for, monkeypatch):
    import os

    _, _, folder = loaded("qwen3", tied=True)
    a = draft_for(folder)
    Policy.of(a).time(1, 0.01)
    monkeypatch.setattr(saved, "FILES", 3)
    for i in range(5):
        saved.keep(a, f"k{i}")
        newest = saved._file(f"k{i}")
        os.utime(newest, (1000 + i, 1000 + i))  # mtimes a second apart, whatever the file system's resolution
    assert sorted(saved.folder().glob("*")) == sorted(saved._file(f"k{i}") for i in (2, 3, 4))
    assert saved.recall(draft_for(folder), "k4") and not saved.recall(draft_for(folder), "k0")

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(newest))  # a file where the folder should be
    saved.keep(a, "k5")  # not an error
    monkeypatch.setattr(saved, "_file", lambda key: 1 / 0)
    saved.keep(a, "k6")  # nor is anything else that goes wrong


def test_the_default_folder_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_MLX_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert saved.folder() == tmp_path / "xdg" / "dflash_mlx" / "auto"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert saved.folder() == Path.home() / ".cache" / "dflash_mlx" / "auto"


def test_the_chat_command_keeps_it_too(pair):
    import os
    import subprocess
    import sys

    args, _, files = pair
    model, draft = args[1], args[3]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))

    def chat(*extra):
        r = subprocess.run([sys.executable, "-m", "dflash_mlx.chat", "--model", model, "--draft", draft,
                            "--max-tokens", "20", *extra], input="Write a loop\n/quit\n",
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stderr

    chat()
    (path,) = files()
    path.write_text(json.dumps(plain_wins(16)))
    chat()
    kept = json.loads(path.read_text())["greedy"]["times"]
    # recalled, then this run's plain steps kept
    assert [1, 16, 100.0, 10.0] in kept and kept != plain_wins(16)["greedy"]["times"]
    path.write_text(json.dumps(plain_wins(16)))
    chat("--fresh")
    assert json.loads(path.read_text()) == plain_wins(16)


def test_the_server_keeps_it_between_restarts(pair):
    import os
    import subprocess
    import sys
    import time

    from util import free_port, openai_client

    args, want, files = pair
    model, draft = args[1], args[3]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))

    def serve(*extra, keeps=True):
        """(text, mean acceptance length) of one request to a new server, stopped once it kept its policy."""
        before = [(p, p.read_text()) for p in files()]
        port = free_port()
        p = subprocess.Popen([sys.executable, "-m", "dflash_mlx.server", "--model", model, "--draft", draft,
                              "--port", str(port), "--log-level", "WARNING", *extra], env=env)
        try:
            r = openai_client(port, wait=60).completions.create(model=model, prompt=PROMPT, max_tokens=60)
            end = time.monotonic() + (10 if keeps else 1)  # --fresh: time to keep it, if it wrongly did
            while [(p, p.read_text()) for p in files()] == before and time.monotonic() < end:
                time.sleep(0.05)  # kept once the server is idle, maybe after the reply
        finally:
            p.terminate()
            p.wait(10)
        return r.choices[0].text, r.model_extra["dflash"]["mean_accepted"]

    text, tau = serve()
    assert text == want and tau > 4
    (path,) = files()
    assert any(n == 16 for _, n, _, _ in json.loads(path.read_text())["greedy"]["times"])
    path.write_text(json.dumps(plain_wins(16)))
    text, tau = serve()
    assert text == want and tau == 1.0  # the restarted server started from the saved policy
    kept = json.loads(path.read_text())["greedy"]["times"]
    assert [1, 16, 100.0, 10.0] in kept and kept != plain_wins(16)["greedy"]["times"]
    path.write_text(json.dumps(plain_wins(16)))
    text, tau = serve("--fresh", keeps=False)
    assert text == want and tau > 4
    assert json.loads(path.read_text()) == plain_wins(16)
