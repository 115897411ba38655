"""The rollout side of MoE routing replay (issue 61, `grpo_hf.rollout.routes`): the engines record the experts of
every token the policy read, and the routes travel with their rows (groups, micro-batches, tool episodes, the async
producer, dynamic sampling).

The check is always the same: the routes a rollout hands on equal, on every token read, the routes of one plain full
forward over cat(prompt, completion) of the same fp32 model (recorded with `routers.recording`), and are -1
everywhere else (left padding, a completion's last token, what follows it). The tokens read are written here from
their definition, one loop per row (`expected_read`), not with `routes.read_mask`.
"""

from __future__ import annotations

import pytest
import torch
from test_families import build
from transformers import GenerationConfig

from grpo_hf.rollout.batching import MicroBatch, split_into_micro_batches
from grpo_hf.rollout.engine import ENGINES, ROUTES_REFUSAL, RolloutEngine, choose_engine, make_engine
from grpo_hf.rollout.routes import NO_ROUTE, realign
from grpo_hf.routers import recording

FAMILIES = ["qwen3_moe", "mixtral"]
EOS = list(range(1, 7))  # several end ids (of 64): rows end at different steps, some not within 12


def expected_read(prompt_mask, completion_mask, context_mask=None) -> torch.Tensor:
    """[N, P + T] bool from the definition: a prompt token, or a completion token (sampled or a tool reply's) that
    another completion token follows."""
    attended = completion_mask if context_mask is None else completion_mask + context_mask
    N, P = prompt_mask.shape
    T = attended.size(1)
    read = torch.zeros(N, P + T, dtype=torch.bool)
    for i in range(N):
        for j in range(P):
            read[i, j] = bool(prompt_mask[i, j])
        for j in range(T - 1):
            read[i, P + j] = bool(attended[i, j]) and bool(attended[i, j + 1])
    return read


def full_forward_routes(model, prompt_ids, prompt_mask, completion_ids, attended) -> torch.Tensor:
    """[N, P + T, L, k] the routes of one plain forward over cat(prompt, completion), padding masked."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1).cpu()
    mask = torch.cat([prompt_mask, attended], dim=1).cpu()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad(), recording(model) as recorder:
        model(input_ids=ids, attention_mask=mask, position_ids=positions)
        return recorder.pop(ids.size(0))


def assert_routes_of_tokens(
    model, routes, prompt_ids, prompt_mask, completion_ids, completion_mask, context_mask=None
):
    """`routes` equal a plain full forward's on every token read, -1 elsewhere."""
    attended = completion_mask if context_mask is None else completion_mask + context_mask
    read = expected_read(
        prompt_mask.cpu(), completion_mask.cpu(), None if context_mask is None else context_mask.cpu()
    )
    full = full_forward_routes(model, prompt_ids, prompt_mask, completion_ids, attended)
    routes = routes.cpu()
    assert routes.shape == full.shape, (routes.shape, full.shape)
    assert torch.equal(routes[read].long(), full[read])
    assert bool((routes[~read] == NO_ROUTE).all())
    assert bool(read[:, prompt_ids.size(1) :].any())  # some completion token was checked


