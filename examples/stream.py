"""Stream DFlash generation with a live tokens-per-second readout.

    python examples/stream.py                       # SmolLM2-135M-Instruct + its embedded draft
    python examples/stream.py --model Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 \
        --prompt "Write a quicksort in Python."
"""

import argparse
import sys

from dflash_mlx import load, load_draft, stream_generate
from dflash_mlx.generate import DEFAULT_MODEL, DEFAULT_PROMPT, known_draft

p = argparse.ArgumentParser()
p.add_argument("--model", default=DEFAULT_MODEL)
p.add_argument("--draft", default=None)
p.add_argument("--prompt", default=DEFAULT_PROMPT)
p.add_argument("--max-tokens", type=int, default=200)
args = p.parse_args()

model, tokenizer = load(args.model)
draft = load_draft(args.draft or known_draft(args.model))
messages = [{"role": "user", "content": args.prompt}]
prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

for r in stream_generate(model, draft, tokenizer, prompt, max_tokens=args.max_tokens):
    print(r.text, end="", flush=True)
    if sys.stderr.isatty():  # live speed in the terminal's title bar
        sys.stderr.write(f"\x1b]0;{r.generation_tps:.1f} tok/s, tau {r.mean_accepted:.2f}\x07")
print()
print(f"{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s, "
      f"{r.mean_accepted:.2f} tokens per round, peak {r.peak_memory:.2f} GB")
