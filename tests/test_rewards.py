"""Reward functions: answer extraction on real-looking model outputs, format checks, registry, calling machinery."""

import asyncio
import functools
import math
import re
import signal
import threading
import time
import types
import warnings
from fractions import Fraction

import pytest

from grpo_hf.rewards import (
    REWARD_FUNCS,
    accuracy_reward,
    answers_match,
    completion_text,
    compute_rewards,
    extract_answer,
    extract_gold,
    format_reward,
    get_reward_funcs,
    gsm8k_format_reward,
    is_reward_func_name,
    make_accuracy_reward,
    needs_main_thread,
    parse_number,
    reward_func_name,
    soft_overlong_punishment,
    tag_count_reward,
)

REASONING = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48 + 24 = 72 clips in April and May.\n"
)
CONTINUATION = (
    "\n\nQuestion: Tom has 5 apples and buys 3 more. How many apples does he have?\nTom has 5 + 3 = 8 apples.\n"
)


def chat(text):
    return [{"role": "assistant", "content": text}]


# (completion, gold, expected accuracy reward)
ACCURACY_CASES = [
    # --- every marker, right answer
    (REASONING + "#### 72", "72", 1.0),
    (REASONING + "So the total is \\boxed{72}.", "72", 1.0),
    (REASONING + "So the answer is $\\boxed{72}$.", "72", 1.0),
    ("<think>\n48 + 24 = 72\n</think>\n<answer>\n72\n</answer>", "72", 1.0),
    (REASONING + "She earns 9 * 8 = 72 dollars. The answer is $72.00.", "72", 1.0),
    (REASONING + "The answer is 72", "72", 1.0),
    (REASONING + "The final answer is 72.", "72", 1.0),
    (REASONING + "**Final Answer:** 72", "72", 1.0),
    (REASONING + "Final answer: 72 clips", "72", 1.0),
    (REASONING + "Answer: 72", "72", 1.0),
    (REASONING + "ANSWER: 72", "72", 1.0),
    (REASONING + "The answer is: 72", "72", 1.0),
    (REASONING + "The answer is **72**.", "72", 1.0),
    (REASONING + "The answer is\n\n72", "72", 1.0),
    (REASONING + "The final answer is: $\\boxed{72}$", "72", 1.0),
    ("\\(\\boxed{72}\\)", "72", 1.0),
    ("\\[\\boxed{72}\\]", "72", 1.0),
    ("\\boxed {72}", "72", 1.0),
    ("\\fbox{72}", "72", 1.0),
    ("<answer>\\boxed{72}</answer>", "72", 1.0),
    (chat(REASONING + "\\boxed{72}"), "72", 1.0),
    (chat("<think>\nadd them\n</think>\n<answer>72</answer>"), "72", 1.0),
    # --- thousands separators, currency
    ("#### 1,080", "1080", 1.0),
    ("#### 1080", "1,080", 1.0),
    ("\\boxed{1{,}080}", "1080", 1.0),
    ("\\boxed{1\\,080}", "1080", 1.0),
    ("The answer is $1,080.", "1080", 1.0),
    ("The answer is 1,000,000", "1000000", 1.0),
    ("$\\boxed{\\$72}$", "72", 1.0),
    ("The answer is €72.", "72", 1.0),
    ("<answer>Janet makes $18 every day at the market.</answer>", "18", 1.0),
    # --- negatives
    ("The answer is -7.", "-7", 1.0),
    ("\\boxed{-7}", "-7", 1.0),
    ("The answer is \u22127", "-7", 1.0),
    ("#### -$7", "-7", 1.0),
    ("The answer is 7", "-7", 0.0),
    ("\\boxed{-7}", "7", 0.0),
    # --- percent (the sign is dropped, the value is not divided by 100)
    ("The answer is 25%.", "25", 1.0),
    ("\\boxed{25\\%}", "25", 1.0),
    ("The answer is 0.25", "25", 0.0),
    # --- units
    ("The answer is 18 dollars.", "18", 1.0),
    ("#### 18 dollars per day", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{\\text{18 apples}}", "18", 1.0),
    ("\\boxed{60 km/h}", "60", 1.0),
    ("\\boxed{5 m^2}", "5", 1.0),
    ("The answer is 72 apples and 3 oranges.", "72", 1.0),
    ("The answer is $15/hour.", "15", 1.0),
    # --- decimals, fractions, LaTeX
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("The answer is 3/4.", "0.75", 1.0),
    ("The answer is 0.75", "3/4", 1.0),
    ("The answer is \\(\\tfrac{1}{3}\\).", "1/3", 1.0),
    ("The answer is 0.33", "1/3", 0.0),
    ("\\boxed{0.5}", "1/2", 1.0),
    ("The answer is .5", "0.5", 1.0),
    ("The answer is 72.0", "72", 1.0),
    ("#### 72.00", "72", 1.0),
    ("The answer is 72.5", "72", 0.0),
    ("\\boxed{72.000001}", "72", 0.0),
    ("The answer is 2.5", "2.50", 1.0),
    ("\\boxed{\\left(72\\right)}", "72", 1.0),
    ("\\boxed{\\mathbf{72}}", "72", 1.0),
    ("\\boxed{{72}}", "72", 1.0),
    # --- equations: the value after the last `=`
    ("\\boxed{x = 72}", "72", 1.0),
    ("\\boxed{9 \\times 8 = 72}", "72", 1.0),
    ("#### 9 * 8 = 72", "72", 1.0),
    ("The answer is 9 * 8 = 72.", "72", 1.0),
    ("The answer is 9 * 8 = 72.", "9", 0.0),
    ("The answer is 9 x 8 = 72.", "72", 1.0),
    ("The answer is 144 / 2 = 72 cookies", "72", 1.0),
    # --- expressions are not evaluated and never pay
    ("\\boxed{9 \\times 8}", "72", 0.0),
    ("\\boxed{9 \\times 8}", "9", 0.0),
    ("\\boxed{2^3}", "2", 0.0),
    ("\\boxed{x + 2}", "2", 0.0),
    # --- wrong answers in tempting spots
    ("She has 72 apples at first. After giving away 10, she has 62 left.\n#### 62", "72", 0.0),
    (REASONING + "The answer is 72." + CONTINUATION + "#### 8", "72", 1.0),  # made-up continuation is ignored
    (REASONING + "The answer is 72." + CONTINUATION + "#### 8", "8", 0.0),  # ... and never pays
    ("#### 72" + CONTINUATION + "The answer is 8.", "8", 0.0),
    ("\\boxed{72}\n\nHuman: what about 10 apples? \\boxed{10}", "72", 1.0),
    ("The answer is 72.<|im_end|>\n<|im_start|>user\nNow \\boxed{9}", "72", 1.0),
    ("\\boxed{5}\n**Question:** a new one. \\boxed{72}", "72", 0.0),
    ("So \\boxed{5}. Wait, I made an error above. The answer is 72.", "72", 1.0),  # the last marker wins
    ("So \\boxed{5}. Wait, I made an error above. The answer is 72.", "5", 0.0),
    ("The answer is 72. Actually, 70 + 3 = 73, so the answer is 73.", "72", 0.0),
    ("\\boxed{72} or maybe \\boxed{73}", "72", 0.0),
    ("#### 72\nI hope this helps! Ask me about the other 15 apples.", "72", 1.0),  # trailing text changes nothing
    ("#### 72\nI hope this helps! Ask me about the other 15 apples.", "15", 0.0),
    # --- no marker: 0.0
    ("The total is 72 apples.", "72", 0.0),
    (REASONING, "72", 0.0),
    ("", "72", 0.0),
    ("#### Step 1: Find the total\n48 + 24 = 72", "1", 0.0),  # a markdown heading is not a marker
    ("#### Step 1: Find the total\n48 + 24 = 72", "72", 0.0),
    ("##### 72", "72", 0.0),
    ("the answer is the sum of 48 and 24, which is 72", "48", 0.0),
    ("To find the answer: 3 + 4 = 7 apples.", "3", 0.0),  # "answer:" mid-sentence is not a marker
    ("The total is \\boxed{72", "72", 0.0),  # truncated, unclosed
    ("<answer>72", "72", 0.0),
    ("<answer>48 and 24</answer>", "48", 0.0),  # two numbers: ambiguous
    # --- gold forms
    ("\\boxed{72}", 72, 1.0),
    ("\\boxed{72}", 72.0, 1.0),
    ("\\boxed{72}", "72.0", 1.0),
    ("\\boxed{72}", "$72", 1.0),
    ("\\boxed{72}", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72", 1.0),
    ("\\boxed{72}", "seventy-two", None),
    ("\\boxed{72}", "", None),
    ("\\boxed{72}", None, None),
    ("no answer here", None, None),
]


def test_accuracy_table_is_large():
    assert len(ACCURACY_CASES) >= 80


@pytest.mark.parametrize(("completion", "gold", "expected"), ACCURACY_CASES)
def test_accuracy_reward_table(completion, gold, expected):
    prompt = [{"role": "user", "content": "q"}] if isinstance(completion, list) else "q"
    assert accuracy_reward(prompts=[prompt], completions=[completion], answer=[gold]) == [expected]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("#### 72", "72"),
        ("#### 1,080", "1080"),
        ("The answer is $72.00.", "72"),
        ("\\boxed{-7}", "-7"),
        ("\\boxed{\\frac{3}{4}}", "0.75"),  # terminating fractions print as decimals
        ("\\boxed{\\frac{6}{3}}", "2"),
        ("\\boxed{1/3}", "1/3"),
        ("\\boxed{-\\frac{2}{6}}", "-1/3"),
        ("The answer is .50", "0.5"),
        ("The answer is 1e6", "1000000"),
        ("The answer is 0.125", "0.125"),
        ("\\boxed{3/0}", None),
        ("\\boxed{x + 2}", None),
        ("no marker 5 6 7", None),
        (chat("The answer is 12."), "12"),
    ],
)
def test_extract_answer_canonical(text, expected):
    assert extract_answer(text) == expected


