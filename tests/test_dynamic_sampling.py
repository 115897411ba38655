"""DAPO's dynamic sampling: the group filter, the pool of kept groups, fresh prompts, and the trainer end to end
(1 process in-process; 1 and 2 gloo processes under torchrun)."""

import json
import logging
import math

import pytest
import torch
from conftest import torchrun
from datasets import Dataset, IterableDataset
from distributed.dynamic_sampling_step import G, build_trainer

from grpo_hf import GRPOConfig
from grpo_hf.rollout.dynamic import FreshPrompts, GroupPool, groups_with_signal, prompt_key


def naive_has_signal(group: list[float]) -> bool:
    values = [v for v in group if not math.isnan(v)]
    return len(values) >= 2 and any(v != values[0] for v in values)


def test_groups_with_signal_matches_a_loop_over_groups():
    generator = torch.Generator().manual_seed(0)
    total = torch.randint(0, 3, (400,), generator=generator).float()  # many all-equal groups among 100 of 4
    total[torch.rand(400, generator=generator) < 0.2] = float("nan")
    total[:4] = torch.tensor([0.1, 0.1, 0.1, 0.1])  # equal, and 0.1 * 4 / 4 != 0.1 in float: still no signal
    total[4:8] = torch.tensor([float("nan"), 2.0, float("nan"), float("nan")])  # a single reward: no signal
    expected = [naive_has_signal(total[i : i + 4].tolist()) for i in range(0, 400, 4)]
    assert groups_with_signal(total, 4).tolist() == expected
    assert 10 < sum(expected) < 90  # both kinds are exercised


def _round(prompt_width: int, completion_width: int, totals: list[float], tag: str) -> dict:
    n = len(totals)
    return {
        "prompt_ids": torch.full((n, prompt_width), 7),
        "prompt_mask": torch.ones(n, prompt_width, dtype=torch.long),
        "completion_ids": torch.full((n, completion_width), 9),
        "completion_mask": torch.ones(n, completion_width, dtype=torch.long),
        "rewards": torch.tensor(totals).unsqueeze(1),
        "prompts": [f"{tag}{i // 2}" for i in range(n)],
        "total": torch.tensor(totals),
    }


def test_group_pool_keeps_groups_with_signal_in_arrival_order_and_pads_rounds_to_one_width():
    pool = GroupPool(num_groups=3, num_generations=2)
    pool.add(_round(3, 2, [1.0, 1.0, 0.0, 1.0, 5.0, 5.0], "a"))  # groups a0 (flat), a1 (kept), a2 (flat)
    assert (pool.num_kept, pool.num_dropped, pool.full) == (1, 2, False)
    pool.add(_round(5, 4, [2.0, 3.0, 4.0, 4.0, 0.0, 1.0], "b"))  # b0 kept, b1 flat, b2 kept
    assert (pool.num_kept, pool.num_dropped, pool.full) == (3, 3, True)
    assert pool.seen == {"a0", "a1", "a2", "b0", "b1", "b2"}
    rows, kept = pool.batch(pad_token_id=0)
    assert rows["prompts"] == ["a1", "a1", "b0", "b0", "b2", "b2"]
    assert kept.tolist() == [True] * 6
    assert rows["total"].tolist() == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0]
    # Round a's rows are padded to round b's widths: prompts on the left, completions on the right.
    assert rows["prompt_ids"][0].tolist() == [0, 0, 7, 7, 7] and rows["prompt_mask"][0].tolist() == [0, 0, 1, 1, 1]
    assert rows["completion_ids"][0].tolist() == [9, 9, 0, 0] and rows["completion_mask"][0].tolist() == [1, 1, 0, 0]
    assert rows["prompt_ids"][2].tolist() == [7] * 5


def test_group_pool_fills_an_unfinished_batch_with_dropped_groups_flagged_not_kept():
    pool = GroupPool(num_groups=3, num_generations=2)
    pool.add(_round(2, 2, [1.0, 1.0, 0.0, 1.0, 5.0, 5.0], "a"))
    rows, kept = pool.batch(pad_token_id=0)
    assert rows["prompts"] == ["a1", "a1", "a0", "a0", "a2", "a2"]
    assert kept.tolist() == [True, True, False, False, False, False]


