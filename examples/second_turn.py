"""Time to first token of a chat's later turns, with and without the server's
prompt cache: starts `python -m dflash_mlx.server` (default pair) itself.

    python examples/second_turn.py [--prompt-cache-size 4] [--port 8090]
"""

import argparse
import json
import time

from served import served


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-cache-size", default="4")
    p.add_argument("--port", type=int, default=8090)
    args = p.parse_args()
    with served(args.port, "--prompt-cache-size", args.prompt_cache_size) as client:
        essay = " ".join(f"Sentence {i} talks about rivers, cities and the history of trade." for i in range(40))
        chat = [{"role": "user", "content": f"Here is my essay draft. {essay} Please summarise it in two sentences."}]
        for turn, follow_up in enumerate(["And in one word?", "Thanks. Why?", "Ok."], 1):
            tic, first, text, usage = time.perf_counter(), None, "", None
            for chunk in client.chat.completions.create(model="default", messages=chat, max_tokens=32, temperature=0,
                                                        stream=True, stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter() - tic
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
            print(json.dumps({"turn": turn, "prompt_tokens": usage.prompt_tokens,
                              "cached_tokens": usage.prompt_tokens_details.cached_tokens,
                              "time_to_first_token_s": round(first, 3)}))
            chat += [{"role": "assistant", "content": text}, {"role": "user", "content": follow_up}]


if __name__ == "__main__":
    main()