def test_fallback_last_number_is_opt_in():
    assert extract_answer("In total she pays $1,080 for 3 tickets, so 1,080.") is None
    assert extract_answer("In total she pays $1,080 for 3 tickets, so 1,080.", fallback_last_number=True) == "1080"
    assert extract_answer("the difference is -7", fallback_last_number=True) == "-7"
    assert extract_answer("no numbers", fallback_last_number=True) is None
    # A marker that holds no single number is an answer (None); the fallback does not override it.
    assert extract_answer("\\boxed{x + 2} so 72", fallback_last_number=True) is None
    reward = make_accuracy_reward(fallback_last_number=True)
    assert reward(["q", "q"], ["The total is 72 apples.", "The total is 71."], answer=["72", "72"]) == [1.0, 0.0]
    assert accuracy_reward(["q"], ["The total is 72 apples."], answer=["72"]) == [0.0]


# A GSM8K-format fixture written for these tests (not read from any dataset).
GSM8K_GOLDS = [
    ("A baker makes 12 * 4 = <<12*4=48>>48 muffins.\nShe sells 48 - 6 = <<48-6=42>>42 of them.\n#### 42", "42"),
    ("The tickets cost 4 * 250 = $<<4*250=1000>>1,000 in total.\n#### 1,000", "1000"),
    ("He walks 3 / 2 = <<3/2=1.5>>1.5 miles a day.\nIn 8 days that is 1.5 * 8 = <<1.5*8=12>>12 miles.\n#### 12", "12"),
    ("The share is 1,200 / 4 = $<<1200/4=300>>300.\nSo each gets $300 - $50 = $<<300-50=250>>250.\n#### 250", "250"),
    ("Week one: 2 + 3 = <<2+3=5>>5\nWeek two: 5 * 2 = <<5*2=10>>10\nTotal: 5 + 10 = <<5+10=15>>15\n#### 15", "15"),
    ("A tank holds 70,000 liters.\nIt loses 70000 * 0.1 = <<70000*0.1=7000>>7000.\n#### 63000", "63000"),
]


