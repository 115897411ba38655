"""Tools, environments and multi-turn episodes (TRL 1.16's `tools=` / `environment_factory=`), offline.

The episodes run on grpo_hf's engines. Where a test needs the model to call tools, a scripted engine (registered here)
writes each turn from the conversation so far, as a model that has learned the format would; where a test checks what
a real engine sampled, the real engine samples and only the reading of its turn is scripted (`EpisodeRunner.parse`).
The tokenizer is the byte-level one of `conftest` with TRL's Qwen2.5 chat template, which renders tools.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import trl
from conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset

from grpo_hf import GRPOConfig, GRPOTrainer
from grpo_hf.core import SamplingCorrection
from grpo_hf.logprobs import completion_logps
from grpo_hf.rollout import RolloutEngine, register_engine
from grpo_hf.rollout import tools as tools_module
from grpo_hf.rollout.batching import pad_token_lists
from grpo_hf.rollout.tools import ToolCaller, tool_reply_ids

QWEN_TEMPLATE = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()


def tool_tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


def call(tool: str, **arguments) -> str:
    """A turn that calls `tool`, as the Qwen2.5 template writes it."""
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call><|im_end|>"


class ScriptedEngine(RolloutEngine):
    """Writes each row's turn with `ScriptedEngine.script(context text, row) -> text`; logs each call's contexts."""

    name = "scripted"
    script = None
    calls: list[list[str]] = []

    def sample(self, model, prompt_ids, prompt_mask):
        tokenizer = ScriptedEngine.tokenizer
        contexts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
        ScriptedEngine.calls.append(contexts)
        texts = [type(self).script(context, row) for row, context in enumerate(contexts)]
        rows = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        rows = [ids[: self.generation_config.max_new_tokens] for ids in rows]
        return pad_token_lists(rows, self.generation_config.pad_token_id, left=False)[0].to(prompt_ids.device)


register_engine("scripted", ScriptedEngine)


def scripted(script, tokenizer):
    ScriptedEngine.script, ScriptedEngine.tokenizer, ScriptedEngine.calls = staticmethod(script), tokenizer, []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def async_add(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0.01)
    return a + b


def fail(reason: str) -> str:
    """Always raise.

    Args:
        reason: Why.
    """
    raise RuntimeError(reason)


def args_for(tmp_path, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=160,
        max_prompt_length=None,
        max_steps=1,
        beta=0.0,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        rollout_engine="scripted",
    )
    return GRPOConfig(**{**settings, **overrides})


def sums_dataset(n: int = 2) -> Dataset:
    prompts = [[{"role": "user", "content": f"What is {k} + {k + 3}?"}] for k in range(n)]
    return Dataset.from_dict({"prompt": prompts, "answer": [str(2 * k + 3) for k in range(n)]})


def answer_after_tools(context: str, row: int) -> str:
    """Even rows (of an engine call) call `add` with the question's numbers and answer with its reply; odd rows
    answer at once (wrong)."""
    a, b = map(int, re.findall(r"What is (\d+) \+ (\d+)\?", context)[-1])
    replies = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.S)
    if replies:
        return f"Answer: {replies[-1]}<|im_end|>"
    return "Answer: 0<|im_end|>" if row % 2 == 1 else call("add", a=a, b=b)


def last_answer(completions, answer, **_):
    return [float(c[-1]["content"] == f"Answer: {a}") for c, a in zip(completions, answer, strict=True)]


def zero(completions, **_):
    return [0.0] * len(completions)


def trainer_for(tmp_path, tokenizer, *, reward_funcs=last_answer, dataset=None, seed=0, **kwargs) -> GRPOTrainer:
    config = kwargs.pop("args", None) or args_for(tmp_path)
    return GRPOTrainer(
        build_tiny_model(tokenizer, seed=seed),
        reward_funcs,
        config,
        train_dataset=sums_dataset() if dataset is None else dataset,
        processing_class=tokenizer,
        **kwargs,
    )


def one_rollout(trainer):
    """The micro-batches of one generation batch, and what the reward functions were shown."""
    rows = [row for row in trainer.train_dataset for _ in range(trainer.args.num_generations)]
    return trainer.experience.train_batches(rows[: trainer.args.generation_batch_size])


# ---- tools: the ids, the masks, the messages, the metrics ----------------------------------------------------------
def test_an_episode_is_sampled_turns_and_the_templates_reply_ids(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(answer_after_tools, tokenizer)
    seen = {}

    def reward(completions, **kwargs):
        seen["completions"] = completions
        return last_answer(completions, **kwargs)

    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=reward, tools=[add])
    (batch,) = one_rollout(trainer)

    turn1 = tokenizer(call("add", a=0, b=3), add_special_tokens=False)["input_ids"]
    reply = tool_reply_ids(tokenizer, [{"role": "tool", "name": "add", "content": "3"}], {})
    turn2 = tokenizer("Answer: 3<|im_end|>", add_special_tokens=False)["input_ids"]
    n = len(turn1) + len(reply) + len(turn2)
    assert batch.completion_ids[0, :n].tolist() == turn1 + reply + turn2  # the ids, never re-tokenised
    assert batch.completion_mask[0, :n].tolist() == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
    assert batch.context_mask[0, :n].tolist() == [0] * len(turn1) + [1] * len(reply) + [0] * len(turn2)
    assert batch.attention_mask[0, n:].sum() == 0
    odd = tokenizer("Answer: 0<|im_end|>", add_special_tokens=False)["input_ids"]
    assert batch.completion_mask[1].sum() == len(odd) and batch.context_mask[1].sum() == 0
    assert seen["completions"][0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 0, "b": 3}}}],
        },
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "Answer: 3"},
    ]
    assert seen["completions"][1] == [{"role": "assistant", "content": "Answer: 0"}]
    metrics = trainer._metrics["train"]
    assert metrics["tools/call_frequency"] == [0.5] and metrics["tools/failure_frequency"] == [0.0]
    model_tokens = batch.completion_mask.sum(dim=1).float()  # tool replies are not completion length
    assert metrics["completions/max_length"] == [model_tokens.max().item()]
    assert "<tools>" in ScriptedEngine.calls[0][0] and '"name": "add"' in ScriptedEngine.calls[0][0]  # the schema


def test_tools_train_and_log_trls_metrics(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(answer_after_tools, tokenizer)
    trainer = trainer_for(tmp_path, tokenizer, tools=[add])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] == 0.5 and logged["tools/failure_frequency"] == 0.0
    assert logged["reward"] == 0.5  # the tool users answer right, the others wrong
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_async_tools(tmp_path):
    tokenizer = tool_tokenizer()

    def script(context, row):
        return answer_after_tools(context, row).replace('"name": "add"', '"name": "async_add"')

    scripted(script, tokenizer)
    trainer = trainer_for(tmp_path, tokenizer, tools=[async_add])
    one_rollout(trainer)
    assert trainer._metrics["train"]["tools/call_frequency"] == [0.5]
    assert trainer._metrics["train"]["tools/failure_frequency"] == [0.0]
    assert trainer._metrics["train"]["reward"] == [0.5]


def test_malformed_tool_calls_become_error_replies(tmp_path):
    tokenizer = tool_tokenizer()
    bad_turns = [
        call("missing_tool", a=1),  # unknown tool
        call("add", a=1),  # a required argument missing
        call("add", a=1, b=2, c=3),  # an argument the tool does not take
        call("fail", reason="boom"),  # the tool raises
    ]
    replies = {}

    def script(context, row):
        found = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.S)
        if found:
            (which,) = [k for k, turn in enumerate(bad_turns) if turn in context]
            replies[which] = found[-1]
            return "done<|im_end|>"
        return bad_turns[row]  # the first turn: rows 0-3 of one engine call

    scripted(script, tokenizer)
    config = args_for(tmp_path, max_completion_length=400)  # room for the error replies
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[add, fail], args=config)
    (batch,) = one_rollout(trainer)
    errors = [json.loads(replies[row])["error"] for row in range(4)]
    assert "unknown tool 'missing_tool'" in errors[0]
    assert "wrong arguments" in errors[1] and "'b'" in errors[1]
    assert "wrong arguments" in errors[2] and "'c'" in errors[2]
    assert errors[3] == "RuntimeError: boom"
    assert trainer._metrics["train"]["tools/call_frequency"] == [1.0]
    assert trainer._metrics["train"]["tools/failure_frequency"] == [1.0]
    assert bool((batch.context_mask.sum(dim=1) > 0).all())  # each reply was read by the model


def test_a_turn_that_does_not_parse_is_text_and_ends_the_episode(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(lambda context, row: "<tool_call>\n{not json\n</tool_call><|im_end|>", tokenizer)
    seen = []

    def record(completions, **_):
        seen.extend(completions)
        return [0.0] * len(completions)

    trainer = trainer_for(
        tmp_path, tokenizer, reward_funcs=lambda completions, **_: seen.extend(completions) or [0.0] * 4, tools=[add]
    )
    (batch,) = one_rollout(trainer)
    assert len(ScriptedEngine.calls) == 1 and trainer._metrics["train"]["tools/call_frequency"] == [0.0]
    assert seen[0] == [{"role": "assistant", "content": "<tool_call>\n{not json\n</tool_call>"}]
    assert batch.context_mask.sum() == 0


# ---- concurrency: tools at once, turns without waiting for the slowest ----------------------------------------------
def test_the_tools_of_different_episodes_run_at_the_same_time(tmp_path):
    """Four episodes each call a tool that waits for the other three: done one after another, they would time out."""
    tokenizer = tool_tokenizer()
    barrier = threading.Barrier(4, timeout=10)

    def meet(name: str) -> str:
        """Wait for the others.

        Args:
            name: Who arrives.
        """
        barrier.wait()
        return "met"

    def script(context, row):
        return "ok<|im_end|>" if "<tool_response>" in context else call("meet", name=str(row))

    scripted(script, tokenizer)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[meet])
    one_rollout(trainer)
    assert trainer._metrics["train"]["tools/failure_frequency"] == [0.0]


def test_an_episode_whose_tool_returned_goes_on_while_a_slow_tool_runs(tmp_path):
    """Rows 0 and 1 call a tool that returns only once row 2's or 3's next turn has been sampled: the runner samples
    the turns of the episodes whose tools are done without waiting for the others."""
    tokenizer = tool_tokenizer()
    fast_turn_sampled = threading.Event()

    def slow(x: int) -> int:
        """Wait for a fast episode's next turn.

        Args:
            x: Any number.
        """
        if not fast_turn_sampled.wait(timeout=10):
            raise TimeoutError("no episode went on while this tool ran")
        return x

    def fast(x: int) -> int:
        """Return at once.

        Args:
            x: Any number.
        """
        return x

    def script(context, row):
        if "<tool_response>" in context:
            if "fast" in context.split("<|im_start|>user\nWhat")[-1]:
                fast_turn_sampled.set()
            return "ok<|im_end|>"
        return call("slow" if row < 2 else "fast", x=row)

    scripted(script, tokenizer)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[slow, fast])
    one_rollout(trainer)
    assert trainer._metrics["train"]["tools/failure_frequency"] == [0.0]
    called = r'"name": "(\w+)", "arguments"'  # a call, not a schema
    replied = [" ".join(re.findall(called, "".join(contexts))) for contexts in ScriptedEngine.calls[1:]]
    fast_calls = [k for k, names in enumerate(replied) if "fast" in names]
    slow_calls = [k for k, names in enumerate(replied) if "slow" in names]
    assert max(fast_calls) < min(slow_calls)  # the fast episodes' next turns, before the slow tools returned


class OneAtATime:
    """Tool calls that return one at a time, like real ones, but in an order a seeded generator decides: each call
    draws a latency when it starts, and each time the runner waits for tools (`ToolCaller.wait_any`) the call with the
    earliest start + latency on a virtual clock, and only it, returns. The first to return gives `first_reply`, the
    others `reply`. `turn_read()` counts the calls asked for (the runner starts each as soon as its turn is read)."""

    def __init__(self, caller, seed: int, first_reply: str, reply: str):
        self.rng, self.first_reply, self.reply = random.Random(seed), first_reply, reply
        self.condition = threading.Condition()
        self.running: list[tuple[float, threading.Event, dict]] = []  # (return time, its event, its reply)
        self.clock, self.asked, self.returned = 0.0, 0, 0
        self.wait_any, caller.wait_any = caller.wait_any, self.return_one

    def turn_read(self) -> None:
        with self.condition:
            self.asked += 1

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: What to look up.
        """
        event, box = threading.Event(), {}
        with self.condition:
            self.running.append((self.clock + self.rng.uniform(1.0, 10.0), event, box))
            self.condition.notify_all()
        event.wait(timeout=10)
        return box.get("reply", "never returned")

    def return_one(self, in_flight) -> None:
        with self.condition:  # every call asked for has started its thread
            assert self.condition.wait_for(lambda: len(self.running) + self.returned >= self.asked, timeout=10)
            first = min(self.running, key=lambda call: call[0])
            self.running.remove(first)
            self.clock = first[0]
            first[2]["reply"] = self.first_reply if self.returned == 0 else self.reply
            self.returned += 1
            first[1].set()
        self.wait_any(in_flight)


