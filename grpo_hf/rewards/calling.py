"""Calling reward functions: argument checks, async functions on a background loop, timeouts, the error policy.

`compute_rewards` calls each reward function once on the whole batch and returns an `[N][R]` matrix with NaN for
"no reward". Sync functions run one after another (in a worker thread when a timeout is set), then the `async def`
ones concurrently on one persistent event loop. A result of the wrong shape or type is a bug and always raises;
NaN/inf become None with a warning; an exception is located by calling the function again sample by sample, then
raised (`error_policy="raise"`) or scored None and counted (`"skip"`).

With a `RewardLogs`, functions that accept them also get TRL's `log_extra(column, values)` (one value per completion
of the call, a column of the completions table) and `log_metric(name, value)` (a scalar, averaged into the metric
`name`). What a call logs is kept only if the call succeeds; the per-sample retries log their own sample's row.

A reward function that calls `signal.signal` (math-verify's `parse` and `verify` do, for their default timeouts,
through `signal.alarm`) works only on the main thread, and raises `ValueError: signal only works in main thread` when
it runs in another: asynchronous GRPO's scorer thread, or the worker thread of a `timeout`. `needs_main_thread(error)`
recognises that failure (in the error or the errors it was raised from, as `compute_rewards` raises it), so a caller
can run that function again on the main thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import numbers
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grpo_hf.background import event_loop
from grpo_hf.rewards.functions import reward_func_name

logger = logging.getLogger(__name__)

__all__ = ["REWARD_ARGUMENTS", "RewardLogs", "compute_rewards", "needs_main_thread"]

# ---------------------------------------------------------------------------------------------------------------------
# Calling reward functions: validation, async, timeouts, error policy
# ---------------------------------------------------------------------------------------------------------------------

REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
"""The keyword arguments every reward function gets besides the dataset columns (which must not share these names)."""
_ERROR_POLICIES = ("raise", "skip")


class _RewardTimeout(Exception):
    pass


_MAIN_THREAD_ONLY = "signal only works in main thread"  # CPython's ValueError (then "of the main interpreter")


def needs_main_thread(error: BaseException) -> bool:
    """Whether `error` is a reward function's call of `signal.signal` off the main thread: CPython's `ValueError`
    whose message says "signal only works in main thread", or an error raised from or while handling one (math-verify
    raises its own `ValueError` from it; `compute_rewards` under `error_policy="raise"` a `RuntimeError`). Such a
    function fails for the thread it ran in, not for its input: run it again on the main thread."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ValueError) and _MAIN_THREAD_ONLY in str(error):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


STILL_RUNNING_AFTER = 60.0  # seconds: with reward_timeout=None, a call still running then (and every as long after)
# is reported, naming the functions, since nothing else would stop or show a reward function that never returns


