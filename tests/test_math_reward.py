r"""MATH-style answers: LaTeX extraction, equivalence through math-verify, the comparison timeout, and the registry.

The accuracy reward for GSM8K is untouched (tests/test_rewards.py); these pairs are what MATH needs on top of it:
fractions against decimals, `\dfrac`, radicals, intervals, sets, units and degrees.
"""

import io
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_hf.rewards import (
    REWARD_FACTORIES,
    MathAccuracyReward,
    accuracy_reward,
    compute_rewards,
    extract_latex_answer,
    extract_latex_gold,
    get_reward_funcs,
    latex_worker,
    make_math_accuracy_reward,
)

pytest.importorskip("math_verify")

EQUIVALENT = [
    (r"\frac{1}{2}", "0.5"),
    ("0.75", r"\dfrac{3}{4}"),
    (r"\tfrac{1}{2}", r"\frac12"),
    ("1/3", r"\frac13"),
    ("10", "10.0"),
    (r"\sqrt{8}", r"2\sqrt{2}"),
    (r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt2}"),
    (r"(-\infty, 3]", r"(-\infty,3]"),
    ("[1, 2)", "[1,2)"),
    (r"\{1,2\}", r"\{2,1\}"),
    (r"5\text{ cm}", "5"),
    (r"5 \mbox{ cm}", "5"),
    (r"30^\circ", "30"),
    (r"30^{\circ}", "30"),
    ("x^2+2x+1", "(x+1)^2"),
    ("2", "x = 2"),
    (r"\$10", "10"),
    ("1,000", "1000"),
    (r"50\%", "0.5"),
]
NOT_EQUIVALENT = [
    (r"\frac{1}{3}", "0.33"),
    (r"\frac{1}{3}", "0.3333"),
    ("2", r"\sqrt{2}"),
    (r"\sqrt{2}", "2"),
    ("[1,2)", "[1,2]"),
    ("(1,2)", "[1,2]"),
    (r"(-\infty, 3]", r"(-\infty, 3)"),
    (r"\{1,2\}", r"\{1,3\}"),
    (r"5\text{ cm}", r"6\text{ cm}"),
    (r"\frac{\pi}{6}", r"30^\circ"),  # radians and degrees are different numbers to math-verify
    ("x^2+1", "(x+1)^2"),
    ("3", "4"),
    (r"-\frac{1}{2}", r"\frac{1}{2}"),
]


@pytest.fixture(scope="module")
def reward():
    reward = make_math_accuracy_reward()
    yield reward
    reward.close()


def test_extracts_latex_answers_with_the_accuracy_markers():
    cases = {
        r"so the value is $\boxed{\frac{\sqrt3}{2}}$.": r"\frac{\sqrt3}{2}",
        r"The answer is $(-\infty, 3]$.": r"(-\infty, 3]",
        r"The final answer is \(x^2+1\)": "x^2+1",
        r"<think>3/4</think> <answer>\dfrac{3}{4}</answer>": r"\dfrac{3}{4}",
        r"<answer>\boxed{7}</answer>": "7",  # the inner marker starts last
        "#### 3/4": "3/4",
        r"The answer is: 30^\circ. Done.": r"30^\circ",
        r"The answer is -\frac{1}{2}, as shown above": r"-\frac{1}{2}",
        r"First \boxed{5}. Wait, that is wrong: \boxed{6}": "6",  # the last marker wins
        "\\boxed{5}\n\nQuestion: what is 3+4?\n\\boxed{7}": "5",  # a made-up continuation is cut off
        "#### Step 1\nadd them": None,  # a heading, not a marker
        "The answer is the sum of the roots": None,
        "the roots are 2 and 3": None,  # no marker
        r"\boxed{}": None,
    }
    for text, expected in cases.items():
        assert extract_latex_answer(text) == expected, text
    assert extract_latex_answer([{"role": "assistant", "content": r"\boxed{\pi}"}]) == r"\pi"


def test_gold_is_the_boxed_answer_of_a_solution_or_the_whole_value():
    solution = r"We get $x = \frac{1}{2}$ twice, so the answer is $\boxed{\frac{1}{2}}$."
    assert extract_latex_gold(solution) == r"\frac{1}{2}"
    assert extract_latex_gold(r"\frac{1}{2}") == r"\frac{1}{2}"
    assert extract_latex_gold(r"$(-\infty, 3]$") == r"(-\infty, 3]"
    assert extract_latex_gold(0.5) == "0.5" and extract_latex_gold(3) == "3"
    assert extract_latex_gold(None) is None and extract_latex_gold("  ") is None


@pytest.mark.parametrize(("gold", "prediction"), EQUIVALENT)
def test_equivalent_answers_score_one(reward, gold, prediction):
    assert reward(["q"], [f"Therefore the answer is $\\boxed{{{prediction}}}$."], answer=[gold]) == [1.0]


@pytest.mark.parametrize(("gold", "prediction"), NOT_EQUIVALENT)
def test_different_answers_score_zero(reward, gold, prediction):
    assert reward(["q"], [f"Therefore the answer is $\\boxed{{{prediction}}}$."], answer=[gold]) == [0.0]