@pytest.mark.parametrize("engine", ["loop", "generate"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_rolled_back_reply_does_not_end_the_episodes_whose_tools_are_still_running(tmp_path, engine, seed):
    """Four episodes call a tool whose calls return one at a time; the first to return gives a reply too long for the
    budget, which is rolled back while the three other calls are still running. Those three still get their replies
    and their next turns (with `loop`, decoding went on waiting for them)."""
    tokenizer = tool_tokenizer()
    config = args_for(tmp_path, rollout_engine=engine, max_completion_length=120, temperature=1.0)
    shown = []

    def record(completions, **_):
        shown.extend(completions)
        return [0.0] * len(completions)

    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=record, args=config, tools=[add])
    sampler = with_eos_tokens(trainer, [i for i in range(len(tokenizer)) if i % 2 == 1])
    tools = OneAtATime(sampler.episodes.caller, seed, first_reply="x" * 400, reply="found")
    sampler.tools = [tools.lookup]

    def parse(tok, ids, context, row_tools):
        if "<tool_response>" in tok.decode(context):
            return {"role": "assistant", "content": "done"}
        tools.turn_read()
        return {"role": "assistant", "content": "", "tool_calls": [call_of("lookup", key="k")]}

    sampler.episodes.parse = parse
    torch.manual_seed(seed)
    (batch,) = one_rollout(trainer)
    roles = sorted([m["role"] for m in c] for c in shown)
    assert roles == [["assistant"]] + [["assistant", "tool", "assistant"]] * 3
    assert all(c[1]["content"] == "found" for c in shown if len(c) == 3)
    assert trainer._metrics["train"]["completions/clipped_ratio"] == [0.0]
    assert tools.returned == 4


@pytest.mark.parametrize("engine", ["loop", "generate"])
def test_the_episodes_of_a_seed_do_not_depend_on_how_long_the_tools_take(tmp_path, engine):
    """Eight episodes of up to three turns call a tool that sleeps a random few milliseconds, the sleeps drawn from
    a different seed in each of two rollouts: the tools return in a different order, so turns share engine calls
    (`generate`) or join the decoding batch (`loop`) differently. With the same training seed, every episode is the
    same token for token: each draws from its own stream."""
    tokenizer = tool_tokenizer()

    def rollout(latency_seed: int):
        latency = random.Random(latency_seed)

        def lookup(key: str) -> str:
            """Look a key up.

            Args:
                key: What to look up.
            """
            time.sleep(latency.uniform(0.0, 0.02))
            return f"value of {key}"

        config = args_for(
            tmp_path, rollout_engine=engine, per_device_train_batch_size=8, max_completion_length=120, temperature=1.0
        )
        trainer = trainer_for(
            tmp_path, tokenizer, reward_funcs=zero, tools=[lookup], args=config, dataset=sums_dataset(4)
        )
        sampler = with_eos_tokens(trainer, [i for i in range(len(tokenizer)) if i % 3 == 0])

        def parse(tok, ids, context, tools):
            if tok.decode(context).count("<tool_response>") >= 2:
                return {"role": "assistant", "content": "done"}
            return {"role": "assistant", "content": "", "tool_calls": [call_of("lookup", key=str(len(ids)))]}

        sampler.episodes.parse = parse
        torch.manual_seed(0)
        (batch,) = one_rollout(trainer)
        return batch.completion_ids, batch.completion_mask, torch.rand(1)

    ids, mask, after = rollout(latency_seed=1)
    ids_again, mask_again, after_again = rollout(latency_seed=2)
    assert ids.size(0) == 8 and int(mask.sum()) > 24  # eight episodes, their turns a few tokens each
    torch.testing.assert_close(ids_again, ids, rtol=0, atol=0)
    torch.testing.assert_close(mask_again, mask, rtol=0, atol=0)
    assert after_again == after  # the global generator too: the rollout drew one seed from it, the rest was forked


def test_a_tool_call_that_takes_too_long_becomes_an_error(tmp_path):
    tokenizer = tool_tokenizer()
    release = threading.Event()

    def hang(x: int) -> int:
        """Hang.

        Args:
            x: Any number.
        """
        release.wait(timeout=10)
        return x

    replies = []

    def script(context, row):
        found = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.S)
        if found:
            replies.append(json.loads(found[-1]))
            return "ok<|im_end|>"
        return call("hang", x=row)

    scripted(script, tokenizer)
    config = args_for(tmp_path, tool_timeout=0.2, max_completion_length=400)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[hang], args=config)
    try:
        one_rollout(trainer)
    finally:
        release.set()
    assert replies == [{"error": "tool 'hang' timed out after 0.2 seconds"}] * 4
    assert trainer._metrics["train"]["tools/failure_frequency"] == [1.0]


