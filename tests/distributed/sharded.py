"""GRPO under real FSDP2 (and DeepSpeed ZeRO-2/3 when installed) against DDP, on 2 CPU processes (gloo):

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/sharded.py --killed RUN_DIR
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/sharded.py OUT.pt RUN_DIR

The first launch trains under FSDP2 and is killed (SIGKILL) after its sharded checkpoint of step 2; the second
resumes it, and does everything else in one launch.

Each case of `CASES` trains the same tiny model for 3 steps twice, under DDP and under FSDP2 (accelerate's own
FSDP2 code path: `fully_shard` per decoder layer and on the root, DTensor shards), with the real rollout engines
sampling the completions. Process 0 writes, per case and layout: the per-step losses, rewards and KLs, the last
rollout's reference log-probs (gathered), how many all-gathers each rollout's generation made, and whether the
parameters were sharded. Then, under FSDP2 only: the resume of the killed run, the all-gathers per rollout at two
completion lengths, and `save_model` with a sharded state dict followed by `from_pretrained`.
"""

import copy
import importlib
import importlib.util
import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from datasets import Dataset
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for conftest's builders

from conftest import (  # noqa: E402
    build_tiny_model,
    build_tiny_tokenizer,
    exit_without_teardown,
    fresh_accelerator,
    make_trainer,
    tiny_run_args,
)

from grpo_hf import GRPOTrainer  # noqa: E402