@pytest.mark.parametrize(("solution", "expected"), GSM8K_GOLDS)
def test_extract_gold_from_gsm8k_solution(solution, expected):
    assert extract_gold(solution) == expected
    assert accuracy_reward(["q"], [f"so \\boxed{{{expected}}}"], answer=[solution]) == [1.0]
    assert accuracy_reward(["q"], ["so \\boxed{7}"], answer=[solution]) == [0.0]


@pytest.mark.parametrize(
    ("gold", "expected"),
    [(72, "72"), (72.0, "72"), (0.5, "0.5"), (Fraction(1, 3), "1/3"), ("72", "72"), (" $1,080 ", "1080"),
     ("\\frac{3}{4}", "0.75"), ("18 dollars", "18"), ("The answer is 5", "5"), ("-3", "-3"), (True, None),
     (float("nan"), None), (None, None), ("", None), ("5 and 6", None)],
)  # fmt: skip
def test_extract_gold_values(gold, expected):
    assert extract_gold(gold) == expected


def test_answers_match_rules():
    assert answers_match("72", "72") and answers_match("72.00", 72) and answers_match(72, "72.0")
    assert not answers_match("71.99999999", "72")  # integer gold: exact
    assert answers_match("0.75", "3/4") and answers_match(Fraction(1, 3), "1/3")
    assert answers_match("0.3333333333", "1/3")  # non-integer gold: relative tolerance 1e-6
    assert not answers_match("0.333", "1/3")
    assert not answers_match(None, "1") and not answers_match("1", None) and not answers_match(None, None)
    assert parse_number("$1,080.50") == Fraction(216100, 200)
    assert parse_number("-7") == -7 and parse_number("3/4") == Fraction(3, 4) and parse_number("abc") is None
    assert parse_number(float("inf")) is None and parse_number(False) is None


