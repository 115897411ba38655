"""The checks of what `GRPOConfig` cannot see: the model, the tokenizer or processor, the datasets and the reward
functions. Bad inputs fail when the trainer is built, not steps into training, with a message that names the
argument or the dataset row and says what to change. Every check of the config alone runs when the config is built
(`GRPOConfig.__post_init__`); this module imports nothing of it.

What is checked when:

- `GRPOTrainer(...)`, in this order, before anything is generated:
  1. `models.build_models`: `check_local_path` (a string that can only be a local path and does not exist is
     reported as a missing path, not as an unreachable Hub) and `models.check_processing_class`.
  2. `check_inputs`, the entry point for the model and the data:
     - `check_policy_model`: a decoder-only causal LM (or an image-text-to-text model) whose vocabulary covers the
       tokenizer, a pad token, and trainable parameters (or adapters from `peft_config`);
     - `check_datasets`: each dataset (train, eval, each split of a dict of eval datasets) is map-style
       (`_require_map_style`: the one place that says which dataset types are supported) or a stream
       (`_check_stream`: the settings it needs, then its first rows are checked as below), has a 'prompt' column,
       no column named like a reward-function argument, and (train) rows for one generation batch; then one pass
       over its prompts: type, emptiness, message roles and contents, chat and plain not mixed, a chat template to
       render them; and, unless `max_prompt_length` (None by default, as TRL) already keeps prompt + completion
       within the model's positions, the token length of the longest prompts (`_check_prompt_lengths`); when it
       does, that the part of each chat prompt never cut (system messages, last user turn) fits it
       (`_check_kept_parts`).
       Large datasets are sampled (`MAX_ROWS_SCANNED`, `MAX_ROWS_TOKENIZED`) and the log says so.
  3. `rewards.reward_models.build_reward_funcs` (a reward model path goes through `check_local_path`), then
     `check_reward_funcs`: each function accepts every keyword argument it will get (or `**kwargs`) and gets every
     argument it requires.
  4. the number of `reward_weights`; `checkpoint.check_writable(output_dir)`; after `Trainer.__init__`, the EOS
     ids (`rollout.eos_token_ids_of`) and `chat_template_kwargs`.
- `evaluate(stream)` with a stream not seen at construction: `check_dataset` on it.
- At every reward call (`rewards.calling`): each value a reward function returns is an int, float, bool or None
  (`numbers.Real`; NumPy numbers and one-element arrays or tensors count too; strings, even "0.5", do not).
"""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import datasets

from grpo_hf import streams
from grpo_hf.paths import check_local_path, looks_like_local_path
from grpo_hf.peft_utils import base_model
from grpo_hf.rewards.calling import REWARD_ARGUMENTS
from grpo_hf.rollout.prompts import is_conversational, kept_part, prompt_text
from grpo_hf.rollout.vision import IMAGE_COLUMNS
from grpo_hf.values import with_article as _a
from grpo_hf.vision import is_processor, tokenizer_of

logger = logging.getLogger(__name__)

__all__ = [
    "MAX_ROWS_SCANNED",
    "MAX_ROWS_TOKENIZED",
    "check_dataset",
    "check_datasets",
    "check_inputs",
    "check_local_path",
    "check_policy_model",
    "check_reward_funcs",
    "looks_like_local_path",
    "model_max_positions",
]

MAX_ROWS_SCANNED = 100_000
"""Rows whose prompt is checked for type and content; larger datasets: a random sample of this many (1-2 s)."""
MAX_ROWS_TOKENIZED = 2_000
"""Prompts tokenized to check their length: at most this many, the longest by characters (under a second)."""
MESSAGE_ROLES = ("system", "user", "assistant", "tool")
# Text columns that usually hold the prompts (most likely first), and those that usually hold the answers: the error
# for a dataset without a 'prompt' column suggests renaming the first of its text columns named like the former.
PROMPT_LIKE_COLUMNS = ("question", "problem", "query", "instruction", "input", "messages", "conversations", "text")
ANSWER_LIKE_COLUMNS = ("answer", "solution", "response", "completion", "output", "label", "target", "ground_truth")
_CHUNK = 10_000  # rows read at once from a datasets.Dataset
_CHAT_EXAMPLE = "[{'role': 'user', 'content': 'What is 2 + 2?'}]"