def calls_turn(*calls: str) -> str:
    """A turn that makes several calls, in order."""
    return "\n".join(c.removesuffix("<|im_end|>") for c in calls) + "<|im_end|>"


class Gate:
    """Holds every call that enters it until released, as a service that answers requests one at a time: once each
    of the `episodes` still calling has a call waiting (or `patience` seconds pass: then `stalled`), one waiting call,
    drawn by a seeded generator, is released after a latency drawn by it; and so on until `total` calls went through.
    Records ("start" | "end", episode, note) events and the most episodes that waited at once."""

    def __init__(self, seed: int, episodes: int, calls_each: int, patience: float = 10.0):
        self.rng, self.episodes, self.calls_each, self.patience = random.Random(seed), episodes, calls_each, patience
        self.changed = threading.Condition()
        self.waiting: list[tuple[object, int]] = []  # (ticket, episode)
        self.events: list[tuple[str, int, str]] = []
        self.widest, self.stalled = 0, False
        self.thread = threading.Thread(target=self._release_all, daemon=True)

    def wait(self, episode: int, note: str) -> None:
        with self.changed:
            ticket = object()
            self.events.append(("start", episode, note))
            self.waiting.append((ticket, episode))
            self.changed.notify_all()
            self.changed.wait_for(lambda: all(t is not ticket for t, _ in self.waiting), timeout=2 * self.patience)
            self.events.append(("end", episode, note))
            self.changed.notify_all()

    def _calling(self) -> int:
        ended: dict[int, int] = {}
        for kind, episode, _ in self.events:
            ended[episode] = ended.get(episode, 0) + (kind == "end")
        return self.episodes - sum(n == self.calls_each for n in ended.values())

    def _release_all(self) -> None:
        for _ in range(self.episodes * self.calls_each):
            with self.changed:
                if not self.changed.wait_for(lambda: len(self.waiting) >= self._calling(), timeout=self.patience):
                    self.stalled = True
                if not self.waiting:
                    return
                self.widest = max(self.widest, len({episode for _, episode in self.waiting}))
                pick = self.rng.randrange(len(self.waiting))
            time.sleep(self.rng.uniform(0.001, 0.01))  # the service's latency for this request
            with self.changed:
                self.waiting.pop(pick)
                self.changed.notify_all()


class Ledger:
    """A stateful environment whose tool reads its balance, waits on the test's `Gate`, then writes balance + 1."""

    gate: Gate | None = None

    def reset(self, **row):
        self.balance = 0

    def deposit(self, note: str) -> int:
        """Deposit one unit.

        Args:
            note: A label for the deposit.
        """
        seen = self.balance
        Ledger.gate.wait(id(self), note)
        self.balance = seen + 1
        return self.balance


def ledger_rollout(tmp_path, seed: int):
    """Four episodes, each depositing twice in one turn ("a" then "b") on its own `Ledger`; returns the instances
    the rewards saw and the replies each episode read."""
    tokenizer = tool_tokenizer()
    Ledger.gate = gate = Gate(seed, episodes=4, calls_each=2)

    def script(context, row):
        if "<tool_response>" in context:
            return "done<|im_end|>"
        return calls_turn(call("deposit", note="a"), call("deposit", note="b"))

    seen = {}

    def reward(completions, environments, **_):
        seen["environments"], seen["completions"] = environments, completions
        return [0.0] * len(completions)

    scripted(script, tokenizer)
    config = args_for(tmp_path, max_completion_length=400)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=reward, environment_factory=Ledger, args=config)
    gate.thread.start()
    one_rollout(trainer)
    gate.thread.join(timeout=30)
    return gate, seen


def test_the_calls_of_one_turn_run_one_after_another_in_call_order(tmp_path):
    """Two deposits in one turn on a ledger that reads, waits and writes: run in order they make 2 (at once, 1)."""
    gate, seen = ledger_rollout(tmp_path, seed=0)
    assert [ledger.balance for ledger in seen["environments"]] == [2, 2, 2, 2]
    for ledger in seen["environments"]:
        events = [(kind, note) for kind, who, note in gate.events if who == id(ledger)]
        assert events == [("start", "a"), ("end", "a"), ("start", "b"), ("end", "b")]
    for completion in seen["completions"]:
        assert [m["content"] for m in completion if m["role"] == "tool"] == ["1", "2"]  # the replies, in call order


def test_the_calls_of_different_episodes_wait_at_the_same_time(tmp_path):
    """The gate lets a call through only once every episode still calling has one waiting: the four episodes' calls
    wait together (one after another, the gate would stall)."""
    gate, _ = ledger_rollout(tmp_path, seed=1)
    assert not gate.stalled and gate.widest == 4
    starts = [k for k, (kind, _, note) in enumerate(gate.events) if kind == "start" and note == "a"]
    first_end = next(k for k, (kind, _, _) in enumerate(gate.events) if kind == "end")
    assert len(starts) == 4 and max(starts) < first_end  # every episode's first call began before any call ended


# ---- timeouts: a hung call's environment is retired, hung threads are counted and named -----------------------------
class Worker:
    """An environment whose tool may hang until the test lets it go; it then writes to the instance, late."""

    made = 0
    release = threading.Event()
    late_writes = threading.Semaphore(0)

    def __init__(self):
        Worker.made += 1
        self.notes = []

    def reset(self, **row):
        self.notes = []

    def work(self, hang: bool) -> str:
        """Do some work.

        Args:
            hang: Whether to hang until released.
        """
        if hang:
            Worker.release.wait(timeout=20)
            self.notes.append("late")  # after the timeout: the instance must no longer be anyone's
            Worker.late_writes.release()
            return "late"
        self.notes.append("work")
        return "ok"


def test_a_timed_out_call_retires_its_environment_and_its_late_write_lands_on_no_later_episode(
    tmp_path, monkeypatch, caplog
):
    """Rollout 1: episodes 0 and 1 hang past tool_timeout, 2 and 3 return. Their instances leave the pool, two new
    ones are made; the hung calls return during rollout 2 and write to their own (retired) instances only. With
    MAX_HUNG_CALLS = 1, the two hung calls are named in a warning."""
    monkeypatch.setattr(tools_module, "MAX_HUNG_CALLS", 1)
    Worker.release, Worker.late_writes = threading.Event(), threading.Semaphore(0)
    tokenizer = tool_tokenizer()
    rollout = {"k": 1}

    def script(context, row):
        if "<tool_response>" in context:
            return "done<|im_end|>"
        if rollout["k"] == 2:
            return call("work", hang=False)
        return call("work", hang=row < 2)

    seen = []

    def reward(completions, environments, **_):
        seen.append(list(environments))
        return [0.0] * len(completions)

    original_work = Worker.work

    def work_releasing(self, hang: bool) -> str:
        if rollout["k"] == 2 and not Worker.release.is_set():  # rollout 2's first call lets rollout 1's hung go
            Worker.release.set()
            for _ in range(2):
                assert Worker.late_writes.acquire(timeout=20)
        return original_work(self, hang)

    work_releasing.__name__, work_releasing.__doc__ = "work", Worker.work.__doc__
    monkeypatch.setattr(Worker, "work", work_releasing)
    scripted(script, tokenizer)
    config = args_for(tmp_path, tool_timeout=1.0, max_completion_length=400)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=reward, environment_factory=Worker, args=config)
    made = Worker.made
    caller = trainer.experience.sampler.episodes.caller
    try:
        with caplog.at_level(logging.WARNING, logger="grpo_hf.rollout.tools"):
            one_rollout(trainer)
        assert caller.hung_calls == 2
        rollout["k"] = 2
        one_rollout(trainer)
    finally:
        Worker.release.set()
    first, second = seen
    hung, returned = first[:2], first[2:]
    assert [w.notes for w in second] == [["work"]] * 4  # no late write on any instance of rollout 2
    assert [w.notes for w in hung] == [["late"]] * 2  # the late writes landed on the retired instances
    assert Worker.made == made + 3 + 2  # rollout 1: 3 beside the probe (4 at once); rollout 2: 2 for the retired
    assert {id(w) for w in returned} <= {id(w) for w in second}  # the instances whose calls returned: reused
    assert not {id(w) for w in hung} & {id(w) for w in second}  # the hung calls' instances were never handed out
    assert trainer._metrics["train"]["tools/work/timeouts"] == [2.0, 0.0]
    assert trainer._metrics["train"]["tools/work/failures"] == [2.0, 0.0]
    (warning,) = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
    assert warning.startswith("2 tool calls that timed out are still running in their threads ('work' x2)")
    deadline = time.monotonic() + 10
    while caller.hung_calls and time.monotonic() < deadline:  # their threads end once the calls return
        time.sleep(0.01)
    assert caller.hung_calls == 0