@contextlib.contextmanager
def _report_if_still_running(names: list[str], n: int, timeout: float | None):
    """Within: with no timeout, warn every `STILL_RUNNING_AFTER` seconds that the call of `names` on n completions is
    still running (a watchdog thread; with a timeout the call is bounded and nothing is needed)."""
    if timeout is not None:
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def watch() -> None:
        while not done.wait(STILL_RUNNING_AFTER):
            logger.warning(
                "Reward function %s has been running for %.0f s on %d completions, and reward_timeout=None sets no "
                "limit: is it stuck? Set reward_timeout (seconds per call) to stop such a call, with "
                "reward_error_policy='skip' to score it None and go on.",
                " and ".join(repr(name) for name in names), time.monotonic() - started, n,
            )  # fmt: skip

    watcher = threading.Thread(target=watch, name="grpo_hf-reward-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


class _Outcome:
    """Either `value` (the raw return) or `error` (the exception, possibly a `_RewardTimeout`), and what the call
    logged (`log`: a `_CallLog`, committed once the call is known to have succeeded)."""

    __slots__ = ("value", "error", "log")

    def __init__(self, value: Any = None, error: BaseException | None = None):
        self.value = value
        self.error = error
        self.log: _CallLog | None = None


class RewardLogs:
    """What reward functions log during one `compute_rewards` call through TRL's `log_extra` / `log_metric`.

    `extra`: column name -> one value per completion (None where nothing was logged); `metrics`: metric name -> the
    values logged for it, in call order.
    """

    def __init__(self, num_completions: int):
        self.num_completions = num_completions
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = defaultdict(list)


class _CallLog:
    """The logs of one call of reward function `name` on the completions [offset, offset + n) of the batch."""

    def __init__(self, sink: RewardLogs, name: str, offset: int, n: int):
        self.sink, self.name, self.offset, self.n = sink, name, offset, n
        self.extra: dict[str, list[Any]] = {}
        self.metrics: list[tuple[str, float]] = []

    def log_extra(self, column: str, values: list) -> None:
        values = list(values)
        if len(values) != self.n:
            raise ValueError(
                f"Reward function {self.name!r} called log_extra({column!r}, ...) with {len(values)} values for "
                f"{self.n} completions: give one value per completion."
            )
        self.extra[str(column)] = values

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.append((str(name), float(value)))

    def commit(self) -> None:
        for column, values in self.extra.items():
            self.sink.extra.setdefault(column, [None] * self.sink.num_completions)[
                self.offset : self.offset + self.n
            ] = values
        for name, value in self.metrics:
            self.sink.metrics[name].append(value)


def _accepts(func: Callable, name: str) -> bool:
    """Whether `func` takes the keyword argument `name` (by name, or through **kwargs)."""
    try:
        parameters = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == name and p.kind is not p.POSITIONAL_ONLY) for p in parameters)


def _bind_logs(func: Callable, name: str, sink: RewardLogs | None, kwargs: dict, offset: int, n: int):
    """`kwargs` plus `log_extra` / `log_metric` of a fresh `_CallLog` when `func` accepts them; and that log."""
    if sink is None:
        return kwargs, None
    log = _CallLog(sink, name, offset, n)
    extra = {key: getattr(log, key) for key in ("log_extra", "log_metric") if _accepts(func, key)}
    return ({**kwargs, **extra}, log) if extra else (kwargs, None)


def _with_log(outcome: _Outcome, log: _CallLog | None) -> _Outcome:
    outcome.log = log
    return outcome


def _is_async(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or (callable(func) and inspect.iscoroutinefunction(func.__call__))


def _run_coroutine(coro) -> Any:
    return asyncio.run_coroutine_threadsafe(coro, event_loop()).result()  # the process's loop (`grpo_hf.background`)


async def _await_with_timeout(awaitable, timeout: float | None) -> Any:
    if timeout is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, timeout)
    except asyncio.TimeoutError as e:
        raise _RewardTimeout() from e


async def _async_outcome(func: Callable, kwargs: dict, timeout: float | None) -> _Outcome:
    try:
        return _Outcome(await _await_with_timeout(func(**kwargs), timeout))
    except Exception as e:
        return _Outcome(error=e)


async def _gather_outcomes(calls: list[tuple[Callable, dict]], timeout: float | None) -> list[_Outcome]:
    return list(await asyncio.gather(*(_async_outcome(f, kw, timeout) for f, kw in calls)))


def _sync_outcome(func: Callable, kwargs: dict, timeout: float | None) -> _Outcome:
    """Call a sync function; with a timeout, in a daemon thread (a call that times out is left running there)."""
    if timeout is None:
        try:
            value = func(**kwargs)
            if inspect.isawaitable(value):
                value = _run_coroutine(_await_with_timeout(value, None))
            return _Outcome(value)
        except Exception as e:
            return _Outcome(error=e)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = func(**kwargs)
        except BaseException as e:  # carried to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"grpo_hf-reward-{reward_func_name(func)}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        return _Outcome(error=_RewardTimeout())
    if "error" in box:
        if not isinstance(box["error"], Exception):
            raise box["error"]
        return _Outcome(error=box["error"])
    value = box["value"]
    if inspect.isawaitable(value):
        try:
            value = _run_coroutine(_await_with_timeout(value, timeout))
        except Exception as e:
            return _Outcome(error=e)
    return _Outcome(value)


