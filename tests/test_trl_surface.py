"""TRL 1.16 behaviours beyond the names: a given PeftModel's reference is its adapter, frozen; `use_liger_kernel`,
`quantization_config`, string reward models' `model_init_kwargs`, the completion logs (`log_completions` files,
`log_unique_prompts`, `log_completions_hub_repo`), `ds3_gather_for_generation`. Tiny models, CPU, offline."""

import copy

import pytest
import torch
from conftest import TRAINING, build_tiny_model, id_sum_reward, make_dataset, tiny_run_args, train_logs

from grpo_hf import GRPOTrainer
from grpo_hf.logprobs import padded_logps
from grpo_hf.peft_utils import REFERENCE_ADAPTER


def trained_adapter(tokenizer):
    """A PeftModel whose adapter is not the identity: lora_B set to random values, so it moves the logits."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build_tiny_model(tokenizer), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    return model


def test_a_given_peft_model_is_its_own_reference_frozen(tmp_path, tokenizer):
    """beta > 0 and a PeftModel with a trained adapter: the reference is that adapter (a frozen copy), not the base
    model. The first step's KL is 0, its reference log-probs are the given PeftModel's, and the copy stays put."""
    model = trained_adapter(tokenizer)
    given = copy.deepcopy(model).eval()
    args = tiny_run_args(tmp_path, TRAINING, max_steps=2, beta=0.1)
    trainer = GRPOTrainer(model, id_sum_reward, args, make_dataset(), processing_class=tokenizer)
    assert (
        set(trainer.model.peft_config) == {"default", REFERENCE_ADAPTER} and trainer.model.active_adapter == "default"
    )
    reference = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if f".{REFERENCE_ADAPTER}." in n}
    assert reference and not any(p.requires_grad for n, p in trainer.model.named_parameters() if n in reference)
    first, expected, base_model_logps = train_and_score_first_batch(trainer, given)
    mask = first.completion_mask.bool()
    torch.testing.assert_close(first.ref_logps[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert (base_model_logps[mask] - expected[mask]).abs().max() > 1e-3  # the base model would be another reference
    logs = train_logs(trainer)
    assert logs[0]["kl"] == pytest.approx(0.0, abs=1e-6) and logs[1]["kl"] > 0.0
    for name, param in trainer.model.named_parameters():
        if name in reference:
            assert torch.equal(param, reference[name]), name  # the reference adapter did not train
    trained = [p for n, p in trainer.model.named_parameters() if ".default." in n and "lora_" in n]
    assert trained and all(p.requires_grad for p in trained)  # the trained adapter is trainable again


def moe_adapter(tokenizer):
    """A tiny Qwen3-MoE whose LoRA adapts the experts' fused weights through `target_parameters`, lora_B random."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"])
    model = get_peft_model(Qwen3MoeForCausalLM(config), lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("peft_version", ["installed", "0.19.0"])
def test_a_moe_adapter_on_target_parameters_takes_trls_reference(
    tmp_path, tokenizer, monkeypatch, caplog, peft_version
):
    """A given PeftModel whose LoRA uses `target_parameters` (MoE experts): as TRL, a frozen "ref" copy of its adapter
    where PEFT takes two adapters there (>= 0.20), else (PEFT 0.17-0.19, one adapter only) no second adapter, a
    warning, and the model with its adapters off as the reference."""
    import peft

    if peft_version != "installed":
        monkeypatch.setattr(peft, "__version__", peft_version)
    model = moe_adapter(tokenizer)
    given = copy.deepcopy(model).eval()
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, beta=0.1)
    with caplog.at_level("WARNING", logger="grpo_hf.peft_utils"):
        trainer = GRPOTrainer(model, id_sum_reward, args, make_dataset(), processing_class=tokenizer)
    first, adapted, base = train_and_score_first_batch(trainer, given)
    mask = first.completion_mask.bool()
    assert (base[mask] - adapted[mask]).abs().max() > 1e-3  # the two candidate references differ
    warned = any("target_parameters" in r.getMessage() for r in caplog.records)
    if peft_version == "installed":  # peft >= 0.20 here: TRL adds the "ref" adapter
        assert set(trainer.model.peft_config) == {"default", REFERENCE_ADAPTER} and not warned
        torch.testing.assert_close(first.ref_logps[mask], adapted[mask], rtol=1e-5, atol=1e-5)
    else:
        assert set(trainer.model.peft_config) == {"default"} and warned
        torch.testing.assert_close(first.ref_logps[mask], base[mask], rtol=1e-5, atol=1e-5)