def test_a_timed_out_standalone_tool_is_counted_and_named(monkeypatch, caplog):
    """A plain function has no instance to retire; its hung thread is counted and named all the same."""
    monkeypatch.setattr(tools_module, "MAX_HUNG_CALLS", 2)
    release = threading.Event()

    def stuck(x: int) -> int:
        release.wait(timeout=20)
        return x

    caller = ToolCaller(timeout=0.05)
    try:
        with caplog.at_level(logging.WARNING, logger="grpo_hf.rollout.tools"):
            turns = [caller.submit([call_of("stuck", x=k)], {"stuck": stuck}) for k in range(3)]
            while waiting := [t for t in turns if not t.done(time.monotonic())]:
                caller.wait_any(waiting)
            stats = {}
            replies = [t.replies(stats)[0][0]["content"] for t in turns]
        assert replies == [json.dumps({"error": "tool 'stuck' timed out after 0.05 seconds"})] * 3
        assert caller.hung_calls == 3 and stats["stuck"].timeouts == 3 and stats["stuck"].returned == 0
        (warning,) = [r.getMessage() for r in caplog.records if "still running" in r.getMessage()]
        assert "('stuck' x3)" in warning
    finally:
        release.set()


def test_waiting_on_no_turn_returns_at_once():
    """Nothing could wake a wait on no turn: the main suite once hung forever on a list of the turns not yet done that
    came out empty because the last one timed out while it was built."""
    waiter = threading.Thread(target=ToolCaller(timeout=0.05).wait_any, args=([],), daemon=True)
    waiter.start()
    waiter.join(timeout=10)
    assert not waiter.is_alive()


def test_after_a_timeout_the_rest_of_the_turn_and_the_episodes_next_calls_wait_for_the_hung_call():
    """A turn [hang, record]: `hang` times out and `record` never runs; the episode's next turns, while `hang` still
    runs, run nothing either (the second one too, though the turn before it ran nothing); once it has returned, the
    next turn runs."""
    release, ran = threading.Event(), []

    def hang(x: int) -> int:
        release.wait(timeout=20)
        return x

    def record(x: int) -> int:
        ran.append(x)
        return x

    caller, tools = ToolCaller(timeout=0.5), {"hang": hang, "record": record}

    def finish(turn):
        caller.wait_any([turn])
        return turn.replies(stats)

    stats = {}
    try:
        first = caller.submit([call_of("hang", x=1), call_of("record", x=2)], tools)
        (timed_out, not_run), failures = finish(first)
        assert failures == 2 and json.loads(timed_out["content"])["error"].startswith("tool 'hang' timed out")
        not_run_error = json.loads(not_run["content"])["error"]
        assert not_run_error == "not run: the call of 'hang' before it in this turn timed out"
        second = caller.submit([call_of("record", x=3)], tools, after=first)
        (blocked,), _ = finish(second)
        assert "the earlier call of 'hang' in this episode timed out and is still running" in blocked["content"]
        third = caller.submit([call_of("record", x=4)], tools, after=second)  # still behind `hang`
        (blocked,), _ = finish(third)
        assert "the earlier call of 'hang' in this episode timed out and is still running" in blocked["content"]
    finally:
        release.set()
    while first.still_running():
        time.sleep(0.01)
    (ok,), failures = finish(caller.submit([call_of("record", x=5)], tools, after=third))
    assert ok["content"] == "5" and failures == 0 and ran == [5]
    assert (stats["hang"].calls, stats["hang"].timeouts) == (1, 1)
    assert (stats["record"].calls, stats["record"].failures) == (4, 3)


# ---- cancellation: a tool's CancelledError is its failed call -------------------------------------------------------
def cancelled_sync(x: int) -> int:
    """Give up.

    Args:
        x: Any number.
    """
    raise asyncio.CancelledError("gave up")


async def cancelled_async(x: int) -> int:
    """Give up.

    Args:
        x: Any number.
    """
    await asyncio.sleep(0.01)
    raise asyncio.CancelledError("gave up")


async def cancelled_inner(x: int) -> int:
    """Give up.

    Args:
        x: Any number.
    """
    task = asyncio.ensure_future(asyncio.sleep(10))
    asyncio.get_running_loop().call_later(0.01, task.cancel)
    return await task  # the awaited task is cancelled: CancelledError leaves this coroutine


@pytest.mark.parametrize("tool", [cancelled_sync, cancelled_async, cancelled_inner])
def test_a_tool_that_raises_cancelled_error_is_a_failed_call(tmp_path, tool):
    """Each episode's turn calls the cancelled tool, then `add`: the first is an error reply counted as a failure,
    the second still runs, and the rollout goes on."""
    tokenizer = tool_tokenizer()
    replies = []

    def script(context, row):
        found = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.S)
        if found:
            replies.append(found)
            return "done<|im_end|>"
        return calls_turn(call(tool.__name__, x=row), call("add", a=row, b=1))

    scripted(script, tokenizer)
    config = args_for(tmp_path, max_completion_length=400)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[tool, add], args=config)
    one_rollout(trainer)
    assert len(replies) == 4
    for cancelled, added in replies:
        assert json.loads(cancelled)["error"].startswith("CancelledError") and added.isdigit()
    metrics = trainer._metrics["train"]
    assert metrics[f"tools/{tool.__name__}/failures"] == [4.0] and metrics["tools/add/failures"] == [0.0]
    assert metrics["tools/failure_frequency"] == [0.5]


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_keyboard_interrupt_and_system_exit_from_a_tool_stop_the_run(tmp_path, error):
    def stop(x: int) -> int:
        """Stop.

        Args:
            x: Any number.
        """
        raise error()

    tokenizer = tool_tokenizer()
    scripted(lambda context, row: "done<|im_end|>" if "<tool_response>" in context else call("stop", x=1), tokenizer)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[stop])
    with pytest.raises(error):
        one_rollout(trainer)


# ---- per-tool metrics -----------------------------------------------------------------------------------------------
def test_per_tool_metrics_of_a_scripted_run(tmp_path, monkeypatch):
    """Each call's latency is read on a clock of its own thread, which `nap` advances by its argument (drawn by a
    seeded generator): the latency mean is exact. Episodes: [nap, nap] then answer; nap, then fail, then answer;
    fail then answer; answer at once: 2, 3, 2 and 1 turns."""
    clock = threading.local()
    monkeypatch.setattr(tools_module, "time", SimpleNamespace(monotonic=lambda: getattr(clock, "now", 0.0)))

    def nap(seconds: float) -> str:
        """Nap.

        Args:
            seconds: How long.
        """
        clock.now = getattr(clock, "now", 0.0) + seconds
        return "rested"

    rng = random.Random(3)
    naps = [round(rng.uniform(0.1, 2.0), 3) for _ in range(3)]
    tokenizer = tool_tokenizer()

    def script(context, row):
        replies = context.count("<tool_response>")
        if f'"seconds": {naps[2]}' in context and replies == 1:
            return call("fail", reason="no")
        if replies:
            return "done<|im_end|>"
        first = [calls_turn(call("nap", seconds=naps[0]), call("nap", seconds=naps[1])), call("nap", seconds=naps[2])]
        return [*first, call("fail", reason="no"), "done<|im_end|>"][row]

    scripted(script, tokenizer)
    config = args_for(tmp_path, max_completion_length=400)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[nap, fail, add], args=config)
    one_rollout(trainer)
    metrics = trainer._metrics["train"]
    assert metrics["tools/nap/calls"] == [3.0] and metrics["tools/nap/failures"] == [0.0]
    assert metrics["tools/nap/timeouts"] == [0.0]
    assert metrics["tools/nap/latency_mean"] == [pytest.approx(sum(naps) / 3, abs=1e-12)]
    assert metrics["tools/fail/calls"] == [2.0] and metrics["tools/fail/failures"] == [2.0]
    assert metrics["tools/fail/latency_mean"] == [0.0]  # ran to its end (raising) at once
    assert metrics["tools/add/calls"] == [0.0] and "tools/add/latency_mean" not in metrics  # never ran
    assert metrics["tools/turns_mean"] == [2.0]
    assert metrics["tools/call_frequency"] == [5 / 4] and metrics["tools/failure_frequency"] == [2 / 5]  # TRL's