def _sync_per_sample(func: Callable, kwargs: dict, n: int, timeout: float | None, bind=None) -> Iterable[_Outcome]:
    """One call per sample, lazily (the "raise" policy stops at the first failure). `bind(kwargs, offset, n)` adds
    the log callables (`_bind_logs`)."""
    for i in range(n):
        call_kwargs, log = bind(_slice_kwargs(kwargs, i), i, 1) if bind else (_slice_kwargs(kwargs, i), None)
        yield _with_log(_sync_outcome(func, call_kwargs, timeout), log)


def _async_per_sample(func: Callable, kwargs: dict, n: int, timeout: float | None, bind=None) -> list[_Outcome]:
    """One call per sample, all concurrently."""
    calls = [bind(_slice_kwargs(kwargs, i), i, 1) if bind else (_slice_kwargs(kwargs, i), None) for i in range(n)]
    outcomes = _run_coroutine(_gather_outcomes([(func, call_kwargs) for call_kwargs, _ in calls], timeout))
    return [_with_log(outcome, log) for outcome, (_, log) in zip(outcomes, calls, strict=True)]


def _slice_kwargs(kwargs: dict, i: int) -> dict:
    return {k: (v if k == "trainer_state" or v is None else v[i : i + 1]) for k, v in kwargs.items()}


