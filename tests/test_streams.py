"""Streams (`datasets.IterableDataset`, e.g. `load_dataset(..., streaming=True)`) as train and eval datasets:
`RepeatedStream` keeps the sampler's order, a run on a stream equals the run on the same rows as a `datasets.Dataset`
(1 and 2 processes), and what a stream needs from the config is checked up front."""

import itertools
import logging

import pytest
import torch
from conftest import (
    TRAINING,
    assert_same_step,
    build_tiny_model,
    id_sum_reward,
    make_dataset,
    make_trainer,
    tiny_run_args,
)
from datasets import Dataset, IterableDatasetDict

from grpo_hf import GRPOTrainer
from grpo_hf.rollout import RepeatedStream, RepeatSampler


def prompts_of(rows) -> list[str]:
    return [row["prompt"] for row in rows]


def test_repeated_stream_is_the_samplers_order():
    dataset = make_dataset(7)
    for G, per_batch, repeats in [(2, 3, 2), (1, 1, 1), (3, 2, 3), (4, 7, 1)]:
        sampler = RepeatSampler(7, G, per_batch, repeat_count=repeats, shuffle=False)
        expected = [dataset[i]["prompt"] for i in sampler]
        stream = RepeatedStream(dataset.to_iterable_dataset(), G, per_batch, repeat_count=repeats)
        assert prompts_of(stream) == expected
        # the rule, written out: batches of `per_batch` prompts, each copied G times, the batch `repeats` times
        naive = []
        for start in range(0, 7 - per_batch + 1, per_batch):
            batch = [p for p in prompts_of(dataset)[start : start + per_batch] for _ in range(G)]
            naive += batch * repeats
        assert expected == naive
    rows = list(RepeatedStream(make_dataset(2, answer=["x", "y"]).to_iterable_dataset(), 2))
    assert rows[0] == rows[1] and rows[0] is not rows[1]  # copies, with every column


def test_repeated_stream_shuffles_with_each_epoch():
    stream = RepeatedStream(make_dataset(12).to_iterable_dataset().shuffle(seed=0, buffer_size=12), 3, 2)
    stream.set_epoch(0)
    first = prompts_of(stream)
    stream.set_epoch(1)
    second = prompts_of(stream)
    stream.set_epoch(1)
    assert prompts_of(stream) == second  # deterministic for an epoch
    assert first != second and sorted(first) == sorted(second)
    assert all(len(set(second[k : k + 3])) == 1 for k in range(0, 36, 3))  # a group's copies stay together


def test_a_cycling_stream_goes_from_pass_to_pass_and_fails_loudly_when_empty():
    """Training streams cycle: pass k is read with the stream's epoch + k (its shuffle), leftovers dropped per pass,
    without end (Trainer stops at max_steps and, on resume, skips the batches it trained on in its one epoch)."""
    shuffled = make_dataset(5).to_iterable_dataset().shuffle(seed=0, buffer_size=5)
    stream = RepeatedStream(shuffled, 1, 2, cycle=True)
    stream.set_epoch(3)
    served = list(itertools.islice(iter(stream), 12))  # 3 passes of 2 batches of 2 (the 5th prompt left over)
    expected = []
    for epoch in (3, 4, 5):
        shuffled.set_epoch(epoch)
        expected += prompts_of(shuffled)[:4]
    assert prompts_of(served) == expected and expected[:4] != expected[4:8]
    with pytest.raises(ValueError, match=r"The stream's pass 1 held fewer prompts than one generation batch takes"):
        next(iter(RepeatedStream(make_dataset(1).to_iterable_dataset(), 2, 2, cycle=True)))


def train_recording_prompts(tmp_path, tokenizer, train_dataset, **overrides):
    seen: list[list[str]] = []

    def reward(prompts, completion_ids, **kwargs):
        seen.append(list(prompts))
        return id_sum_reward(completion_ids)

    args = tiny_run_args(tmp_path, TRAINING, **{"shuffle_dataset": False, "beta": 0.04, **overrides})
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer, seed=3), reward, args, train_dataset=train_dataset, processing_class=tokenizer
    )
    torch.manual_seed(0)
    trainer.train()
    return trainer, seen