def test_tool_caller_checks_its_timeout():
    with pytest.raises(ValueError, match="tool_timeout=0 must be > 0"):
        ToolCaller(timeout=0)


# ---- bounds --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["loop", "generate"])  # `run_joining` (turns join as they come) and `run`
@pytest.mark.parametrize("room", [-1, 0])
def test_a_reply_that_would_overflow_is_rolled_back_as_trl_does(tmp_path, engine, room):
    """Every token ends a turn, so each first turn is one token, its EOS, and calls `add`; max_completion_length
    leaves `room` tokens after it and the reply. -1: the reply would overflow and is rolled back, as TRL 1.16 does:
    the episode ends on its turn's EOS, without the reply's ids or message, not truncated (so not masked), the call
    counted. 0: the reply fills the budget exactly: kept, and the episode ends on it, truncated."""
    tokenizer = tool_tokenizer()
    reply = tool_reply_ids(tokenizer, [{"role": "tool", "name": "add", "content": "3"}], {})
    config = args_for(
        tmp_path,
        rollout_engine=engine,
        max_completion_length=1 + len(reply) + room,
        mask_truncated_completions=True,
        temperature=1.0,
    )
    shown = []

    def record(completions, **_):
        shown.extend(completions)
        return [0.0] * len(completions)

    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=record, tools=[add], args=config)
    sampler = with_eos_tokens(trainer, list(range(len(tokenizer))))
    calling = {"role": "assistant", "content": "", "tool_calls": [call_of("add", a=1, b=2)]}
    sampler.episodes.parse = lambda tok, ids, context, tools: calling
    (batch,) = one_rollout(trainer)
    metrics = trainer._metrics["train"]
    assert metrics["tools/call_frequency"] == [1.0]
    if room < 0:
        assert [[m["role"] for m in c] for c in shown] == [["assistant"]] * 4
        assert batch.completion_mask.sum(dim=1).tolist() == [1] * 4  # the turn's EOS, in the loss
        assert batch.context_mask.sum() == 0
        assert metrics["completions/clipped_ratio"] == [0.0]
    else:
        assert [[m["role"] for m in c] for c in shown] == [["assistant", "tool"]] * 4
        assert batch.context_mask.sum(dim=1).tolist() == [len(reply)] * 4
        assert batch.completion_mask.sum() == 0  # truncated, so masked
        assert metrics["completions/clipped_ratio"] == [1.0]


def test_max_tool_calling_iterations_bounds_the_rounds(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(lambda context, row: call("add", a=1, b=2), tokenizer)
    config = args_for(tmp_path, max_completion_length=400, max_tool_calling_iterations=2)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[add], args=config)
    one_rollout(trainer)
    assert trainer._metrics["train"]["tools/call_frequency"] == [2.0]  # then the third call ends the episode
    assert trainer._metrics["train"]["completions/clipped_ratio"] == [0.0]  # each last turn ended with its EOS


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(max_tool_calling_iterations=-1), "max_tool_calling_iterations=-1 must be >= 0"),
        (dict(tool_timeout=0.0), "tool_timeout=0.0 must be > 0 seconds"),
    ],
)
def test_tool_settings_are_checked(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        args_for(tmp_path, **overrides)


def test_a_chat_template_that_cannot_render_tools_is_refused(tmp_path):
    tokenizer = build_tiny_tokenizer()  # conftest's ChatML template has no tools
    with pytest.raises(ValueError, match="need a chat template that renders tool calls"):
        trainer_for(tmp_path, tokenizer, tools=[add])


# ---- every engine: exact ids, and exactly zero gradient on tool output ----------------------------------------------
@pytest.mark.kernel_paths
@pytest.mark.parametrize("engine", ["loop", "generate", "cuda_graph"])
def test_tool_output_gets_zero_gradient_and_every_sampled_token_one(tmp_path, engine):
    """A real engine samples; half the tokens end a turn (an odd id is an EOS here), each first turn is read as a call
    of `add`. The training rows hold the engine's ids and the template's reply ids; the loss's gradient with respect to
    the log-probs is exactly 0 on every reply position and nonzero on every sampled token, each turn's end included;
    the shared-prefix forward reads the replies as the padded one does."""
    tokenizer = tool_tokenizer()
    config = args_for(tmp_path, rollout_engine=engine, max_completion_length=120, temperature=1.0)
    trainer = trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[add], args=config)
    model = trainer.model
    sampler = with_eos_tokens(trainer, [i for i in range(len(tokenizer)) if i % 2 == 1])
    first_turn = {"role": "assistant", "content": "", "tool_calls": [call_of("add", a=1, b=2)]}
    sampler.episodes.parse = lambda tok, ids, context, tools: (
        {"role": "assistant", "content": "x"} if "<tool_response>" in tok.decode(context) else first_turn
    )
    sampled = record_turns(sampler)
    torch.manual_seed(0)
    (batch,) = one_rollout(trainer)

    reply = tool_reply_ids(tokenizer, [{"role": "tool", "name": "add", "content": "3"}], {})
    for row in range(4):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()].tolist()
        ids = batch.completion_ids[row].tolist()
        (turn1,) = [t for t in sampled[tuple(prompt)] if ids[: len(t)] == t]  # one of the prompt's first turns
        (turn2,) = sampled[tuple(prompt + turn1 + reply)]
        n = len(turn1) + len(reply) + len(turn2)
        assert ids[:n] == turn1 + reply + turn2
        assert batch.completion_mask[row, :n].tolist() == [1] * len(turn1) + [0] * len(reply) + [1] * len(turn2)
        assert turn1[-1] % 2 == 1 and turn2[-1] % 2 == 1  # each turn ends with its EOS, which is in the loss

    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.25])
    logps, _ = completion_logps(model, batch, share_prefix=False)
    logps.retain_grad()
    loss, _ = trainer.objective(logps, batch, accumulation_steps=1)
    loss.backward()
    assert bool((logps.grad[batch.context_mask.bool()] == 0).all())
    assert bool((logps.grad[batch.completion_mask.bool()] != 0).all())
    shared, _ = completion_logps(model, batch, share_prefix=True)
    attended = batch.attention_mask.bool()
    torch.testing.assert_close(shared[attended], logps.detach()[attended], rtol=1e-5, atol=1e-5)


def with_eos_tokens(trainer, eos_token_ids: list[int]):
    """Make `eos_token_ids` end every turn a real engine samples for `trainer` (a random tiny model then ends its
    turns within a few tokens); returns the trainer's sampler."""
    trainer.model.generation_config.eos_token_id = trainer.eos_token_ids = eos_token_ids
    sampler = trainer.experience.sampler
    sampler.generation = type(sampler.generation)(
        trainer.generation_config, eos_token_ids, sampler.generation.chat_template_kwargs, False
    )
    sampler.episodes.eos_token_ids = set(eos_token_ids)
    trainer.generation_config.eos_token_id = eos_token_ids
    return sampler