def test_completion_text_forms():
    assert completion_text("x") == "x"
    assert completion_text([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}]) == "a\nb"
    assert completion_text({"role": "assistant", "content": [{"type": "text", "text": "hi"}]}) == "hi"
    assert completion_text(None) == ""


# ---------------------------------------------------------------------------------------------------------------------
# Format rewards
# ---------------------------------------------------------------------------------------------------------------------

FORMAT_CASES = [
    ("<think>\nreasoning\n</think>\n<answer>\n72\n</answer>", 1.0),
    ("<think>reasoning</think>\n<answer>72</answer>", 1.0),
    ("  <think>reasoning</think>\n\n<answer>72</answer>\n", 1.0),  # whitespace around and between is fine
    ("<think>reasoning</think><answer>72</answer>", 1.0),
    ("<think>reasoning</think>\n<answer>72</answer> extra text", 0.0),
    ("preamble <think>reasoning</think>\n<answer>72</answer>", 0.0),
    ("<think></think>\n<answer>72</answer>", 0.0),  # empty reasoning
    ("<think>reasoning</think>\n<answer> </answer>", 0.0),  # empty answer
    ("<think>reasoning</think>\nsome text\n<answer>72</answer>", 0.0),
    ("<answer>72</answer>\n<think>reasoning</think>", 0.0),  # wrong order
    ("<think>a</think>\n<think>b</think>\n<answer>72</answer>", 0.0),  # duplicated tag
    ("<think>a <answer>1</answer></think>\n<answer>72</answer>", 0.0),
    ("<think>reasoning\n<answer>72</answer>", 0.0),  # missing </think>
    ("#### 72", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_format_reward(completion, expected):
    assert format_reward(["q"], [completion]) == [expected]
    assert format_reward([[{"role": "user", "content": "q"}]], [chat(completion)]) == [expected]


GSM8K_FORMAT_CASES = [
    ("48 + 24 = 72 clips.\n#### 72", 1.0),
    ("Step one.\nStep two.\n\n#### 1,080\n", 1.0),
    ("She owes money.\n#### -7", 1.0),
    ("Half of it.\n#### 0.5", 1.0),
    ("It costs $5.\n#### $5", 1.0),
    ("#### 72", 0.0),  # no reasoning
    ("48 + 24 = 72 clips. #### 72", 0.0),  # not on its own line
    ("48 + 24 = 72.\n#### 72\nHope this helps!", 0.0),  # not the last line
    ("48 + 24 = 72.\n#### 72 clips", 0.0),  # only the number on the line
    ("48 + 24 = 72.\n#### 70\n#### 72", 0.0),  # twice
    ("48 + 24 = 72.\n#### seventy-two", 0.0),
    ("48 + 24 = 72.\nThe answer is 72.", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), GSM8K_FORMAT_CASES)
def test_gsm8k_format_reward(completion, expected):
    assert gsm8k_format_reward(["q"], [completion]) == [expected]
    assert gsm8k_format_reward(["q"], [chat(completion)]) == [expected]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>\nr\n</think>\n<answer>\n72\n</answer>", 1.0),
        ("<think>\nr\n</think>\n<answer>72</answer>", 0.5),  # "\n<answer>\n" and "\n</answer>" missing
        ("<think>r</think><answer>72</answer>", 0.0),
        ("<think>\nr\n</think>\n", 0.5),
        ("<think>\nr\n</think>\n<think>\nr\n</think>\n<answer>\n72\n</answer>", 0.5),  # duplicates earn nothing
        ("just text", 0.0),
    ],
)
def test_tag_count_reward(completion, expected):
    assert tag_count_reward(["q"], [completion]) == [expected]


