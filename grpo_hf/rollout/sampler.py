"""Prompt rows -> sampled completions: the rollout engine, tool episodes and `rollout_func`, behind one call.

`Sampler.sample(prompts, columns)` is the sampling half of a rollout round (`experience.ExperienceMaker` does the
scoring and what follows). It owns the rollout engine (chosen at the first rollout, `engine.make_engine`), gathers
sharded weights for it (ZeRO-3, FSDP2), has a LoRA policy's adapted layers decode with merged copies of their weights
(`lora_decode.LoraDecode`, refreshed after each optimizer step), and takes completions from one of three sources:

- the engine, one completion per row (single turn);
- with `tools` or an `environment_factory`, tool episodes on top of the engine (`episodes.EpisodeRunner`): each row's
  environment is reset first (`environments.Environments`), its prompt rendered with its tools' schemas;
- the user's `rollout_func` (TRL's contract, `custom.rollout_from_func`), which replaces the engine's first turn: as
  in TRL, each row's environment is reset before it is called (it gets the prompts with their observations), and
  with tools its completions are each episode's first turn, a turn that calls tools going on on the engine.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from grpo_hf.parallel import fsdp2_gathered, is_fsdp2, is_zero3
from grpo_hf.peft_utils import is_peft_model
from grpo_hf.rollout.batching import Sequences
from grpo_hf.rollout.custom import rollout_from_func
from grpo_hf.rollout.engine import RolloutEngine, check_records_routes, choose_engine, make_engine
from grpo_hf.rollout.environments import EMPTY_PROMPT, Environments
from grpo_hf.rollout.episodes import EpisodeRunner, Episodes
from grpo_hf.rollout.lora_decode import LoraDecode
from grpo_hf.rollout.prompts import is_conversational, tokenize_prompts
from grpo_hf.rollout.tools import ToolStats, tool_chat_template
from grpo_hf.rollout.vision import IMAGE_COLUMNS, row_images, tokenize_vision_prompts
from grpo_hf.routers import is_moe
from grpo_hf.vision import has_images, image_token_ids, is_processor, tokenizer_of

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """What sampling needs besides the model: the settings the rollout engine is built with, and the chat template's
    extra arguments."""

    generation_config: Any  # a `transformers.GenerationConfig`: max_new_tokens, temperature, top_p, ...
    eos_token_ids: list[int]  # every id that ends a completion
    chat_template_kwargs: dict[str, Any]
    sharded: bool  # FSDP or ZeRO-3: the weights are gathered anew for each rollout


@dataclass(frozen=True)
class ToolSetup:
    """A run's tools and environments, and the chat template its episodes are rendered with (None: the tokenizer's)."""

    tools: list[Callable]
    environments: Environments | None
    template: str | None

    @classmethod
    def build(cls, tools, environment_factory, tokenizer) -> ToolSetup | None:
        """None without tools or environments; else the checked setup."""
        if not tools and environment_factory is None:
            return None
        tools = list(tools or [])
        for k, tool in enumerate(tools):
            if not callable(tool) or not getattr(tool, "__name__", None):
                raise TypeError(
                    f"tools[{k}] is {tool!r}; a tool is a named function (sync or async) with a docstring."
                )
        names = [tool.__name__ for tool in tools]
        if len(set(names)) < len(names):
            raise ValueError(f"tools has several functions named alike ({names}); the model calls them by name.")
        environments = None if environment_factory is None else Environments(environment_factory, tools)
        return cls(tools, environments, tool_chat_template(tokenizer))

    def all_tools(self) -> list[Callable]:
        """TRL's `trainer.tools`: the standalone tools and every environment's methods (bound to its probed
        instance)."""
        return list(self.tools) if self.environments is None else self.environments.all_tools(self.tools)

    def reward_funcs(self) -> list[Callable]:
        """Each environment class's `get_reward`, as a reward function named after the class (weight 1)."""
        return [] if self.environments is None else self.environments.reward_funcs()

    def tool_names(self) -> list[str]:
        """Every tool's name, standalone and environments' (the per-tool metrics' names), sorted."""
        names = {tool.__name__ for tool in self.tools}
        return sorted(names | (self.environments.tool_names() if self.environments is not None else set()))

    def reward_columns(self) -> list[str]:
        """The keyword arguments the episodes add for the reward functions."""
        return ["environments"] if self.environments is not None else []


