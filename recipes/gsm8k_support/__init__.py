"""What the GSM8K recipe (`recipes/gsm8k.py`) needs beyond the library, kept next to it rather than in `grpo_hf`.

- `data`: GSM8K loading, the prompt formats ("####" and "tags") and the built-in offline arithmetic problems;
- `evaluation`: greedy pass@1, scored with the library's own reward functions;
- `plotting`: the training curves PNG (matplotlib: `pip install -e ".[recipes]"`).

`GRPOTrainer` uses none of it: it trains on any dataset with a `prompt` column and any reward functions. The recipe
imports this package as a sibling (`python recipes/gsm8k.py` puts `recipes/` on `sys.path`); tests and benchmarks
add `recipes/` to `sys.path` themselves.
"""