def test_a_new_adapter_keeps_the_base_model_as_reference(tmp_path, tokenizer):
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    args = tiny_run_args(tmp_path, TRAINING, max_steps=1, beta=0.1)
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer),
        id_sum_reward,
        args,
        make_dataset(),
        processing_class=tokenizer,
        peft_config=config,
    )
    assert set(trainer.model.peft_config) == {"default"}  # a new adapter starts as the base model: no copy needed


def test_use_liger_kernel_applies_layer_kernels_only_or_says_what_is_missing(tmp_path, monkeypatch):
    """Never transformers' default Liger patching (whose fused linear cross-entropy replaces the forward): TRL's layer
    kernels only, and a clear error where liger-kernel or a GPU is missing."""
    from grpo_hf import GRPOConfig

    with pytest.raises(ImportError, match="use_liger_kernel=True needs the liger-kernel package and a GPU"):
        GRPOConfig(output_dir=str(tmp_path), use_liger_kernel=True, use_cpu=True)
    with pytest.raises(ValueError, match="fused_linear_cross_entropy"):
        GRPOConfig(
            output_dir=str(tmp_path), use_liger_kernel=True, liger_kernel_config={"fused_linear_cross_entropy": True}
        )
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "liger_kernel" else find_spec(name, *a)
    )
    args = GRPOConfig(output_dir=str(tmp_path), use_liger_kernel=True, liger_kernel_config={"rms_norm": True})
    assert args.liger_kernel_config == {"rms_norm": True, "fused_linear_cross_entropy": False}


def test_log_completions_writes_trls_files_in_training_and_evaluation(tmp_path, tokenizer, monkeypatch):
    """TRL's per-step parquet files (columns step, prompt, completion, one per reward function, advantage) beside
    completions.jsonl, for training and evaluation; the tracker's table has one row per prompt with
    log_unique_prompts; log_completions_hub_repo uploads each file to a Hub dataset (a stand-in API here)."""
    import sys
    import types

    import pandas as pd

    logged, uploads = [], []

    class StandInApi:
        def create_repo(self, repo_id, **kwargs):
            uploads.append(("create", repo_id, kwargs["repo_type"]))

        def upload_file(self, path_or_fileobj, path_in_repo, repo_id, repo_type, run_as_future):
            uploads.append((path_in_repo, repo_id, repo_type, pd.read_parquet(path_or_fileobj).shape))

    monkeypatch.setattr("huggingface_hub.HfApi", StandInApi)
    args = tiny_run_args(
        tmp_path,
        TRAINING,
        max_steps=2,
        log_completions=True,
        log_unique_prompts=True,
        log_completions_hub_repo="me/logs",
    )
    args.eval_strategy, args.eval_steps = "steps", 2
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer), id_sum_reward, args, make_dataset(), make_dataset(2), processing_class=tokenizer
    )
    # a running wandb, as its callback would have imported and started it (not installed here)
    monkeypatch.setitem(
        sys.modules, "wandb", types.SimpleNamespace(run=1, Table=lambda dataframe: dataframe, log=logged.append)
    )
    args.report_to = ["wandb"]
    trainer.train()
    files = sorted(p.name for p in (tmp_path / "completions").iterdir())
    assert files == ["completions_00001.parquet", "completions_00002.parquet", "eval_completions_00002.parquet"]
    table = pd.read_parquet(tmp_path / "completions" / "completions_00001.parquet")
    assert list(table.columns) == ["step", "prompt", "completion", "id_sum_reward", "advantage"] and len(table) == 4
    eval_table = pd.read_parquet(tmp_path / "completions" / "eval_completions_00002.parquet")
    assert len(eval_table) == 8 and set(eval_table["step"]) == {2}  # 2 prompts x 4, evaluated after step 2
    assert [len(entry["completions"]) for entry in logged if "completions" in entry] == [1, 1]  # one prompt a step
    assert [len(entry["eval/completions"]) for entry in logged if "eval/completions" in entry] == [2]
    assert uploads[0] == ("create", "me/logs", "dataset")
    assert [u[0] for u in uploads[1:]] == [f"completions/{name}" for name in files[:2] + files[2:]]


