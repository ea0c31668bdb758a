"""The benchmark on tiny real models: JSON fields, identity check, failures,
temperatures, categories."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_draft, make_target  # noqa: E402
from util import count_pq  # noqa: E402

from dflash_mlx.bench import benchmark as bm  # noqa: E402
from dflash_mlx.bench.datasets import DatasetError, load_samples, pick_file, read_jsonl  # noqa: E402
from dflash_mlx.generate import EMBEDDED, known_draft  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    {"prompt": "def add(a, b):\n    return", "category": "code"},
    {"turns": ["import os\n", "class Config:"], "category": "chat"},
    {"messages": [{"role": "user", "content": "for i in range(10):"}]},
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    target = make_target(d / "target", "qwen3")
    draft = make_draft(d / "draft", target)
    small = make_target(d / "small", "qwen3", seed=7, layers=2)
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return d, target, draft, small, prompts


def _args(pair, out, *extra):
    d, target, draft, _, prompts = pair
    return [
        "--model", str(target), "--draft", str(draft), "--dataset", str(prompts),
        "--max-tokens", "24", "--warmup-tokens", "4", "--temp", "0", "--out", str(out), *extra,
    ]


def _cli(argv, **env):
    blas = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    e = dict(os.environ, **env)
    if os.path.exists(blas):
        e["LD_PRELOAD"] = blas
    return subprocess.run(
        [sys.executable, "-m", "dflash_mlx.benchmark", *argv],
        cwd=ROOT, env=e, capture_output=True, text=True, timeout=120,
    )


def test_json_has_every_field_and_outputs_match(pair, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = bm.main(_args(pair, out, "--baseline-draft-model", str(pair[3])))
    printed = capsys.readouterr().out
    assert code == 0
    res = json.loads(out.read_text())
    assert res["ok"] and res["failures"] == []
    for k in ("model", "draft", "dataset", "max_tokens", "temps", "block_size", "seed",
              "profile", "versions", "chat_template", "baseline_draft_model"):
        assert k in res["config"]
    (r0,) = res["results"]
    assert r0["temp"] == 0 and r0["seed"] is None and r0["speedup_vs_greedy"] is None
    assert list(r0["categories"]) == ["code", "chat", "other", "all"]
    s = r0["summary"]
    assert s["prompts"] == 4 and s["identical"] == 4  # the 2-turn sample counts twice
    for k in ("speedup", "e2e_speedup", "tau", "acceptance_histogram", "round_time_s",
              "costs", "ideal_speedup", "plain_step_s", "baseline_speedup", "methods"):
        assert s[k] is not None, k
    assert set(s["methods"]) == {"plain", "dflash", "baseline"}
    assert set(s["round_time_s"]) == {"draft", "verify", "accept", "other", "round"}
    assert s["ideal_speedup"] == pytest.approx(
        s["tau"] / (s["costs"]["draft"] + s["costs"]["verify"])
    )
    assert len(s["acceptance_histogram"]) == res["config"]["block_size"] == 16
    assert sum(s["acceptance_histogram"]) == s["methods"]["dflash"]["rounds"]
    for m in s["methods"].values():
        assert m["decode_tps"] > 0 and m["e2e_tps"] > 0 and m["peak_memory_gb"] > 0
    ids = [r["id"] for r in r0["prompts"]]
    assert ids == ["prompts:1", "prompts:2#1", "prompts:2#2", "prompts:3"]
    assert [r["category"] for r in r0["prompts"]] == ["code", "chat", "chat", None]
    for r in r0["prompts"]:
        assert r["identical"] and r["checked"] and r["first_difference"] is None
        assert "tokens" not in r
        assert r["baseline_identical"]
        assert r["tau"] >= 1 and r["speedup"] > 0 and r["ideal_speedup"] > 0
        d = r["runs"]["dflash"]
        assert d["rounds"] == sum(r["acceptance_histogram"])
        # committed tokens = rounds' tokens + the prefill's first (up to truncation)
        assert d["generated_tokens"] <= 1 + sum((i + 1) * n for i, n in enumerate(r["acceptance_histogram"]))
        for k in ("decode_tps", "e2e_tps", "prompt_tps", "peak_memory_gb", "generated_tokens", "finish_reason"):
            assert k in r["runs"]["plain"] and k in d
    assert "identical outputs: 4/4" in printed
    try:
        import matplotlib  # noqa: F401

        assert out.with_suffix(".png").stat().st_size > 1000
    except ImportError:
        assert "no chart written" in printed


def test_inline_profile_and_block_size(pair, tmp_path, capsys):
    out = tmp_path / "r.json"
    code = bm.main(_args(pair, out, "--profile", "inline", "--block-size", "4",
                         "--max-samples", "1", "--no-chat-template", "--chart", str(tmp_path / "c.png")))
    capsys.readouterr()
    assert code == 0
    res = json.loads(out.read_text())
    assert res["config"]["chat_template"] is False and res["config"]["block_size"] == 4
    (r0,) = res["results"]
    assert len(r0["prompts"]) == 1 and len(r0["summary"]["acceptance_histogram"]) == 4
    assert r0["summary"]["round_time_s"]["verify"] > 0


def test_block_size_columns_side_by_side(pair, tmp_path, capsys):
    """--block-size 4,auto,1: one DFlash column each in the same pass, each
    with its speedup, tau and round split; auto is the main column."""
    out = tmp_path / "r.json"
    code = bm.main(_args(pair, out, "--block-size", "4,auto,1", "--max-samples", "1"))
    printed = capsys.readouterr().out
    assert code == 0
    res = json.loads(out.read_text())
    assert list(res["config"]["columns"].values()) == ["auto", "4", "1"] and res["config"]["adaptive"] is True
    (r0,) = res["results"]
    cols = r0["summary"]["columns"]
    assert list(cols) == ["dflash", "dflash@4", "dflash@1"]
    for k, col in cols.items():
        assert col["speedup"] > 0 and col["round_time_s"]["verify"] > 0
        assert r0["summary"]["methods"][k]["tau"] == col["tau"]
    assert cols["dflash@1"]["tau"] == 1.0 and 1.0 <= cols["dflash@4"]["tau"] <= 4.0
    (p0,) = r0["prompts"]
    assert all(c["identical"] for c in p0["columns"].values()) and p0["identical"]
    for name in ("dflash auto", "dflash 4", "dflash 1"):
        assert name in printed
    assert "round, dflash 4," in printed


def test_variant_columns(pair, tmp_path, capsys):
    """Each extra value of --draft-bits / --denoise-steps / --proposal and each
    --accept-threshold is a column differing from the main one in that alone;
    exact columns must match plain decoding, the relaxed one reports its
    agreement instead (and cannot fail the run)."""
    out = tmp_path / "r.json"
    code = bm.main(_args(pair, out, "--block-size", "8", "--draft-bits", "none,8", "--denoise-steps", "1,2",
                         "--proposal", "sample,argmax", "--accept-threshold", "0.05", "--max-samples", "1",
                         "--profile", "off"))
    printed = capsys.readouterr().out
    assert code == 0
    res = json.loads(out.read_text())
    labels = ["8 proposal=sample", "bits=8", "denoise=2", "proposal=argmax", "threshold=0.05"]
    assert list(res["config"]["columns"].values()) == labels
    (r0,) = res["results"]
    cols = r0["prompts"][0]["columns"]
    for k in ("dflash", "dflash@bits=8", "dflash@denoise=2", "dflash@proposal=argmax"):
        assert cols[k]["identical"] and "agreement" not in cols[k]
    relaxed = cols["dflash@threshold=0.05"]
    assert 0 <= relaxed["agreement"] <= 1 and relaxed["agreement"] == (
        1.0 if relaxed["identical"] else relaxed["first_difference"] / len(r0["prompts"][0]["tokens"]["plain"]))
    assert "dflash threshold=0.05 (relaxed acceptance, not exact)" in printed
    assert r0["summary"]["columns"]["dflash@threshold=0.05"]["agreement"] == relaxed["agreement"]


@pytest.mark.parametrize("extra, message", [
    (["--draft-bits", "3"], "draft bits are 4, 8 or none"),
    (["--accept-threshold", "1.5"], "--accept-threshold values must be in (0, 1]"),
    (["--denoise-steps", "0"], "--denoise-steps must be at least 1"),
])
def test_bad_variant_values(pair, tmp_path, extra, message):
    r = _cli(_args(pair, tmp_path / "r.json", *extra))
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr


def test_differing_outputs_fail(pair, tmp_path):
    """--perturb-dflash gives the DFlash side alone a real repetition penalty:
    its tokens then differ from plain decoding, and the run must fail."""
    out = tmp_path / "r.json"
    p = _cli(_args(pair, out, "--perturb-dflash", "50", "--profile", "off", "--warmup-tokens", "0"))
    assert p.returncode == bm.MISMATCH_EXIT, p.stderr
    assert "outputs differ" in p.stderr and "Traceback" not in p.stderr
    res = json.loads(out.read_text())
    assert not res["ok"] and res["failures"]
    bad = [r for r in res["results"][0]["prompts"] if not r["identical"]]
    assert bad and all(r["tokens"]["plain"] != r["tokens"]["dflash"] for r in bad)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--dataset", "no-such-set"], "Unknown dataset"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--draft", "/nonexistent/draft"], "/nonexistent/draft"),
        (["--temp", "0,-1"], "--temp values must be >= 0"),
        (["--temp", "0,hot"], "--temp takes comma-separated numbers"),
        (["--seed", "x"], "--seed must be an integer or 'none'"),
    ],
)
def test_bad_input_is_one_line(pair, tmp_path, capsys, extra, message):
    code = bm.main(_args(pair, tmp_path / "r.json") + extra)
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith("error:") and message in err and "\n" not in err


@pytest.fixture(scope="module")
def sampled(pair, tmp_path_factory):
    """Two identical runs at temperatures 0 and 0.7 (seed left to default):
    their JSON results and the first one's printed summary."""
    d = tmp_path_factory.mktemp("sampled")
    res, printed = [], ""
    for i in range(2):
        out = d / f"r{i}.json"
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            code = bm.main(_args(pair, out, "--temp", "0,0.7", "--profile", "off", "--warmup-tokens", "0"))
        assert code == 0
        res.append(json.loads(out.read_text()))
        printed = printed or buf.getvalue()
    return res, printed


