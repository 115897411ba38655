"""Tools for multi-turn episodes: the chat template that renders them, the ids of a tool reply, calling them.

A tool is a plain function, sync or `async def`, described to the model by the chat template (`apply_chat_template(
tools=[...])` builds each schema from the type hints and the docstring). The model asks for one or more calls in its
turn; `ToolCaller` runs them and gives back one tool message per call, in call order.

What runs in order, what runs at once:
- one turn's calls run one after another, in the order the model wrote them, each starting when the one before has
  returned: two calls on one environment never race. (TRL runs a turn's sync calls so, and gathers its async ones at
  once after them.) They run in a daemon thread of the turn's own; an async call runs on the process's event loop
  (`grpo_hf.background`) while that thread waits for it;
- an episode's next turn is sampled only once its calls are done, so all of an episode's calls are in order;
- the calls of different episodes run at the same time, and no episode waits for another's tools.

Failures: a call that raises (anything short of KeyboardInterrupt and SystemExit: `asyncio.CancelledError` included,
from a sync or an async tool), names an unknown tool, passes arguments the function does not take, times out or is not
run becomes the tool message `{"error": "..."}` and counts as a failure: it never stops training. KeyboardInterrupt
and SystemExit from a tool stop the run.

Timeouts (`timeout` seconds per call, None: no limit; a call's clock starts when it is due: its turn was asked, or the
call before it returned). The first call to overrun them times out and the turn ends there: the calls after it are
not run. A timed-out async call is cancelled. A timed-out sync call cannot be killed: its thread runs on, its result
dropped, and being a daemon thread it holds up neither later turns nor the interpreter's exit. What it leaves behind:
- its thread, counted (`ToolCaller.hung_calls`) until the call returns; past `MAX_HUNG_CALLS` of them a warning names
  their tools;
- its episode's later calls are not run while it still runs (each an error reply), so none races it;
- `ToolCalls.timed_out_tools`: the episode runner hands the owners of timed-out bound methods (environment instances)
  back, and `environments.Environments.retire` takes them out of the pool for good, so a late write can never land on
  an instance another episode has been given. A timed-out plain function has nothing to retire: it is counted only.

`ToolStats`: per tool, its calls, failures, timeouts and the wall time of the calls that ran to their end: the run's
`tools/<name>/...` metrics.

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
import logging
import threading
import time
from collections import Counter
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

__all__ = [
    "MAX_HUNG_CALLS",
    "ToolCaller",
    "ToolCalls",
    "ToolStats",
    "parse_turn",
    "tool_chat_template",
    "tool_reply_ids",
]

logger = logging.getLogger(__name__)

MAX_HUNG_CALLS = 16  # timed-out calls still running in their threads, past which a warning names them


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
class ToolStats:
    """What one tool's calls did, summed: the per-tool metrics (`tools/<name>/...`)."""

    calls: int = 0
    failures: int = 0  # raised, bad arguments, timed out, or not run
    timeouts: int = 0
    returned: int = 0  # calls that ran to their end (a value or an error): the count of `seconds`
    seconds: float = 0.0  # their total wall time

    def add(self, other: ToolStats) -> None:
        self.calls, self.failures = self.calls + other.calls, self.failures + other.failures
        self.timeouts, self.returned = self.timeouts + other.timeouts, self.returned + other.returned
        self.seconds += other.seconds


@dataclass
class _Call:
    """One call of a turn."""

    name: str
    tool: Callable | None  # None: it failed before it ran (`error`)
    arguments: dict[str, Any]
    error: str | None = None  # its reply's error: failed before it ran, timed out, or not run
    outcome: tuple[bool, Any] | None = None  # once it ended: (True, what it returned) or (False, what it raised)
    seconds: float = 0.0  # how long it ran
    timed_out: bool = False
    task: futures.Future | None = None  # an async call's coroutine on the event loop, once started (cancellable)

    @property
    def ended(self) -> bool:
        return self.error is not None or self.outcome is not None


