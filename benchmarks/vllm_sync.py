"""vLLM colocate on the offline SmolLM2-135M (fp32): weight-push time, and the numbers behind skipping old log-probs.

One rollout of config (a) of `benchmarks/vs_trl.py` (16 completions, up to 128 tokens) with `use_vllm=True`; then:

- weight push: `--pushes` pushes of the whole model into the running vllm.LLM (`reload_weights` + prefix-cache reset),
  seconds each;
- log-prob gaps over the completion tokens: vLLM's sampled-token log-probs against the trainer's no-grad forward
  (`old_logps`, what TRL computes on every step under vLLM), and that forward against the training forward
  (`logps.detach()`, what grpo_hf uses as pi_old when no optimizer step separates rollout and loss);
- the importance weights (sequence_mask, clip_max 3, TRL's defaults) computed from either pi_old: their largest
  difference says whether the extra forward changes the correction.

    python benchmarks/vllm_sync.py            # needs vllm (make install-vllm: .venv-vllm/bin/python)
    python benchmarks/vllm_sync.py --tiny --pushes 1   # config (a)'s tiny model and 1/16 of its tokens: a check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _worker  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="_worker's tiny model and tokens")
    args = parser.parse_args()
    import torch

    from grpo_hf.core import sampling_importance_weights
    from grpo_hf.logprobs import completion_logps

    with tempfile.TemporaryDirectory() as output_dir:
        extra = {"use_vllm": True}
        trainer = _worker.build_trainer("grpo_hf", "a", 1, 0, "cpu", output_dir, extra, tiny=args.tiny)
        inputs = next(iter(trainer.get_train_dataloader()))
        metrics, G = trainer._metrics["train"], trainer.args.num_generations
        batch = trainer.experience.rollout_round(inputs, G, metrics)  # one rollout: starts vLLM, pushes, samples
        model, engine = trainer.model, trainer.rollout
        pushes = [engine.backend.push(model) for _ in range(args.pushes)]
        mask = batch.completion_mask.bool()
        with torch.no_grad():
            old_logps = trainer.logps.no_grad(model, batch)  # [B, T] the no-grad forward
        kwargs = trainer.logps.kwargs(trainer.logps.plan(model, batch))  # the training forward's path, no replay
        logps, _ = completion_logps(model, batch, share_prefix=kwargs.pop("share_prefix"), **kwargs)  # with grad
        logps = logps.detach()
    sampling = batch.sampling_logps
    settings = {"mode": "sequence_mask", "clip_min": None, "clip_max": 3.0}
    w_old, _ = sampling_importance_weights(old_logps, sampling, mask, **settings)
    w_now, _ = sampling_importance_weights(logps, sampling, mask, **settings)

    def gap(a, b):
        d = (a - b)[mask].abs()
        return {"max": d.max().item(), "mean": d.mean().item()}

    result = {
        "completion_tokens": int(mask.sum()),
        "push_seconds": pushes,
        "push_seconds_median": statistics.median(pushes),
        "vllm_vs_old_logps": gap(sampling, old_logps),
        "old_vs_training_logps": gap(old_logps, logps),
        "importance_weight_max_difference": (w_old - w_now).abs().max().item(),
        "importance_weight_range": [w_old.min().item(), w_old.max().item()],
    }
    result["first_completion"] = trainer.processing_class.decode(batch.completion_ids[0][mask[0]])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