def test_two_temperatures_in_one_run(sampled):
    (res, _), printed = sampled
    assert res["ok"] and res["config"]["temps"] == [0.0, 0.7]
    greedy, hot = res["results"]
    assert (greedy["temp"], greedy["seed"], hot["temp"], hot["seed"]) == (0.0, None, 0.7, 0)
    assert [r["id"] for r in greedy["prompts"]] == [r["id"] for r in hot["prompts"]]
    assert all(r["identical"] and r["checked"] for r in greedy["prompts"])
    assert not any(r["checked"] for r in hot["prompts"])
    assert any(g["output"] != h["output"] for g, h in zip(greedy["prompts"], hot["prompts"]))
    assert greedy["speedup_vs_greedy"] is None
    assert hot["speedup_vs_greedy"] == pytest.approx(hot["summary"]["speedup"] / greedy["summary"]["speedup"])
    assert printed.count("category") == 2 and printed.count("identical outputs:") == 2
    assert "identical outputs: 4/4 (required)" in printed
    assert f"temp 0.7 speedup = {hot['speedup_vs_greedy']:.2f}x the greedy one" in printed


def test_unseeded_dflash_sampling(pair, tmp_path, capsys, monkeypatch):
    """--seed none: DFlash samples unseeded (sampled drafts verified with
    the p/q rule); the default seed draws with the position-keyed noise."""
    calls = count_pq(monkeypatch)
    base = ["--temp", "0.7", "--profile", "off", "--warmup-tokens", "0", "--block-size", "4"]
    assert bm.main(_args(pair, tmp_path / "a.json", *base)) == 0 and calls[0] == 0
    assert bm.main(_args(pair, tmp_path / "b.json", *base, "--seed", "none")) == 0 and calls[0] > 0
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["results"][0]["seed"] == "none" and "temp 0.7 (DFlash unseeded)" in capsys.readouterr().out