def test_each_completions_row_carries_the_step_at_which_it_was_logged(tmp_path, tokenizer):
    """TRL's "step" column is the trainer's global step when the rows are logged: a 3-step run writes files 1, 2 and 3
    whose rows say 1, 2 and 3 (not the step the rollout started from, 0 for the first), and completions.jsonl too."""
    import json

    import pandas as pd

    args = tiny_run_args(tmp_path, TRAINING, max_steps=3, log_completions=True, num_completions_to_print=1)
    GRPOTrainer(build_tiny_model(tokenizer), id_sum_reward, args, make_dataset(), processing_class=tokenizer).train()
    steps = {}
    for step in (1, 2, 3):
        table = pd.read_parquet(tmp_path / "completions" / f"completions_{step:05d}.parquet")
        steps[step] = table["step"].tolist()
    assert steps == {1: [1] * 4, 2: [2] * 4, 3: [3] * 4}
    with open(tmp_path / "completions.jsonl", encoding="utf-8") as lines:
        assert [json.loads(line)["step"] for line in lines] == [1] * 4 + [2] * 4 + [3] * 4


def test_quantization_config_loads_the_model_quantized_or_says_what_is_missing(tmp_path, tokenizer, monkeypatch):
    """TRL's `quantization_config` (QLoRA): added to the string model's from_pretrained arguments (here bitsandbytes
    is missing: a clear error), refused when model_init_kwargs has one too, ignored for a built model; a quantized
    model's adapters are trained in bf16, DoRA's magnitude vector excepted."""
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    from grpo_hf import models

    path = tmp_path / "tiny"
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    qlora = BitsAndBytesConfig(load_in_4bit=True)
    args = tiny_run_args(tmp_path / "out", TRAINING, max_steps=1)
    with pytest.raises(ImportError, match="needs the bitsandbytes package"):
        GRPOTrainer(str(path), id_sum_reward, args, make_dataset(), quantization_config=qlora)
    both = tiny_run_args(tmp_path / "out", TRAINING, max_steps=1, model_init_kwargs={"quantization_config": qlora})
    with pytest.raises(ValueError, match="set both as a trainer argument and in model_init_kwargs"):
        GRPOTrainer(str(path), id_sum_reward, both, make_dataset(), quantization_config=qlora)
    seen = {}
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: object())  # bitsandbytes "installed"
    monkeypatch.setattr(
        models, "load_model", lambda name, **kwargs: seen.update(kwargs) or build_tiny_model(tokenizer)
    )
    models.build_models(str(path), tokenizer, with_reference=False, quantization_config=qlora)
    assert seen["quantization_config"] is qlora
    monkeypatch.undo()
    model = build_tiny_model(tokenizer)
    model.is_loaded_in_4bit = True  # as bitsandbytes leaves it
    peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True)
    policy, _, _ = models.build_models(model, tokenizer, peft_config, with_reference=False, quantization_config=qlora)
    trainable = {n: p.dtype for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(
        dtype == (torch.float32 if "lora_magnitude_vector" in n else torch.bfloat16) for n, dtype in trainable.items()
    )
    assert any("lora_magnitude_vector" in n for n in trainable)


def test_a_reward_model_path_loads_with_model_init_kwargs(tmp_path, tokenizer):
    """As TRL: a reward model given as a path is loaded with the config's model_init_kwargs (here its dtype), and
    placed by accelerate like the reference."""
    from test_reward_models import build_model as build_reward_model
    from test_reward_models import build_tokenizer as build_reward_tokenizer

    reward_dir = tmp_path / "reward"
    reward_tokenizer = build_reward_tokenizer()
    build_reward_model(len(reward_tokenizer)).save_pretrained(reward_dir)
    reward_tokenizer.save_pretrained(reward_dir)
    args = tiny_run_args(tmp_path / "out", TRAINING, max_steps=1, beta=0.0, model_init_kwargs={"dtype": "bfloat16"})
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer), [id_sum_reward, str(reward_dir)], args, make_dataset(), processing_class=tokenizer
    )
    assert trainer.reward_funcs[1].model.dtype == torch.bfloat16
    trainer.train()
    assert "rewards/reward/mean" in train_logs(trainer)[0]