def record_turns(sampler) -> dict[tuple[int, ...], list[list[int]]]:
    """Record every turn the sampler's engine samples, by the context ids it was sampled after: from `generate`
    (one call per round of turns) or, for an engine that decodes turns as they come (`loop`), from its source."""
    turns: dict[tuple[int, ...], list[list[int]]] = {}
    original = sampler.engine_for

    def recording(model):
        engine = original(model)
        if hasattr(engine, "_recording"):
            return engine
        engine._recording = True
        if hasattr(engine, "decode_turns"):
            decode = engine.decode_turns

            def decode_recording(model, source):
                poll, done, contexts = source.poll, source.turn_done, {}

                def polled(block):
                    ready = poll(block)
                    contexts.update({key: list(context) for key, context, _ in ready})
                    return ready

                def turn_done(key, turn, logps):
                    turns.setdefault(tuple(contexts[key]), []).append(list(turn))
                    done(key, turn, logps)

                source.poll, source.turn_done = polled, turn_done
                decode(model, source)

            engine.decode_turns = decode_recording
        else:
            generate = engine.generate

            def generate_recording(model, ids, mask, **kwargs):
                out = generate(model, ids, mask, **kwargs)
                for k in range(ids.size(0)):
                    turn = out.completion_ids[k, : int(out.completion_mask[k].sum())].tolist()
                    turns.setdefault(tuple(ids[k][mask[k].bool()].tolist()), []).append(turn)
                return out

            engine.generate = generate_recording
        return engine

    sampler.engine_for = recording
    return turns