def test_soft_overlong_punishment_boundaries():
    reward = soft_overlong_punishment(max_completion_length=100, soft_punish_cache=20)
    lengths = [0, 79, 80, 81, 90, 99, 100, 101, 500]
    got = reward(["q"] * len(lengths), ["c"] * len(lengths), completion_ids=[[7] * n for n in lengths])
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0, -1.0])
    assert reward_func_name(reward) == "soft_overlong_punishment"
    with pytest.raises(ValueError, match="completion_ids"):
        reward(["q"], ["c"])
    with pytest.raises(ValueError, match="soft_punish_cache"):
        soft_overlong_punishment(100, 0)
    with pytest.raises(ValueError, match="soft_punish_cache"):
        soft_overlong_punishment(100, 101)


# ---------------------------------------------------------------------------------------------------------------------
# Registry and names
# ---------------------------------------------------------------------------------------------------------------------


def constant_reward(prompts, completions, **kwargs):
    return [0.5] * len(completions)


def test_registry_lookups():
    assert {"accuracy", "format", "format_gsm8k", "tag_count"} <= set(REWARD_FUNCS)
    assert get_reward_funcs("accuracy") == [accuracy_reward]
    assert get_reward_funcs(["format", "format_gsm8k", "tag_count"]) == [
        format_reward,
        gsm8k_format_reward,
        tag_count_reward,
    ]
    assert get_reward_funcs(constant_reward) == [constant_reward]
    assert get_reward_funcs(["accuracy", constant_reward])[1] is constant_reward
    assert [reward_func_name(f) for f in REWARD_FUNCS.values()] == [
        "accuracy_reward",
        "format_reward",
        "gsm8k_format_reward",
        "tag_count_reward",
    ]


def test_registry_import_paths():
    assert get_reward_funcs("grpo_hf.rewards:accuracy_reward") == [accuracy_reward]
    (func,) = get_reward_funcs(f"{__name__}:constant_reward")
    assert func is constant_reward
    assert is_reward_func_name("accuracy") and is_reward_func_name("pkg.mod:fn")
    assert not is_reward_func_name("Qwen/Qwen2.5-0.5B") and not is_reward_func_name("./checkpoints/rm")
    with pytest.raises(ValueError, match="Cannot import module 'no_such_module_xyz'"):
        get_reward_funcs("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        get_reward_funcs("grpo_hf.rewards:nope")
    with pytest.raises(ValueError, match="not a callable"):
        get_reward_funcs("grpo_hf.rewards:REWARD_FUNCS")


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError) as info:
        get_reward_funcs(["accuracy", "acuracy"])
    message = str(info.value)
    assert "'acuracy'" in message and "package.module:function" in message
    for name in REWARD_FUNCS:
        assert name in message


def test_reward_func_name():
    class Scorer:
        def __call__(self, prompts, completions, **kwargs):
            return [0.0] * len(completions)

    assert reward_func_name(constant_reward) == "constant_reward"
    assert reward_func_name(functools.partial(constant_reward, scale=2)) == "constant_reward"
    assert reward_func_name(Scorer()) == "Scorer"
    assert reward_func_name(make_accuracy_reward("gold")) == "accuracy_reward"
    assert reward_func_name(make_accuracy_reward("gold", name="acc_gold")) == "acc_gold"
    model_like = types.SimpleNamespace(config=types.SimpleNamespace(_name_or_path="/ckpt/my-reward-model/"))
    assert reward_func_name(model_like) == "my-reward-model"


def test_accuracy_reward_column_option_and_missing_column():
    reward = make_accuracy_reward(answer_column="solution")
    assert reward(["q"], ["#### 3"], solution=["3"], answer=["4"]) == [1.0]
    with pytest.raises(KeyError, match="'answer'.*make_accuracy_reward"):
        accuracy_reward(["q"], ["#### 3"], solution=["3"])


# ---------------------------------------------------------------------------------------------------------------------
# compute_rewards
# ---------------------------------------------------------------------------------------------------------------------

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["#### 1", "bad sample", "#### 3"]


def test_compute_rewards_matrix_and_kwargs():
    seen = {}

    def spy(prompts, completions, completion_ids, trainer_state, **kwargs):
        seen.update(prompts=prompts, completion_ids=completion_ids, trainer_state=trainer_state, **kwargs)
        return [True, 2, None]

    state = object()
    rewards, errors = compute_rewards(
        [accuracy_reward, spy],
        PROMPTS,
        COMPLETIONS,
        [[1], [2, 2], [3]],
        columns={"answer": ["1", "2", "4"], "difficulty": ["easy", "hard", "easy"]},
        trainer_state=state,
    )
    assert rewards[0] == [1.0, 1.0] and rewards[2][0] == 0.0 and rewards[1][1] == 2.0
    assert math.isnan(rewards[2][1])  # None -> NaN
    assert errors == {"accuracy_reward": 0, "spy": 0}
    assert seen["trainer_state"] is state and seen["difficulty"] == ["easy", "hard", "easy"]
    assert seen["completion_ids"] == [[1], [2, 2], [3]] and seen["prompts"] == PROMPTS
    assert all(type(x) is float for row in rewards for x in row)