def test_a_run_on_a_stream_equals_the_run_on_the_dataset(tmp_path, tokenizer):
    """4 prompts, 2 per generation batch served to 2 micro-steps, 5 steps: the stream runs past its end into a second
    pass, and every step sees the prompts the map-style run does. Within the first pass the two runs are the same
    run (losses, gradient norms, weights); past it they draw different samples, because the DataLoader draws a seed
    from the global RNG each time a new pass over the dataset starts, and the stream's passes are one endless
    Trainer epoch (`RepeatedStream(cycle=True)`)."""
    settings = dict(max_steps=5, per_device_train_batch_size=2, num_generations=2, steps_per_generation=2)
    dataset = make_dataset(4)
    mapped, mapped_prompts = train_recording_prompts(tmp_path / "map", tokenizer, dataset, **settings)
    streamed, stream_prompts = train_recording_prompts(
        tmp_path / "stream", tokenizer, dataset.to_iterable_dataset(), **settings
    )
    assert stream_prompts == mapped_prompts and len(stream_prompts) == 3  # rollouts at steps 1, 3 and 5
    assert stream_prompts[0] == [dataset[0]["prompt"]] * 2 + [dataset[1]["prompt"]] * 2
    assert streamed.state.global_step == 5

    def first_pass(trainer):
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h][:4]

    assert first_pass(streamed) == first_pass(mapped)
    settings["max_steps"] = 4
    mapped, _ = train_recording_prompts(tmp_path / "map4", tokenizer, dataset, **settings)
    streamed, _ = train_recording_prompts(tmp_path / "stream4", tokenizer, dataset.to_iterable_dataset(), **settings)
    for (name, p), q in zip(streamed.model.named_parameters(), mapped.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_a_shuffled_stream_keeps_groups_together(tmp_path, tokenizer):
    stream = make_dataset(8).to_iterable_dataset()
    _, seen = train_recording_prompts(tmp_path, tokenizer, stream, shuffle_dataset=True, max_steps=3)
    groups = [tuple(prompts[k : k + 4]) for prompts in seen for k in range(0, len(prompts), 4)]
    assert len(groups) == 3 and all(len(set(group)) == 1 for group in groups)
    assert [group[0] for group in groups] != prompts_of(make_dataset(3))  # shuffled (seed 0)


@pytest.mark.parametrize("case", ["grpo-1-fast", "dapo-2-fast"])
def test_two_processes_on_a_stream_match_one_process_on_the_dataset(distributed_steps, case):
    """accelerate hands each process its share of each batch of the stream (`dispatch_batches=False`), as the sampler
    does for a dataset: same advantages, loss and update."""
    assert_same_step(distributed_steps[1][case], distributed_steps[2][f"{case}-stream"])


def test_evaluate_on_streams_equals_evaluate_on_datasets(tmp_path, tokenizer):
    args = tiny_run_args(tmp_path, TRAINING, per_device_eval_batch_size=4, beta=0.04)
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer), id_sum_reward, args, train_dataset=make_dataset(), processing_class=tokenizer
    )

    def evaluate(eval_dataset):
        torch.manual_seed(0)
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
        return {k: v for k, v in metrics.items() if not k.endswith(("_runtime", "_per_second"))}

    dataset = make_dataset(3)
    on_dataset = evaluate(dataset)
    on_stream = evaluate(dataset.to_iterable_dataset())
    # the same completions and rewards; the loss (about 1e-8 on-policy) up to float rounding
    assert on_stream.pop("eval_loss") == pytest.approx(on_dataset.pop("eval_loss"), abs=1e-7)
    assert on_stream == on_dataset and on_dataset["eval_reward"] > 0
    splits = evaluate(IterableDatasetDict({"a": dataset.to_iterable_dataset(), "b": dataset.to_iterable_dataset()}))
    assert splits["eval_a_reward"] == on_dataset["eval_reward"] and "eval_b_loss" in splits