def call_of(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# ---- environments ---------------------------------------------------------------------------------------------------
class Counter:
    """Count up to a target: its tool adds to the count; it owns its reward."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.count, self.target = 0, None

    def reset(self, **row):
        self.count, self.target = 0, int(row["target"])
        return f" Reach {self.target}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    def get_reward(self) -> float:
        return float(self.count == self.target)


class Echo:
    """Say something back; no reward of its own."""

    def reset(self, **row):
        assert "environment" not in row  # the routing column is not the environment's
        return None

    def shout(self, text: str) -> str:
        """Shout the text back.

        Args:
            text: What to shout.
        """
        return text.upper()


def environment_script(context, row):
    """Counter rows: even rows increment by the target (reward 1), odd by 1 (reward 0, unless the target is 1);
    echo rows shout."""
    if "<tool_response>" in context:
        return "done<|im_end|>"
    reach = re.findall(r"Reach (\d+)\.", context)
    if reach:
        return call("increment", step=int(reach[-1]) if row % 2 == 0 else 1)
    return call("shout", text="hi")


def test_environments_routed_by_column_with_their_own_rewards_and_reward_funcs(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(environment_script, tokenizer)
    seen = []

    def reward(prompts, environments, **_):
        seen.append((prompts, environments))
        return [1.0 if isinstance(e, Echo) else None for e in environments]

    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "Count."}], [{"role": "user", "content": "Shout."}]],
            "environment": ["counter", "echo"],
            "target": ["4", "0"],
        }
    )
    config = args_for(tmp_path, max_steps=2, shuffle_dataset=False)
    factory = {"counter": Counter, "echo": Echo}
    trainer = trainer_for(
        tmp_path, tokenizer, reward_funcs=reward, dataset=dataset, environment_factory=factory, args=config
    )
    assert trainer.reward_func_names == ["reward", "Counter"] and trainer.reward_weights.tolist() == [1.0, 1.0]
    made = Counter.made
    trainer.train()
    assert Counter.made == made + 1  # one instance probed, one more for a batch's two counter rows; then reused
    (prompts, environments), (_, environments_2) = seen
    assert [type(e) for e in environments] == [Counter, Counter, Echo, Echo]
    assert [id(e) for e in environments] == [id(e) for e in environments_2]  # the pool, reused
    assert prompts[0][-1]["content"] == "Count. Reach 4." and prompts[2][-1]["content"] == "Shout."
    # Counter: rows 0 (step 4) reach the target, row 1 (step 1) does not; echo rows: the reward function's 1.0
    assert trainer.state.log_history[0]["rewards/Counter/mean"] == 0.5
    assert trainer.state.log_history[0]["rewards/reward/mean"] == 1.0
    tools_seen = ScriptedEngine.calls[0]
    assert '"name": "increment"' in tools_seen[0] and '"name": "shout"' not in tools_seen[0]  # each row, its own tools
    assert '"name": "shout"' in tools_seen[2] and '"name": "increment"' not in tools_seen[2]


class OwnsItsData(Counter):
    """An environment that writes each prompt itself."""

    def reset(self, **row):
        assert row["prompt"] == [{"role": "user", "content": ""}]
        self.count, self.target = 0, 3
        return "Reach 3."


def test_environment_owned_data_and_reward_alone(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(environment_script, tokenizer)
    config = args_for(tmp_path, max_steps=2)
    trainer = GRPOTrainer(
        build_tiny_model(tokenizer), None, config, processing_class=tokenizer, environment_factory=OwnsItsData
    )
    assert trainer.reward_func_names == ["OwnsItsData"]
    trainer.train()
    assert trainer.state.global_step == 2
    assert [row["rewards/OwnsItsData/mean"] for row in trainer.state.log_history[:2]] == [0.5, 0.5]


@pytest.mark.parametrize(
    "case, message",
    [
        ("unknown environment", r"names environments \['nowhere'\] in its `environment` column, which are not among"),
        ("no dataset, no environment", "`train_dataset` is required unless an `environment_factory` is provided"),
        ("environment-owned data, no max_steps", "set max_steps > 0"),
        ("several environments, no dataset", "requires a `train_dataset` with an `environment` column"),
        ("environment without reset", "has no `reset` method"),
    ],
)
def test_construction_errors(tmp_path, case, message):
    tokenizer = tool_tokenizer()
    model, config = build_tiny_model(tokenizer), args_for(tmp_path)
    dataset, factory, tools = None, Counter, None
    if case == "unknown environment":
        dataset = Dataset.from_dict(
            {"prompt": [[{"role": "user", "content": "x"}]] * 2, "environment": ["counter", "nowhere"]}
        )
        factory = {"counter": Counter}
    elif case == "no dataset, no environment":
        factory, tools = None, [add]
    elif case == "environment-owned data, no max_steps":
        config = args_for(tmp_path, max_steps=-1, num_train_epochs=1)
    elif case == "several environments, no dataset":
        factory = {"counter": Counter, "echo": Echo}
    else:
        factory = type("NoReset", (), {"act": lambda self, x: x})
    with pytest.raises((ValueError, TypeError), match=message):
        GRPOTrainer(
            model,
            last_answer,
            config,
            train_dataset=dataset,
            processing_class=tokenizer,
            tools=tools,
            environment_factory=factory,
        )


# ---- TRL's semantics: what reset() gets, rollout_func with environments and tools, the public attributes ------------
class Recorder:
    """Records each reset's keyword arguments (class-wide)."""

    resets: list[dict] = []

    def reset(self, **row):
        Recorder.resets.append(dict(row))
        return f" Reach {row['target']}."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        return step


@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("with_prompt", [False, True])
def test_reset_gets_the_row_as_trl_passes_it(tmp_path, routed, with_prompt):
    tokenizer = tool_tokenizer()
    scripted(environment_script, tokenizer)
    columns = {"target": ["4", "5"], "environment": ["counter", "counter"]}
    if with_prompt:
        columns["prompt"] = [[{"role": "user", "content": "Count."}]] * 2
    factory = {"counter": Recorder} if routed else Recorder
    Recorder.resets = []
    trainer = trainer_for(
        tmp_path, tokenizer, reward_funcs=zero, dataset=Dataset.from_dict(columns), environment_factory=factory
    )
    one_rollout(trainer)
    expected = {"target": "4"}
    if with_prompt:
        expected["prompt"] = [{"role": "user", "content": "Count."}]
    if not routed:  # the routing column is the trainer's only with several environments
        expected["environment"] = "counter"
    assert Recorder.resets[0] == expected
    assert ScriptedEngine.calls[0][0].count("Reach 4.") == 1  # the observation, on an empty prompt where none


def test_rollout_func_with_environments_and_tools_runs_the_tool_loop_on_its_output(tmp_path):
    """As TRL: environments are reset before rollout_func (which sees their observations), rewards get them, and a
    rollout_func completion that calls a tool is the first turn of an episode that goes on on the engine."""
    tokenizer = tool_tokenizer()
    scripted(environment_script, tokenizer)  # the engine's turns: "done" after a tool reply
    seen = {}
    first = tokenizer(call("increment", step=4), add_special_tokens=False)["input_ids"]
    plain = tokenizer("no tools<|im_end|>", add_special_tokens=False)["input_ids"]

    def rollout_func(prompts, trainer):
        seen["prompts"] = prompts
        texts = [
            tokenizer.apply_chat_template(p, tools=trainer.tools, add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        completions = [first if k % 2 == 0 else plain for k in range(len(prompts))]
        return {
            "prompt_ids": [list(x) for x in ids],
            "completion_ids": completions,
            "logprobs": [[-0.5] * len(c) for c in completions],
            "env_mask": [[0] + [1] * (len(c) - 1) for c in completions],  # its first token: the environment's
        }

    def reward(completions, environments, **_):
        seen["environments"], seen["completions"] = environments, completions
        return [0.0] * len(completions)

    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Count."}]] * 2, "target": ["4", "4"]})
    trainer = trainer_for(
        tmp_path, tokenizer, reward_funcs=reward, dataset=dataset, environment_factory=Counter,
        rollout_func=rollout_func,
    )  # fmt: skip
    (batch,) = one_rollout(trainer)
    assert [p[-1]["content"] for p in seen["prompts"]] == ["Count. Reach 4."] * 4  # reset before rollout_func
    assert [type(e) for e in seen["environments"]] == [Counter] * 4 and seen["environments"] == trainer.environments
    assert [e.count for e in trainer.environments] == [4, 0, 4, 0]  # the tool ran on the rows that called it
    reply = tool_reply_ids(tokenizer, [{"role": "tool", "name": "increment", "content": "4"}], {})
    done = tokenizer("done<|im_end|>", add_special_tokens=False)["input_ids"]
    n = len(first) + len(reply) + len(done)
    assert batch.completion_ids[0, :n].tolist() == first + reply + done
    assert batch.completion_mask[0, :n].tolist() == [0] + [1] * (len(first) - 1) + [0] * len(reply) + [1] * len(done)
    assert batch.context_mask[0, :n].tolist() == [1] + [0] * (len(first) - 1) + [1] * len(reply) + [0] * len(done)
    assert batch.completion_ids[1, : len(plain)].tolist() == plain and batch.context_mask[1].sum() == 1
    assert len(ScriptedEngine.calls) == 1 and len(ScriptedEngine.calls[0]) == 2  # the engine: the two calling rows
    assert seen["completions"][0][-1] == {"role": "assistant", "content": "done"}
    assert trainer._metrics["train"]["tools/call_frequency"] == [0.5]


def test_trainer_tools_and_environments_are_trls_attributes(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(environment_script, tokenizer)
    plain = trainer_for(tmp_path, tokenizer, reward_funcs=zero)
    assert plain.tools == [] and plain.environments is None
    assert trainer_for(tmp_path, tokenizer, reward_funcs=zero, tools=[add]).tools == [add]
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Count."}]] * 2, "target": ["4", "1"]})
    trainer = trainer_for(
        tmp_path, tokenizer, reward_funcs=zero, dataset=dataset, tools=[add], environment_factory=Counter
    )
    assert trainer.environments is None  # until the first rollout
    assert [tool.__name__ for tool in trainer.tools] == ["add", "increment"]
    probed = trainer.tools[1].__self__
    assert isinstance(probed, Counter)  # a method bound to the environment instance probed at construction
    one_rollout(trainer)
    assert isinstance(trainer.environments, list) and len(trainer.environments) == 4
    assert all(isinstance(e, Counter) for e in trainer.environments) and trainer.environments[0] is probed
    assert [e.target for e in trainer.environments] == [4, 4, 1, 1]


@pytest.mark.parametrize(
    "case, trl_words",  # the words TRL's own tests match
    [
        ("unknown environment", "not among the environments"),
        ("no dataset, no environment", "`train_dataset` is required"),
        ("several environments, no dataset", "requires a `train_dataset`"),
        ("environment-owned data, no max_steps", "max_steps"),
        ("no reward", "No reward source provided"),
    ],
)
def test_errors_keep_trls_words(tmp_path, case, trl_words):
    tokenizer = tool_tokenizer()
    config, dataset, factory, tools, rewards = args_for(tmp_path), None, Counter, None, last_answer
    if case == "unknown environment":
        dataset = Dataset.from_dict({"environment": ["counter", "nowhere"], "target": ["1", "2"]})
        factory = {"counter": Counter}
    elif case == "no dataset, no environment":
        factory, tools = None, [add]
    elif case == "several environments, no dataset":
        factory = {"counter": Counter, "echo": Echo}
    elif case == "environment-owned data, no max_steps":
        config = args_for(tmp_path, max_steps=-1, num_train_epochs=1)
    else:
        factory, rewards, dataset, tools = None, None, sums_dataset(), [add]
    with pytest.raises(ValueError, match=trl_words):
        GRPOTrainer(
            build_tiny_model(tokenizer), rewards, config, train_dataset=dataset, processing_class=tokenizer,
            tools=tools, environment_factory=factory,
        )  # fmt: skip


# ---- max_prompt_length: None by default (TRL); when set, whole turns of history go, never the system or the tools --
SYSTEM = {"role": "system", "content": "You add numbers with the tool you are given, and say the sum. " * 4}


def chat_with_history(k: int) -> list[dict]:
    return [
        SYSTEM,
        {"role": "user", "content": "Tell me a long story first. " * 6},
        {"role": "assistant", "content": "Once upon a time there was a sum. " * 8},
        {"role": "user", "content": "Now a short one."},
        {"role": "assistant", "content": "The end."},
        {"role": "user", "content": f"What is {k} + {k + 3}?"},
    ]


def rendered(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tools=[add], add_generation_prompt=True, tokenize=False)


def test_max_prompt_length_is_none_by_default_so_a_long_system_and_tool_prompt_is_whole(tmp_path):
    tokenizer = tool_tokenizer()
    scripted(answer_after_tools, tokenizer)
    settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=160, max_steps=1)
    config = GRPOConfig(
        output_dir=str(tmp_path), **settings, beta=0.0, use_cpu=True, report_to="none", rollout_engine="scripted"
    )
    assert config.max_prompt_length is None  # TRL's: no limit
    prompt = [SYSTEM, {"role": "user", "content": "What is 0 + 3?"}]
    dataset = Dataset.from_dict({"prompt": [prompt, prompt], "answer": ["3", "3"]})
    trainer = trainer_for(tmp_path, tokenizer, dataset=dataset, tools=[add], args=config)
    one_rollout(trainer)
    seen = ScriptedEngine.calls[0][0]
    assert len(tokenizer(seen)["input_ids"]) > 512  # over the old default
    assert seen == rendered(tokenizer, prompt)  # the system message and the tool's schema, whole
    assert trainer._metrics["train"]["prompts/num_truncated"] == [0.0]


def test_a_prompt_over_max_prompt_length_loses_whole_turns_of_history_and_says_so_once(tmp_path, caplog):
    tokenizer = tool_tokenizer()
    scripted(answer_after_tools, tokenizer)
    prompts = [chat_with_history(k) for k in range(2)]
    kept = [[m for j, m in enumerate(p) if j not in (1, 2)] for p in prompts]  # the first turn of history dropped
    limit = max(len(tokenizer(rendered(tokenizer, p))["input_ids"]) for p in kept)
    assert all(len(tokenizer(rendered(tokenizer, p))["input_ids"]) > limit for p in prompts)
    dataset = Dataset.from_dict({"prompt": prompts, "answer": ["3", "5"]})
    config = args_for(tmp_path, max_prompt_length=limit)
    trainer = trainer_for(tmp_path, tokenizer, dataset=dataset, tools=[add], args=config)
    with caplog.at_level("WARNING", logger="grpo_hf.rollout.sampler"):
        one_rollout(trainer)
        one_rollout(trainer)
    assert ScriptedEngine.calls[0][0] == rendered(tokenizer, kept[0])  # system, tools and the last turns, whole
    assert ScriptedEngine.calls[0][2] == rendered(tokenizer, kept[1])
    assert trainer._metrics["train"]["prompts/num_truncated"] == [4.0, 4.0]
    warnings = [r.getMessage() for r in caplog.records if "max_prompt_length" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("4 of the 4 prompt rows of this rollout are over")
    assert "whole turns of their history were dropped" in warnings[0]


def test_a_prompt_whose_system_tools_and_last_turn_are_over_max_prompt_length_is_an_error(tmp_path):
    """Refused when the trainer is built where the system message and last user turn alone are over the limit, at
    the rollout where the tools' schemas make them so."""
    tokenizer = tool_tokenizer()
    scripted(answer_after_tools, tokenizer)
    prompt = [SYSTEM, {"role": "user", "content": "What is 0 + 3?"}]
    dataset = Dataset.from_dict({"prompt": [prompt, prompt], "answer": ["3", "3"]})
    alone = len(
        tokenizer(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False))["input_ids"]
    )
    assert alone < 500 < len(tokenizer(rendered(tokenizer, prompt))["input_ids"])
    with pytest.raises(ValueError, match=rf"row 0: its system messages and last user turn alone are {alone} tokens"):
        trainer_for(tmp_path, tokenizer, dataset=dataset, tools=[add], args=args_for(tmp_path, max_prompt_length=64))
    trainer = trainer_for(
        tmp_path, tokenizer, dataset=dataset, tools=[add], args=args_for(tmp_path, max_prompt_length=500)
    )
    with pytest.raises(ValueError, match=r"over max_prompt_length=500, and still \d+ tokens with its history dropped"):
        one_rollout(trainer)


# ---- rollout_func: env_mask and logprobs ----------------------------------------------------------------------------
def test_rollout_func_env_mask_and_logprobs(tmp_path):
    tokenizer = tool_tokenizer()

    def rollout_func(prompts, trainer):
        prompt_ids = [tokenizer("question", add_special_tokens=False)["input_ids"]] * len(prompts)
        completion_ids = [[40, 41, 42, 43, tokenizer.eos_token_id]] * len(prompts)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[-1.0, -2.0, -3.0, -4.0, -5.0]] * len(prompts),
            "env_mask": [[1, 0, 0, 1, 1]] * len(prompts),  # tokens 1-2: the environment's
        }

    config = args_for(tmp_path, rollout_engine="auto")
    trainer = trainer_for(
        tmp_path,
        tokenizer,
        reward_funcs=lambda completions, **_: [0.0, 1.0] * 2,
        rollout_func=rollout_func,
        args=config,
    )
    (batch,) = one_rollout(trainer)
    assert batch.completion_mask[0].tolist() == [1, 0, 0, 1, 1]
    assert batch.context_mask[0].tolist() == [0, 1, 1, 0, 0]
    assert batch.sampling_logps[0].tolist() == [-1.0, 0.0, 0.0, -4.0, -5.0]  # off the loss mask: 0
    assert trainer._metrics["train"]["completions/mean_length"] == [3.0]  # the model's tokens only

    # With the sampler's correction on (as with use_vllm=True), the weight pi_old / pi_sampler reads those log-probs
    trainer.objective.correction = SamplingCorrection("token_truncate", clip_min=None, clip_max=1e9)
    logps = torch.full_like(batch.sampling_logps, -2.0)
    weight, metrics = trainer.objective.sampling_weight(logps, batch)
    expected = torch.exp(torch.tensor([-2.0, 0.0, 0.0, -2.0, -2.0]) - torch.tensor([-1.0, 0.0, 0.0, -4.0, -5.0]))
    torch.testing.assert_close(weight[0][batch.completion_mask[0].bool()], expected[[0, 3, 4]])


@pytest.mark.parametrize("bad, key", [(-1, "completion_ids"), (10**6, "prompt_ids")])
def test_rollout_func_token_ids_outside_the_vocabulary(tmp_path, bad, key):
    tokenizer = tool_tokenizer()

    def rollout_func(prompts, trainer):
        prompt_ids = [[50, 51]] * len(prompts)
        completion_ids = [[60, 61, tokenizer.eos_token_id]] * len(prompts)
        out = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": [[0.0] * 3] * len(prompts)}
        out[key] = [list(ids) for ids in out[key]]
        out[key][2][0] = bad
        return out

    trainer = trainer_for(
        tmp_path, tokenizer, rollout_func=rollout_func, args=args_for(tmp_path, rollout_engine="auto")
    )
    with pytest.raises(ValueError, match=rf"rollout_func returned {key}\[2\] with token ids \[{bad}\] outside"):
        one_rollout(trainer)


# ---- the loop engine: turns join the decoding batch at the next token step ------------------------------------------
class _ScriptedSource:
    """Three episodes of three turns; a turn's `reply` ids come back `delay` polls after it ends (a tool's latency).

    As real tools do, replies come back one at a time: a poll hands back those whose time has come, and a blocking
    poll (the engine has nothing left to decode) only the one that was due first, never every waiting episode at
    once."""

    def __init__(self, prompts: list[list[int]], reply: list[int], delay: int = 1, turns: int = 3, budget=10):
        self.contexts, self.reply, self.delay = [list(p) for p in prompts], reply, delay
        self.budgets = budget if isinstance(budget, list) else [budget] * len(prompts)  # per episode
        self.turns, self.count = turns, [0] * len(prompts)
        self.ready, self.waiting, self.done_turns = list(range(len(prompts))), [], []
        self.polls, self.joined_mid_decode = 0, False

    def poll(self, block):
        self.polls += 1
        back = [k for k, at in self.waiting if at <= self.polls]
        if block and not back and self.waiting:
            back = [min(self.waiting, key=lambda waiting: waiting[1])[0]]  # the first due: the engine waits for it
        self.waiting = [(k, at) for k, at in self.waiting if k not in back]
        self.ready += back
        ready, self.ready = self.ready, []
        if ready and not block:
            self.joined_mid_decode = True  # handed out while other turns were still being decoded
        return [(k, list(self.contexts[k]), self.budgets[k]) for k in ready]

    def turn_done(self, k, turn, logps):
        self.done_turns.append((list(self.contexts[k]), list(turn), list(logps)))
        self.count[k] += 1
        self.contexts[k] += turn
        if self.count[k] < self.turns:
            self.contexts[k] += self.reply
            self.waiting.append((k, self.polls + self.delay))


def test_loop_turns_join_the_batch_and_keep_the_models_log_probs(tokenizer):
    """`loop.decode_turns` with turns that come back at different times: some join while others are mid-turn, the
    batch's cache grows on the left for longer contexts, finished rows leave it; every sampled token's log-prob is
    the one a plain forward over its context gives (so each row read exactly its own context)."""
    from transformers import GenerationConfig

    from grpo_hf.rollout.loop import decode_turns

    model = build_tiny_model(tokenizer, seed=1).eval()
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("ab", "a longer one", "xyz!")]
    source = _ScriptedSource(prompts, reply=tokenizer(" <r> ", add_special_tokens=False)["input_ids"])
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=10, pad_token_id=tokenizer.pad_token_id)
    ends = [i for i in range(len(tokenizer)) if i % 5 == 0]  # a fifth of the tokens end a turn: varied lengths
    torch.manual_seed(0)
    decode_turns(model, source, config, ends)
    assert len(source.done_turns) == 9 and source.joined_mid_decode
    assert_log_probs_are_the_models(model, source.done_turns)
    for _, turn, _ in source.done_turns:
        assert turn[-1] % 5 == 0 or len(turn) == 10  # an EOS or the budget ends a turn