def test_wrong_length_names_function_and_lengths():
    def short(prompts, completions, **kwargs):
        return [1.0]

    for policy in ("raise", "skip"):
        with pytest.raises(ValueError, match="'short' returned 1 rewards for 3 completions"):
            compute_rewards([short], PROMPTS, COMPLETIONS, error_policy=policy)


def test_non_numeric_result_is_an_error():
    def words(prompts, completions, **kwargs):
        return [1.0, "high", 0.0]

    with pytest.raises(TypeError, match="'words' returned 'high' \\(str\\) for completion 1"):
        compute_rewards([words], PROMPTS, COMPLETIONS, error_policy="skip")

    def scalar(prompts, completions, **kwargs):
        return 1.0

    with pytest.raises(TypeError, match="'scalar' returned a float"):
        compute_rewards([scalar], PROMPTS, COMPLETIONS)


def test_nan_becomes_none_with_warning():
    def nan_reward(prompts, completions, **kwargs):
        return [float("nan"), 0.5, float("inf")]

    with pytest.warns(RuntimeWarning, match="'nan_reward' returned NaN/inf for 2 of 3"):
        rewards, errors = compute_rewards([nan_reward], PROMPTS, COMPLETIONS)
    assert math.isnan(rewards[0][0]) and rewards[1][0] == 0.5 and math.isnan(rewards[2][0])
    assert errors == {"nan_reward": 0}


def test_async_functions_run_concurrently():
    # Each function waits for the other's event: run one after the other, they would time out.
    events = {}

    async def ping(prompts, completions, **kwargs):
        events.setdefault("ping", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("pong", asyncio.Event()).wait(), 5)
        return [1.0] * len(completions)

    async def pong(prompts, completions, **kwargs):
        events.setdefault("pong", asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault("ping", asyncio.Event()).wait(), 5)
        return [2.0] * len(completions)

    rewards, errors = compute_rewards([ping, constant_reward, pong], PROMPTS, COMPLETIONS)
    assert rewards == [[1.0, 0.5, 2.0]] * 3 and errors == {"ping": 0, "constant_reward": 0, "pong": 0}


