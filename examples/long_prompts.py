"""Write a JSONL of long prompts for the benchmark: a Python standard-library
module cut to about N tokens, then a question about it (offline, no download).

    python examples/long_prompts.py --tokens 4000 --count 4 --out long.jsonl
    python -m dflash_mlx.benchmark --dataset long.jsonl --max-tokens 128
"""

import argparse
import json
import sysconfig
from pathlib import Path

MODULES = ["heapq.py", "fractions.py", "calendar.py", "textwrap.py", "argparse.py", "inspect.py", "typing.py", "pathlib.py"]
QUESTION = "\n```\n\nExplain what the last function in this code does, then suggest one improvement."


def main():
    from dflash_mlx import load

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4000, help="Prompt length, in the model's tokens.")
    p.add_argument("--count", type=int, default=4)
    p.add_argument("--model", default="smollm2", help="Whose tokenizer counts the tokens.")
    p.add_argument("--out", default="long.jsonl")
    args = p.parse_args()
    _, tok = load(args.model)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for name in MODULES[: args.count]:
        ids = tok.encode((stdlib / name).read_text())
        code = tok.decode(ids[: args.tokens])
        rows.append({"prompt": f"Here is a Python module ({name}):\n```python\n{code}{QUESTION}", "category": "long"})
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts of about {args.tokens} tokens to {args.out}")


if __name__ == "__main__":
    main()
