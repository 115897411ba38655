"""Tools for multi-turn episodes: the chat template that renders them, the ids of a tool reply, calling them.

A tool is a plain function, sync or `async def`, described to the model by the chat template (`apply_chat_template(
tools=[...])` builds each schema from the type hints and the docstring). The model asks for one or more calls in its
turn; `ToolCaller` runs every call of every episode at once (each sync call in a daemon thread of its own, async ones
on the process's event loop, `grpo_hf.background`), each with `timeout` seconds (None: no limit), and gives back one
tool message per call. A call that raises, names an unknown tool, passes arguments the function does not take, or
runs out of time becomes the tool message `{"error": "..."}` and counts as a failure: it never stops training. A
timed-out sync call cannot be killed: its thread runs on, its result dropped; being a daemon thread of its own, it
holds up neither later calls nor the interpreter's exit.

Parsing the model's turn and the chat template's rules for tools come from TRL (`trl.chat_template_utils`): a template
must render a whole tool exchange (`supports_tool_calling`), the tokenizer needs a response template to parse tool
calls (`add_response_schema` sets one for the known templates), and the template must be prefix-preserving, because
an episode's ids are built by appending the ids of each tool reply to the ids the model sampled; where it is not,
TRL's training variant of the template is used (`get_training_chat_template`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as futures
import inspect
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

from grpo_hf.background import event_loop

__all__ = ["ToolCaller", "ToolCalls", "parse_turn", "tool_chat_template", "tool_reply_ids"]


def tool_chat_template(tokenizer) -> str | None:
    """Check that `tokenizer` can run tool episodes and return the chat template to render them with: None for its
    own, or TRL's prefix-preserving training variant of it. Sets a response template on the tokenizer when it has none
    and TRL knows one for its chat template (so that `parse_turn` can read tool calls)."""
    if not supports_tool_calling(tokenizer):
        raise ValueError(
            "tools / environment_factory need a chat template that renders tool calls and tool replies (user -> "
            "assistant with tool_calls -> tool); this tokenizer's does not. Set `tokenizer.chat_template` to one that "
            "does (for example TRL's Qwen2.5 template, trl/chat_templates/qwen2_5.jinja) and pass the tokenizer as "
            "processing_class."
        )
    if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
        try:
            add_response_schema(tokenizer)
        except ValueError as error:
            raise ValueError(
                "tools / environment_factory need to parse the tool calls in the model's turns, and TRL knows no "
                "response template for this chat template. Set `tokenizer.response_template` (transformers' response "
                f"parsing) or use a chat template TRL knows (trl.chat_template_utils.add_response_schema): {error}"
            ) from error
    if is_chat_template_prefix_preserving(tokenizer):
        return None
    template = get_training_chat_template(tokenizer)
    if template is None:
        raise ValueError(
            "tools / environment_factory append each tool reply's ids to the ids the model sampled, which needs a "
            "prefix-preserving chat template (earlier messages rendered the same whatever follows); this one is not, "
            "and TRL has no training variant of it. Use a prefix-preserving chat template."
        )
    return template


def parse_turn(tokenizer, ids: list[int], context: list[int], tools: Sequence[Callable]) -> dict[str, Any]:
    """The assistant message of one sampled turn `ids` after the token ids `context`, with its `tool_calls` if it made
    any; a turn that does not parse is its decoded text (TRL's `parse_response`)."""
    return parse_response(tokenizer, ids, prefix=context, tools=list(tools) or None)


def tool_reply_ids(
    tokenizer,
    replies: list[dict[str, Any]],
    template_kwargs: dict[str, Any],
    render: Callable[[list[dict[str, Any]], bool], list[int]] | None = None,
) -> list[int]:
    """The ids the chat template puts after an assistant turn that ended with its EOS, for the tool messages
    `replies`, up to and including the next assistant header: what the model reads before its next turn.

    Rendered on a stand-in conversation, with and without the replies; the difference is the reply. The stand-in's
    assistant turn is cut after its last EOS, as the sampled turn is (a template may put a newline after it).
    `render(messages, add_generation_prompt)`: a conversation's ids (default: the tokenizer's chat template; a VLM's
    processor renders replies with images, `rollout.vision.tool_reply_inputs`)."""
    if render is None:

        def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
            return tokenizer.apply_chat_template(
                messages,
                tokenize=True,
                return_dict=False,
                add_generation_prompt=add_generation_prompt,
                **template_kwargs,
            )

    call = [{"type": "function", "function": {"name": replies[0]["name"], "arguments": {}}}]
    head = [{"role": "user", "content": "."}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix, full = render(head, False), render(head + replies, True)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("The chat template renders an assistant turn differently once tool replies follow it.")
    return full[len(prefix) :]


@dataclass
class ToolCalls:
    """The calls of one model turn, in flight: one future per call, and when they must be done by."""

    names: list[str]
    pending: list[futures.Future | None]  # None: failed before it ran (its error is in `errors`)
    errors: list[str | None]
    deadline: float | None  # time.monotonic() seconds; None: no limit

    def done(self, now: float) -> bool:
        return all(f is None or f.done() for f in self.pending) or (self.deadline is not None and now >= self.deadline)

    def replies(self, timeout: float | None) -> tuple[list[dict[str, Any]], int]:
        """One tool message per call, in order, and how many calls failed."""
        messages, failures = [], 0
        for name, future, error in zip(self.names, self.pending, self.errors, strict=True):
            if error is None and not future.done():
                future.cancel()
                error = f"tool {name!r} timed out after {timeout} seconds"
            if error is None and future.exception() is not None:
                error = f"{type(future.exception()).__name__}: {future.exception()}"
            if error is not None:
                failures += 1
                content: Any = json.dumps({"error": error})
            else:
                result = future.result()
                content = result if isinstance(result, list) else str(result)  # a list: content parts, as TRL
            messages.append({"role": "tool", "name": name, "content": content})
        return messages, failures


class ToolCaller:
    """Runs tool calls concurrently: each sync call in a daemon thread, async ones on the tools' event loop."""

    def __init__(self, timeout: float | None = None):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"tool_timeout={timeout} must be > 0 seconds, or None for no limit.")
        self.timeout = timeout

    def submit(self, tool_calls: list[dict[str, Any]], tools: dict[str, Callable]) -> ToolCalls:
        """Start every call of `tool_calls` (parsed from one turn) with the episode's `tools` (name -> function)."""
        names, pending, errors = [], [], []
        for call in tool_calls:
            function = call.get("function", call)
            name = function.get("name", "unknown") if isinstance(function, dict) else "unknown"
            future, error = None, None
            if call.get("type", "function") != "function":
                error = f"unsupported tool call type {call.get('type')!r}"
            elif name not in tools:
                error = f"unknown tool {name!r}; the tools are {sorted(tools)}"
            else:
                future, error = self._start(tools[name], function.get("arguments") or {})
            names.append(name)
            pending.append(future)
            errors.append(error)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        return ToolCalls(names, pending, errors, deadline)

    def _start(self, tool: Callable, arguments: Any) -> tuple[futures.Future | None, str | None]:
        if not isinstance(arguments, dict):
            return None, f"the arguments must be a JSON object, got {arguments!r}"
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as error:
            return None, f"wrong arguments for {getattr(tool, '__name__', 'tool')}: {error}"
        if inspect.iscoroutinefunction(tool):
            return asyncio.run_coroutine_threadsafe(tool(**arguments), event_loop()), None
        future: futures.Future = futures.Future()
        future.set_running_or_notify_cancel()
        threading.Thread(target=_run, args=(future, tool, arguments), name="grpo_hf-tool", daemon=True).start()
        return future, None

    def wait_any(self, in_flight: list[ToolCalls]) -> None:
        """Block until at least one of `in_flight` is done (all its calls returned, or its deadline passed)."""
        while True:
            now = time.monotonic()
            if any(calls.done(now) for calls in in_flight):
                return
            waiting = [f for calls in in_flight for f in calls.pending if f is not None and not f.done()]
            deadlines = [calls.deadline for calls in in_flight if calls.deadline is not None]
            timeout = max(0.0, min(deadlines) - now) if deadlines else None
            futures.wait(waiting, timeout=timeout, return_when=futures.FIRST_COMPLETED)


def _run(future: futures.Future, tool: Callable, arguments: dict[str, Any]) -> None:
    """Call `tool` and settle `future` with what it returned or raised (a dropped, timed-out call: nothing to do)."""
    try:
        result = tool(**arguments)
    except BaseException as error:  # noqa: B036  (whatever a tool raises is its reply, never the trainer's crash)
        if not future.cancelled():
            future.set_exception(error)
        return
    if not future.cancelled():
        future.set_result(result)