# ---- the entry point -------------------------------------------------------------------------------------------
def check_inputs(
    model, processing_class, peft_config, train_dataset, eval_dataset, args, *, environments: bool = False
) -> dict:
    """The policy (`check_policy_model`) and every dataset (`check_datasets`, prompt lengths against the model's
    positions). Returns {dataset name: its columns that reach the reward functions}. With `environments`, prompts may
    be empty: each environment's `reset` writes its episode's prompt."""
    check_policy_model(model, processing_class, peft_config)
    positions = model_max_positions(model)
    return check_datasets(train_dataset, eval_dataset, processing_class, args, positions, environments)


# ---- models ----------------------------------------------------------------------------------------------------
def model_max_positions(model) -> int | None:
    """The longest sequence the policy's positions cover (`max_position_embeddings` / `n_positions`), or None."""
    config = getattr(base_model(model), "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_policy_model(model, tokenizer, peft_config=None) -> None:
    """The policy is a decoder-only causal LM (or an image-text-to-text model) whose vocabulary covers the tokenizer
    (a processor's own), and something in it trains."""
    tokenizer = tokenizer_of(tokenizer)
    base = base_model(model)
    config = base.config
    if getattr(config, "is_encoder_decoder", False) or not base.can_generate() or base.get_output_embeddings() is None:
        raise TypeError(
            f"The policy model is {_a(type(base).__name__)}, not a decoder-only causal LM: GRPO samples completions "
            "from it token by token. Load it with AutoModelForCausalLM.from_pretrained(...); a sequence-"
            "classification model belongs in reward_funcs, as a reward model."
        )
    embeddings = base.get_input_embeddings()
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(config, "vocab_size", None)
    if vocab is not None and vocab < len(tokenizer):
        raise ValueError(
            f"The policy's vocabulary has {vocab} token embeddings but the tokenizer has {len(tokenizer)} tokens, so "
            "some token ids have no embedding. Pass the tokenizer the model was trained with, or grow the model: "
            "model.resize_token_embeddings(len(tokenizer))."
        )
    if tokenizer.pad_token_id is None:
        raise ValueError(
            "The tokenizer has neither a pad token nor an EOS token to pad with. Set them to tokens the model "
            "knows, e.g. tokenizer.eos_token = '<|im_end|>' (the end of a completion; it also pads)."
        )
    if not any(param.requires_grad for param in model.parameters()):
        hint = "" if peft_config is None else " (peft_config gave no trainable adapter either)"
        raise ValueError(
            f"Every parameter of the policy is frozen (requires_grad=False){hint}: nothing would train. Unfreeze "
            "them (model.requires_grad_(True)), or pass peft_config=peft.LoraConfig(...) to train adapters."
        )


# ---- datasets --------------------------------------------------------------------------------------------------
def check_datasets(
    train_dataset, eval_dataset, tokenizer, args, model_max_positions: int | None, environments: bool = False
) -> dict:
    """Check the train dataset and every eval dataset (`check_dataset`). Returns {dataset name: its columns other
    than 'prompt' that reach the reward functions} (none with `remove_unused_columns=True`). With `environments`,
    prompts may be empty: each environment's `reset` writes its episode's prompt."""
    if train_dataset is None:
        raise ValueError("`train_dataset` is required: a datasets.Dataset with a 'prompt' column.")
    named = [("train_dataset", train_dataset)]
    if isinstance(eval_dataset, dict) and isinstance(eval_dataset.get("prompt"), list):
        raise TypeError(
            "eval_dataset is a dict of columns; wrap it: eval_dataset=datasets.Dataset.from_dict(columns). (A dict of "
            "datasets, one per split, is fine.)"
        )
    if isinstance(eval_dataset, dict):  # DatasetDict / a plain dict: Trainer evaluates each split
        named += [(f"eval_dataset[{key!r}]", split) for key, split in eval_dataset.items()]
    elif eval_dataset is not None:
        named.append(("eval_dataset", eval_dataset))
    return {
        name: check_dataset(
            dataset, name, tokenizer, args, model_max_positions, name == "train_dataset", empty_ok=environments
        )
        for name, dataset in named
    }


def check_dataset(
    dataset, name: str, tokenizer, args, model_max_positions: int | None, is_train=True, empty_ok: bool = False
) -> list[str]:
    """One dataset: its type, columns and size, then one pass over its prompts (a stream: `_check_stream`). Returns
    its reward columns."""
    if streams.is_stream(dataset):
        return _check_stream(dataset, name, tokenizer, args, model_max_positions, is_train, empty_ok)
    _require_map_style(dataset, name)
    return _check_rows(dataset, name, tokenizer, args, model_max_positions, is_train, empty_ok)


def _check_stream(
    dataset, name: str, tokenizer, args, model_max_positions: int | None, is_train: bool, empty_ok: bool = False
) -> list[str]:
    """A stream (`datasets.IterableDataset`): what it needs from the config, then its first rows
    (`streams.STREAM_ROWS_CHECKED`) as a dataset's are checked; later rows are not read before training."""
    if args.accelerator_config.dispatch_batches:
        raise ValueError(  # TRL's opening words
            f"Iterable datasets require `dispatch_batches=False`: {name} is a stream, which every process reads for "
            "its share of each batch, but accelerator_config sets dispatch_batches=True. Set it to False."
        )
    if is_train and args.max_steps <= 0:
        raise ValueError(
            f"{name} is a stream (IterableDataset): it has no length, so the number of training steps is unknown. "
            "Set max_steps, e.g. GRPOConfig(max_steps=1000)."
        )
    if is_train and args.dynamic_sampling:
        raise ValueError(
            f"dynamic_sampling draws extra prompts from {name} by index, and a stream (IterableDataset) has none. "
            "Turn dynamic_sampling off, or load the dataset without streaming=True."
        )
    if is_train and args.dataloader_num_workers != 0:
        logger.warning(
            f"{name} is a stream (IterableDataset): it is read by a single loader worker, so that each prompt's "
            f"{args.num_generations} copies stay together; dataloader_num_workers={args.dataloader_num_workers} "
            "does not apply to it."
        )
    prompts_per_batch = args.generation_batch_size // args.num_generations
    rows = streams.first_rows(dataset, max(streams.STREAM_ROWS_CHECKED, prompts_per_batch if is_train else 0))
    if not rows:
        raise ValueError(f"{name} is an empty stream: it needs at least one prompt.")
    if is_train and len(rows) < prompts_per_batch:
        raise ValueError(
            f"{name} streams {len(rows)} prompts but one generation batch takes {prompts_per_batch} "
            f"(generation_batch_size={args.generation_batch_size} / num_generations={args.num_generations}): "
            "training could not make a step. Add prompts, or lower per_device_train_batch_size / "
            "steps_per_generation."
        )
    return _check_rows(rows, name, tokenizer, args, model_max_positions, False, empty_ok)


def _check_rows(
    dataset, name: str, tokenizer, args, model_max_positions: int | None, is_train: bool, empty_ok: bool = False
) -> list[str]:
    """A map-style dataset's (or a stream's first rows') size, columns and prompts."""
    if len(dataset) == 0:
        raise ValueError(f"{name} is empty: it needs at least one prompt.")
    columns = _columns(dataset, name)
    if "prompt" not in columns and not empty_ok:
        raise _no_prompt_column(dataset, name, columns)
    reward_columns = [] if args.remove_unused_columns else [c for c in columns if c != "prompt"]
    clashing = [c for c in reward_columns if c in REWARD_ARGUMENTS]
    if clashing:
        column = clashing[0]
        raise ValueError(
            f"{name} has a column named {column!r}, like a reward-function argument ({', '.join(REWARD_ARGUMENTS)}). "
            f"Rename it, e.g. dataset.rename_column({column!r}, 'my_{column}')."
        )
    prompts_per_batch = args.generation_batch_size // args.num_generations
    if is_train and len(dataset) < prompts_per_batch:
        raise ValueError(
            f"{name} has {len(dataset)} prompts but one generation batch takes {prompts_per_batch} "
            f"(generation_batch_size={args.generation_batch_size} / num_generations={args.num_generations}). Add "
            "prompts, or lower per_device_train_batch_size / steps_per_generation."
        )
    if set(IMAGE_COLUMNS) & set(columns) and not is_processor(tokenizer):
        raise ValueError(
            f"{name} has image columns ({', '.join(sorted(set(IMAGE_COLUMNS) & set(columns)))}) but "
            "processing_class is a tokenizer, not a processor: pass the vision-language model's processor "
            "(AutoProcessor.from_pretrained(...)), or None to load the model's own (docs/vision.md)."
        )
    if "prompt" not in columns:  # environments: each row's episode starts from the prompt its `reset` writes
        return reward_columns
    indices, prompts = _scan_prompts(dataset, name, seed=args.seed, empty_ok=empty_ok)
    if is_conversational(prompts[0]) and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{name} holds chat prompts (lists of messages) but the tokenizer has no chat_template to render them. "
            "Set tokenizer.chat_template, or make the prompts plain strings."
        )
    _check_prompt_lengths(indices, prompts, name, tokenizer, args, model_max_positions)
    return reward_columns


