"""Multi-turn episodes: the model's turns and its tools' replies, as one completion of exact token ids.

An episode is `[prompt][turn 1][tool reply][turn 2]...[turn k]`. Each turn is sampled by the rollout engine (any
engine: `loop`, `generate`, `cuda_graph`, vLLM) with the ids so far as its prompt; when a turn ends with its EOS and
asks for tools, the calls run (`tools.ToolCaller`) and the chat template's ids for their replies (`tools.
tool_reply_ids`) are appended. Nothing is tokenised twice: a training row holds the ids the engine sampled and the
ids the template gave the replies, so the log-probs of the loss are those of the tokens the model saw.

Masks (`Episodes`): `completion_mask` is 1 on the sampled tokens (each turn's closing EOS included: a model that is
never trained to end its turn never learns to stop), `context_mask` on the tool replies: attended to by the forward,
out of the loss, its token counts, the sampler's importance ratio and the entropy statistics.

Bounds: `max_completion_length` bounds the whole episode, turns and replies together. A reply that would overflow it
is rolled back, as TRL 1.16 does: the episode ends on the calling turn's EOS, without the reply's ids or messages, and
is not truncated (its calls still count in the tool metrics). A reply that fills it exactly is kept and the episode
ends there, truncated (it ends on the reply, not on an EOS; TRL's row also does). A turn that reaches it without an
EOS ends the episode, truncated (`mask_truncated_completions` masks truncated episodes). `max_tool_calling_iterations`
(None: no limit) bounds the rounds of tool calls; a turn asking for more ends the episode as it is.

Randomness: the episodes sampled for a seed do not depend on how long the tools take, in which order they return, or
which rows share an engine call or a decoding step. Each episode draws from a random stream of its own
(`sampling.RowDraws`): the uniform behind its k-th sampled token is a hash of (rollout seed, episode row, k) and of
nothing else, and the rollout seed is one draw from torch's global generator, the only one a rollout takes from it
(whatever the engine or the tools draw runs under a forked generator, so the global state after a rollout does not
depend on them either). Given the same contexts, a row's draws are then the same whichever batch, step or thread
samples it; what remains is floating-point rounding that can differ with the batch's shape. Engines that take the
streams: `loop` (`decode_turns`) and `generate`/`generate_static` (a logits processor draws each row from its stream,
`sampling.DrawFromStreams`); the others (`cuda_graph`, vLLM) still draw from their own generators. Rows of different
processes have different streams.

Scheduling: an episode's calls run one after another in call order (a turn's calls in the order the model wrote them,
the next turn's after them: `tools`); tools of different episodes run at the same time, and no episode waits for the
slowest. With an engine that decodes turns as they come (`loop.decode_turns`, `run_joining`), a turn's tools start as
soon as it ends and the episode's next turn joins the decoding batch at the next token step once they have returned;
decoding ends only when no tool call is in flight and no episode is ready (an episode whose reply is rolled back does
not end the others). With the other engines (`run`), the turns of every episode ready to sample are sampled in one
engine call; the runner then waits only until *some* tool calls have returned and samples those episodes' next turns,
so a slow tool holds back its own episode and not the batch. Finished episodes leave the batch.

Images (a VLM, `processor` given): a tool may answer with content parts holding images (`{"type": "image", "image":
PIL image}`, as in TRL). The processor renders such a reply (`rollout.vision.tool_reply_inputs`): its image tokens
are in the reply's ids, and its image inputs join the episode's (`Episodes.image_inputs`, one `vision.ImageRow` per
row, the replies' images in order), which every later turn's generation and the training forwards take. The joining
decoder (`run_joining`) prefills text only: an episode whose replies brought images goes on, once it is done, with one
engine call per round of ready turns, as in `run`, whose engines take images (`RolloutEngine.takes_images`).

Timeouts and failures (`tools`): a failed, timed-out or cancelled call is an error reply the model reads in its next
turn, never the rollout's end. `Episodes.timed_out_owners` names the environment instances whose calls timed out, for
the sampler to retire from their pool. `Episodes.tool_stats` and `turns` carry what the calls did and the model's
turns per episode, for the metrics.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo_hf.rollout.batching import pad_token_lists
from grpo_hf.rollout.routes import masked, no_routes, read_mask
from grpo_hf.rollout.sampling import RowDraws, draw_seed
from grpo_hf.rollout.tools import ToolCaller, ToolCalls, ToolStats, parse_turn, tool_reply_ids
from grpo_hf.rollout.vision import tool_reply_inputs
from grpo_hf.vision import ImageRow, has_images, merge_rows

# generate(prompt_ids [n, P], prompt_mask [n, P], max_new_tokens, images: [n] `ImageRow` or None, or None, draws) ->
# (completion_ids [n, T], completion_mask [n, T], sampler log-probs [n, T] or None[, MoE routes [n, P + T, L, k] or
# None]): one engine call; `draws` (RowDraws) are the rows' random streams, for an engine that takes them
# (`RolloutEngine.generate(draws=...)`); the routes (`RolloutEngine.sampling_routes`), by an engine that records them.
Generate = Callable[
    [torch.Tensor, torch.Tensor, int, list | None, RowDraws],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
]
# A row's stream is its index plus this times the process's index: rows of different processes draw differently.
_STREAMS_PER_PROCESS = 2**32


@dataclass
class Episodes:
    """B episodes as training rows (completions right-padded), with what they did."""

    completion_ids: torch.Tensor  # [B, T] long: turns and tool replies, in order
    completion_mask: torch.Tensor  # [B, T] long: 1 on sampled tokens (the loss)
    context_mask: torch.Tensor  # [B, T] long: 1 on tool-reply tokens (read, not trained)
    is_truncated: torch.Tensor  # [B] bool: the episode hit max_completion_length
    sampling_logps: torch.Tensor | None  # [B, T] the sampler's log-probs of sampled tokens, 0 elsewhere; None: none
    messages: list[list[dict[str, Any]]]  # [B] the episode as chat messages: assistant turns and tool replies
    tool_calls: int  # calls made, over the B episodes
    tool_failures: int  # calls that failed (raised, unknown tool, bad arguments, timed out, not run)
    tool_stats: dict[str, ToolStats]  # per tool name called (known or not): its calls, failures, timeouts, latency
    turns: list[int]  # [B] the model's turns in each episode
    timed_out_owners: list[Any]  # the objects (environment instances) whose bound methods timed out, once each
    image_inputs: list[ImageRow | None] | None = None  # [B] the images of each episode's tool replies; None: none
    # [B, P + T, L, k] the MoE routes of every token the model read (prompt, turns, the replies later turns read),
    # aligned with cat(prompt_ids, completion_ids), -1 elsewhere (`rollout.routes`); None: not recorded
    routes: torch.Tensor | None = None


@dataclass
class _Episode:
    """One episode while it runs."""

    prompt: list[int]  # the prompt's ids (no padding)
    tools: dict[str, Callable]  # name -> function, this episode's
    stream: int  # its random stream (`RowDraws`)
    ids: list[int] = field(default_factory=list)  # completion ids so far
    sampled: list[int] = field(default_factory=list)  # per completion id: 1 sampled, 0 tool reply
    logps: list[float] = field(default_factory=list)  # per completion id: the sampler's log-prob (0 on replies)
    messages: list[dict[str, Any]] = field(default_factory=list)
    rounds: int = 0  # rounds of tool calls so far
    truncated: bool = False
    calls: ToolCalls | None = None  # the calls in flight
    images: list[ImageRow] = field(default_factory=list)  # the image inputs of each tool reply with images
    image_row: ImageRow | None = None  # all of them merged (`vision.merge_rows`): what the model reads
    last_calls: ToolCalls | None = None  # the calls of the previous round (a timed-out one may still run)
    stats: dict[str, ToolStats] = field(default_factory=dict)  # per tool name: what its calls did
    timed_out: list[Callable] = field(default_factory=list)  # the tools whose calls timed out
    routes: torch.Tensor | None = None  # [c, L, k] the MoE routes of its context's first c tokens, -1: none yet

    def add_routes(self, routes: torch.Tensor) -> None:
        """Take an engine call's routes [c', L, k] of this episode's first c' tokens (its context and turn): a token
        keeps the routes it was first read with (a turn that prefills the whole context again reads the earlier
        tokens again; with the episode cache, only its new tokens), -1 where none was recorded."""
        if self.routes is None:
            self.routes = routes
            return
        known = self.routes[: routes.size(0)]
        merged = routes.clone()
        merged[: known.size(0)] = torch.where(known >= 0, known, routes[: known.size(0)])
        self.routes = torch.cat([merged, self.routes[merged.size(0) :]])  # a shorter call keeps the known rest

    @property
    def context(self) -> list[int]:
        return self.prompt + self.ids

    @property
    def drawn(self) -> int:
        """Tokens sampled so far: the next token's draw in its stream."""
        return sum(self.sampled)