async def async_double(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [2.0] * len(completions)


def test_async_from_running_loop_and_from_thread():
    async def inside_loop():
        return compute_rewards([async_double], PROMPTS, COMPLETIONS)

    assert asyncio.run(inside_loop())[0] == [[2.0]] * 3
    box = {}
    thread = threading.Thread(target=lambda: box.update(out=compute_rewards([async_double], PROMPTS, COMPLETIONS)))
    thread.start()
    thread.join(10)
    assert box["out"][0] == [[2.0]] * 3


def test_async_callable_object_and_partial():
    class AsyncScorer:
        __name__ = "async_scorer"

        async def __call__(self, prompts, completions, **kwargs):
            await asyncio.sleep(0)
            return [3.0] * len(completions)

    rewards, errors = compute_rewards([AsyncScorer(), functools.partial(async_double)], PROMPTS, COMPLETIONS)
    assert rewards == [[3.0, 2.0]] * 3 and errors == {"async_scorer": 0, "async_double": 0}


def fails_on_bad(prompts, completions, **kwargs):
    for c in completions:
        if "bad" in c:
            raise ZeroDivisionError("cannot score this one")
    return [1.0] * len(completions)


async def async_fails_on_bad(prompts, completions, **kwargs):
    return fails_on_bad(prompts, completions)


@pytest.mark.parametrize("func", [fails_on_bad, async_fails_on_bad])
def test_exception_raises_with_function_and_sample(func):
    with pytest.raises(RuntimeError) as info:
        compute_rewards([func], PROMPTS, COMPLETIONS, columns={"answer": ["1", "2", "3"]})
    message = str(info.value)
    assert f"'{func.__name__}'" in message and "ZeroDivisionError: cannot score this one" in message
    assert "sample 1 of 3" in message and "'bad sample'" in message and "'p1'" in message and "answer='2'" in message
    assert "reward_error_policy='skip'" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("func", [fails_on_bad, async_fails_on_bad])
def test_skip_policy_scores_none_and_counts(func, caplog):
    rewards, errors = compute_rewards([func, constant_reward], PROMPTS, COMPLETIONS, error_policy="skip")
    assert rewards[0] == [1.0, 0.5] and rewards[2] == [1.0, 0.5]
    assert math.isnan(rewards[1][0]) and rewards[1][1] == 0.5
    assert errors == {func.__name__: 1, "constant_reward": 0}
    assert "failed on 1 of 3" in caplog.text


def test_batch_only_failure():
    def batch_only(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise MemoryError("batch too big")
        return [1.0]

    with pytest.raises(RuntimeError, match="'batch_only' raised MemoryError.*each sample passes alone.*'p0'"):
        compute_rewards([batch_only], PROMPTS, COMPLETIONS)
    rewards, errors = compute_rewards([batch_only], PROMPTS, COMPLETIONS, error_policy="skip")
    assert rewards == [[1.0]] * 3 and errors == {"batch_only": 0}


def test_timeout_sync():
    release = threading.Event()

    def slow(prompts, completions, **kwargs):
        release.wait(10)
        return [1.0] * len(completions)

    try:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"'slow' did not return within 0.2 s.*reward_timeout"):
            compute_rewards([slow, constant_reward], PROMPTS, COMPLETIONS, timeout=0.2)
        rewards, errors = compute_rewards(
            [slow, constant_reward], PROMPTS, COMPLETIONS, timeout=0.2, error_policy="skip"
        )
        assert time.perf_counter() - t0 < 5
        assert all(math.isnan(row[0]) and row[1] == 0.5 for row in rewards) and errors["slow"] == 3
        # A fast function is unaffected by the timeout.
        assert compute_rewards([constant_reward], PROMPTS, COMPLETIONS, timeout=5)[0] == [[0.5]] * 3
    finally:
        release.set()


def signal_timed_reward(completions, **kwargs):
    """A reward bounded with signal.alarm, as math-verify bounds parse and verify by default."""
    previous = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.alarm(5)
    try:
        return [float(len(c)) for c in completions]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def in_thread(fn, name="grpo_hf-scorer"):
    """fn() in a thread named as asynchronous GRPO's scorer; its result, or the exception it raised."""
    box = {}
    thread = threading.Thread(target=lambda: box.update(value=_outcome(fn)), name=name)
    thread.start()
    thread.join()
    return box["value"]


def _outcome(fn):
    try:
        return fn()
    except Exception as e:
        return e


def test_needs_main_thread_recognises_a_signal_call_off_the_main_thread():
    call = lambda: compute_rewards([signal_timed_reward], ["q", "q"], ["ab", "abc"])  # noqa: E731
    assert call() == ([[2.0], [3.0]], {"signal_timed_reward": 0})  # on the main thread: fine
    raw = in_thread(lambda: signal_timed_reward(["ab"]))
    assert isinstance(raw, ValueError) and "signal only works in main thread" in str(raw)
    assert needs_main_thread(raw)
    raised = in_thread(call)  # error_policy="raise": a RuntimeError from it, naming the function and the fix
    assert isinstance(raised, RuntimeError) and needs_main_thread(raised)
    assert "'signal_timed_reward'" in str(raised) and "works only in the main thread" in str(raised)
    assert "in the thread 'grpo_hf-scorer'" in str(raised) and "parsing_timeout=None" in str(raised)
    with pytest.raises(RuntimeError, match="works only in the main thread") as timed:  # reward_timeout's own thread
        compute_rewards([signal_timed_reward], ["q"], ["ab"], timeout=5)
    assert needs_main_thread(timed.value)
    assert call() == ([[2.0], [3.0]], {"signal_timed_reward": 0})  # what a caller does then: call it here


def test_needs_main_thread_is_that_failure_only():
    assert not needs_main_thread(ValueError("math domain error"))
    assert not needs_main_thread(RuntimeError("signal only works in main thread"))  # CPython raises a ValueError
    assert not needs_main_thread(KeyError("answer"))
    try:
        try:
            raise ValueError("signal only works in main thread of the main interpreter")
        except ValueError:
            raise TypeError("while handling it") from None  # the cause suppressed: __context__ still holds it
    except TypeError as e:
        assert needs_main_thread(e)
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a  # a cycle ends the walk
    assert not needs_main_thread(a)
    other = RuntimeError("Reward function 'f' raised ValueError: bad")
    other.__cause__ = ValueError("bad")
    assert not needs_main_thread(other)
    plain = in_thread(lambda: compute_rewards([accuracy_reward], ["q"], ["#### 3"], columns={"answer": ["3"]}))
    assert plain == ([[1.0]], {"accuracy_reward": 0})  # grpo_hf's own rewards need no main thread


def test_math_verify_parse_and_verify_off_the_main_thread_are_recognised():
    math_verify = pytest.importorskip("math_verify")
    gold = math_verify.parse("$\\frac{1}{2}$", parsing_timeout=None)
    answer = math_verify.parse("\\boxed{0.5}", parsing_timeout=None)
    for call in (lambda: math_verify.parse("\\boxed{0.5}"), lambda: math_verify.verify(gold, answer)):
        error = in_thread(call)  # math-verify's own ValueError, raised from CPython's
        assert isinstance(error, ValueError) and "signal.alarm" in str(error) and needs_main_thread(error)
    assert in_thread(lambda: math_verify.verify(gold, answer, timeout_seconds=None)) is True  # timeouts off: fine


def test_timeout_async():
    async def slow_async(prompts, completions, **kwargs):
        await asyncio.sleep(10)
        return [1.0] * len(completions)

    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"'slow_async' did not return within 0.2 s.*reward_timeout"):
        compute_rewards([slow_async], PROMPTS, COMPLETIONS, timeout=0.2)
    rewards, errors = compute_rewards(
        [slow_async, async_double], PROMPTS, COMPLETIONS, timeout=0.2, error_policy="skip"
    )
    assert time.perf_counter() - t0 < 5
    assert all(math.isnan(row[0]) and row[1] == 2.0 for row in rewards) and errors == {
        "slow_async": 3,
        "async_double": 0,
    }


