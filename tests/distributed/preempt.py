"""recipes/gsm8k.py stopped by a signal on two machines, then run again by the same command (tests/test_nodes.py):

    python -m torch.distributed.run --nnodes 2 --node_rank R --nproc_per_node 1 --master_addr 127.0.0.1 \
        --master_port P tests/distributed/preempt.py MODEL_DIR SHARED_DIR PHASE

Cases: the synchronous step, and the asynchronous producer at max_staleness=1; each trains the tiny model saved in
MODEL_DIR for 5 steps on 8 prompts (an epoch is 2 steps: the stop lands in epoch 2, whose rest a resumed run must
read in that epoch's order), saving only when stopped (save_steps=500). PHASE `unbroken` runs each case to its end in
SHARED_DIR/<case>/unbroken; `stopped` runs it in SHARED_DIR/<case>/run, where process 1's reward function, during the
rollout of step 3, sends SIGUSR1 to its own process (a stop that lands mid-rollout, on one process of two), once per
output directory (a marker file there: the same command run again is not stopped); `resume` is the same command as
`stopped`. The process exits with the recipe's own code: `STOPPED_EXIT_CODE` when a case was stopped (after every
case ran), else 0, through the recipe's `leave_together`.
"""

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import fresh_accelerator, load_recipe  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))
CASES = {"sync": [], "async1": ["--max_staleness", "1"]}
STOP_DURING_STEP = 3


def stopping_reward(completions, trainer_state, **kwargs):
    """Varies within a group; on process 1, during the rollout of step STOP_DURING_STEP of a run whose output_dir
    has no `.stopped_once` yet, sends SIGUSR1 to this process (the main thread's handler records it)."""
    marker_dir = os.environ.get("STOP_MARKER_DIR")
    marker = Path(marker_dir or ".") / ".stopped_once"
    if marker_dir and RANK == 1 and trainer_state.global_step == STOP_DURING_STEP - 1 and not marker.exists():
        marker.write_text("stopped")
        os.kill(os.getpid(), signal.SIGUSR1)
    return [sum(map(ord, c[0]["content"])) % 7 / 7 for c in completions]


def argv(model_dir: str, output_dir: Path, case: str) -> list[str]:
    args = ["--model_name_or_path", model_dir, "--dataset_name", "builtin:arithmetic", "--num_train_examples", "8"]
    args += ["--eval_before", "false", "--eval_after", "false", "--max_steps", "5", "--seed", "0"]
    args += ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "8"]
    args += ["--learning_rate", "1e-2", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true"]
    args += ["--reward_funcs", "preempt:stopping_reward", "--output_dir", str(output_dir), "--logging_steps", "1"]
    args += ["--save_strategy", "steps", "--save_steps", "500", "--resume_from_checkpoint", "true"]
    return args + CASES[case]


def main(model_dir: str, shared_dir: str, phase: str) -> int:
    recipe = load_recipe("gsm8k")
    code = 0
    for case in CASES:
        output_dir = Path(shared_dir) / case / ("unbroken" if phase == "unbroken" else "run")
        os.environ.pop("STOP_MARKER_DIR", None)
        if phase != "unbroken":
            os.environ["STOP_MARKER_DIR"] = str(output_dir)
        fresh_accelerator()
        try:
            recipe.main(argv(model_dir, output_dir, case))
        except recipe.TrainingStopped as stopped:
            code = stopped.code
    recipe.leave_together(code)
    return code


if __name__ == "__main__":
    main(*sys.argv[1:4])