def assert_log_probs_are_the_models(model, done_turns) -> None:
    """Every turn's log-probs are those a plain forward over its context and itself gives."""
    with torch.no_grad():
        for context, turn, logps in done_turns:
            ids = torch.tensor([context + turn])
            expected = torch.log_softmax(model(input_ids=ids).logits[0, len(context) - 1 : -1].float(), dim=-1)
            expected = expected.gather(1, torch.tensor(turn)[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(logps), expected, rtol=1e-5, atol=1e-5)


def test_loop_batch_keeps_only_the_columns_its_rows_attend_to(tokenizer):
    """The longest episode's turns take one token each, and it leaves the batch while shorter ones go on decoding:
    every decoding step's attention mask is as wide as its longest live row (no column is padding in every row), so
    the cache never outgrows what the rows read, and every log-prob is still the plain forward's."""
    from transformers import GenerationConfig

    from grpo_hf.rollout.loop import decode_turns

    model = build_tiny_model(tokenizer, seed=1).eval()
    texts = ("ab", "a much longer prompt than the others, by far", "xyz!")
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    reply = tokenizer(" <r> ", add_special_tokens=False)["input_ids"]
    source = _ScriptedSource(prompts, reply=reply, delay=3, budget=[12, 1, 12])
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)
    widths = []

    def record(module, args, kwargs):
        if kwargs["input_ids"].size(1) == 1:  # a decoding step (a join's prefill pads to the batch's width)
            mask = kwargs["attention_mask"]
            widths.append((mask.size(1), int(mask.sum(dim=1).max())))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    torch.manual_seed(0)
    decode_turns(model, source, config, [tokenizer.eos_token_id])  # turns end at their budget: 12, 1, 12 tokens
    hook.remove()
    assert len(source.done_turns) == 9 and len(widths) > 20
    assert all(width == longest for width, longest in widths), widths
    assert_log_probs_are_the_models(model, source.done_turns)