class ToolCalls:
    """The calls of one model turn, run one after another in call order by a daemon thread of the turn's own.

    Each call has `timeout` seconds from when it is due (the turn was asked, or the call before it ended). The first
    call to overrun them abandons the turn (`done`): it times out, the calls after it are not run, and an async one is
    cancelled. Every field is guarded by the caller's condition `changed`, notified whenever a call ends."""

    def __init__(
        self,
        calls: list[_Call],
        timeout: float | None,
        changed: threading.Condition,
        hung: _HungCalls,
        behind: ToolCalls | None = None,  # the episode's turn whose timed-out call still runs: nothing here runs
    ):
        self.calls, self.timeout, self._changed, self._hung, self.behind = calls, timeout, changed, hung, behind
        self.due = time.monotonic()  # when the first call not ended became due
        self.abandoned = False
        self.running: _Call | None = None  # the call in the thread right now
        if not self.finished:
            threading.Thread(target=self._run_all, name="grpo_hf-tool", daemon=True).start()

    @property
    def finished(self) -> bool:
        return all(call.ended for call in self.calls)

    def done(self, now: float) -> bool:
        """Every call ended, or the turn was abandoned, now if the call due has overrun its timeout."""
        with self._changed:
            if self.finished or self.abandoned:
                return True
            if self.timeout is not None and now >= self.due + self.timeout:
                self._abandon()
                return True
            return False

    def deadline(self) -> float | None:
        """When the call due times out (time.monotonic() seconds); None: no limit, or nothing left to wait for."""
        with self._changed:
            if self.timeout is None or self.finished or self.abandoned:
                return None
            return self.due + self.timeout

    def still_running(self) -> str | None:
        """The name of the episode's timed-out call that still runs in its thread, this turn's or the one it was
        not run behind; else None."""
        with self._changed:
            if self.abandoned and self.running is not None:
                return self.running.name
        return self.behind.still_running() if self.behind is not None else None

    def timed_out_tools(self) -> list[Callable]:
        return [call.tool for call in self.calls if call.timed_out and call.tool is not None]

    def replies(self, stats: dict[str, ToolStats]) -> tuple[list[dict[str, Any]], int]:
        """One tool message per call, in call order, and how many calls failed; each call is counted into `stats`
        (name -> ToolStats). A tool that raised KeyboardInterrupt or SystemExit raises it here."""
        messages, failures = [], 0
        with self._changed:
            for call in self.calls:
                error = call.error
                if error is None:
                    returned, value = call.outcome
                    if not returned and isinstance(value, (KeyboardInterrupt, SystemExit)):
                        raise value
                    error = None if returned else f"{type(value).__name__}: {value}"
                tool = stats.setdefault(call.name, ToolStats())
                tool.calls += 1
                tool.timeouts += call.timed_out
                if call.outcome is not None and not call.timed_out:
                    tool.returned, tool.seconds = tool.returned + 1, tool.seconds + call.seconds
                if error is not None:
                    failures, tool.failures = failures + 1, tool.failures + 1
                    content: Any = json.dumps({"error": error})
                else:
                    result = call.outcome[1]
                    content = result if isinstance(result, list) else str(result)  # a list: content parts, as TRL
                messages.append({"role": "tool", "name": call.name, "content": content})
        return messages, failures

    def _abandon(self) -> None:
        """The call due has overrun its timeout: it times out, the rest are not run (the lock is held)."""
        self.abandoned = True
        late = next(call for call in self.calls if not call.ended)
        late.timed_out, late.error = True, f"tool {late.name!r} timed out after {self.timeout} seconds"
        for call in self.calls:
            if not call.ended:
                call.error = f"not run: the call of {late.name!r} before it in this turn timed out"
        if self.running is late:
            if late.task is not None:
                late.task.cancel()
            self._hung.add(id(self), late.name)

    def _run_all(self) -> None:
        for call in self.calls:
            with self._changed:
                if self.abandoned:
                    return
                if call.ended:  # failed before it ran
                    continue
                self.running = call
            start = time.monotonic()
            outcome = self._outcome(call)
            with self._changed:
                call.seconds, self.running = time.monotonic() - start, None
                if self.abandoned:  # it timed out: its late outcome is dropped, and the calls after it never run
                    self._hung.remove(id(self))
                    return
                call.outcome, self.due = outcome, time.monotonic()
                self._changed.notify_all()

    def _outcome(self, call: _Call) -> tuple[bool, Any]:
        """Run `call`: (True, what it returned) or (False, what it raised, whatever it is: CancelledError included)."""
        try:
            if not inspect.iscoroutinefunction(call.tool):
                return True, call.tool(**call.arguments)
            task = asyncio.run_coroutine_threadsafe(call.tool(**call.arguments), event_loop())
            with self._changed:
                call.task = task
                if self.abandoned:
                    task.cancel()
            return True, task.result()
        except BaseException as error:  # noqa: B036  (whatever a tool raises is its reply, never the trainer's crash)
            return False, error