STEPS, G = 3, 4
CASES = {  # name -> settings; every case runs under DDP and FSDP2
    "beta": dict(beta=0.04),  # a separate reference model, sharded like the policy
    "beta0": dict(beta=0.0, loss_type="bnpo", rollout_engine="generate"),  # model.generate; bnpo: a non-zero loss
    "iterations": dict(num_iterations=2),
    "lora": dict(beta=0.04, lora=True),  # the reference is the policy with its adapters off
    "steps_per_generation": dict(steps_per_generation=2),
}
FSDP2 = dict(fsdp="full_shard", fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"})


def zero(stage: int) -> dict:
    """Settings for accelerate's DeepSpeed path at ZeRO `stage`, with the trainer's torch AdamW (DeepSpeed's CPU
    accelerator: no ops are built). `use_cpu=False`: accelerate takes DeepSpeed only then (see
    `allow_deepspeed_on_cpu`)."""
    config = {
        "zero_optimization": {
            "stage": stage,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": 0,  # partition every tensor (by default, small ones stay whole)
        },
        "zero_allow_untested_optimizer": True,
        **dict.fromkeys(["train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"], "auto"),
        "gradient_clipping": "auto",
    }
    return dict(deepspeed=config, use_cpu=False)


LAYOUTS = {"ddp": {}, "fsdp": FSDP2}


def allow_fsdp_on_cpu() -> None:
    """Let accelerate keep the FSDP plugin it was given on CPU. The harness's patch, not the library's: accelerate
    enables FSDP only for accelerator devices (`AcceleratorState.__init__` ignores the plugin and picks
    `DistributedType.MULTI_CPU`, i.e. DDP), yet `fully_shard` and accelerate's FSDP2 code run on gloo. Without
    this, an "FSDP" run on this CPU machine is silently DDP and nothing sharded is tested."""
    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        if not AcceleratorState._shared_state:  # a fresh state (`build_trainer`): start from the process's own type
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # as accelerate does on a GPU: later `AcceleratorState()` calls copy PartialState's type over their own
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = patched


def allow_deepspeed_on_cpu() -> None:
    """Let accelerate's DeepSpeed path run on CPU processes (gloo). The harness's patch: accelerate takes DeepSpeed
    only without `cpu`, and without `cpu` it finds no accelerator, so `PartialState` counts one process
    (`DistributedType.NO`) although DeepSpeed's `init_distributed` set up a process group of two. Here the backend
    choice falls back to the CPU one (gloo, MULTI_CPU), after which accelerate switches to DEEPSPEED as on a GPU."""
    prepare = PartialState._prepare_backend

    def patched(self, cpu=False, sagemaker_dp=False, backend=None):
        found = prepare(self, cpu, sagemaker_dp, backend)
        if found[1] == DistributedType.NO and not cpu and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            return prepare(self, True, sagemaker_dp, backend)
        return found

    PartialState._prepare_backend = patched
    # Not about correctness, about time: on CPU, DeepSpeed's process group compiles a shared-memory all-reduce on first
    # use (85 s here; ZeRO training does not call it, DeepSpeed's inference all-reduce does). Skip the build.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # (`deepspeed.comm.torch` is torch)


class AllGathers:
    """Counts FSDP2's parameter all-gathers (one per shard unit each time it is unsharded)."""

    count = 0

    @classmethod
    def install(cls) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as module

        gather = module.foreach_all_gather

        def counted(*args, **kwargs):
            cls.count += 1
            return gather(*args, **kwargs)

        module.foreach_all_gather = counted


def reward(completion_ids, **kwargs):
    return [float(sum(ids) % 7) for ids in completion_ids]


def build_trainer(run_dir: Path, lora: bool = False, **settings) -> GRPOTrainer:
    fresh_accelerator()  # DDP or FSDP2, per trainer
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")
    common = dict(
        num_generations=G,
        per_device_train_batch_size=G,  # one group per process
        max_completion_length=6,
        max_steps=STEPS,
        learning_rate=3e-2,
        shuffle_dataset=False,
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    dataset = Dataset.from_dict({"prompt": [f"Prompt number {i}" for i in range(6)]})
    args = tiny_run_args(run_dir, common, **settings)
    return make_trainer(args, reward, dataset, model_seed=5, peft_config=peft_config)


def count_generation_gathers(trainer: GRPOTrainer) -> list[int]:
    """Record the FSDP2 all-gathers made inside each rollout's `model_for_generation` block, one entry per rollout."""
    counts: list[int] = []
    original = trainer.experience.sampler.model_for_generation

    @contextmanager
    def counting():
        before = AllGathers.count
        with original() as model:
            yield model
        counts.append(AllGathers.count - before)

    trainer.experience.sampler.model_for_generation = counting
    return counts


def history(trainer: GRPOTrainer) -> dict[str, list[float]]:
    rows = [h for h in trainer.state.log_history if "loss" in h]
    return {key: [h.get(key, 0.0) for h in rows] for key in ("loss", "reward", "kl", "async/staleness_max")}


def is_sharded(param: torch.Tensor) -> bool:
    """A DTensor shard (FSDP2), or a ZeRO-3 partition (the local tensor emptied, the values in DeepSpeed's shards)."""
    return type(param).__name__ == "DTensor" or (hasattr(param, "ds_numel") and param.numel() == 0)


def shard_units(model) -> int:
    """How many FSDP2 shard units `model` has (0 for None or a model FSDP2 does not shard)."""
    from torch.distributed.fsdp import FSDPModule

    return 0 if model is None else sum(isinstance(module, FSDPModule) for module in model.modules())


def train_case(name: str, layout: str, out_dir: Path) -> dict:
    trainer = build_trainer(out_dir / f"{name}-{layout}", **CASES[name], **LAYOUTS[layout])
    adapters = [p.detach().sum() for n, p in trainer.model.named_parameters() if "lora_A" in n]  # before prepare
    gathers = count_generation_gathers(trainer)
    trainer.train()
    ref_logps = None
    if trainer.args.beta != 0.0:
        ref_logps = trainer.accelerator.gather(torch.cat([part.ref_logps for part in trainer._buffer]))
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return {
        **history(trainer),
        "ref_logps": ref_logps,
        "gathers": gathers,
        "sharded": all(is_sharded(p) for p in params),
        "reference_sharded": trainer.ref_model is not None and all(map(is_sharded, trainer.ref_model.parameters())),
        "reference_units": shard_units(trainer.ref_model),
        "adapters": trainer.accelerator.gather(torch.stack(adapters)[None]) if adapters else None,  # [processes, n]
        "trainer": trainer,
    }


class KillAfterSave(TrainerCallback):
    """SIGKILL this process once the checkpoint of `step` is on disk: a run that dies without a word (an OOM kill,
    a lost node). The launcher then stops the other process."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step and torch.distributed.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)


def killed_run(run_dir: Path) -> None:
    """FSDP2, the "beta" case for 3 steps, saving every 2: process 1 is killed after checkpoint-2 is written."""
    trainer = build_trainer(run_dir, **CASES["beta"], **FSDP2, save_strategy="steps", save_steps=2)
    trainer.add_callback(KillAfterSave(2))
    trainer.train()
    raise AssertionError("the run was to be killed at step 2")


def resume_from_sharded_checkpoint(run_dir: Path) -> dict[str, list[float]]:
    """FSDP2: the killed run (`killed_run`) resumed by a new trainer from its newest complete checkpoint."""
    trainer = build_trainer(run_dir, **CASES["beta"], **FSDP2, save_strategy="no")
    trainer.train(resume_from_checkpoint=True)
    return history(trainer)


def zero3_without_gathering(out_dir: Path) -> dict:
    """ZeRO-3 with `ds3_gather_for_generation=False`, the "beta0" case (`model.generate`): whether the parameters
    were still partitioned while each rollout sampled, and the run's history."""
    LAYOUTS["zero3_no_gather"] = {**zero(3), "ds3_gather_for_generation": False}
    trainer = build_trainer(out_dir / "zero3-no-gather", **CASES["beta0"], **LAYOUTS["zero3_no_gather"])
    partitioned, original = [], trainer.experience.sampler.model_for_generation

    @contextmanager
    def recording():
        with original() as model:
            partitioned.append(all(is_sharded(p) for p in model.parameters()))
            yield model

    trainer.experience.sampler.model_for_generation = recording
    trainer.train()
    return {**history(trainer), "partitioned_while_sampling": partitioned, "engine": trainer.rollout.name}


def gathers_per_rollout(out_dir: Path, lengths=(4, 16)) -> dict[int, list[int]]:
    """FSDP2: the all-gathers of one rollout's generation at each `max_completion_length`."""
    found = {}
    for T in lengths:
        trainer = build_trainer(out_dir / f"length{T}", **FSDP2, max_completion_length=T, max_steps=1)
        gathers = count_generation_gathers(trainer)
        trainer.train()
        found[T] = gathers
    return found


def load_saved(save_dir: Path, lora: bool):
    """What `save_model` wrote, loaded as a user would: the model, or the base model with the LoRA adapter."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    # A user loads it in a new process. Here the trainer's ZeRO-3 config is still registered with transformers, and
    # from_pretrained would partition the model (a collective that process 0 alone would enter, and wait in for ever).
    unset_hf_deepspeed_config()
    if not lora:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(save_dir)
    from peft import PeftModel

    return PeftModel.from_pretrained(build_tiny_model(build_tiny_tokenizer(), seed=5), save_dir)


def saved_model_logits(trainer: GRPOTrainer, save_dir: Path, lora: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`save_model` under FSDP2 with a sharded state dict; the trained model's logits on fixed ids, and (process 0)
    those of the model loaded from what was saved."""
    trainer.save_model(str(save_dir))
    trainer.accelerator.wait_for_everyone()
    input_ids = torch.arange(10, 30).view(2, 10)  # [2, 10]
    with torch.no_grad():
        trained = trainer.model(input_ids=input_ids).logits  # a sharded forward: every process takes part
    if not trainer.accelerator.is_main_process:
        return trained, None
    with torch.no_grad():
        return trained, load_saved(save_dir, lora)(input_ids=input_ids).logits


def summary(results: dict) -> str:
    """The figures docs/distributed.md quotes: each layout's largest difference from DDP, and the gathers."""
    lines = ["case / layout: max |difference| from DDP over the steps (loss, kl, reward, reference log-probs)"]
    for name, layouts in results["cases"].items():
        ddp = layouts["ddp"]
        for layout, run in layouts.items():
            if layout == "ddp":
                continue
            diffs = [
                max(abs(a - b) for a, b in zip(ddp[key], run[key], strict=True)) for key in ("loss", "kl", "reward")
            ]
            if ddp["ref_logps"] is not None:
                diffs.append(float((ddp["ref_logps"] - run["ref_logps"]).abs().max()))
            lines.append(f"{name} / {layout}: " + ", ".join(f"{d:.2g}" for d in diffs))
    unbroken, resumed = results["cases"]["beta"]["fsdp"], results["resumed"]
    diffs = [
        max(abs(a - b) for a, b in zip(unbroken[key], resumed[key], strict=True)) for key in ("loss", "kl", "reward")
    ]
    lines.append("killed and resumed / unbroken FSDP2 (loss, kl, reward): " + ", ".join(f"{d:.2g}" for d in diffs))
    lines.append(f"FSDP2 all-gathers per rollout by max_completion_length: {results['gathers_per_rollout']}")
    return "\n".join(lines)


def main(out_path: str, killed_dir: Path) -> None:
    AllGathers.install()
    out_dir = Path(out_path).parent
    results: dict = {"cases": {}}
    for name in CASES:
        ddp, fsdp = train_case(name, "ddp", out_dir), train_case(name, "fsdp", out_dir)
        if name in ("beta", "lora"):
            results[f"saved_{name}"] = saved_model_logits(fsdp["trainer"], out_dir / f"final-{name}", name == "lora")
        for run in (ddp, fsdp):
            run.pop("trainer")
        results["cases"][name] = {"ddp": ddp, "fsdp": fsdp}
    results["resumed"] = resume_from_sharded_checkpoint(killed_dir)
    results["gathers_per_rollout"] = gathers_per_rollout(out_dir)
    if importlib.util.find_spec("deepspeed") is not None:  # the optional extra: last, it leaves DeepSpeed set up
        allow_deepspeed_on_cpu()
        for stage in (2, 3):
            LAYOUTS[f"zero{stage}"] = zero(stage)
            run = train_case("beta", f"zero{stage}", out_dir)
            saved = saved_model_logits(run.pop("trainer"), out_dir / f"final-zero{stage}", False)
            results[f"saved_zero{stage}"] = saved
            results["cases"]["beta"][f"zero{stage}"] = run
        LAYOUTS["zero2_async"] = {**zero(2), "max_staleness": 1}  # the producer's copy of a ZeRO-2 policy
        run = train_case("beta", "zero2_async", out_dir)
        run.pop("trainer")
        results["cases"]["beta"]["zero2_async"] = run
        results["zero3_no_gather"] = zero3_without_gathering(out_dir)
    if torch.distributed.get_rank() == 0:
        torch.save(copy.deepcopy(results), out_path)
        print(summary(results), flush=True)
    torch.distributed.barrier()  # leave together: a rank that exits while gloo has the other connected can abort


if __name__ == "__main__":
    allow_fsdp_on_cpu()
    if sys.argv[1] == "--killed":
        killed_run(Path(sys.argv[2]))
    else:
        main(sys.argv[1], Path(sys.argv[2]))
    exit_without_teardown()