def prompts(G: int = 3):
    """Three prompts of 3, 7 and 5 tokens, left-padded to 7, each repeated G times."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.zeros(3, 7, dtype=torch.long)
    for row, length in enumerate((3, 7, 5)):
        ids[row, 7 - length :] = torch.randint(12, 64, (length,), generator=generator)
    ids = ids.repeat_interleave(G, dim=0)
    return ids, (ids != 0).long()


def generation_config(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(do_sample=True, max_new_tokens=max_new_tokens, pad_token_id=0, eos_token_id=EOS, top_k=0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["loop", "generate"])
def test_each_engine_records_the_routes_of_every_token_it_read(family, name):
    """Left-padded prompts of different lengths in groups of 3, rows ending at different steps (the loop engine drops
    finished rows from its batch when 8 steps remain), some cut at max_new_tokens."""
    model = build(family).eval()
    prompt_ids, prompt_mask = prompts()
    engine, _ = make_engine(name, model, generation_config(12), EOS, record_routes=True)
    assert engine.name == name and engine.record_routes
    for seed in range(20):  # the first seed whose rows end at several steps, some cut
        torch.manual_seed(seed)
        out = engine.generate(model, prompt_ids, prompt_mask)
        lengths = out.completion_mask.sum(dim=1)
        if len(set(lengths.tolist())) > 2 and bool(out.is_truncated.any()) and not bool(out.is_truncated.all()):
            break
    assert len(set(lengths.tolist())) > 2 and bool(out.is_truncated.any()) and not bool(out.is_truncated.all())
    routes = engine.sampling_routes
    assert routes.dtype == torch.int16 and routes.shape[2:] == (2, 2)  # 2 MoE layers, top 2
    assert_routes_of_tokens(model, routes, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)


def test_recording_draws_the_same_tokens_and_off_records_nothing():
    model = build("qwen3_moe").eval()
    prompt_ids, prompt_mask = prompts()
    outs = []
    for record in (False, True):
        engine, _ = make_engine("loop", model, generation_config(6), EOS)
        engine.record_routes = record
        torch.manual_seed(0)
        outs.append(engine.generate(model, prompt_ids, prompt_mask))
        assert (engine.sampling_routes is not None) == record
    assert torch.equal(outs[0].completion_ids, outs[1].completion_ids)


@pytest.mark.parametrize("name", ["continuous_batching", "cuda_graph", "generate_static"])
def test_an_engine_that_cannot_record_routes_is_refused_by_name_under_replay(name):
    model = build("qwen3_moe")
    with pytest.raises(ValueError) as error:
        make_engine(name, model, generation_config(4), EOS, record_routes=True)
    assert f"rollout_engine={name!r}" in str(error.value) and ROUTES_REFUSAL in str(error.value)
    assert "'loop' or 'generate'" in str(error.value)
    assert choose_engine("auto", model, generation_config(4), record_routes=True)[0] == "loop"
    from grpo_hf.rollout.engine import engine_class

    engine = engine_class(name).__new__(engine_class(name))  # asked directly, at `generate`: refused the same way
    engine.record_logps, engine.record_routes, engine.name = False, True, name
    with pytest.raises(ValueError, match="cannot record the MoE routes"):
        engine.generate(model, *prompts())


def test_micro_batches_cut_and_pad_the_routes_with_their_tokens():
    """`split_into_micro_batches` trims each micro-batch's unused prompt and completion columns and pads to a multiple:
    the routes follow on both sides of the prompt's width."""
    N, P, T, L, k = 4, 5, 6, 2, 2
    prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 1]])
    completion_mask = torch.tensor([[1] * 6, [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    routes = torch.arange(N * (P + T) * L * k).reshape(N, P + T, L, k).to(torch.int16)
    batch = MicroBatch(prompt_mask * 7, prompt_mask, completion_mask * 9, completion_mask, advantages=torch.zeros(N),
                       routes=routes)  # fmt: skip
    parts = split_into_micro_batches(batch, 2, multiple=4, pad_token_id=0)
    for part, rows in zip(parts, (slice(0, 2), slice(2, 4)), strict=True):
        p, t = part.prompt_ids.size(1), part.completion_ids.size(1)
        assert part.routes.shape == (2, p + t, L, k) and p % 4 == 0 and t % 4 == 0
        for i in range(2):  # every token keeps its routes, wherever its column went
            row = rows.start + i
            for j in range(P):
                if prompt_mask[row, j]:
                    assert torch.equal(part.routes[i, p - (P - j)], routes[row, j])
            for j in range(T):
                if completion_mask[row, j]:
                    assert torch.equal(part.routes[i, p + j], routes[row, P + j])
    assert parts[1].prompt_ids.size(1) == 4 and parts[1].completion_ids.size(1) == 4  # trimmed (3 -> 4), padded
    assert bool((parts[1].routes[:, :2] == NO_ROUTE).all())  # the new left columns hold none


def test_realign_pads_and_cuts_each_side():
    routes = torch.arange(2 * 5).reshape(2, 5, 1, 1)  # P = 2, T = 3
    wider = realign(routes, 2, 4, 5)
    assert wider[:, :, 0, 0].tolist() == [[-1, -1, 0, 1, 2, 3, 4, -1, -1], [-1, -1, 5, 6, 7, 8, 9, -1, -1]]
    assert realign(wider, 4, 2, 3).tolist() == routes.tolist()


# ---- through the trainer: groups, micro-batches, tool episodes, the async producer ---------------------------------
def moe_model(tokenizer, seed: int = 0):
    """A tiny fp32 Qwen3-MoE (2 MoE layers, 4 experts, top 2) over the byte tokenizer's vocabulary."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).float()


def assert_batches_route_their_tokens(model, batches):
    assert batches and all(batch.routes is not None for batch in batches)
    for batch in batches:
        assert_routes_of_tokens(model, batch.routes, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                batch.completion_mask, batch.context_mask)  # fmt: skip


def capture_batches(monkeypatch) -> list:
    """Every micro-batch `ExperienceMaker.split` makes from now on (with its routes), in order."""
    from grpo_hf.experience import ExperienceMaker

    batches, split = [], ExperienceMaker.split

    def capturing(self, rollout, size):
        parts = split(self, rollout, size)
        batches.extend(parts)
        return parts

    monkeypatch.setattr(ExperienceMaker, "split", capturing)
    return batches


@pytest.mark.parametrize("engine", ["loop", "generate"])
def test_groups_and_micro_batches_carry_the_routes_of_their_tokens(tmp_path, tokenizer, engine, monkeypatch):
    """Groups of 2 over 4 prompts, micro-batches of 2 rows trimmed and padded to multiples of 8: each micro-batch's
    routes are those of its own tokens."""
    from conftest import TRAINING, make_trainer, tiny_run_args

    settings = dict(num_generations=2, per_device_train_batch_size=2, steps_per_generation=4, pad_to_multiple_of=8)
    args = tiny_run_args(tmp_path, preset=TRAINING, rollout_engine=engine, max_steps=1, **settings)
    trainer = make_trainer(args, tokenizer=tokenizer, model=moe_model(tokenizer))
    batches = capture_batches(monkeypatch)
    rows = [row for row in trainer.train_dataset.select(range(4)) for _ in range(2)]
    trainer.experience.train_batches(rows)
    assert len(batches) == 4 and {b.prompt_ids.size(1) % 8 for b in batches} == {0}
    assert_batches_route_their_tokens(trainer.model, batches)


def test_a_dense_model_records_no_routes(tmp_path, tokenizer, monkeypatch):
    from conftest import TRAINING, make_trainer, tiny_run_args

    trainer = make_trainer(tiny_run_args(tmp_path, preset=TRAINING, rollout_engine="loop"), tokenizer=tokenizer)
    batches = capture_batches(monkeypatch)
    trainer.experience.train_batches([row for row in trainer.train_dataset.select(range(1)) for _ in range(4)])
    assert batches and all(batch.routes is None for batch in batches)


@pytest.mark.parametrize(("engine", "cache_gb"), [("loop", 1.0), ("loop", 0.0), ("generate", 0.0)])
def test_tool_episodes_carry_the_routes_of_every_token_the_model_read(tmp_path, engine, cache_gb):
    """Two turns with a tool reply between: the routes of the prompt, both turns and the reply the second turn read
    (with the loop engine's episode cache, the second turn prefills only its new tokens on the first turn's kept
    states, and the shared system block once: the routes are stitched), -1 on the episode's last token."""
    from test_tools import add, args_for, call_of, one_rollout, sums_dataset, tool_tokenizer, with_eos_tokens, zero

    from grpo_hf import GRPOTrainer
    from grpo_hf.rollout.tools import tool_reply_ids

    tokenizer = tool_tokenizer()
    config = args_for(tmp_path, rollout_engine=engine, max_completion_length=120, temperature=1.0,
                      episode_cache_gb=cache_gb)  # fmt: skip
    model = moe_model(tokenizer)
    trainer = GRPOTrainer(model, zero, config, train_dataset=sums_dataset(), processing_class=tokenizer, tools=[add])
    sampler = with_eos_tokens(trainer, [i for i in range(len(tokenizer)) if i % 2 == 1])
    first_turn = {"role": "assistant", "content": "", "tool_calls": [call_of("add", a=1, b=2)]}
    sampler.episodes.parse = lambda tok, ids, context, tools: (
        {"role": "assistant", "content": "x"} if "<tool_response>" in tok.decode(context) else first_turn
    )
    torch.manual_seed(0)
    (batch,) = one_rollout(trainer)
    reply = tool_reply_ids(tokenizer, [{"role": "tool", "name": "add", "content": "3"}], {})
    assert int(batch.context_mask.sum()) == 4 * len(reply)  # every episode read a reply in its second turn
    assert_batches_route_their_tokens(trainer.model, [batch])
    cache = trainer._metrics["train"]
    if cache_gb:  # the kept states were used: the second turns prefilled only their new tokens
        assert sampler.engine.episode_cache.stats["hits"] == 4 and sampler.engine.episode_cache.stats["reused_tokens"]
    assert cache is not None


def test_the_async_producer_hands_on_the_routes_of_its_rows(tmp_path, tokenizer, monkeypatch):
    """max_staleness=1: the producer's copy of the weights samples (lr 0: the policy's own weights, so its routes are
    those of a plain forward of the policy); each trained micro-batch carries its tokens' routes."""
    from conftest import TRAINING, make_trainer, tiny_run_args

    from grpo_hf import AsyncGRPOTrainer

    args = tiny_run_args(tmp_path, preset=TRAINING, rollout_engine="loop", max_staleness=1, learning_rate=0.0,
                         max_steps=2)  # fmt: skip
    trainer = make_trainer(args, tokenizer=tokenizer, model=moe_model(tokenizer), trainer_cls=AsyncGRPOTrainer)
    batches = capture_batches(monkeypatch)
    trainer.train()
    assert len(batches) == 2
    assert_batches_route_their_tokens(trainer.model, batches)


def test_dynamic_sampling_stacks_rounds_of_other_widths_with_their_routes():
    from grpo_hf.rollout.dynamic import stack_rows

    def part(P, T, value):
        return {"prompt_ids": torch.ones(1, P, dtype=torch.long), "completion_ids": torch.ones(1, T, dtype=torch.long),
                "routes": torch.full((1, P + T, 1, 1), value, dtype=torch.int16)}  # fmt: skip

    stacked = stack_rows([part(2, 3, 5), part(4, 1, 7)], pad_token_id=0)
    assert stacked["routes"][:, :, 0, 0].tolist() == [[-1, -1, 5, 5, 5, 5, 5], [7, 7, 7, 7, 7, -1, -1]]


@pytest.mark.parametrize("name", ["continuous_batching", "cuda_graph"])
def test_routing_replay_with_an_engine_that_cannot_record_is_refused_when_the_trainer_is_built(
    tmp_path, tokenizer, name
):
    from conftest import make_trainer, tiny_run_args

    args = tiny_run_args(tmp_path, rollout_engine=name, router_replay="r3")
    with pytest.raises(ValueError, match=f"rollout_engine={name!r} cannot record the MoE routes"):
        make_trainer(args, tokenizer=tokenizer, model=moe_model(tokenizer))


def test_two_processes_gather_and_stack_dynamic_sampling_rounds_with_their_routes(tmp_path):
    """2 gloo processes (`tests/distributed/routes_step.py`): refill rounds of other widths gathered across the
    processes and stacked; every micro-batch each process trained on carries its own tokens' routes, and the run
    replaying them (r3) logs no route mismatch and no log-prob gap on either process."""
    import json

    from conftest import torchrun

    torchrun("routes_step.py", tmp_path, processes=2)
    results = [json.loads((tmp_path / f"rank_{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["checked"] and r["batches"] >= 1 for r in results)
    assert results[0]["extra_rounds"] >= 1  # a refill round was gathered and stacked
    for result in results:  # r3 on both processes: the weights that sampled, the same experts, the same log-probs
        router = result["router"]
        assert router["router/route_mismatch"] == 0.0 and router["router/token_mismatch"] == 0.0
        assert router["router/logp_gap"] < 1e-5


def test_a_checkpoint_keeps_the_routes_of_its_buffered_batches(tmp_path):
    """The trainer saves the batches it has not trained on yet as plain dicts (`_run_state`) and loads them with
    weights_only: int16 routes come back as they were."""
    from grpo_hf.checkpoint import load_run_state, save_run_state

    routes = torch.randint(-1, 4, (2, 5, 2, 2), dtype=torch.int16)
    batch = MicroBatch(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2, dtype=torch.long),
                       torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                       advantages=torch.zeros(2), routes=routes)  # fmt: skip
    save_run_state(str(tmp_path), 0, {"buffer": [vars(batch)]})
    (loaded,) = [MicroBatch(**part) for part in load_run_state(str(tmp_path), 0, torch.device("cpu"))["buffer"]]
    assert loaded.routes.dtype == torch.int16 and torch.equal(loaded.routes, routes)


class _NoRoutesEngine(RolloutEngine):
    """An engine of one's own that records no routes (`can_record_routes` False): each row samples 3 fixed tokens."""

    name = "no_routes"

    def sample(self, model, prompt_ids, prompt_mask):
        return torch.full((prompt_ids.size(0), 3), 40, dtype=torch.long, device=prompt_ids.device)


def test_an_engine_that_cannot_record_records_nothing_with_replay_off_and_is_refused_with_it_on(
    tmp_path, tokenizer, monkeypatch
):
    from conftest import TRAINING, make_trainer, tiny_run_args

    monkeypatch.setitem(ENGINES, "no_routes", _NoRoutesEngine)
    args = tiny_run_args(tmp_path, preset=TRAINING, rollout_engine="no_routes")
    trainer = make_trainer(args, tokenizer=tokenizer, model=moe_model(tokenizer))
    batches = capture_batches(monkeypatch)
    trainer.experience.train_batches([row for row in trainer.train_dataset.select(range(1)) for _ in range(4)])
    assert (
        batches
        and all(batch.routes is None for batch in batches)
        and not trainer.experience.sampler.engine.record_routes
    )
    with pytest.raises(ValueError, match="rollout_engine='no_routes' cannot record the MoE routes"):
        make_trainer(tiny_run_args(tmp_path, preset=TRAINING, rollout_engine="no_routes", router_replay="r3"),
                     tokenizer=tokenizer, model=moe_model(tokenizer))  # fmt: skip


class _EmptyEngine(RolloutEngine):
    """Samples nothing (a completion of 0 tokens) and leaves the routes of the prompts it read: [N, P, 1, 1]."""

    name = "empty"
    can_record_routes = True

    def sample(self, model, prompt_ids, prompt_mask):
        self.sampling_routes = torch.arange(prompt_ids.numel(), dtype=torch.int16).reshape(*prompt_ids.shape, 1, 1)
        return prompt_ids[:, :0]


def test_an_empty_completion_keeps_the_prompts_routes_and_one_column_of_none():
    engine = _EmptyEngine(generation_config(4), EOS)
    engine.record_routes = True
    prompt_ids, prompt_mask = prompts(G=1)
    out = engine.generate(build("qwen3_moe"), prompt_ids, prompt_mask)
    assert out.completion_ids.shape == (3, 1) and engine.sampling_routes.shape == (3, 8, 1, 1)
    expected = torch.arange(21, dtype=torch.int16).reshape(3, 7).masked_fill(prompt_mask == 0, NO_ROUTE)
    assert torch.equal(engine.sampling_routes[:, :7, 0, 0], expected)
    assert bool((engine.sampling_routes[:, 7] == NO_ROUTE).all())