class _HungCalls:
    """Timed-out calls whose threads still run them (a sync call cannot be killed): counted, and named in a warning
    once there are more than `MAX_HUNG_CALLS`, again each time their number doubles. Guarded by the caller's lock."""

    def __init__(self):
        self.names: dict[int, str] = {}  # id of the turn -> the name of its hung call
        self.warned_at = 0

    def add(self, key: int, name: str) -> None:
        self.names[key] = name
        count = len(self.names)
        if count > MAX_HUNG_CALLS and count >= 2 * self.warned_at:
            self.warned_at = count
            by_name = Counter(self.names.values())
            named = ", ".join(f"{name!r} x{n}" for name, n in by_name.most_common())
            logger.warning(
                f"{count} tool calls that timed out are still running in their threads ({named}): a sync call "
                "cannot be killed, so each holds a thread (and whatever the tool holds) until it returns. Make the "
                "tool return within tool_timeout (give its own I/O a timeout), make it async (a timed-out coroutine "
                "is cancelled), or raise tool_timeout."
            )

    def remove(self, key: int) -> None:
        self.names.pop(key, None)


class ToolCaller:
    """Runs the calls of each turn in order, in a thread of the turn's own, the turns of different episodes at once."""

    def __init__(self, timeout: float | None = None):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"tool_timeout={timeout} must be > 0 seconds, or None for no limit.")
        self.timeout = timeout
        self.changed = threading.Condition()  # every turn's lock; notified when a call ends
        self.hung = _HungCalls()

    @property
    def hung_calls(self) -> int:
        """Calls that timed out and still run in their threads."""
        with self.changed:
            return len(self.hung.names)

    def submit(
        self, tool_calls: list[dict[str, Any]], tools: dict[str, Callable], after: ToolCalls | None = None
    ) -> ToolCalls:
        """Start the calls of `tool_calls` (parsed from one turn) with the episode's `tools` (name -> function), in
        order. `after`: the episode's previous turn; while a timed-out call of it still runs, none of these run."""
        blocked = after.still_running() if after is not None else None
        calls = []
        for call in tool_calls:
            function = call.get("function", call)
            name = function.get("name", "unknown") if isinstance(function, dict) else "unknown"
            arguments = (function.get("arguments") or {}) if isinstance(function, dict) else {}
            error = None
            if call.get("type", "function") != "function":
                error = f"unsupported tool call type {call.get('type')!r}"
            elif name not in tools:
                error = f"unknown tool {name!r}; the tools are {sorted(tools)}"
            elif blocked is not None:
                error = f"not run: the earlier call of {blocked!r} in this episode timed out and is still running"
            else:
                error = _check_arguments(tools[name], arguments)
            calls.append(_Call(name, None if error else tools[name], arguments, error))
        return ToolCalls(calls, self.timeout, self.changed, self.hung, behind=after if blocked is not None else None)

    def wait_any(self, in_flight: list[ToolCalls]) -> None:
        """Block until at least one of `in_flight` is done (all its calls ended, or one overran its timeout); at once
        when `in_flight` is empty (nothing could ever wake the wait)."""
        if not in_flight:
            return
        with self.changed:
            while True:
                now = time.monotonic()
                if any(calls.done(now) for calls in in_flight):
                    return
                deadlines = [d for calls in in_flight if (d := calls.deadline()) is not None]
                self.changed.wait(max(0.0, min(deadlines) - now) if deadlines else None)


def _check_arguments(tool: Callable, arguments: Any) -> str | None:
    """Why `tool` cannot be called with `arguments`, or None."""
    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, got {arguments!r}"
    try:
        inspect.signature(tool).bind(**arguments)
    except TypeError as error:
        return f"wrong arguments for {getattr(tool, '__name__', 'tool')}: {error}"
    return None