def test_fresh_prompts_are_deterministic_skip_prompts_seen_and_repeat_only_after_the_whole_dataset():
    dataset = Dataset.from_dict({"prompt": [f"p{i}" for i in range(6)]})
    first = [row["prompt"] for row in FreshPrompts(dataset, seed=3, step=7).take(6, set())]
    again = [row["prompt"] for row in FreshPrompts(dataset, seed=3, step=7).take(6, set())]
    other_step = [row["prompt"] for row in FreshPrompts(dataset, seed=3, step=8).take(6, set())]
    assert first == again and sorted(first) == [f"p{i}" for i in range(6)] and other_step != first
    fresh = FreshPrompts(dataset, seed=3, step=7)
    seen = {"p0", "p1", "p2"}
    taken = [row["prompt"] for row in fresh.take(3, seen)]
    assert sorted(taken) == ["p3", "p4", "p5"]  # the unseen ones first
    assert len(fresh.take(2, seen | set(taken))) == 2  # then, the dataset exhausted, repeats
    assert prompt_key([{"role": "user", "content": "x"}]) == prompt_key([{"content": "x", "role": "user"}])


def _buffer_rows(trainer) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    prompt_ids = torch.cat([part.prompt_ids for part in trainer._buffer])
    prompt_mask = torch.cat([part.prompt_mask for part in trainer._buffer])
    decode = trainer.processing_class.decode
    prompts = [decode(ids[mask.bool()]) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    advantages = torch.cat([part.advantages for part in trainer._buffer])
    tokens = torch.cat([part.completion_mask.sum(dim=1) for part in trainer._buffer])
    return prompts, advantages, tokens


def test_only_groups_with_signal_are_trained_on_with_their_own_group_advantages(tmp_path):
    """Half the prompts are flat: their groups are dropped and fresh prompts fill the batch; the trained rows are
    all 'varied' and their advantages are (r - mean) / (std + 1e-4) of their own group."""
    kinds = ["flat" if i % 2 == 0 else "varied" for i in range(12)]
    trainer = build_trainer(str(tmp_path), max_rounds=4, kinds=kinds)
    seen = []
    scorer = trainer.reward_funcs[0]

    def reward(prompts, **kwargs):
        seen.append(list(prompts))
        return scorer(prompts=prompts, **kwargs)

    trainer.reward_funcs[0] = reward
    trainer.train()

    prompts, advantages, tokens = _buffer_rows(trainer)
    assert len(prompts) == 16 and all(p.endswith("varied") for p in prompts)
    assert len(set(prompts)) == 4  # four distinct prompts: no group twice
    assert (tokens > 0).all()
    logged = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [row["prompt"] for row in logged] == prompts
    torch.testing.assert_close(torch.tensor([row["advantage"] for row in logged]), advantages)
    rewards = torch.tensor([row["rewards"]["reward"] for row in logged])
    for g in range(4):
        group = rewards[g * G : (g + 1) * G]
        expected = (group - group.mean()) / (group.std() + 1e-4)
        torch.testing.assert_close(advantages[g * G : (g + 1) * G], expected, rtol=0, atol=1e-5)

    logs = next(h for h in trainer.state.log_history if "loss" in h)
    assert logs["dynamic_sampling/extra_rounds"] == trainer.num_generate_calls - 1 == len(seen) - 1 >= 1
    flat_groups = sum(p.endswith("flat") for batch in seen for p in batch[::G])
    assert logs["dynamic_sampling/dropped_groups"] == flat_groups >= 2
    assert logs["dynamic_sampling/unfilled_groups"] == 0
    assert logs["frac_reward_zero_std"] > 0  # the rollout metrics describe every group generated


def test_when_rounds_run_out_the_step_trains_only_on_the_kept_groups(tmp_path):
    """max_rounds=0 keeps the 2 varied groups of 4 and fills with the 2 flat ones, masked out: the update equals a
    run on the 2 varied prompts alone (dapo normalises by the kept tokens)."""
    kinds = ["flat", "varied", "flat", "varied"]
    dynamic = build_trainer(str(tmp_path / "d"), max_rounds=0, kinds=kinds)
    before = [p.detach().clone() for p in dynamic.model.parameters()]
    dynamic.train()
    prompts, advantages, tokens = _buffer_rows(dynamic)
    flat = torch.tensor([p.endswith("flat") for p in prompts])
    assert flat.sum() == 8 and (tokens[flat] == 0).all() and (advantages[flat] == 0).all()
    assert (tokens[~flat] > 0).all() and advantages[~flat].abs().sum() > 0
    logs = next(h for h in dynamic.state.log_history if "loss" in h)
    assert (logs["dynamic_sampling/unfilled_groups"], logs["dynamic_sampling/extra_rounds"]) == (2, 0)
    assert any(not torch.equal(p, q) for p, q in zip(dynamic.model.parameters(), before, strict=True))

    plain = build_trainer(str(tmp_path / "p"), 0, kinds, dynamic_sampling=False, per_device_train_batch_size=8)
    plain.train_dataset = plain.train_dataset.select([1, 3])
    plain.train()
    for (name, p), q in zip(dynamic.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_batch_with_no_signal_after_every_round_warns_and_leaves_the_weights(tmp_path, caplog):
    trainer = build_trainer(str(tmp_path), max_rounds=2, kinds=["flat"] * 8)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with caplog.at_level(logging.WARNING, logger="grpo_hf"):
        trainer.train()
    assert any(
        "0 of 4 groups" in r.getMessage() and "dynamic_sampling_max_rounds" in r.getMessage() for r in caplog.records
    )
    logs = next(h for h in trainer.state.log_history if "loss" in h)
    assert (logs["dynamic_sampling/unfilled_groups"], logs["dynamic_sampling/extra_rounds"]) == (4, 2)
    assert logs["dynamic_sampling/dropped_groups"] == 12 and logs["loss"] == 0.0
    assert all(torch.equal(p, q) for p, q in zip(trainer.model.parameters(), before, strict=True))


def test_dynamic_sampling_settings_are_checked(tmp_path):
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds=-1 must be an int >= 0"):
        GRPOConfig(output_dir=str(tmp_path), dynamic_sampling_max_rounds=-1, per_device_train_batch_size=8)
    trainer = build_trainer(str(tmp_path), 1, ["flat"] * 4)
    stream = IterableDataset.from_generator(lambda: iter([{"prompt": "p", "kind": "flat"}]))
    with pytest.raises(ValueError, match="dynamic_sampling draws extra prompts from train_dataset by index"):
        tokenizer = trainer.processing_class
        type(trainer)(trainer.model, trainer.reward_funcs, trainer.args, stream, processing_class=tokenizer)


ROUNDS = [4, 0]


def _launch(out_dir, num_processes: int) -> dict[int, dict]:
    """Every `ROUNDS` setting trained in one torchrun launch of `num_processes` processes: {max_rounds: its step}."""
    torchrun("dynamic_sampling_step.py", out_dir, *ROUNDS, processes=num_processes)
    return {r: torch.load(out_dir / f"rounds_{r}.pt") for r in ROUNDS}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[int, dict[int, dict]]:
    return {n: _launch(tmp_path_factory.mktemp(f"dynamic_{n}"), n) for n in (1, 2)}


@pytest.mark.parametrize("max_rounds", ROUNDS)
def test_two_processes_keep_the_same_groups_and_make_the_same_update_as_one(layouts, max_rounds):
    """Each process holds half of every group's rows; both must keep the same groups, make the same number of
    rounds (no hang), and train the same update as one process."""
    one, two = layouts[1][max_rounds], layouts[2][max_rounds]
    assert one["rows"] == two["rows"]
    assert sum(1 for prompt, _, advantage in one["rows"] if advantage != 0) > 0
    for key in ("dropped_groups", "extra_rounds", "unfilled_groups"):
        assert one["logs"][f"dynamic_sampling/{key}"] == two["logs"][f"dynamic_sampling/{key}"]
    assert (one["logs"]["dynamic_sampling/unfilled_groups"] > 0) is (max_rounds == 0)
    assert two["logs"]["loss"] == pytest.approx(one["logs"]["loss"], rel=1e-5, abs=1e-7)
    for name, value in one["params"].items():
        torch.testing.assert_close(two["params"][name], value, rtol=1e-5, atol=1e-6)
