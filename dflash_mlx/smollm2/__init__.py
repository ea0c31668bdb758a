"""The real SmolLM2-135M-Instruct pair: its draft, training prompts and held-out set."""