def test_seeded_sampling_repeats(sampled):
    (a, b), _ = sampled
    ra, rb = a["results"][1]["prompts"], b["results"][1]["prompts"]
    assert len(ra) == len(rb) == 4
    for x, y in zip(ra, rb):
        assert x["tokens"] == y["tokens"] and x["output"] == y["output"]


def test_category_table_pools_the_prompts(sampled):
    (res, _), _ = sampled
    for r in res["results"]:
        cats = r["categories"]
        assert {k: g["prompts"] for k, g in cats.items()} == {"code": 1, "chat": 2, "other": 1, "all": 4}
        for name, g in cats.items():
            recs = [p for p in r["prompts"] if name == "all" or (p["category"] or "other") == name]
            for method, key in (("plain", "plain_tps"), ("dflash", "dflash_tps")):
                runs = [p["runs"][method] for p in recs]
                tokens = sum(x["generated_tokens"] - 1 for x in runs)
                assert g[key] == pytest.approx(tokens / sum(x["decode_s"] for x in runs))
            accepted = sum((i + 1) * n for p in recs for i, n in enumerate(p["acceptance_histogram"]))
            rounds = sum(sum(p["acceptance_histogram"]) for p in recs)
            assert g["tau"] == pytest.approx(accepted / rounds)
            assert g["speedup"] == pytest.approx(g["dflash_tps"] / g["plain_tps"])


def test_heldout_dataset():
    samples = load_samples("heldout")
    assert len(samples) == 48
    cats = [x.category for x in samples]
    assert {c: cats.count(c) for c in set(cats)} == {"math": 16, "code": 16, "chat": 16}
    assert all(len(x.turns) == 1 and x.turns[0] for x in samples)
    assert [x.id for x in load_samples("SmolLM2", 5)] == [x.id for x in samples[:5]]


