"""Throughput of the math verifier: `extract_answer` and `accuracy_reward` on 10,000 synthetic completions.

The completions imitate what models write on GSM8K: about 1,200 characters (~300 tokens) of reasoning full of
numbers, `<<a*b=c>>` annotations, dollar amounts and thousands separators, ending in `\\boxed{}`, `#### N`,
`<think>/<answer>`, "The answer is ...", a stated answer followed by a made-up new question, or no marker at all; some
answers are wrong. The generator knows the right reward of each one, and the script checks that `accuracy_reward`
agrees on every completion before it times anything.

Single thread, best of `--repeats` runs:

    python benchmarks/bench_rewards.py [--n 10000] [--repeats 5] [--seed 0]

The last line is `extract_throughput=N completions/s` for `accuracy_reward` end to end (answer extraction, gold
parsing from a GSM8K solution string, numeric comparison).
"""

from __future__ import annotations

import argparse
import random
import time

from grpo_hf.rewards import accuracy_reward, extract_answer

NAMES = ["Janet", "Tom", "Maria", "Ahmed", "Li", "Sofia", "Ravi", "Olga"]
ITEMS = ["apple", "egg", "book", "ticket", "marble", "cookie", "pencil", "shirt"]


def _reasoning_sentence(rng: random.Random) -> str:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    return [
        f"{name} buys {a} {item}s at ${b} each, so {a} * {b} = <<{a}*{b}={a * b}>>{a * b} dollars. ",
        f"Then {name} gives away {b} of the {a + b} {item}s, leaving {a + b} - {b} = {a} {item}s. ",
        f"Over the year that adds up to {a * b * 25:,} {item}s, which is {a * b}% of the stock. ",
        f"Half of {2 * a} is {a}, and a quarter of {4 * b} is {b}, so together we get {a + b}. ",
        f"Let me double-check: {a} + {b} = {a + b}, and {a + b} * 2 = {2 * (a + b)}. That looks right. ",
        f"We know that {name} has {a} {item}s and needs {b} more to reach the goal of {a + b}. ",
    ][rng.randrange(6)]


def _make_completion(rng: random.Random, gold: int) -> tuple[str, float]:
    """One completion and its correct accuracy reward."""
    correct = rng.random() < 0.6
    answer = gold if correct else gold + rng.choice([-10, -3, -1, 1, 2, 7, 100])
    body = ""
    while len(body) < 1100:
        body += _reasoning_sentence(rng)
    style = rng.randrange(7)
    if style == 0:
        text = f"{body}\nSo the final answer is $\\boxed{{{answer:,}}}$."
    elif style == 1:
        text = f"{body}\n#### {answer}"
    elif style == 2:
        text = f"<think>\n{body}\n</think>\n<answer>\n{answer}\n</answer>"
    elif style == 3:
        text = f"{body}\nThe answer is ${answer}.00."
    elif style == 4:  # states the answer, then rambles on with a made-up question whose answer must not count
        other = answer + 5
        text = f"{body}\nThe answer is {answer}.\n\nQuestion: {_reasoning_sentence(rng)}How many? #### {other}"
    elif style == 5:  # self-correction: the last marker wins
        text = f"{body}\nSo \\boxed{{{answer + 3}}}. Wait, I made an error above. The answer is **{answer}**."
    else:  # no marker: reward 0 even if the last number is right
        text = f"{body}\nIn total that gives {answer} in the end."
        return text, 0.0
    return text, 1.0 if answer == gold else 0.0


def make_dataset(n: int, seed: int, group_size: int = 8) -> tuple[list[str], list[str], list[float]]:
    rng = random.Random(seed)
    completions, golds, expected = [], [], []
    for start in range(0, n, group_size):
        gold = rng.randint(1, 5000)
        a = rng.randint(2, 50)
        solution = (
            f"She has {a} * 2 = <<{a}*2={2 * a}>>{2 * a} now.\nSo in total {gold - 1} + 1 = <<{gold - 1}+1={gold}>>"
        )
        solution += f"{gold}\n#### {gold:,}"
        for _ in range(min(group_size, n - start)):
            text, reward = _make_completion(rng, gold)
            completions.append(text)
            golds.append(solution)
            expected.append(reward)
    return completions, golds, expected


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    completions, golds, expected = make_dataset(args.n, args.seed)
    mean_chars = sum(map(len, completions)) / len(completions)
    got = accuracy_reward(prompts=[""] * len(completions), completions=completions, answer=golds)
    wrong = [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    if wrong:
        raise SystemExit(f"accuracy_reward disagrees with the generator on {len(wrong)} completions, e.g. {wrong[:5]}")
    print(
        f"{len(completions)} completions, {mean_chars:.0f} chars on average, mean accuracy {sum(got) / len(got):.3f}"
    )

    t_extract = best_of(args.repeats, lambda: [extract_answer(c) for c in completions])
    t_accuracy = best_of(
        args.repeats, lambda: accuracy_reward(prompts=[""] * len(completions), completions=completions, answer=golds)
    )
    n = len(completions)
    print(f"extract_answer : {t_extract:.3f} s total, {n / t_extract:,.0f} completions/s")
    print(f"accuracy_reward: {t_accuracy:.3f} s total, {n / t_accuracy:,.0f} completions/s")
    print(f"extract_throughput={n / t_accuracy:.0f} completions/s")


if __name__ == "__main__":
    main()