class EpisodeRunner:
    """Runs tool episodes on top of a rollout engine; see the module docstring."""

    def __init__(
        self,
        tokenizer,
        *,
        max_completion_length: int,
        eos_token_ids: Sequence[int],
        max_tool_calling_iterations: int | None = None,
        tool_timeout: float | None = None,
        template_kwargs: dict[str, Any] | None = None,
        processor=None,
        process_index: int = 0,
    ):
        """`processor`: a VLM's, which renders tool replies holding images (None: a tokenizer renders every reply).
        `process_index`: this process's, so that its rows' random streams differ from other processes'."""
        self.tokenizer, self.max_completion_length, self.processor = tokenizer, max_completion_length, processor
        self.process_index = process_index
        self.eos_token_ids = set(eos_token_ids)
        self.max_rounds = max_tool_calling_iterations
        self.template_kwargs = template_kwargs or {}
        self.caller = ToolCaller(tool_timeout)
        self.parse = parse_turn  # (tokenizer, turn ids, context ids, tools) -> the assistant message of a turn
        self._has_logps = False  # whether the engine gave its log-probs (vLLM)
        self._has_routes = False  # whether every engine call gave its MoE routes
        self.device = None  # the run's device, where the image inputs of tool replies go

    def run(
        self,
        generate: Generate,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        tools: Sequence[list[Callable]],
        first_turns: Sequence[tuple[list[int], list[int], list[float]]] | None = None,
    ) -> Episodes:
        """Run one episode per prompt row (`prompt_ids` [B, P] left-padded) with its `tools` (a list per row).
        `first_turns`: per row, a first turn sampled elsewhere (a `rollout_func`'s): its ids, 1/0 per id (sampled /
        an environment's, read only) and the sampler's log-probs; the episodes go on from there (TRL's tool loop on
        `rollout_func`'s output)."""
        episodes, counts = self._start(prompt_ids, prompt_mask, tools), [0, 0]
        ready, in_flight = list(episodes), []
        self._has_logps = True  # the sampler's log-probs are kept when every engine call (and first turn) gave them
        self._has_routes = first_turns is None  # the routes, when every engine call gave them (not a rollout_func's)
        if first_turns is not None:
            starts = zip(episodes, first_turns, strict=True)
            ready, in_flight = [], [e for e, (ids, sampled, logps) in starts if self.end_turn(e, ids, logps, sampled)]
        with _forked_rng(prompt_ids.device):
            self._rounds(generate, ready, counts, draw_seed(), in_flight)
        return self._as_rows(episodes, prompt_mask, *counts)

    def _rounds(self, generate: Generate, ready: list[_Episode], counts: list[int], seed: int, in_flight=()) -> None:
        """Sample the turns of the `ready` episodes, one engine call per round of ready turns, until all are done
        (`in_flight`: episodes whose tools are running already)."""
        in_flight = list(in_flight)
        while ready or in_flight:
            if ready:
                in_flight += self._sample_turns(generate, ready, seed)
                ready = []
            if in_flight:
                self.caller.wait_any([e.calls for e in in_flight])
                ready, in_flight = self._take_replies(in_flight, counts)

    def run_joining(
        self,
        decode: Callable[[_Turns], None],
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        tools,
        generate: Generate | None = None,
        record_logps: bool = False,
        record_routes: bool = False,
    ) -> Episodes:
        """`run` on an engine that decodes turns as they come (`decode(source)`, the `loop` engine's
        `decode_turns`): a turn whose tools have returned joins the decoding batch at the next token step, and a
        turn's tools start as soon as it ends. Episodes whose tool replies brought images go on afterwards by
        `generate` (as in `run`): the joining decoder prefills text only. `record_logps`: keep the log-probs the
        decoder gives each turn (`_Turns.turn_done`) as the episodes' `sampling_logps` (and those of `generate`'s
        calls, which must then give them); False: None, as the policy's own draw needs no correction.
        `record_routes`: the decoder gives each turn's MoE routes too (`_Turns.turn_done`), kept as `Episodes.routes`
        (with those of `generate`'s calls, which must then give them)."""
        episodes = self._start(prompt_ids, prompt_mask, tools)
        self._has_logps, self._has_routes = record_logps, record_routes
        source = _Turns(self, episodes, draw_seed())
        with _forked_rng(prompt_ids.device):
            decode(source)
            if source.ready or source.in_flight:
                raise RuntimeError(
                    f"The engine stopped decoding with {len(source.ready)} episodes ready for a turn and "
                    f"{len(source.in_flight)} waiting for tools: `decode(source)` must poll until `poll(block=True)` "
                    "returns []."
                )
            if source.held:
                if generate is None:
                    raise ValueError(
                        "A tool replied with images, which the joining decoder (the `loop` engine's decode_turns) "
                        "does not take, and run_joining was given no `generate` to sample the episode's next turns "
                        "with them."
                    )
                self._rounds(generate, [episodes[k] for k in source.held], source.counts, source.seed)
        return self._as_rows(episodes, prompt_mask, *source.counts)

    def _start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tools) -> list[_Episode]:
        self.device = prompt_ids.device
        first = self.process_index * _STREAMS_PER_PROCESS
        return [
            _Episode(ids[mask.bool()].tolist(), {fn.__name__: fn for fn in row_tools}, first + row)
            for row, (ids, mask, row_tools) in enumerate(zip(prompt_ids.cpu(), prompt_mask.cpu(), tools, strict=True))
        ]

    @staticmethod
    def draws(seed: int, episodes: Sequence[_Episode]) -> RowDraws:
        """The random streams of `episodes`' next turns, each at its episode's next draw."""
        streams = torch.tensor([e.stream for e in episodes], dtype=torch.long)
        return RowDraws(seed, streams, torch.tensor([e.drawn for e in episodes], dtype=torch.long))

    def budget(self, episode: _Episode) -> int:
        """The most tokens the episode's next turn may take."""
        return self.max_completion_length - len(episode.ids)

    def _sample_turns(self, generate: Generate, ready: list[_Episode], seed: int) -> list[_Episode]:
        """Sample the next turn of each episode of `ready` in one engine call, each from its own random stream; start
        the tools of the turns that ask for them and return those episodes."""
        budgets = [self.budget(e) for e in ready]
        ids, mask = pad_token_lists([e.context for e in ready], self.tokenizer.pad_token_id, left=True)
        images = [e.image_row for e in ready]  # [n] the images of each episode's tool replies
        draws = self.draws(seed, ready)
        completion_ids, completion_mask, logps, *routes = generate(
            ids, mask, max(budgets), images if has_images(images) else None, draws
        )  # [n, T] each; routes (if given): [[n, W + T, L, k] or None]
        self._has_logps = self._has_logps and logps is not None
        routes = routes[0] if routes else None
        self._has_routes = self._has_routes and routes is not None
        completion_ids, completion_mask = completion_ids.cpu(), completion_mask.cpu()
        logps = logps.cpu() if logps is not None else None
        calling = []
        for row, (episode, budget) in enumerate(zip(ready, budgets, strict=True)):
            n = min(int(completion_mask[row].sum()), budget)
            turn_logps = logps[row, :n].tolist() if logps is not None else [0.0] * n
            if routes is not None:  # the row's context, right-aligned to the W prompt columns, and its turn
                episode.add_routes(routes[row, ids.size(1) - len(episode.context) : ids.size(1) + n])
            if self.end_turn(episode, completion_ids[row, :n].tolist(), turn_logps):
                calling.append(episode)
        return calling

    def end_turn(
        self, episode: _Episode, turn: list[int], logps: list[float], sampled: list[int] | None = None
    ) -> bool:
        """Append a sampled turn to its episode and read it: True when it asks for tools, whose calls start now.
        `sampled`: 1/0 per id (0: written by an environment, out of the loss); None: all sampled."""
        context = episode.context
        episode.ids += turn
        episode.sampled += [1] * len(turn) if sampled is None else list(sampled)
        episode.logps += logps
        message = self.parse(self.tokenizer, turn, context, list(episode.tools.values()))
        episode.messages.append(message)
        if not turn or turn[-1] not in self.eos_token_ids:  # the budget ran out mid-turn
            episode.truncated = True
        elif message.get("tool_calls") and (self.max_rounds is None or episode.rounds < self.max_rounds):
            episode.calls = self.caller.submit(message["tool_calls"], episode.tools, after=episode.last_calls)
            return True
        return False

    def _take_replies(self, in_flight: list[_Episode], counts: list[int]) -> tuple[list[_Episode], list[_Episode]]:
        """Append the replies of the episodes whose calls are done; return (episodes to sample, still calling)."""
        now, ready, waiting = time.monotonic(), [], []
        for episode in in_flight:
            if not episode.calls.done(now):
                waiting.append(episode)
                continue
            replies, failures = episode.calls.replies(episode.stats)
            counts[0] += len(replies)
            counts[1] += failures
            episode.timed_out += episode.calls.timed_out_tools()
            episode.last_calls, episode.calls, episode.rounds = episode.calls, None, episode.rounds + 1
            reply_ids, images = self._reply_inputs(replies)
            length = len(episode.ids) + len(reply_ids)
            if length > self.max_completion_length:  # rolled back (TRL): the episode ends on its calling turn's EOS
                continue
            if images is not None:
                episode.images.append({k: v.to(self.device) for k, v in images.items()})
                episode.image_row = merge_rows(episode.images)
            episode.ids += reply_ids
            episode.sampled += [0] * len(reply_ids)
            episode.logps += [0.0] * len(reply_ids)
            episode.messages += replies
            if length == self.max_completion_length:  # no room left to answer: it ends on the reply, truncated
                episode.truncated = True
                continue
            ready.append(episode)
        return ready, waiting

    def _reply_inputs(self, replies: list[dict[str, Any]]) -> tuple[list[int], ImageRow | None]:
        """The ids of tool messages `replies` and, with a VLM's processor, their images' inputs (None: no image)."""
        if self.processor is None:
            return tool_reply_ids(self.tokenizer, replies, self.template_kwargs), None
        return tool_reply_inputs(self.processor, replies, self.template_kwargs)

    def _as_rows(self, episodes: list[_Episode], prompt_mask, tool_calls: int, tool_failures: int) -> Episodes:
        pad, device = self.tokenizer.pad_token_id, prompt_mask.device
        completion_ids, attended = pad_token_lists([e.ids for e in episodes], pad, left=False)  # [B, T] each
        sampled, _ = pad_token_lists([e.sampled for e in episodes], 0, left=False)
        T = completion_ids.size(1)
        images = [e.image_row for e in episodes]  # [B] each episode's tool-reply images, None for none
        logps = torch.zeros((len(episodes), T), dtype=torch.float32)
        for i, episode in enumerate(episodes):
            logps[i, : len(episode.logps)] = torch.tensor(episode.logps, dtype=torch.float32)
        routes = None
        if self._has_routes and any(e.routes is not None for e in episodes):
            context_mask = (attended - sampled).to(device)
            routes = _episode_routes(episodes, prompt_mask, sampled.to(device), context_mask)
        return Episodes(
            completion_ids=completion_ids.to(device),
            completion_mask=sampled.to(device),
            context_mask=(attended - sampled).to(device),
            is_truncated=torch.tensor([e.truncated for e in episodes], device=device),
            sampling_logps=logps.to(device) if self._has_logps else None,
            messages=[e.messages for e in episodes],
            tool_calls=tool_calls,
            tool_failures=tool_failures,
            tool_stats=_summed([e.stats for e in episodes]),
            turns=[sum(m.get("role") == "assistant" for m in e.messages) for e in episodes],
            timed_out_owners=_owners([tool for e in episodes for tool in e.timed_out]),
            image_inputs=images if has_images(images) else None,
            routes=routes,
        )


