"""One run of `benchmarks/gpu_vs_trl.py`: one trainer (TRL's or grpo_hf's), one job, one seed, one process.

Run by `gpu_vs_trl.py` in a fresh subprocess per run, so that the peak CUDA memory, the allocator, compiled kernels and
CUDA graphs are per trainer. Two modes:

- `--prepare DIR`: build a byte-level tokenizer padded to the vocabulary size (Qwen2.5's 151,936 tokens; `--smoke`:
  1,024) with a ChatML template, and a Qwen2 model in the shape of Qwen2.5-0.5B or -1.5B with random bf16 weights
  (`SHAPES`), and save both to DIR; both trainers then load the same files, as a user's checkpoint.
- `--impl trl|grpo_hf`: train `--steps` optimizer steps of a job (`JOBS`) on the prepared model and write one JSON
  object to `--out` (rewritten after each phase, so that a crash in a later phase keeps the numbers before it):

  - `step_seconds`: wall time of every optimizer step (Trainer's `on_step_begin` -> `on_step_end`, the device
    synchronised at both ends);
  - `generate_seconds`, `decode_steps`: per step, wall time inside generation (grpo_hf: `RolloutEngine.generate`;
    TRL: the model's `generate`, synchronised at both ends; prefill included) and the decode steps it made (the
    completion tensor's width);
  - `mean_length`, `rewards`: the logged mean completion length and mean reward of each step;
  - `peak_cuda_bytes`, `peak_cuda_reserved_bytes`: `torch.cuda.max_memory_allocated` and `max_memory_reserved`
    over the training (null on CPU; a CUDA graph's private memory pool shows only in the reserved figure);
    `peak_rss_mib`;
  - `compile`: what torch.compile did in the process (grpo_hf's engine compiles its decode step): Inductor's
    `cudagraph_skips` (a graph that runs without CUDA graphs), `cudagraph_partitions` (a graph split around what
    CUDA graphs cannot take), Dynamo's `unique_graphs` and graph breaks;
  - `engine`: what generated (grpo_hf: `trainer.rollout.name` after the first step); `engine_log` (grpo_hf): the
    INFO and WARNING lines of `grpo_hf.experience` and `grpo_hf.rollout` (which engine and why, compile times, a step
    that did not compile);
  - after training, the last generation call is replayed twice (CUDA only): once under
    `torch.cuda.set_sync_debug_mode("warn")` (`syncs`: the synchronising operations it warns about) and once under
    `torch.profiler` (`kernels`: GPU kernels seen, inside CUDA graphs too where CUPTI reports them; `launches`:
    host-side launch calls, a CUDA graph replay counting one); `replay_decode_steps` is that call's decode steps;
  - `step_profile` (`--profile-step`): one more optimizer step after the timed ones, under `torch.profiler`: its
    operators by self device time, to tell where a step's time goes;
  - `status`: "ok", "oom" (a `torch.cuda.OutOfMemoryError` while building or training) or "error"; `error`.

Both trainers get the same knobs as `vs_trl.py`'s worker (`_worker.common_config`, `trl_only_config`,
`grpo_hf_only_config`), with the job's batch, length and beta, bf16 weights and `bf16=True`, and one reward function
(`even_id_fraction`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import os
import resource
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # grpo_hf from this checkout when it is not installed

import _worker  # noqa: E402

QWEN_VOCAB_SIZE = 151_936  # Qwen2.5's embedding rows
SMOKE_VOCAB_SIZE = 1_024
SHAPES = {
    # Qwen2.5-0.5B / -1.5B (config.json of the Hub checkpoints), and a tiny one for --smoke
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "smoke": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
}
JOBS = {
    # name: model shape, prompts per step, G, max_completion_length, beta, LoRA rank (0: full fine-tuning)
    "J1": dict(shape="0.5B", prompts=8, num_generations=8, max_completion_length=256, beta=0.04, lora_r=0),
    "J2": dict(shape="0.5B", prompts=16, num_generations=8, max_completion_length=512, beta=0.04, lora_r=0),
    "J3": dict(shape="0.5B", prompts=8, num_generations=8, max_completion_length=256, beta=0.04, lora_r=16),
    "J4": dict(shape="1.5B", prompts=8, num_generations=8, max_completion_length=256, beta=0.04, lora_r=0),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Host-side launch calls as CUPTI names them; prefixes, so cudaLaunchKernelExC, cuLaunchKernelEx, ... count too
HOST_LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchCooperativeKernel",
    "cudaGraphLaunch",
    "cuGraphLaunch",
)


def job_settings(name: str, smoke: bool) -> dict:
    """The job's settings; `smoke` shrinks it to the tiny shape, 1/16 of its tokens, 1/4 of its prompts, G=2."""
    job = dict(JOBS[name])
    if smoke:
        job.update(
            shape="smoke",
            prompts=max(job["prompts"] // 4, 1),
            num_generations=2,
            max_completion_length=max(job["max_completion_length"] // 16, 4),
        )
    return job


def describe(name: str, smoke: bool) -> str:
    job = job_settings(name, smoke)
    lora = f", LoRA r={job['lora_r']}" if job["lora_r"] else ""
    return (
        f"{job['shape']}, {job['prompts']}x{job['num_generations']}, {job['max_completion_length']} tok, "
        f"beta={job['beta']}{lora}"
    )


# ---------------------------------------------------------------------------------------------------------------------
# The model and tokenizer (--prepare)


def build_tokenizer(vocab_size: int):
    """Byte-level tokenizer with a ChatML template: one token per byte when encoding (no merges), and the vocabulary
    filled up to `vocab_size` with 2- and 3-symbol tokens, so that every id the model can sample decodes to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {s: i for i, s in enumerate(specials)}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = itertools.chain.from_iterable(itertools.product(alphabet, repeat=n) for n in (1, 2, 3))
    for chars in itertools.islice(symbols, vocab_size - len(vocab)):
        vocab["".join(chars)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE,
    )


def prepare(shape: str, directory: str, device: str, seed: int) -> dict:
    """Save a tokenizer and a randomly initialised bf16 Qwen2 model of `shape` to `directory`; describe them."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_tokenizer(SMOKE_VOCAB_SIZE if shape == "smoke" else QWEN_VOCAB_SIZE)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=1_000_000.0,
        max_position_embeddings=32_768,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(seed)
    with torch.device(device):  # random init where the model will run: seconds on a GPU for 1.5B parameters
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return {"parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer), **versions()}


def versions() -> dict:
    import peft
    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "peft": peft.__version__,
    }


# ---------------------------------------------------------------------------------------------------------------------
# Data and reward


def make_dataset(num_prompts: int):
    """Short chat prompts of varied length (GSM8K-like word problems, 80-130 bytes)."""
    from datasets import Dataset

    items = ["pencils", "apples", "marbles", "stamps", "books"]
    prompts = []
    for i in range(num_prompts):
        a, b, c = 3 + i % 17, 2 + (7 * i) % 11, 1 + (5 * i) % 23
        text = f"A shop has {a} boxes of {b} {items[i % 5]} and {c} loose ones."
        text += " How many are there in all?" + " Think step by step." * (i % 3) + " End with '#### N'."
        prompts.append([{"role": "user", "content": text}])
    return Dataset.from_dict({"prompt": prompts})


def even_id_fraction(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float]:
    """The fraction of a completion's tokens with an even id: cheap, deterministic, and different across a group."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


# ---------------------------------------------------------------------------------------------------------------------
# Measuring generation


class GenerationMeter:
    """Wall time and decode steps inside each generation call, per optimizer step, and the last call (to replay it).

    `wrap(fn, decode_steps)` returns `fn` timed (the device synchronised before and after the outermost call);
    `decode_steps(output, args, kwargs)` says how many tokens per row the call generated.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.seconds: list[float] = []  # [steps]
        self.decode_steps: list[int] = []  # [steps]
        self.last_call = None  # (unwrapped fn, args, kwargs, decode_steps)
        self._depth = 0

    def new_step(self) -> None:
        self.seconds.append(0.0)
        self.decode_steps.append(0)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, fn, decode_steps):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self._depth:  # a nested call (a wrapper's generate calling the model's): timed by the outer one
                return fn(*args, **kwargs)
            self._depth += 1
            try:
                self.sync()
                start = time.perf_counter()
                output = fn(*args, **kwargs)
                self.sync()
            finally:
                self._depth -= 1
            if self.seconds:
                self.seconds[-1] += time.perf_counter() - start
                self.decode_steps[-1] += decode_steps(output, args, kwargs)
            self.last_call = (fn, args, kwargs, decode_steps)
            return output

        return timed

    def replay(self, sync: bool = True) -> int:
        """Run the last generation call again, unwrapped; its decode steps."""
        import torch

        fn, args, kwargs, decode_steps = self.last_call
        with torch.no_grad():
            output = fn(*args, **kwargs)
        if sync:
            self.sync()
        return decode_steps(output, args, kwargs)


class _ListHandler(logging.Handler):
    def __init__(self, lines: list[str], limit: int):
        super().__init__(logging.INFO)
        self.lines, self.limit = lines, limit

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < self.limit:
            self.lines.append(f"{record.levelname}: {record.getMessage()}"[:400])


def keep_engine_log(lines: list[str], limit: int = 20) -> None:
    """Append the first `limit` INFO/WARNING lines of grpo_hf's engine choice and rollout engines to `lines`."""
    handler = _ListHandler(lines, limit)
    for name in ("grpo_hf.experience", "grpo_hf.rollout"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)


def grpo_hf_decode_steps(output, args, kwargs) -> int:
    return output.completion_ids.size(1)  # [N, T]


def trl_decode_steps(output, args, kwargs) -> int:
    sequences = getattr(output, "sequences", output)  # [N, P + T]
    input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[1]  # [N, P]
    return sequences.size(1) - input_ids.size(1)


def count_syncs(meter: GenerationMeter) -> dict:
    """Synchronising CUDA operations in one replayed generation call, as `set_sync_debug_mode("warn")` reports them
    (the distinct warning messages are kept, to check what was counted)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            steps = meter.replay(sync=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    messages = Counter(str(w.message)[:200] for w in caught)
    syncs = sum(n for message, n in messages.items() if "synchroniz" in message)
    return {"syncs": syncs, "sync_messages": dict(messages.most_common(5)), "replay_decode_steps": steps}


def kernels_and_launches(prof) -> tuple[int, Counter]:
    """From a finished `torch.profiler` run: the GPU kernels it saw (inside CUDA graphs too, where CUPTI reports them;
    copies and memsets left out) and the host-side launch calls by name (a CUDA graph replay is one)."""
    from torch.autograd import DeviceType

    results = getattr(prof.profiler, "kineto_results", None)
    # The raw events when torch exposes them: no Python event tree for the ~10^5-10^6 events of a long decode.
    if results is not None:
        events = [(e.name(), e.device_type()) for e in results.events()]
    else:
        events = [(e.name, e.device_type) for e in prof.events()]
    kernels = sum(1 for name, kind in events if kind == DeviceType.CUDA and not name.startswith(("Memcpy", "Memset")))
    launch_names = Counter(name for name, kind in events if kind == DeviceType.CPU and name.startswith(HOST_LAUNCHES))
    return kernels, launch_names


def count_launches(meter: GenerationMeter) -> dict:
    """GPU kernels and host-side launch calls in one replayed generation call, from `torch.profiler` (the launch calls'
    names are kept, to check what was counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = meter.replay()
    kernels, launch_names = kernels_and_launches(prof)
    del prof
    if kernels == 0 and not launch_names:
        raise RuntimeError("the profiler saw no CUDA kernel and no launch call")
    return {
        "kernels": kernels,
        "launches": sum(launch_names.values()),
        "launch_names": dict(launch_names),
        "replay_decode_steps": steps,
    }


# ---------------------------------------------------------------------------------------------------------------------
# One run


def build_trainer(
    impl: str,
    job: dict,
    model_dir: str,
    steps: int,
    seed: int,
    *,
    engine: str,
    use_cpu: bool,
    output_dir: str,
    extra: dict,
):
    """The trainer of one run: `_worker`'s shared knobs with the job's batch, lengths and beta; `extra` (grpo_hf's
    only) goes last."""
    kwargs = _worker.common_config("a", steps, seed, True, use_cpu, output_dir)
    kwargs.update(
        per_device_train_batch_size=job["prompts"] * job["num_generations"],
        num_generations=job["num_generations"],
        max_completion_length=job["max_completion_length"],
        beta=job["beta"],
        reward_weights=[1.0],
        model_init_kwargs={"dtype": "bfloat16"},
    )
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        kwargs.update(_worker.trl_only_config())
    else:
        from grpo_hf import GRPOConfig, GRPOTrainer

        kwargs.update(_worker.grpo_hf_only_config(), rollout_engine=engine)
        kwargs.update(extra)
    peft_config = None
    if job["lora_r"]:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=job["lora_r"],
            lora_alpha=2 * job["lora_r"],
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=[even_id_fraction],
        args=GRPOConfig(**kwargs),
        train_dataset=make_dataset(max(2 * steps * job["prompts"], 32)),
        peft_config=peft_config,
    )


def step_profiler(cuda: bool):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])