def _short(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit // 2]} ... {text[-limit // 2 :]}"


def _describe_sample(kwargs: dict, i: int) -> str:
    parts = [f"prompt={_short(kwargs['prompts'][i])}", f"completion={_short(kwargs['completions'][i])}"]
    parts += [f"{k}={_short(v[i], 120)}" for k, v in kwargs.items() if k not in REWARD_ARGUMENTS and v is not None]
    return ", ".join(parts)


def _is_real_number(value: Any) -> bool:
    """A reward value: any `numbers.Real` (int, float, bool, Fraction, NumPy floats and ints), or a NumPy scalar /
    array or a torch tensor of one real element (recognised by module name: this package imports neither)."""
    if isinstance(value, numbers.Real):
        return True
    library = type(value).__module__.partition(".")[0]
    if library == "numpy":
        return getattr(value, "size", 0) == 1 and getattr(value.dtype, "kind", "") in ("b", "i", "u", "f")
    if library == "torch":
        return callable(getattr(value, "numel", None)) and value.numel() == 1 and not value.dtype.is_complex
    return False


def _to_floats(name: str, values: Any, n: int) -> list[float | None]:
    """Validate one function's return: a sequence of `n` numbers or None; NaN/inf become None with a warning."""
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(
            f"Reward function {name!r} returned a {type(values).__name__}; it must return a list with one float (or "
            "None) per completion."
        )
    if not hasattr(values, "__len__"):
        values = list(values)
    if len(values) != n:
        raise ValueError(f"Reward function {name!r} returned {len(values)} rewards for {n} completions.")
    out: list[float | None] = []
    non_finite = 0
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if not _is_real_number(v):
            raise TypeError(
                f"Reward function {name!r} returned {_short(v, 80)} ({type(v).__name__}) for completion {i}; "
                "expected a float or None: a reward is an int, float, bool or None (NumPy numbers and one-element "
                "arrays or tensors also work; strings, even '0.5', do not). Return float(...) of your score."
            )
        x = float(v)
        if math.isfinite(x):
            out.append(x)
        else:
            non_finite += 1
            out.append(None)
    if non_finite:
        warnings.warn(
            f"Reward function {name!r} returned NaN/inf for {non_finite} of {n} completions; they are scored None "
            "(no reward from this function).",
            RuntimeWarning,
            stacklevel=4,
        )
    return out


def _failure_message(name: str, error: BaseException, where: str, timeout: float | None) -> str:
    if isinstance(error, _RewardTimeout):
        return (
            f"Reward function {name!r} did not return within {timeout} s (config field `reward_timeout`) {where}. "
            "Make it faster, raise `reward_timeout`, or set `reward_error_policy='skip'` to score such calls None."
        )
    if needs_main_thread(error):
        return (
            f"Reward function {name!r} raised {type(error).__name__}: {error} {where}. It uses signal.signal (e.g. "
            "math-verify's parse and verify with their default timeouts), which works only in the main thread, and "
            f"it was called in the thread {threading.current_thread().name!r} (asynchronous GRPO's scorer, or the "
            "worker thread of `reward_timeout`). Turn its signal timeouts off (math-verify: parse(..., "
            "parsing_timeout=None), verify(..., timeout_seconds=None)), use grpo_hf's 'math_accuracy' (math-verify in "
            "a worker process with its own timeout), or run it on the main thread (max_staleness=0 with GRPOTrainer, "
            "reward_timeout=None)."
        )
    return (
        f"Reward function {name!r} raised {type(error).__name__}: {error} {where}. "
        "Set `reward_error_policy='skip'` to score failing samples None instead of stopping."
    )


def _resolve(
    name: str,
    batch: _Outcome,
    per_sample: Callable[[], Iterable[_Outcome]],
    kwargs: dict,
    n: int,
    timeout: float | None,
    error_policy: str,
) -> tuple[list[float | None], int]:
    """Turn one function's batch outcome into n rewards and an error count, retrying per sample after an exception."""
    if batch.error is None:
        rewards = _to_floats(name, batch.value, n)
        if batch.log is not None:
            batch.log.commit()
        return rewards, 0
    error = batch.error
    if needs_main_thread(error):  # the thread's doing, not the samples': raised whatever the policy, so that the
        where = f"on a batch of {n} completions"  # caller can call it again on the main thread (async GRPO does)
        raise RuntimeError(_failure_message(name, error, where, timeout)) from error
    if isinstance(error, _RewardTimeout):
        if error_policy == "raise":
            raise RuntimeError(_failure_message(name, error, f"on a batch of {n} completions", timeout))
        logger.warning("Reward function %r timed out after %s s on %d completions; scored None.", name, timeout, n)
        return [None] * n, n
    # An exception: retry sample by sample to find (raise) or isolate (skip) the bad ones.
    rewards: list[float | None] = []
    failed = 0
    first_error: tuple[int, BaseException] | None = None
    for i, outcome in enumerate(per_sample()):
        if outcome.error is not None:
            if error_policy == "raise":
                where = f"on sample {i} of {n} ({_describe_sample(kwargs, i)})"
                raise RuntimeError(_failure_message(name, outcome.error, where, timeout)) from outcome.error
            failed += 1
            first_error = first_error or (i, outcome.error)
            rewards.append(None)
        else:
            rewards.extend(_to_floats(name, outcome.value, 1))
            if outcome.log is not None:
                outcome.log.commit()
    if error_policy == "raise":  # every sample passes alone: the batch as a whole is the problem
        where = f"on the batch of {n} completions (each sample passes alone; sample 0: {_describe_sample(kwargs, 0)})"
        raise RuntimeError(_failure_message(name, error, where, timeout)) from error
    if failed:
        i, e = first_error
        logger.warning(
            "Reward function %r failed on %d of %d completions (first: sample %d, %s: %s); scored None.",
            name, failed, n, i, type(e).__name__, e,
        )  # fmt: skip
    else:
        logger.warning(
            "Reward function %r raised %s: %s on the batch but not on any single sample; used per-sample calls.",
            name, type(error).__name__, error,
        )  # fmt: skip
    return rewards, failed


def compute_rewards(
    reward_funcs: list[Callable],
    prompts: list,
    completions: list,
    completion_ids: list | None = None,
    *,
    columns: dict[str, list] | None = None,
    trainer_state: Any = None,
    timeout: float | None = None,
    error_policy: str = "raise",
    logs: RewardLogs | None = None,
) -> tuple[list[list[float]], dict[str, int]]:
    """Call every reward function on the batch; return an `[N][R]` matrix (NaN = None) and error counts per name.

    Each function is called once with keyword arguments `prompts`, `completions`, `completion_ids`, `trainer_state`
    and one keyword per entry of `columns`. Sync functions run one after another in this thread (in a worker thread
    when `timeout` is set); `async def` functions then run concurrently on a background event loop.

    - A result that is not a list of N floats/None raises (ValueError for a wrong length, naming the function and
      both lengths) under every policy: that is a bug in the function, not a bad sample.
    - NaN/inf in a result is scored None, with a `RuntimeWarning`.
    - An exception: the function is called again sample by sample. `error_policy="raise"` raises a RuntimeError naming
      the function and the first failing sample (or, if no sample fails alone, the batch and its first sample);
      `"skip"` scores the failing samples None and counts them.
    - `timeout` (seconds, per call): a call that takes longer raises under `"raise"` (naming the config field
      `reward_timeout`); under `"skip"` the whole batch is scored None for that function and counted. A timed-out
      sync call keeps running in its daemon thread; a timed-out async call is cancelled.

    Error counts are keyed by `reward_func_name` (functions sharing a name share a count).

    `logs`: a `RewardLogs(len(completions))` to collect what the functions log; functions that take `log_extra` /
    `log_metric` (by name or **kwargs) then get them (TRL's callables). None: they are not passed.
    """
    n = len(completions)
    columns = dict(columns or {})
    _check_arguments(prompts, completions, completion_ids, columns, timeout, error_policy)
    kwargs = {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        "trainer_state": trainer_state,
        **columns,
    }
    names = [reward_func_name(f) for f in reward_funcs]
    rewards = [[math.nan] * len(reward_funcs) for _ in range(n)]
    errors = dict.fromkeys(names, 0)

    def store(j: int, column: list[float | None], failed: int) -> None:
        errors[names[j]] += failed
        for i, r in enumerate(column):
            if r is not None:
                rewards[i][j] = r

    _call_each(reward_funcs, names, kwargs, n, timeout, error_policy, logs, store)
    return rewards, errors


def _check_arguments(prompts, completions, completion_ids, columns, timeout, error_policy) -> None:
    """`compute_rewards`' arguments: a known error policy, a positive timeout, one value per completion everywhere."""
    if error_policy not in _ERROR_POLICIES:
        raise ValueError(f"error_policy={error_policy!r} must be one of {_ERROR_POLICIES}.")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds (or None for no limit).")
    n = len(completions)
    lengths = {
        "prompts": len(prompts),
        **({"completion_ids": len(completion_ids)} if completion_ids is not None else {}),
    }
    for key, value in columns.items():
        if key in REWARD_ARGUMENTS:
            raise ValueError(f"Column {key!r} clashes with a reward-function argument; rename it.")
        lengths[key] = len(value)
    wrong = {k: v for k, v in lengths.items() if v != n}
    if wrong:
        raise ValueError(f"compute_rewards got {n} completions but lengths {wrong}.")


def _call_each(reward_funcs, names, kwargs, n, timeout, error_policy, logs, store) -> None:
    """Call the sync functions one after another, then the async ones together; `store(j, rewards, failed)` each
    function's resolved rewards (`_resolve`)."""
    is_async = [_is_async(f) for f in reward_funcs]
    binds = [functools.partial(_bind_logs, f, name, logs) for f, name in zip(reward_funcs, names, strict=True)]
    for j, func in enumerate(reward_funcs):
        if not is_async[j]:
            call_kwargs, log = binds[j](kwargs, 0, n)
            with _report_if_still_running([names[j]], n, timeout):
                batch = _with_log(_sync_outcome(func, call_kwargs, timeout), log)
            per_sample = functools.partial(_sync_per_sample, func, kwargs, n, timeout, binds[j])
            store(j, *_resolve(names[j], batch, per_sample, kwargs, n, timeout, error_policy))
    async_idx = [j for j in range(len(reward_funcs)) if is_async[j]]
    if async_idx:
        calls = [binds[j](kwargs, 0, n) for j in async_idx]
        with _report_if_still_running([names[j] for j in async_idx], n, timeout):
            outcomes = _run_coroutine(
                _gather_outcomes([(reward_funcs[j], kw) for j, (kw, _) in zip(async_idx, calls, strict=True)], timeout)
            )
        for j, batch, (_, log) in zip(async_idx, outcomes, calls, strict=True):
            per_sample = functools.partial(_async_per_sample, reward_funcs[j], kwargs, n, timeout, binds[j])
            store(j, *_resolve(names[j], _with_log(batch, log), per_sample, kwargs, n, timeout, error_policy))