def test_long_prompts_by_length(pair, tmp_path):
    """``long:N,M``: prompts of N and M of the target's tokens, a category
    each, measured side by side like any other set; a bad spec is one line."""
    out = tmp_path / "r.json"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = bm.main(_args(pair, out, "--dataset", "long:140,300", "--max-samples", "1", "--max-tokens", "8",
                             "--no-chat-template", "--profile", "off"))
    assert code == 0
    r = json.loads(out.read_text())["results"][0]
    assert [p["category"] for p in r["prompts"]] == ["140 tok", "300 tok"]
    assert [abs(p["prompt_tokens"] - n) <= 3 for p, n in zip(r["prompts"], (140, 300))] == [True, True]
    assert set(r["categories"]) == {"140 tok", "300 tok", "all"}
    assert bm.main(_args(pair, out, "--dataset", "long:many")) == 1
    assert bm.main(_args(pair, out, "--dataset", "long:20")) == 1


def test_missing_embedded_draft_is_one_line(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "draft"
    monkeypatch.setitem(EMBEDDED, "smollm2", str(missing))
    assert known_draft("SmolLM2") == str(missing)
    code = bm.main(["--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip()
    assert code == 1
    assert err.startswith("error: The embedded smollm2 draft is not installed") and "\n" not in err
    assert str(missing) in err


def test_bad_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(DatasetError, match="line 2"):
        read_jsonl(f)
    f.write_text("not json\n")
    with pytest.raises(DatasetError, match="not JSON"):
        read_jsonl(f)


def test_offline_hub_dataset_is_one_clear_line(pair, tmp_path):
    p = _cli(_args(pair, tmp_path / "r.json") + ["--dataset", "gsm8k"], HF_HUB_OFFLINE="1")
    assert p.returncode == 1
    err = p.stderr.strip()
    assert err.startswith("error: Could not fetch gsm8k") and "\n" not in err


def test_pick_file():
    files = ["README.md", "main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet",
             "socratic/test-00000-of-00001.parquet"]
    assert pick_file(files, "main", "test") == "main/test-00000-of-00001.parquet"
    assert pick_file(["test.jsonl", "data/test-0.parquet"], None, "test") == "test.jsonl"
    assert pick_file(["train.jsonl"], None, "test") is None


def test_statistics():
    assert bm.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bm.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bm.first_difference([1, 2], [1, 2, 3]) == 2
    assert bm.histogram([1, 3, 3, 16], 16)[:3] == [1, 0, 2]
    c = bm.cost_model(4.0, {"draft": 1.0, "verify": 3.0, "accept": 0.5, "other": 0.5}, 2.0)
    assert c["costs"]["verify"] == 1.5 and c["ideal_speedup"] == 2.0


def test_hub_formats(tmp_path, monkeypatch):
    """The paper datasets' prompt formats, with the hub replaced by local files."""
    import huggingface_hub

    from dflash_mlx.bench import datasets as ds

    rows = {
        "HuggingFaceH4/MATH-500": [{"problem": "What is 1+1?"}],
        "openai/openai_humaneval": [{"prompt": "def f(x):\n    pass"}],
        "HuggingFaceH4/mt_bench_prompts": [{"prompt": ["Write a poem.", "Shorter."]}],
    }

    def files(self, repo, repo_type=None):
        return ["README.md", "test.jsonl", "train.jsonl"]

    def download(repo, name, repo_type=None):
        f = tmp_path / repo.replace("/", "_")
        f.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[repo]))
        return str(f.with_suffix(".jsonl"))

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setitem(sys.modules, "datasets", None)  # force the huggingface_hub path
    (m,) = ds.load_samples("math-500")
    assert m.turns == ["What is 1+1?\nPlease reason step by step, and put your final answer within \\boxed{}."]
    (h,) = ds.load_samples("humaneval")
    assert h.turns == [
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        "```python\ndef f(x):\n    pass\n```"
    ]
    (t,) = ds.load_samples("mt-bench")
    assert t.turns == ["Write a poem.", "Shorter."]


@pytest.mark.parametrize("n", range(1, 9))
def test_the_order_balances_place_and_predecessor(n):
    """Each method runs in each place, and right after each other one, equally often."""
    from collections import Counter

    names = [f"m{k}" for k in range(n)]
    rows = [bm.order(names, i) for i in range(2 * n if n % 2 else n)]
    assert all(sorted(r) == names for r in rows)
    places = Counter((p, m) for r in rows for p, m in enumerate(r))
    follows = Counter(pair for r in rows for pair in zip(r, r[1:]))
    assert len(set(places.values())) == 1 and len(places) == n * n
    assert len(set(follows.values())) <= 1 and len(follows) == n * (n - 1)
    assert bm.order(names, len(rows)) == rows[0]  # and it repeats