def _require_map_style(dataset, name: str) -> None:
    """The one place that says which dataset types the trainer takes, besides streams (`datasets.IterableDataset`,
    `_check_stream`): map-style datasets (`datasets.Dataset`, or any object with `__len__` and `__getitem__` returning
    dicts)."""
    kind = type(dataset).__name__
    if isinstance(dataset, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise TypeError(f"{name} is {_a(kind)} with splits {list(dataset)}; pass one split, e.g. dataset['train'].")
    if isinstance(dataset, (list, tuple)):
        fix = "datasets.Dataset.from_list(rows) (rows: dicts with a 'prompt' key)"
        if dataset and not isinstance(dataset[0], Mapping):
            fix = "datasets.Dataset.from_dict({'prompt': prompts})"
        raise TypeError(f"{name} is a plain Python {kind}; wrap it: {name.split('[')[0]}={fix}.")
    if isinstance(dataset, Mapping):
        raise TypeError(f"{name} is {_a(kind)}; for a dict of columns use datasets.Dataset.from_dict(columns).")
    if kind == "DataFrame":
        raise TypeError(f"{name} is a DataFrame; convert it: datasets.Dataset.from_pandas(df, preserve_index=False).")
    if not hasattr(dataset, "__len__"):
        raise ValueError(
            f"{name} is {_a(kind)} without a length. Pass a datasets.Dataset, or for a stream a "
            "datasets.IterableDataset (e.g. datasets.IterableDataset.from_generator(rows)), which the trainer knows "
            "how to keep each prompt's group together in."
        )
    if not hasattr(dataset, "__getitem__"):
        raise TypeError(f"{name} is {_a(kind)} without __getitem__; pass a datasets.Dataset.")


def _row(dataset, index: int, name: str) -> Mapping:
    row = dataset[index]
    if not isinstance(row, Mapping):
        raise TypeError(
            f"{name} row {index} is {_a(type(row).__name__)}; each row must be a dict with a 'prompt' key (a "
            "datasets.Dataset built with Dataset.from_list / from_dict is)."
        )
    return row


def _no_prompt_column(dataset, name: str, columns: list[str]) -> ValueError:
    """The error for a dataset without a 'prompt' column: its columns, and the rename that likely fixes it."""
    likely = _likely_prompt_column(_row(dataset, 0, name), columns)
    if likely is not None:
        fix = f"e.g. dataset.rename_column({likely!r}, 'prompt') if {likely!r} holds them"
    else:
        fix = "or build it from the columns you have: dataset.map(lambda row: {'prompt': ...})"
    return ValueError(
        f"{name} has no 'prompt' column (found: {columns}). Rename the column that holds the prompts (text or chat "
        f"messages) to 'prompt', {fix}."
    )


def _likely_prompt_column(first_row: Mapping, columns: list[str]) -> str | None:
    """The column that most likely holds the prompts, from the dataset's first row: of the columns holding text or
    chat messages, the first named as prompts often are (`PROMPT_LIKE_COLUMNS`, in that order), else the first not
    named as answers are (`ANSWER_LIKE_COLUMNS`); None when there is none."""

    def holds_prompts(column: str) -> bool:
        value = first_row.get(column)
        return (isinstance(value, str) and value.strip() != "") or is_conversational(value)

    texts = [column for column in columns if holds_prompts(column)]
    by_name = {column.lower(): column for column in texts}
    named = [by_name[known] for known in PROMPT_LIKE_COLUMNS if known in by_name]
    others = [column for column in texts if column.lower() not in ANSWER_LIKE_COLUMNS]
    return next(iter(named + others), None)


def _columns(dataset, name: str) -> list[str]:
    columns = getattr(dataset, "column_names", None)
    return list(columns) if columns is not None else list(_row(dataset, 0, name))


def _read_prompts(dataset, indices: Sequence[int], name: str) -> list:
    """The prompts of rows `indices`: column chunks of a `datasets.Dataset` (fast), else row by row."""
    if not isinstance(dataset, datasets.Dataset):
        return [_row(dataset, i, name)["prompt"] for i in indices]
    dataset = dataset.with_format(None)  # plain Python values whatever format the user set
    prompts: list = []
    for start in range(0, len(indices), _CHUNK):
        chunk = indices[start : start + _CHUNK]
        key = slice(chunk[0], chunk[-1] + 1) if isinstance(chunk, range) else list(chunk)
        prompts.extend(dataset[key]["prompt"])
    return prompts


def _scan_prompts(dataset, name: str, seed: int, empty_ok: bool = False) -> tuple[Sequence[int], list]:
    """Check every prompt (a random sample of `MAX_ROWS_SCANNED` for larger datasets): type and content, and chat and
    plain prompts not mixed. Returns the row indices checked and their prompts."""
    n = len(dataset)
    indices: Sequence[int] = range(n)
    if n > MAX_ROWS_SCANNED:
        indices = sorted(random.Random(seed).sample(range(n), MAX_ROWS_SCANNED))
        logger.info(
            "Checking the prompts of %d random rows of %s's %d (grpo_hf.validation.MAX_ROWS_SCANNED).",
            MAX_ROWS_SCANNED, name, n,
        )  # fmt: skip
    prompts = _read_prompts(dataset, indices, name)
    first_of_kind: dict[bool, int] = {}
    for index, prompt in zip(indices, prompts, strict=True):
        problem = _prompt_problem(prompt)
        if problem is not None and not (empty_ok and problem[1] == _NO_CONTENT):
            raise (TypeError if problem[0] == "type" else ValueError)(
                f"{name} row {index}: 'prompt' {problem[1]}. A prompt is a non-empty string, or a non-empty list of "
                f"chat messages like {_CHAT_EXAMPLE} (roles: {', '.join(MESSAGE_ROLES)}). Fix or drop the row, e.g. "
                "with dataset.filter(...)."
            )
        first_of_kind.setdefault(not isinstance(prompt, str), index)
        if len(first_of_kind) == 2:
            raise ValueError(
                f"{name} mixes chat prompts (row {first_of_kind[True]} is a list of messages) and plain prompts (row "
                f"{first_of_kind[False]} is a string). Use one kind: e.g. wrap each string s as "
                "[{'role': 'user', 'content': s}]."
            )
    return indices, prompts


_NO_CONTENT = "has no message with any content"


def _prompt_problem(prompt: Any) -> tuple[str, str] | None:
    """What is wrong with one prompt, as ("type" | "value", description); None when it is fine."""
    if isinstance(prompt, str):
        return ("value", "is empty (or only whitespace)") if not prompt.strip() else None
    if prompt is None:
        return "value", "is missing (None)"
    if isinstance(prompt, Mapping):
        return "type", "is a single message (a dict), not a list of messages: wrap it in a list"
    if not isinstance(prompt, list):
        return "type", f"is {_a(type(prompt).__name__)}"
    if len(prompt) == 0:
        return "value", "is an empty list of messages"
    for k, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            return "type", f"is a list whose item {k} is {_a(type(message).__name__)}, not a message dict"
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            return "value", f"message {k} has role {role!r}"
        if not isinstance(content, str) and _parts_problem(content) is not None:
            return "type", f"message {k} ({role}) has content {_parts_problem(content)}"
    if not any(_content_text(message["content"]).strip() or _has_image(message["content"]) for message in prompt):
        return "value", _NO_CONTENT
    return None


def _parts_problem(content: Any) -> str | None:
    """What is wrong with a message's content that is not a string: it must be a list of TRL's content parts,
    `{"type": "text", "text": str}` or `{"type": "image"}` (docs/vision.md)."""
    if not isinstance(content, list):
        return f"of type {type(content).__name__}, not a string or a list of content parts"
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind == "image" or (kind == "text" and isinstance(part.get("text"), str)):
            continue
        return f"with a part {part!r} that is neither {{'type': 'text', 'text': str}} nor {{'type': 'image'}}"
    return None


def _content_text(content: str | list) -> str:
    """A message's text: the string, or its text parts joined."""
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def _has_image(content: str | list) -> bool:
    return isinstance(content, list) and any(part["type"] == "image" for part in content)


def _check_prompt_lengths(indices, prompts, name: str, tokenizer, args, max_positions: int | None) -> None:
    """Prompt + completion must fit the model's positions, and vLLM's context window when it is set and smaller (vLLM
    would end completions early). Prompts are cut to `max_prompt_length` (`rollout.prompts.fit_prompt`), so only when
    that is None (the default) or too large are the prompts tokenized: the `MAX_ROWS_TOKENIZED` longest (by
    characters)."""
    window = args.vllm_context_window()  # vLLM's, when set (`vllm_config`)
    fix = ", raise vllm_max_model_length" if window is not None else ""
    if window is not None and (max_positions is None or window < max_positions):
        max_positions, within = window, f"vLLM's context window of {window} tokens (vllm_max_model_length)"
    else:
        within = f"the model's {max_positions} positions (max_position_embeddings)"
    if max_positions is None:
        return
    room = max_positions - args.max_completion_length  # the longest prompt the model can take
    if room < 1:
        raise ValueError(
            f"max_completion_length={args.max_completion_length} leaves no room for a prompt within {within}. "
            "Lower max_completion_length."
        )
    limit = args.max_prompt_length
    if limit is not None and limit <= room:
        _check_kept_parts(indices, prompts, name, tokenizer, args)
        return
    order = sorted(range(len(prompts)), key=lambda k: -_num_chars(prompts[k]))
    if len(order) > MAX_ROWS_TOKENIZED:
        logger.info(
            "Checking the token length of the %d longest prompts (by characters) of the %d checked in %s "
            "(grpo_hf.validation.MAX_ROWS_TOKENIZED).", MAX_ROWS_TOKENIZED, len(order), name,
        )  # fmt: skip
        order = order[:MAX_ROWS_TOKENIZED]
    kwargs = args.chat_template_kwargs
    texts = []
    for k in order:
        try:
            texts.append(prompt_text(tokenizer, prompts[k], kwargs))
        except Exception as error:
            raise ValueError(f"{name} row {indices[k]}: the chat template fails on this prompt: {error}") from error
    lengths = [len(ids) for ids in tokenizer_of(tokenizer)(texts, add_special_tokens=False)["input_ids"]]
    for k, length in zip(order, lengths, strict=True):
        kept = length if limit is None else min(length, limit)
        if kept > room:
            setting = "max_prompt_length=None" if limit is None else f"max_prompt_length={limit}"
            raise ValueError(
                f"{name} row {indices[k]}: the prompt has {length} tokens; with {setting} and max_completion_length="
                f"{args.max_completion_length}, prompt + completion exceed {within}. Set max_prompt_length <= "
                f"{room} (longer prompts are then cut: a chat prompt loses whole turns of its history), lower "
                f"max_completion_length{fix}, or drop the long rows."
            )


def _check_kept_parts(indices, prompts, name: str, tokenizer, args) -> None:
    """With `max_prompt_length`, a chat prompt is cut by whole turns of history, never its system messages nor its
    last user turn (`rollout.prompts.fit_prompt`): those of the `MAX_ROWS_TOKENIZED` longest chat prompts must fit
    (the tools' schemas, added at the rollout, are checked there)."""
    chats = [k for k in range(len(prompts)) if is_conversational(prompts[k])]
    order = sorted(chats, key=lambda k: -_num_chars(kept_part(prompts[k])))[:MAX_ROWS_TOKENIZED]
    if not order:
        return
    texts = [prompt_text(tokenizer, kept_part(prompts[k]), args.chat_template_kwargs) for k in order]
    lengths = [len(ids) for ids in tokenizer_of(tokenizer)(texts, add_special_tokens=False)["input_ids"]]
    for k, length in zip(order, lengths, strict=True):
        if length > args.max_prompt_length:
            raise ValueError(
                f"{name} row {indices[k]}: its system messages and last user turn alone are {length} tokens, over "
                f"max_prompt_length={args.max_prompt_length}; a chat prompt is cut by whole turns of its history "
                "only, never into those. Raise max_prompt_length (or set it to None, TRL's default), or drop the "
                "long rows."
            )


def _num_chars(prompt) -> int:
    return len(prompt) if isinstance(prompt, str) else sum(len(_content_text(m["content"])) for m in prompt)


# ---- reward functions ------------------------------------------------------------------------------------------
def check_reward_funcs(funcs: Sequence, names: Sequence[str], columns_of: Mapping[str, list[str]]) -> None:
    """Each reward function can be called with the keyword arguments it will get: `prompts`, `completions`,
    `completion_ids`, `trainer_state` and one per dataset column (`columns_of`: dataset name -> its columns)."""
    for func, func_name in zip(funcs, names, strict=True):
        try:
            parameters = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable: nothing to inspect
            continue
        for p in parameters:
            if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
                raise TypeError(
                    f"Reward function {func_name!r} takes {p.name!r} positional-only, but reward functions are "
                    "called with keyword arguments only. Remove the '/' from its parameters."
                )
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
        named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        required = [p.name for p in parameters if p.name in named and p.default is p.empty]
        for dataset_name, columns in columns_of.items():
            given = [*REWARD_ARGUMENTS, *columns]
            unexpected = [] if accepts_any else [key for key in given if key not in named]
            if unexpected:
                raise TypeError(
                    f"Reward function {func_name!r} would be called with keyword arguments it does not accept: "
                    f"{unexpected} (from the reward signature and the columns of {dataset_name}). Add **kwargs to "
                    "its parameters: def f(prompts, completions, **kwargs)."
                )
            missing = [name for name in required if name not in given]
            if missing:
                raise TypeError(
                    f"Reward function {func_name!r} requires the argument {missing[0]!r}, which it will not get: it "
                    f"is not one of {list(REWARD_ARGUMENTS)} nor a column of {dataset_name} that reaches them "
                    f"({columns}; remove_unused_columns=True passes none). Add the column, or give {missing[0]!r} a "
                    "default."
                )