def test_an_answer_cut_off_inside_its_braces_is_no_answer(reward):
    """A completion that stops inside `\boxed{...}` (max_completion_length, say) never gave its answer: 0.0, even when
    what is there would parse as the gold; an earlier finished answer still counts, and escaped braces are text."""
    completions = [
        r"\boxed{\frac{1}{2",
        r"So the answer is \boxed{\frac{1}{2",
        r"#### \frac{1}{2",
        r"The answer is \boxed{\frac{1}{2}}. To check: \boxed{\frac{1}{",
        r"The answer is $\{1, 2\}$.",
    ]
    golds = [r"\frac{1}{2}"] * 4 + [r"\{1, 2\}"]
    assert [extract_latex_answer(c) for c in completions] == [None, None, None, r"\frac{1}{2}", r"\{1, 2\}"]
    assert reward(["q"] * 5, completions, answer=golds) == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_missing_answers_and_unusable_golds(reward):
    completions = [r"\boxed{\frac12}", "I am not sure.", r"\boxed{1}", r"\boxed{1}"]
    golds = [r"The answer is $\boxed{0.5}$", r"\frac12", None, ""]
    assert reward(["q"] * 4, completions, answer=golds) == [1.0, 0.0, None, None]


def test_answer_column_and_name_are_configurable():
    reward = MathAccuracyReward("solution", name="math_solution")
    try:
        assert reward(["q"], [r"\boxed{0.25}"], solution=[r"So $\boxed{\dfrac14}$."]) == [1.0]
        with pytest.raises(KeyError, match="'solution'"):
            reward(["q"], [r"\boxed{1}"], answer=["1"])
        rewards, errors = compute_rewards([reward], ["q"], [r"\boxed{2}"], columns={"solution": ["2.0"]})
        assert rewards == [[1.0]] and errors == {"math_solution": 0}
    finally:
        reward.close()


def test_a_hanging_comparison_scores_zero_within_its_timeout_and_the_next_one_works():
    reward = make_math_accuracy_reward(timeout=1.0)
    try:
        assert reward(["q"], [r"\boxed{4}"], answer=["4.0"]) == [1.0]  # starts the worker (not timed)
        start = time.monotonic()
        assert reward(["q"], [r"\boxed{9^{9^{9^{9}}}}"], answer=["5"]) == [0.0]  # sympy would take minutes
        assert 1.0 <= time.monotonic() - start < 2.5
        assert reward(["q"], [r"\boxed{\frac{6}{4}}"], answer=["1.5"]) == [1.0]  # on a new worker
    finally:
        reward.close()


def test_the_worker_module_judges_directly():
    """`latex_worker` imported here: the verdicts it sends, one line per `[gold, prediction]` after `ready`."""
    judge = latex_worker.Judge()
    assert judge("\\frac{1}{2}", "0.5") is True and judge("2", "3") is False
    assert judge("", "3") is None  # math-verify cannot read the gold
    out = io.StringIO()
    latex_worker.serve(judge, ['["1.5", "\\\\frac{3}{2}"]\n', '["x = 5", "6"]\n'], out)
    assert out.getvalue() == "ready\ntrue\nfalse\n"


def test_registry_and_the_gsm8k_accuracy_reward_is_unchanged():
    assert REWARD_FACTORIES["math_accuracy"].endswith(":make_math_accuracy_reward")
    (reward,) = get_reward_funcs("math_accuracy")
    try:
        assert isinstance(reward, MathAccuracyReward) and reward.__name__ == "math_accuracy_reward"
        assert reward(["q"], [r"\boxed{\sqrt{4}}"], answer=["2"]) == [1.0]
    finally:
        reward.close()
    assert accuracy_reward(["q"], [r"\boxed{\sqrt{4}}"], answer=["2"]) == [0.0]  # numbers only, as before
    assert accuracy_reward(["q"], ["#### 1,080"], answer=["1080"]) == [1.0]


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def _live_descendants(pid: int) -> set[int]:
    """Processes below pid (zombies excluded), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = dict(line.split(":\t", 1) for line in (entry / "status").read_text().splitlines())
            except (OSError, ValueError):
                continue
            if not status.get("State", "").startswith("Z"):
                parents[int(entry.name)] = int(status["PPid"])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_the_worker_dies_with_the_training_process():
    script = (
        "import threading, time\n"
        "from grpo_hf.rewards import make_math_accuracy_reward\n"
        "reward = make_math_accuracy_reward(timeout=60)\n"
        "reward(['q'], [r'\\boxed{1}'], answer=['2'])\n"  # the worker is up
        "hang = (['q'], [r'\\boxed{9^{9^{9^{9}}}}'])\n"
        "threading.Thread(target=reward, args=hang, kwargs={'answer': ['5']}).start()\n"
        "print('hanging', flush=True)\n"
        "time.sleep(60)\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline() == "hanging\n"
        time.sleep(0.5)  # the worker is busy with a comparison that holds the GIL
        workers = _live_descendants(trainer.pid)
        assert len(workers) == 2  # the watcher and the worker
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, "the math-verify worker outlived the training process"
        time.sleep(0.1)