def profile_table(profiler, cuda: bool, rows: int = 30) -> str:
    """The operators of one training step by self time on the device (CPU time on a CPU): where a step's time goes."""
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return profiler.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def compile_counters() -> dict:
    """torch.compile's counters in this process: what tells a lost or split CUDA graph from a slow one."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {
        "cudagraph_skips": int(inductor.get("cudagraph_skips", 0)),
        "cudagraph_partitions": int(inductor.get("cudagraph_partitions", 0)),
        "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters["graph_break"].values())),
    }


def run(args, record: dict, save) -> None:
    import datasets
    import torch
    import transformers
    from transformers import TrainerCallback

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device (use --device cpu)")
    job = job_settings(args.job, args.smoke)
    meter = GenerationMeter(cuda)
    if args.impl == "trl":
        from transformers import GenerationMixin

        GenerationMixin.generate = meter.wrap(GenerationMixin.generate, trl_decode_steps)
        record["engine"] = "model.generate (dynamic cache)"
    else:
        from grpo_hf.rollout import RolloutEngine

        RolloutEngine.generate = meter.wrap(RolloutEngine.generate, grpo_hf_decode_steps)
        keep_engine_log(record["engine_log"])

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class StepTimer(TrainerCallback):
        profiler = None

        def on_step_begin(self, *_, **__):
            if args.profile_step and len(record["step_seconds"]) == args.steps:  # the extra, untimed step
                self.profiler = step_profiler(cuda)
                self.profiler.__enter__()
                return
            meter.new_step()
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            sync()
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                record["step_profile"] = profile_table(self.profiler, cuda)
                self.profiler = None
                save()
                return
            record["step_seconds"].append(time.perf_counter() - self.start)
            record["generate_seconds"], record["decode_steps"] = meter.seconds, meter.decode_steps
            if args.impl == "grpo_hf" and record.get("engine") is None and trainer.rollout is not None:
                record["engine"] = trainer.rollout.name
            save()

        def on_log(self, _args, _state, _control, logs=None, **__):
            logs = logs or {}
            if "reward" in logs:
                record["rewards"].append(logs["reward"])
            if "completions/mean_length" in logs:
                record["mean_length"].append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as output_dir:
        try:
            trainer = build_trainer(
                args.impl,
                job,
                args.model_dir,
                args.steps + args.profile_step,
                args.seed,
                engine=args.engine,
                use_cpu=not cuda,
                output_dir=output_dir,
                extra=json.loads(args.extra),
            )
            trainer.add_callback(StepTimer())
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
        except torch.cuda.OutOfMemoryError as err:
            record.update(status="oom", error=str(err).splitlines()[0][:300])
            return
        finally:
            record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if cuda:
                record["peak_cuda_bytes"] = torch.cuda.max_memory_allocated()
                record["peak_cuda_reserved_bytes"] = torch.cuda.max_memory_reserved()
            record["compile"] = compile_counters()
        record["status"] = "ok"
        save()
        if not cuda or meter.last_call is None:
            return
        # The CUDA-only measurements, each on one replay of the last generation call; a failure costs only its own.
        for name, measure in (("syncs", count_syncs), ("launches", count_launches)):
            try:
                record.update(measure(meter))
            except Exception as err:  # reported as n/a in the table, with the reason in the JSON
                record["measure_errors"][name] = f"{type(err).__name__}: {err}"[:500]
            save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prepare", metavar="DIR", help="Save the tokenizer and random model of --shape to DIR.")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5B")
    parser.add_argument("--impl", choices=["trl", "grpo_hf"])
    parser.add_argument("--job", choices=sorted(JOBS), default="J1")
    parser.add_argument("--model-dir")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine", default="auto", help="grpo_hf's rollout_engine.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--extra", default="{}", help="JSON dict of extra grpo_hf config fields.")
    parser.add_argument(
        "--profile-step", action="store_true", help="Train one more step, untimed, under torch.profiler."
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    def write(obj: dict) -> None:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, args.out)

    if args.prepare:
        write(prepare(args.shape, args.prepare, args.device, args.seed))
        return
    record = {
        "impl": args.impl,
        "job": args.job,
        "status": "running",
        "engine": None,
        "engine_log": [],
        "step_seconds": [],
        "generate_seconds": [],
        "decode_steps": [],
        "mean_length": [],
        "rewards": [],
        "peak_cuda_bytes": None,
        "peak_cuda_reserved_bytes": None,
        "compile": {},
        "syncs": None,
        "kernels": None,
        "launches": None,
        "replay_decode_steps": None,
        "measure_errors": {},
    }
    try:
        run(args, record, lambda: write(record))
    except BaseException as err:
        record.update(status="error", error="".join(traceback.format_exception_only(type(err), err))[-2000:])
        write(record)
        raise
    write(record)


if __name__ == "__main__":
    main()
