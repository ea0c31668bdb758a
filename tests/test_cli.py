"""`python -m dflash_mlx.generate` end to end, in a subprocess."""

import os
import re
import subprocess
import sys

import pytest

from dflash_mlx.generate import known_draft
from tiny import make_draft
from util import default_sigint, mlx_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cli(*args, stdin=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(
        [sys.executable, "-m", "dflash_mlx.generate", *args],
        input=stdin, capture_output=True, text=True, env=env, timeout=300,
    )


def test_cli_streams_the_targets_greedy_text(loaded, tmp_path):
    model, tok, folder = loaded("qwen3_5")
    draft = make_draft(tmp_path / "d", folder)
    prompt = "Write a loop"
    templated = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    _, want = mlx_run(model, tok, templated, 25)
    r = cli("--model", str(folder), "--draft", str(draft), "--prompt", prompt, "--max-tokens", "25")
    assert r.returncode == 0, r.stderr
    text, _, stats = r.stdout.rpartition("\n==========\n")
    assert text == want
    for line in ("Prompt: ", "Generation: 25 tokens", "Mean acceptance length: ", "Peak memory: "):
        assert line in stats

    raw = "import os\n"
    _, want = mlx_run(model, tok, raw, 10)
    r = cli("--model", str(folder), "--draft", str(draft), "--prompt", "-", "--no-chat-template", "--max-tokens", "10", "--quiet", stdin=raw)
    assert r.returncode == 0 and r.stdout == want + "\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model", "--draft", "/nonexistent/draft"], "neither a local folder"),
        (["--block-size", "0"], "block_size"),
        (["--max-tokens", "-3"], "max_tokens"),
        (["--temp", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--compare", "--compare-runs", "0"], "--compare-runs must be at least 1"),
        (["--draft", "/nonexistent/draft"], "neither a local folder"),
    ],
)
def test_cli_errors_are_one_line(args, message, target_folder, tmp_path, capsys):
    """The first case runs `python -m dflash_mlx.generate` in a subprocess (its
    exit code, and nothing else on a real process's stderr); the others call
    the same main() in this process (no ~5 s start of Python and MLX each)."""
    from dflash_mlx.generate import main

    folder = target_folder("qwen3")
    base = ["--model", str(folder), "--draft", str(make_draft(tmp_path / "d", folder)), "--prompt", "hi"]
    if "/nonexistent/model" in args:
        r = cli(*base, *args)
        code, stderr = r.returncode, r.stderr
    else:
        code, stderr = main([*base, *args]), capsys.readouterr().err  # an exception would fail the test
    assert code != 0
    assert "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1 and message in stderr


def test_compare_alternates_runs_and_checks_identity(target_folder, tmp_path):
    folder = target_folder("qwen3")
    draft = make_draft(tmp_path / "d", folder, echo=True)
    r = cli("--model", str(folder), "--draft", str(draft), "--prompt", "hi", "--max-tokens", "12",
            "--compare", "--compare-runs", "2")
    assert r.returncode == 0, r.stderr
    m = re.search(r"speedup ([0-9.]+)x \(median of 2 alternating pairs: ([0-9.]+)-([0-9.]+)\)", r.stdout)
    assert m, r.stdout
    low, mid, high = float(m[2]), float(m[1]), float(m[3])
    assert 0 < low <= mid <= high
    assert "Identical output: yes" in r.stdout


def test_known_drafts():
    assert known_draft("Qwen/Qwen3-8B") == "z-lab/Qwen3-8B-DFlash-b16"
    assert known_draft("mlx-community/Qwen3-8B-4bit") == "z-lab/Qwen3-8B-DFlash-b16"
    assert known_draft("mlx-community/Qwen3.5-35B-A3B-4bit") == "z-lab/Qwen3.5-35B-A3B-DFlash"
    assert known_draft("meta-llama/Llama-3.1-8B-Instruct") == "z-lab/LLaMA3.1-8B-Instruct-DFlash-UltraChat"
    assert known_draft("Qwen/Qwen2.5-7B") is None
    assert known_draft("mlx-community/gemma-4-26b-a4b-it-4bit") == "z-lab/gemma-4-26B-A4B-it-DFlash"
    assert known_draft("google/gemma-4-31B-it") == "z-lab/gemma-4-31B-it-DFlash"
    assert known_draft("google/gemma-4-31B") is None  # the drafts are trained on the -it models
    assert known_draft("MiniMaxAI/MiniMax-M2.5") == "z-lab/MiniMax-M2.5-DFlash"


def test_ctrl_c_ends_cleanly(target_folder, tmp_path):
    import signal
    import time

    folder = target_folder("qwen3")
    draft = make_draft(tmp_path / "d", folder)
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen(
        [sys.executable, "-m", "dflash_mlx.generate", "--model", str(folder), "--draft", str(draft),
         "--prompt", "hi", "--max-tokens", "100000", "--block-size", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        preexec_fn=default_sigint,
    )
    p.stdout.read(1)  # generation has started
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130
    assert err.decode().strip() == "error: interrupted"