def _episode_routes(episodes: list[_Episode], prompt_mask, completion_mask, context_mask) -> torch.Tensor:
    """[B, P + T, L, k]: each episode's routes (its prompt's right-aligned to the P prompt columns, its completion's
    from column P on), -1 where no token was read (`routes.read_mask`: padding, the episode's last token)."""
    like = next(e.routes for e in episodes if e.routes is not None)
    P, T = prompt_mask.size(1), completion_mask.size(1)
    rows = no_routes(len(episodes), P + T, like[None].to(prompt_mask.device))  # [B, P + T, L, k]
    for i, episode in enumerate(episodes):
        if episode.routes is None:
            continue
        length = min(episode.routes.size(0), len(episode.prompt) + len(episode.ids))
        start = P - len(episode.prompt)
        rows[i, start : start + length] = episode.routes[:length].to(rows.device)
    return masked(rows, read_mask(prompt_mask, completion_mask, context_mask))


def _summed(stats: list[dict[str, ToolStats]]) -> dict[str, ToolStats]:
    total: dict[str, ToolStats] = {}
    for part in stats:
        for name, tool in part.items():
            total.setdefault(name, ToolStats()).add(tool)
    return total


def _owners(tools: list[Callable]) -> list[Any]:
    """The objects `tools` are bound methods of (environment instances), once each; plain functions have none."""
    owners = {id(tool.__self__): tool.__self__ for tool in tools if inspect.ismethod(tool)}
    return list(owners.values())


