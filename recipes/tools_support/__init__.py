"""What the tool demo (`recipes/tools.py`) needs beyond the library, kept next to it rather than in `grpo_hf`.

- `problems`: the calculator tool, the generated multiplication word problems and their reward;
- `warm_start`: the short supervised warm start (TRL's `SFTTrainer`) on generated traces, with or without the tool;
- `evaluation`: greedy episodes on held-out problems, run by grpo_hf's own `EpisodeRunner`.

The recipe imports this package as a sibling (`python recipes/tools.py` puts `recipes/` on `sys.path`).
"""
