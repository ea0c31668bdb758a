"""Prompt sets for the benchmark.

Three sources:

- the five datasets of the DFlash paper (gsm8k, math500, humaneval, mbpp,
  mt-bench), fetched from the Hugging Face hub and formatted as in the
  published benchmark;
- any JSONL file, one object a line: ``{"prompt": "..."}``, ``{"messages":
  [{"role": ..., "content": ...}, ...]}`` (a chat to continue) or
  ``{"turns": ["...", "..."]}`` (user turns; the answers are generated);
- bundled sets: ``heldout`` (alias ``smollm2``), the held-out prompts of
  the SmolLM2 pair, and ``demo``, those of the toy demo pair;
- ``long`` (or ``long:256,4096``): long-context prompts made offline, a
  Python standard-library module cut to 256, 1024, 2048 and 4096 of the
  target's tokens (or the lengths given), then a question about it; each
  length is a category. (The modules' text follows the Python version.)

A JSONL row may carry a ``"category"`` string (the paper datasets are their
own category); the benchmark reports speeds per category.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..errors import DFlashError

HERE = Path(__file__).parent.parent  # the package folder, where demo/ and smollm2/ are
BUNDLED = {"demo": HERE / "demo" / "prompts.jsonl", "heldout": HERE / "smollm2" / "heldout.jsonl"}

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE = (
    "Write a solution to the following problem and make sure that it passes "
    "the tests:\n```python\n{}\n```"
)


class DatasetError(DFlashError, ValueError):
    """A prompt set could not be found, fetched or read."""


@dataclass
class Sample:
    """One benchmark item.

    Args:
        id: A short name for reports.
        turns: User turns. Each turn is generated in order, the previous
            answers appended between them (MT-Bench style).
        messages: A whole chat to continue instead of ``turns``.
        category: A group for per-category reports (math, code, ...).
    """

    id: str
    turns: List[str] = field(default_factory=list)
    messages: Optional[List[Dict[str, str]]] = None
    category: Optional[str] = None


@dataclass
class HubSet:
    """Where a paper dataset lives on the hub and how its rows become turns."""

    repo: str
    config: Optional[str]
    split: str
    turns: Callable[[dict], List[str]]


HUB_SETS = {
    "gsm8k": HubSet("openai/gsm8k", "main", "test", lambda r: [r["question"] + REASON]),
    "math500": HubSet("HuggingFaceH4/MATH-500", None, "test", lambda r: [r["problem"] + REASON]),
    "humaneval": HubSet(
        "openai/openai_humaneval", None, "test", lambda r: [CODE.format(r["prompt"])]
    ),
    "mbpp": HubSet("google-research-datasets/mbpp", "sanitized", "test", lambda r: [r["prompt"]]),
    "mt-bench": HubSet("HuggingFaceH4/mt_bench_prompts", None, "train", lambda r: list(r["prompt"])),
}
LONG_LENGTHS = (256, 1024, 2048, 4096)
LONG_MODULES = ["heapq.py", "fractions.py", "calendar.py", "textwrap.py", "argparse.py", "inspect.py"]
LONG_QUESTION = "\n```\n\nExplain what the last function in this code does, then suggest one improvement."

ALIASES = {"math-500": "math500", "mt_bench": "mt-bench", "mtbench": "mt-bench", "smollm2": "heldout"}


def is_hub(name: str) -> bool:
    """Whether ``name`` names a paper dataset (rather than a file or a bundled set)."""
    return not Path(name).expanduser().is_file() and ALIASES.get(name.lower(), name.lower()) in HUB_SETS


def long_lengths(name: str) -> Optional[List[int]]:
    """The prompt lengths ``long`` / ``long:N,M`` asks for, else None."""
    key, _, spec = name.lower().partition(":")
    if key != "long" or Path(name).expanduser().is_file():
        return None
    if not spec:
        return list(LONG_LENGTHS)
    try:
        lengths = [int(x) for x in spec.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 16:
        raise DatasetError(f"'{name}': give long:N[,M...] with prompt lengths of at least 16 tokens.")
    return lengths


def long_samples(tokenizer, lengths: Sequence[int] = LONG_LENGTHS, per: int = 2) -> List[Sample]:
    """``per`` long-context prompts of each length (in ``tokenizer``'s
    tokens, the question included): standard-library modules cut short,
    offline. Category: the length."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    tail = len(encode(LONG_QUESTION))
    if min(lengths) < 2 * tail:
        raise DatasetError(f"Long prompts need at least {2 * tail} tokens with this tokenizer "
                           f"(the question alone takes {tail}); got {min(lengths)}.")
    if per > len(LONG_MODULES):
        raise DatasetError(f"At most {len(LONG_MODULES)} long prompts of each length; asked for {per}.")
    try:
        texts = {name: (stdlib / name).read_text() for name in LONG_MODULES[:per]}
    except OSError as e:
        raise DatasetError(f"Long prompts are cut from the Python standard library, not readable here: {e}") from None
    samples = []
    for n in lengths:
        for name, text in texts.items():
            ids = encode(f"Here is a Python module ({name}):\n```python\n{text}")
            if len(ids) < n - tail:
                raise DatasetError(f"{name} has only {len(ids)} tokens: long prompts of up to "
                                   f"{len(ids) + tail} tokens with this tokenizer; asked for {n}.")
            code = tokenizer.decode(ids[: n - tail])  # re-encoded, within a token or two of n
            samples.append(Sample(f"{name[:-3]}@{n}", [code + LONG_QUESTION], category=f"{n} tok"))
    return samples