def test_vespo_folds_the_token_level_vllm_correction_into_its_weight():
    """loss_type='vespo' with vLLM's per-token importance weight (TRL allows token_* modes): log w_i gains
    sum_t m clamp(log weight, log 1e-8, 20), and the weight does not multiply the loss; checked against loops."""
    import math

    from grpo_hf import GRPOConfig
    from grpo_hf.core import grpo_loss

    torch.manual_seed(0)
    N, T = 4, 5
    logps = -torch.rand(N, T, dtype=torch.float64) * 2
    old = logps + 0.1 * torch.randn(N, T, dtype=torch.float64)
    weight = torch.exp(0.2 * torch.randn(N, T, dtype=torch.float64))
    weight[0, 1] = 0.0  # token_mask: a masked token (log 0 -> log 1e-8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2], dtype=torch.float64)
    expected = 0.0
    for i in range(N):
        log_w = sum(max(-20.0, min(20.0, float(logps[i, t] - old[i, t]))) for t in range(T) if mask[i, t])
        log_w += sum(
            max(math.log(1e-8), min(20.0, math.log(float(weight[i, t])) if weight[i, t] > 0 else -1e9))
            for t in range(T)
            if mask[i, t]
        )
        log_w = max(math.log(1e-8), min(20.0, log_w))
        k, lam = (2.0, 3.0) if advantages[i] >= 0 else (3.0, 2.0)
        phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
        expected += sum(phi * float(advantages[i]) * float(logps[i, t]) for t in range(T) if mask[i, t])
    expected = -expected / float(mask.sum())
    loss, _ = grpo_loss(logps, old, None, advantages, mask, loss_type="vespo", beta=0.0, sampling_weight=weight)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    unweighted, _ = grpo_loss(logps, old, None, advantages, mask, loss_type="vespo", beta=0.0)
    assert abs(unweighted.item() - expected) > 1e-6  # the weight did change the loss
    GRPOConfig(
        output_dir="unused", use_cpu=True, use_vllm=True, loss_type="vespo", vllm_importance_sampling_mode="token_mask"
    )
    with pytest.raises(ValueError, match="use 'token_truncate' or 'token_mask'"):
        GRPOConfig(output_dir="unused", use_cpu=True, use_vllm=True, loss_type="vespo")


def train_and_score_first_batch(trainer, given):
    """Train, and return the first micro-batch with the log-probs of the PEFT model `given` (a copy of the model as
    passed) on it, with its adapters and with them disabled."""
    batches = []
    original = trainer.experience.train_batches
    trainer.experience.train_batches = lambda rows: batches.append(original(rows)) or batches[-1]
    trainer.train()
    first = batches[0][0]
    with torch.no_grad():
        adapted, _ = padded_logps(given, first)
        with given.disable_adapter():
            base, _ = padded_logps(given, first)
    return first, adapted, base


def test_a_deep_copy_of_a_model_trls_sft_trainer_patched_is_refused(tokenizer, tmp_path):
    """TRL's SFTTrainer patches `model.forward` with its fused LM head, a closure over the forward it replaced (bound
    to that model). A deep copy's forward then runs the original's weights: GRPO would sample from a model it does not
    train (a warm-started, deep-copied policy whose samples never changed). The trainer refuses it and says how."""
    from trl.trainer.utils import add_fused_lm_head

    from grpo_hf import models

    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model)
    clone = copy.deepcopy(model)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        model.lm_head.weight.zero_()  # the original only: the clone's own head is untouched
        assert clone.lm_head.weight.abs().sum() > 0 and torch.all(clone(ids).logits == 0)  # it ran the original's
    assert models.forward_of_another_module(clone) is model
    args = tiny_run_args(tmp_path / "out", TRAINING, max_steps=1)
    with pytest.raises(ValueError, match="runs the forward of another LlamaForCausalLM.*del model.forward"):
        GRPOTrainer(clone, id_sum_reward, args, make_dataset(), processing_class=tokenizer)
    assert models.forward_of_another_module(model) is None  # the patched model itself is accepted
    models.build_models(model, tokenizer, with_reference=False)
    del clone.forward  # the class's forward again: the clone's own weights
    assert models.forward_of_another_module(clone) is None and torch.any(clone(ids).logits != 0)


def test_the_reference_copy_of_a_policy_trls_sft_trainer_patched_runs_its_own_weights(tokenizer):
    """With beta > 0 the reference is a deep copy of the policy given as an object. TRL's fused-LM-head patch would
    make that copy run the policy's forward (a KL of 0 against a reference that trains along); it is dropped."""
    from trl.trainer.utils import add_fused_lm_head

    from grpo_hf import models

    model = build_tiny_model(tokenizer)
    add_fused_lm_head(model)  # what a warm start with TRL's SFTTrainer leaves on the policy
    policy, reference, _ = models.build_models(model, tokenizer, with_reference=True)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        policy.lm_head.weight.zero_()  # the policy trains on; the reference stays
        assert torch.all(policy(ids).logits == 0) and torch.any(reference(ids).logits != 0)