class _Turns:
    """The turns of a run's episodes as an engine that decodes them as they come takes them (`loop.decode_turns`):
    `poll` hands out the episodes ready for a turn, `draws` their random streams, `turn_done` takes each turn back
    when it ends."""

    def __init__(self, runner: EpisodeRunner, episodes: list[_Episode], seed: int):
        self.runner, self.episodes, self.seed = runner, episodes, seed
        self.ready, self.in_flight, self.counts = list(range(len(episodes))), [], [0, 0]
        self.held: list[int] = []  # episodes whose tool replies brought images: for `run_joining` to go on with
        self.gone: list[int] = []  # episodes that called tools but will not come back to the decoder (`ended`)

    def poll(self, block: bool) -> list[tuple[int, list[int], int]]:
        """(episode index, context ids, budget) of each episode ready for its next turn; with `block`, wait while
        tool calls are in flight until some episode is ready (a call whose reply is rolled back readies none); []
        then means every episode is done."""
        if self.in_flight:
            self._collect()
        while block and not self.ready and self.in_flight:
            self.runner.caller.wait_any([self.episodes[k].calls for k in self.in_flight])
            self._collect()
        ready, self.ready = self.ready, []
        return [(k, self.episodes[k].context, self.runner.budget(self.episodes[k])) for k in ready]

    def draws(self, keys: Sequence[int]) -> RowDraws:
        """The random streams of the episodes `keys` (as `poll` gave them), each at its episode's next draw."""
        return self.runner.draws(self.seed, [self.episodes[k] for k in keys])

    def turn_done(self, k: int, turn: list[int], logps: list[float], routes: torch.Tensor | None = None) -> bool:
        """Take episode k's turn; True when it called tools (it comes back for another turn unless its reply is
        rolled back), so that the decoder keeps its cache. `routes` [c, L, k]: the MoE routes of the episode's first
        c tokens (context and turn, -1 where this turn's forwards read none), when the decoder records them."""
        if routes is not None:
            self.episodes[k].add_routes(routes)
        if self.runner.end_turn(self.episodes[k], turn, logps):
            self.in_flight.append(k)
            return True
        return False

    def ended(self) -> list[int]:
        """The episodes that called tools and will not come back for a turn here since the last call (a reply rolled
        back, a reply that filled the budget, a reply with images: `generate` goes on with those), for the decoder to
        drop what it kept for them."""
        gone, self.gone = self.gone, []
        return gone

    def _collect(self) -> None:
        calling = [self.episodes[k] for k in self.in_flight]
        ready, waiting = self.runner._take_replies(calling, self.counts)
        index = {id(e): k for k, e in enumerate(self.episodes)}
        self.held += [index[id(e)] for e in ready if e.image_row is not None]
        self.ready += [index[id(e)] for e in ready if e.image_row is None]
        back = {id(e) for e in ready if e.image_row is None} | {id(e) for e in waiting}
        self.gone += [index[id(e)] for e in calling if id(e) not in back]
        self.in_flight = [index[id(e)] for e in waiting]


def _forked_rng(device: torch.device):
    """A context in which torch's global generators (the CPU's, and `device`'s if it is a CUDA device) may be drawn
    from without changing what they draw after it."""
    if device.type != "cuda":
        return torch.random.fork_rng(devices=[])
    devices = [device.index if device.index is not None else torch.cuda.current_device()]
    return torch.random.fork_rng(devices=devices)