def load_samples(name: str, limit: Optional[int] = None) -> List[Sample]:
    """The samples of a dataset: a paper dataset name, a bundled set
    (``heldout``, ``demo``), or the path of a JSONL file; at most ``limit``.
    (``long`` needs the target's tokenizer: :func:`long_samples`.)"""
    key = ALIASES.get(name.lower(), name.lower())
    path = Path(name).expanduser()
    if path.is_file():
        samples = read_jsonl(path)
    elif key in BUNDLED:
        if not BUNDLED[key].exists():
            raise DatasetError(
                f"The {key} prompt set {BUNDLED[key]} is not installed; "
                "pass --dataset with a JSONL file or a dataset name."
            )
        samples = read_jsonl(BUNDLED[key])
    elif key in HUB_SETS:
        samples = fetch(key, limit)
    else:
        raise DatasetError(
            f"Unknown dataset '{name}': give a JSONL file, {', '.join(BUNDLED)}, long[:N,...], or one of "
            f"{', '.join(HUB_SETS)}."
        )
    return samples[:limit] if limit else samples


def read_jsonl(path: Path) -> List[Sample]:
    """Read a JSONL file of prompts (see the module docstring)."""
    samples = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"Cannot read {path}: {e}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path} line {i} is not JSON ({e.msg}).") from None
        samples.append(_sample(row, f"{Path(path).stem}:{i}", f"{path} line {i}"))
    if not samples:
        raise DatasetError(f"{path} holds no prompts.")
    return samples


def _sample(row, sid: str, where: str) -> Sample:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with 'prompt', 'messages' or 'turns'.")
    if "id" in row:
        sid = str(row["id"])
    elif isinstance(row.get("file"), str):
        sid = f"{row['file']}@{sid.rsplit(':', 1)[-1]}"
    cat = row["category"] if isinstance(row.get("category"), str) and row["category"] else None
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return Sample(sid, [row["prompt"]], category=cat)
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t for t in turns):
        return Sample(sid, list(turns), category=cat)
    msgs = row.get("messages")
    if (
        isinstance(msgs, list)
        and msgs
        and all(isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role") for m in msgs)
    ):
        msgs = [{"role": m["role"], "content": m["content"]} for m in msgs]
        return Sample(sid, messages=msgs, category=cat)
    raise DatasetError(
        f"{where}: expected a non-empty 'prompt' string, 'turns' list of strings "
        "or 'messages' list of {role, content}."
    )


def fetch(name: str, limit: Optional[int] = None) -> List[Sample]:
    """Fetch a paper dataset from the hub (with ``datasets`` if installed,
    else with ``huggingface_hub``); a one-line DatasetError when offline."""
    spec = HUB_SETS[name]
    try:
        rows = _rows(spec)
        samples = []
        for i, row in enumerate(rows):
            if limit and len(samples) == limit:
                break
            samples.append(Sample(f"{name}:{i}", spec.turns(row), category=name))
    except DatasetError:
        raise
    except Exception as e:  # network, offline mode, auth, layout changes
        detail = str(e).strip().splitlines()[0] if str(e).strip() else "no detail"
        raise DatasetError(
            f"Could not fetch {name} ({spec.repo}) from the hub ({type(e).__name__}: "
            f"{detail}); are you online? Offline, pass a JSONL file of prompts or 'heldout'."
        ) from None
    return samples


def _rows(spec: HubSet):
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        return datasets.load_dataset(spec.repo, spec.config, split=spec.split)
    from huggingface_hub import HfApi, hf_hub_download

    files = HfApi().list_repo_files(spec.repo, repo_type="dataset")
    name = pick_file(files, spec.config, spec.split)
    if name is None:
        raise DatasetError(f"No {spec.split} split file found in the hub dataset {spec.repo}.")
    return _read_rows(Path(hf_hub_download(spec.repo, name, repo_type="dataset")))


def pick_file(files: List[str], config: Optional[str], split: str) -> Optional[str]:
    """The data file of ``split`` (under folder ``config`` if given) in a hub
    dataset's file list, JSONL preferred over parquet; first shard only."""

    def fits(f: str) -> bool:
        parts = f.split("/")
        stem = parts[-1]
        if config and config not in parts[:-1]:
            return False
        return stem == f"{split}.jsonl" or stem.startswith(f"{split}-") or stem.startswith(f"{split}.")

    rank = {".jsonl": 0, ".json": 1, ".parquet": 2}
    found = [f for f in files if Path(f).suffix in rank and fits(f)]
    found.sort(key=lambda f: (rank[Path(f).suffix], f))
    return found[0] if found else None


def _read_rows(path: Path) -> List[dict]:
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(
                f"Reading {path.name} needs pyarrow or datasets: pip install pyarrow"
            ) from None
        return pq.read_table(str(path)).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else list(data.values())[0]
    return [json.loads(line) for line in text.splitlines() if line.strip()]