@dataclass
class Sampled:
    """This process's B rows, sampled."""

    tokens: Sequences  # prompt [B, P] and completion [B, T] ids and masks (`context_mask`: tool replies)
    is_truncated: Tensor  # [B] bool
    is_prompt_truncated: Tensor  # [B] bool: left-truncated to max_prompt_length
    # [B, T] the sampler's own log-probs (vLLM, rollout_func, any engine under `Sampler.record_logps`), 0 off the loss
    sampling_logps: Tensor | None = None
    # [B, P + T, L, k] the experts each MoE layer chose per token, column for column with cat(prompt, completion) ids,
    # -1 where none was recorded (`batching.Rollout.routes`); None: not recorded
    routes: Tensor | None = None
    prompts: list | None = (
        None  # [B] the prompts as the model saw them (an environment's observation added); None: as given
    )
    messages: list | None = None  # [B] each episode's chat messages (tool episodes); None: decode the ids
    tool_calls: int | None = None  # calls made over the B rows (tool episodes); None: no tools
    tool_failures: int = 0
    tool_stats: dict[str, ToolStats] | None = None  # per tool of the run (every name, called or not); None: no tools
    turns: list[int] | None = None  # [B] the model's turns in each episode (tool episodes)
    # the `loop` engine's episode cache counts of this rollout (`episode_cache.EpisodeCache.stats`); None: no cache
    episode_cache: dict[str, int] | None = None