def test_a_reward_function_still_running_without_a_timeout_is_reported_by_name(monkeypatch, caplog):
    """reward_timeout=None (the default) sets no limit, so a function that never returns would hang the run without
    a word: every STILL_RUNNING_AFTER seconds a warning names it (sync, and async ones together) and says how to
    bound it. A function that returns in time, or one under a timeout, is not reported."""
    from grpo_hf.rewards import calling

    monkeypatch.setattr(calling, "STILL_RUNNING_AFTER", 0.1)

    def stuck(prompts, completions, **kwargs):
        time.sleep(0.35)
        return [1.0] * len(completions)

    async def stuck_async(prompts, completions, **kwargs):
        await asyncio.sleep(0.25)
        return [1.0] * len(completions)

    with caplog.at_level("WARNING", logger="grpo_hf.rewards.calling"):
        rewards, _ = compute_rewards([stuck, stuck_async, constant_reward], PROMPTS, COMPLETIONS)
    assert rewards == [[1.0, 1.0, 0.5]] * 3
    messages = [record.getMessage() for record in caplog.records]
    assert sum("'stuck' has been running" in m for m in messages) >= 2  # reported again while it runs
    assert any("'stuck_async' has been running" in m for m in messages)
    assert all("reward_timeout=None" in m and "constant_reward" not in m for m in messages)
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_hf.rewards.calling"):
        compute_rewards([stuck, constant_reward], PROMPTS, COMPLETIONS, timeout=5)
    assert not caplog.records


def test_compute_rewards_argument_checks():
    with pytest.raises(ValueError, match="error_policy"):
        compute_rewards([constant_reward], PROMPTS, COMPLETIONS, error_policy="ignore")
    with pytest.raises(ValueError, match="timeout"):
        compute_rewards([constant_reward], PROMPTS, COMPLETIONS, timeout=0)
    with pytest.raises(ValueError, match="'answer': 2"):
        compute_rewards([constant_reward], PROMPTS, COMPLETIONS, columns={"answer": ["1", "2"]})
    with pytest.raises(ValueError, match="clashes"):
        compute_rewards([constant_reward], PROMPTS, COMPLETIONS, columns={"completions": COMPLETIONS})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compute_rewards([], PROMPTS, COMPLETIONS) == ([[], [], []], {})


def test_the_no_reward_error_suggests_registered_names():
    """The names the "No reward source provided" error suggests are registry entries (a user copies them)."""
    from grpo_hf.rewards import REWARD_FUNCS
    from grpo_hf.rewards.reward_models import build_reward_funcs

    with pytest.raises(ValueError, match="No reward source provided") as error:
        build_reward_funcs([])
    suggested = re.findall(r"'(\w+)'", re.search(r"reward_funcs=\[([^\]]*)\]", str(error.value)).group(1))
    assert suggested and all(name in REWARD_FUNCS for name in suggested)
