"""A 2-process run (gloo) in which one rank misbehaves; the test checks that every rank stops, soon, saying why.

    python -m torch.distributed.run --nproc_per_node=2 tests/distributed/faults.py OUTPUT_DIR MODE

MODE: reward_raises | reward_times_out | short_shard | sigkill | sigstop (all on rank 1 only; sigstop: the process
hangs, its connections open, as on a node that is lost without a word); resume: no fault, the run resumed from the
newest complete checkpoint of OUTPUT_DIR, rank 0 sleeping 12 s at the start of step 3 (rank 1 waits in a
collective, beating) and 12 s at the end of train (rank 1, gone by then, ended cleanly: not dead). The collective
timeout is long (ddp_timeout=600 s) and the heartbeat's bound short (fault_timeout=10 s): a silent process must be
noticed by the heartbeat, not by a collective, and healthy waits longer than the bound must not end a process.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from datasets import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import make_trainer, tiny_run_args  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

RANK = int(os.environ.get("RANK", "0"))


def main(output_dir: str, mode: str) -> None:
    def reward(completion_ids, trainer_state, **kwargs):
        if RANK == 1 and trainer_state.global_step == 1:
            if mode == "reward_raises":
                raise ValueError("the grader's answer key is missing")
            if mode == "reward_times_out":
                time.sleep(600)
        return [float(sum(ids) % 5) for ids in completion_ids]

    num_prompts = 8 if (mode == "short_shard" and RANK == 1) else 12
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}" for i in range(num_prompts)]})
    args = tiny_run_args(
        output_dir,
        {},
        per_device_train_batch_size=2,
        num_generations=4,
        max_completion_length=4,
        max_steps=4,
        save_strategy="steps",
        save_steps=1,
        reward_timeout=5 if mode == "reward_times_out" else None,
        ddp_timeout=600,
        fault_timeout=10,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = make_trainer(args, reward, dataset)
    if mode in ("sigkill", "sigstop") and RANK == 1:

        class Die(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == 2 and mode == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.global_step == 2 and mode == "sigstop":  # a reaper, in case nobody kills it
                    reaper = f"sleep 120; kill -9 {os.getpid()}"
                    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}  # not the launcher's pipes
                    subprocess.Popen(["sh", "-c", reaper], start_new_session=True, **quiet)
                    os.kill(os.getpid(), signal.SIGSTOP)

        trainer.add_callback(Die())
    if mode == "resume":  # the same run launched again after a fault: from the newest complete checkpoint
        from grpo_hf.checkpoint import resolve_resume

        if RANK == 0:  # two healthy waits longer than fault_timeout: neither may end a process

            class Linger(TrainerCallback):
                def on_step_begin(self, args, state, control, **kwargs):
                    if state.global_step == 2:  # rank 1 waits in its next collective meanwhile, and beats
                        time.sleep(args.fault_timeout + 2)

                def on_train_end(self, args, state, control, **kwargs):  # rank 1 left train and exits: done, not dead
                    time.sleep(args.fault_timeout + 2)

            trainer.add_callback(Linger())

        print("resuming from", resolve_resume(True, output_dir), flush=True)
        trainer.train(resume_from_checkpoint=True)
        print("ended at step", trainer.state.global_step, flush=True)
    else:
        trainer.train()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