class Sampler:
    """The sampling of one run (see the module docstring)."""

    def __init__(
        self,
        args,
        accelerator,
        tokenizer,
        generation: Generation,
        wrapped: Callable[[], nn.Module],  # -> the outermost model wrapper (Trainer re-wraps it when training starts)
        rollout_func: Callable[[list], dict] | None = None,  # TRL's `rollout_func`, its trainer argument bound
        agentic: ToolSetup | None = None,  # tools and environments: tool episodes
        record_logps: bool = False,
    ):
        """`record_logps`: every rollout's `Sampled.sampling_logps` holds the engine's log-probs of its tokens (the
        engine is chosen among those that record them, `RolloutEngine.can_record_logps`); it may also be set later,
        as the attribute of the same name, before or after the engine is built."""
        self.args, self.accelerator, self.generation = args, accelerator, generation
        # A VLM's processor tokenizes prompts with their images (`rollout.vision`); its tokenizer does the rest.
        self.processor, self.tokenizer = (tokenizer if is_processor(tokenizer) else None), tokenizer_of(tokenizer)
        self.wrapped, self.rollout_func = wrapped, rollout_func
        self.tools = agentic.tools if agentic is not None else []
        self.tool_names = agentic.tool_names() if agentic is not None else []
        self.environments = agentic.environments if agentic is not None else None
        self.environments_in_use: list | None = None  # the last rollout's environment instances, one per row
        self.warned_cut = False  # whether prompts over max_prompt_length were reported (once a run)
        self.record_logps = record_logps  # the engine records its log-probs (`RolloutEngine.record_logps`)
        # the engine records its log-probs where it can (no engine is ruled out), for metrics that no loss reads
        # (`replay.RouterReplay`'s log-prob gap); set by the trainer
        self.metric_logps = False
        self.gathers = True  # a sharded policy's weights are gathered for the rollout (False: `for_model`)
        self.engine: RolloutEngine | None = None  # chosen at the first rollout (`engine_for`)
        self.moe: bool | None = None  # the policy has MoE routers whose routes the engine records (`_is_moe`)
        self.lora_decode: LoraDecode | None = None  # a LoRA policy's merged copies for the engine, made with it
        self.episodes = None
        if self._replays_routes() and rollout_func is None:  # at construction: an engine that records the routes
            check_records_routes(self._engine_name())
        if agentic is not None:
            self.template_kwargs = dict(generation.chat_template_kwargs)
            if agentic.template is not None:
                self.template_kwargs["chat_template"] = agentic.template
            self.episodes = EpisodeRunner(
                self.tokenizer,
                max_completion_length=args.max_completion_length,
                eos_token_ids=generation.eos_token_ids,
                max_tool_calling_iterations=args.max_tool_calling_iterations,
                tool_timeout=args.tool_timeout,
                template_kwargs=self.template_kwargs,
                processor=self.processor,  # a VLM's: renders tool replies with images
                process_index=accelerator.process_index,  # its rows' random streams differ from other processes'
            )

    def sample(self, prompts: list, columns: dict[str, list]) -> Sampled:
        """Sample one completion (or episode) per row of `prompts` (None: a row without a prompt, which its
        environment's `reset` writes); `columns` (the rows' other fields) gain what `rollout_func` returns besides its
        tokens, and `environments` with environments."""
        if self.rollout_func is not None:
            return self._from_func(prompts, columns)
        if self.episodes is not None:
            return self._episodes(prompts, columns)
        prompt_ids, prompt_mask, is_prompt_truncated, images = self._tokenize_images(prompts, columns)
        with self.decoding() as (model, engine):
            completion_ids, completion_mask, is_truncated = engine.generate(
                model, prompt_ids, prompt_mask, **({"images": images} if images else {})
            )
        logps = _engine_logps(engine, completion_mask)
        tokens = Sequences(prompt_ids, prompt_mask, completion_ids, completion_mask, image_inputs=images)
        return Sampled(tokens, is_truncated, is_prompt_truncated, logps, routes=_engine_routes(engine))

    def _start_environments(self, prompts: list, columns: dict[str, list]) -> tuple[list, list, list]:
        """Reset each row's environment, as TRL before any sampling (`rollout_func`'s included): returns the prompts
        (each `reset` observation appended), and per row the tools its prompt describes and those it calls. `reset`
        gets the row as the dataset has it: no `prompt` where the row has none."""
        row_tools = [self.tools] * len(prompts)
        if self.environments is None:
            return prompts, row_tools, row_tools
        rows = [
            {**({} if p is None else {"prompt": p}), **{k: v[i] for k, v in columns.items()}}
            for i, p in enumerate(prompts)
        ]
        prompts = [EMPTY_PROMPT if p is None else p for p in prompts]
        prompts, instances, schema_tools = self.environments.start(prompts, rows)
        columns["environments"] = self.environments_in_use = instances
        return prompts, schema_tools, self.environments.row_tools(instances, self.tools)

    def _from_func(self, prompts: list, columns: dict[str, list]) -> Sampled:
        """The user's `rollout_func` on the rows (their environments reset first); with tools, its completions are
        each episode's first turn: a turn that calls tools goes on on the rollout engine, as TRL's tool loop."""
        if self.environments is not None:
            prompts, _, row_tools = self._start_environments(prompts, columns)
        else:
            row_tools = [self.tools] * len(prompts)
        device = self.accelerator.device
        output = rollout_from_func(
            self.rollout_func,
            prompts,
            pad_token_id=self.tokenizer.pad_token_id,
            eos_token_ids=self.generation.eos_token_ids,
            vocab_size=self._vocab_size(),
            device=device,
        )
        columns.update(output.columns)
        shown = prompts if self.environments is not None else None
        not_cut = torch.zeros(len(prompts), dtype=torch.bool)
        if self.episodes is None:
            return Sampled(output.tokens, output.is_truncated, not_cut, output.logps, prompts=shown)
        tokens = output.tokens
        attended = tokens.completion_mask + (0 if tokens.context_mask is None else tokens.context_mask)
        first_turns = [
            (ids[keep].tolist(), sampled[keep].tolist(), logps[keep].tolist())
            for ids, keep, sampled, logps in zip(
                tokens.completion_ids.cpu(), attended.cpu().bool(), tokens.completion_mask.cpu(), output.logps.cpu(),
                strict=True,
            )
        ]  # fmt: skip
        with self.decoding() as (model, engine):
            generate = self._turn_sampler(model, engine)
            run = self.episodes.run(generate, tokens.prompt_ids, tokens.prompt_mask, row_tools, first_turns)
        return self._from_episodes(run, shown, tokens.prompt_ids, tokens.prompt_mask, not_cut)

    def _turn_sampler(self, model, engine):
        """One engine call of the episode runner (`episodes.Generate`)."""

        def generate(ids, mask, max_new_tokens, images, draws):  # images: each row's tool-reply images, or None
            ids, mask = ids.to(self.accelerator.device), mask.to(self.accelerator.device)
            extra = {"images": images} if images is not None else {}
            completion_ids, completion_mask, _ = engine.generate(
                model, ids, mask, max_new_tokens=max_new_tokens, draws=draws, **extra
            )
            return completion_ids, completion_mask, _engine_logps(engine, completion_mask), _engine_routes(engine)

        return generate

    def _from_episodes(self, run: Episodes, prompts: list, prompt_ids, prompt_mask, is_prompt_truncated) -> Sampled:
        """The rows of a run of episodes; the environment instances whose calls timed out leave their pool (a hung
        call may still be running on one: it must never be reset for another episode)."""
        if self.environments is not None:
            self.environments.retire(run.timed_out_owners)
        tool_stats = {name: run.tool_stats.get(name, ToolStats()) for name in self.tool_names}  # unknown names: out
        tokens = Sequences(
            prompt_ids,
            prompt_mask,
            run.completion_ids,
            run.completion_mask,
            context_mask=run.context_mask,
            image_inputs=run.image_inputs,  # the images of the tool replies, which the forwards read
        )
        return Sampled(
            tokens,
            run.is_truncated,
            is_prompt_truncated,
            run.sampling_logps,
            routes=run.routes,
            prompts=prompts,
            messages=run.messages,
            tool_calls=run.tool_calls,
            tool_failures=run.tool_failures,
            tool_stats=tool_stats,
            turns=run.turns,
        )

    def _tokenize_images(self, prompts: list, columns: dict[str, list]) -> tuple[Tensor, Tensor, Tensor, list | None]:
        """`_tokenize`, and for a VLM each row's image inputs (None when no row has images): by the processor with
        each row's `image`/`images` (`rollout.vision`), a group's rows sharing one dict."""
        if self.processor is None:
            return *self._tokenize(prompts), None
        images = [row_images({k: columns[k][i] for k in IMAGE_COLUMNS if k in columns}) for i in range(len(prompts))]
        settings = (self.args.max_prompt_length, self.generation.chat_template_kwargs)
        ids, mask, truncated, rows = tokenize_vision_prompts(self.processor, prompts, images, *settings)
        self._report_cut(prompts, truncated)
        device = self.accelerator.device
        on_device = {id(r): {k: v.to(device) for k, v in r.items()} for r in rows if r}
        rows = [on_device[id(r)] if r else None for r in rows]  # a group's rows still share one
        return ids.to(device), mask.to(device), truncated, (rows if has_images(rows) else None)

    def _episodes(self, prompts: list, columns: dict[str, list]) -> Sampled:
        """Tool episodes: reset each row's environment, render its prompt with its tools, run the episodes."""
        if any(row_images({k: columns[k][i] for k in IMAGE_COLUMNS if k in columns}) for i in range(len(prompts))):
            raise ValueError(
                "Tool episodes do not take prompt images yet (a tool's reply may hold images): rows with `image`/"
                "`images` and tools= or environment_factory= cannot be combined (docs/vision.md). Drop the image "
                "columns or the tools."
            )
        prompts, schema_tools, row_tools = self._start_environments(prompts, columns)
        if not is_conversational(prompts[0]):
            raise ValueError(
                "tools / environment_factory need conversational prompts (lists of chat messages): the chat template "
                "renders the tools and the tool replies. Give the dataset's `prompt` column as messages."
            )
        prompt_ids, prompt_mask, is_prompt_truncated = self._tokenize(prompts, schema_tools)
        with self.decoding() as (model, engine):
            generate = self._turn_sampler(model, engine)
            if hasattr(engine, "decode_turns"):  # `loop`: turns join the decoding batch at the next token step
                run = self.episodes.run_joining(
                    lambda source: engine.decode_turns(model, source),
                    prompt_ids,
                    prompt_mask,
                    row_tools,
                    generate,
                    record_logps=engine.record_logps,
                    record_routes=engine.record_routes,
                )
            else:  # one engine call per round of ready turns
                run = self.episodes.run(generate, prompt_ids, prompt_mask, row_tools)
        sampled = self._from_episodes(run, prompts, prompt_ids, prompt_mask, is_prompt_truncated)
        cache = getattr(engine, "episode_cache", None)
        sampled.episode_cache = dict(cache.stats) if cache is not None else None
        return sampled

    def _tokenize(self, prompts: list, tools: list | None = None) -> tuple[Tensor, Tensor, Tensor]:
        kwargs = self.template_kwargs if tools is not None else self.generation.chat_template_kwargs
        prompt_ids, prompt_mask, truncated = tokenize_prompts(
            self.tokenizer, prompts, self.args.max_prompt_length, kwargs, tools=tools
        )
        self._report_cut(prompts, truncated)
        return prompt_ids.to(self.accelerator.device), prompt_mask.to(self.accelerator.device), truncated

    def _report_cut(self, prompts: list, truncated: Tensor) -> None:
        """Warn, once a run, when prompts were over max_prompt_length: how many, and how they were cut (later cuts:
        the `prompts/num_truncated` metric)."""
        if self.warned_cut or not bool(truncated.any()):
            return
        self.warned_cut = True
        chat = is_conversational(prompts[0])
        logger.warning(
            "%d of the %d prompt rows of this rollout are over max_prompt_length=%d and were cut: %s. Later cuts are "
            "counted by the prompts/num_truncated metric only. max_prompt_length=None (TRL's default) keeps prompts "
            "whole.",
            int(truncated.sum()),
            len(prompts),
            self.args.max_prompt_length,
            "whole turns of their history were dropped, their system messages, tools' schemas and last user turn kept"
            if chat
            else "their beginning was dropped",
        )

    def for_model(self, model: nn.Module) -> Sampler:
        """A sampler like this one that decodes `model` (the async producer's copy of the weights, or the policy whose
        weights a vLLM server holds: `grpo_hf.producer`) with an engine of its own that records its log-probs: the
        same settings, tools and environments. It never gathers sharded weights (a collective call, which the
        producer's thread must not make): a copy is whole, and a server's engine reads only the policy's config."""
        other = copy.copy(self)
        other.wrapped, other.engine, other.lora_decode, other.record_logps = (lambda: model), None, None, True
        other.gathers = False
        return other

    def _vocab_size(self) -> int:
        model = self.accelerator.unwrap_model(self.wrapped())
        embeddings = model.get_input_embeddings()
        return getattr(embeddings, "num_embeddings", None) or model.config.get_text_config().vocab_size

    # ---- the rollout engine ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def decoding(self):
        """The bare model (`model_for_generation`) and the rollout engine (`engine_for`), with a LoRA policy's adapted
        layers on their merged copies (`lora_decode`) for the duration."""
        with self.model_for_generation() as model:
            engine = self.engine_for(model)
            engine.record_logps = self.record_logps or (self.metric_logps and engine.can_record_logps)
            engine.record_routes = engine.can_record_routes and self._is_moe(model)
            with self.lora_decode.applied() if self.lora_decode is not None else contextlib.nullcontext():
                yield model, engine

    def describe(self) -> str:
        """What samples, for the start-of-training line: `rollout_func`, or the engine `engine_for` takes (or has
        taken) and why each faster one was skipped (`engine.choose_engine`)."""
        if self.rollout_func is not None:
            return "rollout: the rollout_func given (no rollout engine)"
        if self.engine is not None:
            return f"rollout engine: {type(self.engine).__name__} (chosen)"
        model = self.accelerator.unwrap_model(self.wrapped())
        _, why = choose_engine(
            self._engine_name(), model, self.generation.generation_config, sharded=self.generation.sharded,
            blocked_token_ids=image_token_ids(model), record_logps=self.record_logps,
            record_routes=self._replays_routes(),
        )  # fmt: skip
        return why

    def engine_for(self, model: nn.Module) -> RolloutEngine:
        """The rollout engine (`args.rollout_engine`), chosen at the first rollout, with the model on its device; for
        a LoRA policy and an engine that runs its forward, the merged copies it decodes with (`lora_decode`)."""
        if self.engine is None:
            self.engine, why = make_engine(
                self._engine_name(),
                model,
                self.generation.generation_config,
                self.generation.eos_token_ids,
                sharded=self.generation.sharded,
                autocast=self.accelerator.autocast,  # for engines that call a model autocast does not wrap
                args=self.args,  # for the engines that take settings from it (vllm)
                accelerator=self.accelerator,
                tokenizer=self.tokenizer,  # vllm's structured outputs
                blocked_token_ids=image_token_ids(model),  # a VLM's: never sampled
                record_logps=self.record_logps,  # an engine that records its log-probs
                record_routes=self._replays_routes(),  # an engine that records MoE routes (named: or refused)
            )
            logger.info(why)
            if is_peft_model(model) and self.engine.decodes_with_model:
                merge = self.args.merge_lora_for_generation
                self.lora_decode, why = LoraDecode.build(model, enabled=merge, sharded=self.generation.sharded)
                logger.info(why)
        return self.engine

    def _is_moe(self, model: nn.Module) -> bool:
        """Whether the policy has MoE routers `routers` can record (looked up once): the engine then records the
        routes of every rollout (`Sampled.routes`), for routing replay and for the mismatch it measures either way. An
        MoE model whose routers `routers` does not know records nothing (routing replay refuses it on its own)."""
        if self.moe is None:
            try:
                self.moe = is_moe(model)
            except ValueError:
                self.moe = False
        return self.moe

    def _replays_routes(self) -> bool:
        """Whether routing replay needs the rollout's routes (router_replay='r3'): the engine must record them."""
        return getattr(self.args, "router_replay", "off") == "r3"

    def _engine_name(self) -> str:
        """`rollout_engine`; under ZeRO-3 without `ds3_gather_for_generation`, `generate`, whose decoding keeps the
        processes in step (every forward gathers each layer from all of them, so all must run as many)."""
        name = self.args.rollout_engine
        if self.args.ds3_gather_for_generation or not is_zero3(self.accelerator):
            return name
        if name not in ("auto", "generate"):
            raise ValueError(
                f"ds3_gather_for_generation=False samples with the ZeRO-3-sharded model, which only rollout_engine="
                f"'generate' does (its processes decode in step); rollout_engine={name!r} was asked. Use 'auto' or "
                "'generate', or set ds3_gather_for_generation=True."
            )
        return "generate"

    def weights_updated(self, model: nn.Module) -> None:
        """Tell the rollout engine, if one was built, that the policy's weights changed (`model`: unwrapped), and mark
        the merged LoRA copies stale (refreshed before the next rollout)."""
        if self.lora_decode is not None:
            self.lora_decode.mark_stale()
        if self.engine is not None:
            self.engine.on_weights_updated(model)

    @contextlib.contextmanager
    def model_for_generation(self):
        """The bare model for `generate`. Under DeepSpeed ZeRO-3 its shards are gathered first (TRL's helper); under
        FSDP2 once for the whole rollout (`parallel.fsdp2_gathered`), not in every forward (every token).

        Gradient checkpointing needs no switching off: `generate` runs in eval mode, where it is inactive. The vllm
        engine decodes with vLLM's copy of the weights: it gets the model as it is, sharded or not, and its push
        gathers a bucket of weights at a time (`weights.weight_buckets`), never the whole model.
        """
        wrapped = self.wrapped()
        if not self.gathers:  # `for_model`'s
            yield wrapped
        elif self.args.rollout_engine == "vllm":
            yield self.accelerator.unwrap_model(wrapped)
        elif is_zero3(self.accelerator):
            from trl.models.utils import unwrap_model_for_generation

            gather = self.args.ds3_gather_for_generation  # False: each layer gathered as it runs
            with unwrap_model_for_generation(wrapped, self.accelerator, gather_deepspeed3_params=gather) as unwrapped:
                yield unwrapped
        elif is_fsdp2(self.accelerator):
            with fsdp2_gathered(wrapped):
                yield self.accelerator.unwrap_model(wrapped)
        else:
            yield self.accelerator.unwrap_model(wrapped)


def _engine_routes(engine: RolloutEngine) -> Tensor | None:
    """The MoE routes [B, P + T, L, k] of the engine's last call (`RolloutEngine.sampling_routes`), None: none."""
    return engine.sampling_routes if engine.record_routes else None


def _engine_logps(engine: RolloutEngine, completion_mask: Tensor) -> Tensor | None:
    """The engine's log-probs [B, T] of its last call's tokens (vLLM; the others with `record_logps`), 0 off
    `completion_mask`; None: it has none."""
    logps = getattr(engine, "sampling_logps", None)
    if logps is None or logps.shape != completion_mask.shape:
        return None
    return logps.masked_fill(completion_mask == 0, 0.0)
