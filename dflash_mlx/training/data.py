"""Training data for DFlash drafts: read text / JSONL, tokenize, and replace
responses with the target's own greedy continuations."""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional


from ..errors import DFlashError

TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs", ".json", ".toml", ".yaml", ".yml", ".html", ".css", ".sh"}


class DataError(DFlashError, ValueError):
    """Training data is missing, empty or malformed."""


@dataclass
class Sequence:
    """Token ids of one training sequence; tokens at positions >= ``start``
    are training targets (positions before it are context only)."""

    tokens: List[int]
    start: int = 1


def read_records(path: str) -> List[Dict]:
    """Records of a file or folder: ``{"text"}``, ``{"prompt", "completion"}``
    or ``{"messages"}`` dicts. Text files become ``{"text"}``; .jsonl lines
    are taken as they are (a line may also be a bare string)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"Data path '{path}' does not exist.")
    if p.is_dir():
        files = sorted(
            f for f in p.rglob("*")
            if f.is_file() and (f.suffix in TEXT_SUFFIXES or f.suffix == ".jsonl")
            and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
    else:
        files = [p]
    records = []
    for f in files:
        if f.suffix == ".jsonl":
            records.extend(_jsonl(f))
        else:
            text = f.read_text(encoding="utf-8", errors="replace")
            if text.strip():
                records.append({"text": text})
    if not records:
        raise DataError(f"No training text found in '{path}'.")
    return records


def _jsonl(f: Path) -> List[Dict]:
    out = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{f}:{n}: not valid JSON ({e.msg}).") from None
        if isinstance(r, str):
            r = {"text": r}
        if not isinstance(r, dict) or not ({"text", "prompt", "messages"} & set(r)):
            raise DataError(
                f"{f}:{n}: expected an object with 'text', 'prompt' (and "
                "'completion') or 'messages'."
            )
        out.append(r)
    return out


def _encode(tokenizer, text: str) -> List[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def split(tokenizer, record: Dict) -> (List[int], Optional[List[int]]):
    """Prompt ids and response ids of a record (response None for plain text)."""
    if "messages" in record:
        msgs = record["messages"]
        last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=None)
        if last is None:
            return _chat(tokenizer, msgs, True), []
        prompt = _chat(tokenizer, msgs[:last], True)
        full = _chat(tokenizer, msgs[: last + 1], False)
        if full[: len(prompt)] != prompt:
            return full, None
        return prompt, full[len(prompt):]
    if "prompt" in record:
        prompt = _encode(tokenizer, record["prompt"])
        comp = record.get("completion")
        return prompt, _encode(tokenizer, comp) if comp else []
    return _encode(tokenizer, record["text"]), None


def _chat(tokenizer, msgs, gen: bool) -> List[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
        return _encode(tokenizer, text + ("assistant: " if gen else ""))
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True)
    return list(ids)


def prompt_text(tokenizer, record: Dict) -> str:
    """The text a decoding prompt made from ``record`` would be."""
    if "messages" in record:
        msgs = record["messages"]
        if msgs and msgs[-1].get("role") == "assistant":
            msgs = msgs[:-1]
        if getattr(tokenizer, "chat_template", None) is not None:
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
    if "prompt" in record:
        return record["prompt"]
    return record["text"]


def sequences(tokenizer, records: List[Dict], seq_len: int) -> List[Sequence]:
    """Tokenize records into sequences of at most ``seq_len`` tokens; plain
    text is cut into consecutive chunks."""
    out = []
    for r in records:
        prompt, resp = split(tokenizer, r)
        if resp is None:
            for i in range(0, len(prompt), seq_len):
                chunk = prompt[i : i + seq_len]
                if len(chunk) >= 2:
                    out.append(Sequence(chunk, 1))
        else:
            toks = (prompt + resp)[:seq_len]
            start = max(1, min(len(prompt), len(toks) - 1))
            if len(toks) >= 2:
                out.append(Sequence(toks, start))
    return out


def regen_prompts(tokenizer, records: List[Dict], seq_len: int, prompt_len: int) -> List[List[int]]:
    """Prompts to continue with the target: the prompt of each record, or for
    plain text, the first ``prompt_len`` tokens of each ``seq_len`` chunk."""
    out = []
    for r in records:
        prompt, resp = split(tokenizer, r)
        if resp is None:
            for i in range(0, len(prompt), seq_len):
                chunk = prompt[i : i + prompt_len]
                if len(chunk) == prompt_len or (i == 0 and chunk):
                    out.append(chunk)
        elif prompt:
            out.append(prompt[: max(1, seq_len - 2)])
    return out


def regenerate(model, prompts: List[List[int]], max_tokens: int, eos: set, batch: int = 32,
               progress=None, on_sequence=None, sampler=None) -> List[Sequence]:
    """The target's greedy continuation of each prompt (up to ``max_tokens``
    tokens, an ending EOS kept), as Sequences whose targets are the generated
    tokens. mlx-lm's continuous batching runs up to ``batch`` prompts at a
    time; ``on_sequence(i, seq)`` is called as each one finishes. An mlx-lm
    ``sampler`` draws the tokens instead of the argmax."""
    from mlx_lm.generate import BatchGenerator

    from .fastmath import numpy_exp

    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}.")
    # Joining a running batch copies every layer's cache, so prompts join in
    # waves (when half the batch is free) rather than one per finished row,
    # shortest first so a wave's prompts pad little.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    kw = {"sampler": sampler} if sampler is not None else {}
    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(eos)],
                         completion_batch_size=batch, prefill_batch_size=batch, **kw)
    out: List[Optional[Sequence]] = [None] * len(prompts)
    index: Dict[int, int] = {}
    made: Dict[int, List[int]] = {}
    with numpy_exp(model):  # about half of a batched step is exp on MLX-CPU
        try:
            done = 0
            while done < len(prompts):
                if len(made) <= batch // 2 and order:
                    wave, order = order[: batch - len(made)], order[batch - len(made):]
                    uids = gen.insert([list(prompts[i]) for i in wave], [max_tokens] * len(wave))
                    index.update(zip(uids, wave))
                    made.update((u, []) for u in uids)
                for r in gen.next_generated():
                    made[r.uid].append(r.token)
                    if r.finish_reason is None:
                        continue
                    i = index[r.uid]
                    out[i] = Sequence(list(prompts[i]) + made.pop(r.uid), max(1, len(prompts[i])))
                    done += 1
                    if on_sequence is not None:
                        on_sequence(i, out[i])
                    if progress is not None:
                        progress(done, len(out[i].tokens) - out[i].start)
        finally:
            gen.close()
    return out