def test_a_stream_gets_one_loader_worker_and_no_dispatching(tmp_path, tokenizer, caplog):
    stream = make_dataset().to_iterable_dataset()
    with caplog.at_level(logging.WARNING, logger="grpo_hf.validation"):
        args = tiny_run_args(tmp_path, TRAINING, dataloader_num_workers=2)
        trainer = make_trainer(args, id_sum_reward, stream, tokenizer=tokenizer)
    assert "dataloader_num_workers=2 does not apply to it" in caplog.text
    assert trainer.get_train_dataloader().num_workers == 0
    assert trainer.accelerator.dataloader_config.dispatch_batches is False
    # the config is the user's, as built: the trainer's loader settings are its own
    assert trainer.args.dataloader_num_workers == 2 and trainer.args.accelerator_config.dispatch_batches is None

    # an eval stream: its own loader reads with one worker; the map-style train set keeps its workers
    args = tiny_run_args(tmp_path, TRAINING, dataloader_num_workers=2, per_device_eval_batch_size=4)
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer),
        id_sum_reward,
        args,
        train_dataset=make_dataset(),
        eval_dataset=make_dataset(2).to_iterable_dataset(),
        processing_class=tokenizer,
    )
    assert trainer.get_train_dataloader().num_workers == 2
    assert trainer.get_eval_dataloader().num_workers == 0
    assert trainer.args.dataloader_num_workers == 2


@pytest.mark.parametrize(
    ("stream", "overrides", "error", "message"),
    [
        (make_dataset(), dict(max_steps=-1), ValueError, r"train_dataset is a stream .* Set max_steps"),
        (
            make_dataset(),
            dict(accelerator_config={"dispatch_batches": True}),
            ValueError,
            r"Iterable datasets require `dispatch_batches=False`: train_dataset is a stream",
        ),
        (make_dataset(), dict(dynamic_sampling=True), ValueError, r"dynamic_sampling draws extra prompts"),
        (make_dataset(1), dict(num_generations=2), ValueError, r"train_dataset streams 1 prompts but one .* takes 2"),
        (make_dataset().filter(lambda row: False), {}, ValueError, r"train_dataset is an empty stream"),
        (Dataset.from_dict({"question": ["a", "b"]}), {}, ValueError, r"train_dataset has no 'prompt' column"),
        (
            Dataset.from_dict({"prompt": ["a", "b", "  "]}),
            {},
            ValueError,
            r"train_dataset row 2: 'prompt' is empty",
        ),
    ],
    ids=["no max_steps", "dispatch_batches", "dynamic sampling", "too short", "empty", "no prompt", "empty prompt"],
)
def test_what_a_stream_needs_is_checked_up_front(tmp_path, tokenizer, stream, overrides, error, message):
    with pytest.raises(error, match=message):
        stream = stream.to_iterable_dataset() if len(stream) else empty()
        make_trainer(tiny_run_args(tmp_path, TRAINING, **overrides), id_sum_reward, stream, tokenizer=tokenizer)


def empty():
    return make_dataset().to_iterable_dataset().filter(lambda row: False)


def test_a_stream_given_to_evaluate_is_checked_like_one_given_at_construction(tmp_path, tokenizer):
    args = tiny_run_args(
        tmp_path, TRAINING, per_device_eval_batch_size=4, accelerator_config={"dispatch_batches": True}
    )
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer), id_sum_reward, args, train_dataset=make_dataset(), processing_class=tokenizer
    )
    with pytest.raises(ValueError, match=r"Iterable datasets require `dispatch_batches=False`: eval_dataset"):
        trainer.evaluate(eval_dataset=make_dataset(2).to_iterable_dataset())
    trainer.args.accelerator_config.dispatch_batches = False
    with pytest.raises(ValueError, match=r"eval_dataset row 1: 'prompt' is empty"):
        trainer.evaluate(eval_dataset=Dataset.from_dict({"prompt": ["a", ""]}).to_iterable_dataset())
