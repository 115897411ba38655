"""Environments (TRL 1.16's `environment_factory`): stateful tools, one instance per episode, and their rewards.

An environment is a class whose instances a factory (the class itself, or any callable) creates:

- `reset(**row)` starts an episode on a dataset row, as TRL passes it: every column of the row, no more (a dataset
  without a `prompt` column gives none: the episode's prompt is then an empty user message that the observation
  fills; with several environments the routing column `environment` is left out). It may return a string (or
  content parts), appended to the last user message of the prompt: the observation the model starts from.
- its public methods (not `reset`, `get_reward`, nor names starting with `_`) are that episode's tools, described to
  the model by the chat template like any tool (type hints and docstrings);
- an optional `get_reward()` (sync or async) scores the finished episode from the environment's state: it becomes a
  reward function named after the class, weight 1, beside `reward_funcs`. Every reward function also gets the
  episode's instance in `environments=` (one per completion).

`environment_factory` is one factory (every row uses it) or a dict name -> factory, each row naming its own in an
`environment` column. Instances are made once and reused: each rollout hands out the instances of the pool in order
and makes new ones only when a batch needs more at once than exist ("construct once, reset often", as TRL).

An instance one of whose methods timed out (`tool_timeout`) is retired after its rollout (`retire`): it is never
handed out or reset again, and the next rollout makes a new one in its place, since the timed-out call may still be
running and would write into whatever episode the instance served next. Its own episode keeps it to the end: that
episode's later calls are not run while the timed-out one runs (`tools`), and its `get_reward` still reads it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["EMPTY_PROMPT", "Environments", "environment_reward", "public_methods"]

EMPTY_PROMPT = [{"role": "user", "content": ""}]  # the prompt of a row that has none: the environment's reset gives it
_RESERVED = ("reset", "get_reward")


def public_methods(instance: Any) -> list[Callable]:
    """The tools of an environment instance: its class's public functions, bound to it (properties not evaluated)."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in _RESERVED and not name.startswith("_")
    ]


def environment_reward(env_type: type) -> Callable:
    """A reward function reading `get_reward()` of each completion's environment of class `env_type` (exactly that
    class; other environments' completions get None)."""
    if inspect.iscoroutinefunction(env_type.get_reward):

        async def reward(environments, **_) -> list[float | None]:
            return [await e.get_reward() if type(e) is env_type else None for e in environments]

    else:

        def reward(environments, **_) -> list[float | None]:
            return [e.get_reward() if type(e) is env_type else None for e in environments]

    reward.__name__ = env_type.__name__
    return reward


class Environments:
    """The environment factories of a run, their instance pools and the tools each exposes."""

    def __init__(self, factory: Callable | Mapping[str, Callable], tools: list[Callable]):
        self.routed = isinstance(factory, Mapping)  # several environments, chosen per row by `environment`
        self.factories: dict[str | None, Callable] = dict(factory) if self.routed else {None: factory}
        self.pools: dict[str | None, list[Any]] = {}
        self.schema_tools: dict[str | None, list[Callable]] = {}  # per environment: what its prompts describe
        self.reward_types: list[type] = []  # classes with a `get_reward`, once each
        for name, make in self.factories.items():
            instance = make()  # probed once (its tools, its reward) and kept as the pool's first instance
            if not callable(getattr(instance, "reset", None)):
                raise ValueError(
                    f"The environment {type(instance).__name__} made by environment_factory"
                    f"{'' if name is None else f'[{name!r}]'} has no `reset` method: an environment must define "
                    "reset(**row), called at the start of each episode."
                )
            self.pools[name] = [instance]
            self.schema_tools[name] = list(tools) + public_methods(instance)
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_types:
                self.reward_types.append(type(instance))

    def all_tools(self, tools: list[Callable]) -> list[Callable]:
        """TRL's `trainer.tools`: the standalone tools, then the methods of each environment's first (probed)
        instance, bound to it."""
        return list(tools) + [m for name in self.factories for m in public_methods(self.pools[name][0])]

    def reward_funcs(self) -> list[Callable]:
        """One reward function per environment class that owns a reward (`get_reward`)."""
        return [environment_reward(env_type) for env_type in self.reward_types]

    def names_of(self, rows: list[dict[str, Any]]) -> list[str | None]:
        """Each row's environment name (None with a single factory); an unknown name is an error."""
        if not self.routed:
            return [None] * len(rows)
        names = [row.get("environment") for row in rows]
        unknown = sorted({repr(n) for n in names if n not in self.factories})
        if unknown:
            raise ValueError(
                f"Rows name the environments {unknown} in their `environment` column, which are not among the "
                f"environments passed to `environment_factory`: it has {sorted(self.factories)}."
            )
        return names

    def start(self, prompts: list, rows: list[dict[str, Any]]) -> tuple[list, list[Any], list[list[Callable]]]:
        """Reset one instance per row: returns the prompts with each `reset` observation appended to the last user
        message, the instances, and each row's tools (for its prompt's schema, and to call)."""
        names, handed = self.names_of(rows), {}
        instances, prompts = [], list(prompts)
        for i, (name, row) in enumerate(zip(names, rows, strict=True)):
            pool, k = self.pools[name], handed.get(name, 0)
            if k == len(pool):
                pool.append(self.factories[name]())
            handed[name] = k + 1
            instance = pool[k]
            arguments = {key: value for key, value in row.items() if not (self.routed and key == "environment")}
            observation = instance.reset(**arguments)
            if observation is not None:
                prompts[i] = _with_observation(prompts[i], observation)
            instances.append(instance)
        return prompts, instances, [self.schema_tools[name] for name in names]

    def retire(self, instances: list[Any]) -> None:
        """Take `instances` out of their pools for good (a call of theirs timed out and may still be running): the
        next rollout that needs one more instance makes a new one."""
        gone = {id(instance) for instance in instances}
        for name, pool in self.pools.items():
            self.pools[name] = [instance for instance in pool if id(instance) not in gone]

    def tool_names(self) -> set[str]:
        """The names of every environment's tools (the standalone tools included)."""
        return {tool.__name__ for tools in self.schema_tools.values() for tool in tools}

    def row_tools(self, instances: list[Any], tools: list[Callable]) -> list[list[Callable]]:
        """The tools each episode calls: the standalone ones and its own instance's methods."""
        return [list(tools) + public_methods(instance) for instance in instances]


def _with_observation(prompt: list[dict[str, Any]], observation: str | list) -> list[dict[str, Any]]:
    """`prompt` with `observation` appended to its last message's content (a new list; the row is left as it is)."""
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}] if content else []
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return [*prompt[:-1], {**prompt[-1], "content": content + observation}]
