"""Tool episodes decoded with and without the episode cache: prefill tokens, time and memory per rollout.

The `loop` engine's joining decoder (`EpisodeRunner.run_joining` driving `LoopEngine.decode_turns`) samples
`--prompts` x `--group` tool episodes (16 rows by default) with the real SmolLM2-135M-Instruct weights (the demos'
offline model). Every prompt opens with one system block of about 1,000 tokens: an instruction and four JSON tool
schemas (`TOOLS`), rendered by TRL's Qwen2.5 tool template with `tools=`; its token count is printed. The turns are
sampled, each ended on an EOS after at most `--turn-tokens` tokens (`TurnCap`); what is scripted is their *reading*
(`scripted_parse`, as `benchmarks/_worker.py` scripts the `tools` config): a turn calls the next tool while its
episode has made fewer than 2 rounds of calls, and up to 4 rounds when a hash of the turn's ids is even, so episodes
take 3 to 5 turns. The tools sleep (`--latency` seconds, scaled per tool) and answer with fixed JSON of a few dozen
tokens.

Two arms, each rollout in a process of its own (peak memory is the process's), alternated for `--reps` repetitions
with one seed per repetition:

- `today`: `episode_cache_bytes=0`, every turn re-prefills its whole context (prompt, system block, earlier turns
  and replies);
- `after`: the episode cache (`--cache-gb`): a row's KV cache kept across its turns, so a rejoining row prefills its
  tool reply only, and the prefix the batch's contexts share prefilled once.

Per arm, the median over repetitions of: prefill tokens per episode (the real tokens of every model forward with more
than one input column, counted by a forward pre-hook on the decoder) and the tokens those forwards computed, padding
included; the episode's own new tokens (sampled tokens and tool replies); the tokens every prompt shares; seconds per
rollout (after a warm-up forward); peak MB (CPU: the process's peak RSS; CUDA: `max_memory_allocated`). Then the
ratios after/today, the targets (prefill tokens per episode within 1.2x of the episode's new tokens plus one shared
prefix per batch, prefill positions per episode, padding included, within 1.2x of its new tokens, rollout time at most
0.5x today's), how many episodes both arms sampled token for token alike (the rows draw from their own random
streams, so only float rounding can part them), and the cache's own counters.

`--model qwen3_5` and `--model gemma3` run the same episodes on random-weight models of SmolLM2's tokenizer shaped like
Qwen3.5 (Gated DeltaNet layers beside full attention) and Gemma 3 (sliding windows beside full attention), whose
caches `cache_layers` keeps row by row.

    python benchmarks/multi_turn.py             # the table in docs/tools.md ("Multi-turn episodes")
    python benchmarks/multi_turn.py --smoke     # a quick check: 2 rows, one tool, short episodes, one repetition
    python benchmarks/multi_turn.py --model gemma3 --prompts 2 --group 4 --reps 1 --latency 0.05 \
        --max-completion-length 384             # the Gemma-3-shaped row of docs/tools.md (qwen3_5 likewise)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(ROOT))  # grpo_hf from this checkout where it is not installed
sys.path.insert(1, str(ROOT / "recipes"))

ARMS = {"today": False, "after": True}  # arm -> episode cache on
SYSTEM = (
    "You are a travel assistant. Use the tools to look things up before you answer: call one tool at a time, read "
    "its result, then call the next one or answer. Keep every message short."
)
PROMPTS = [
    "I fly from Lisbon to Berlin on 2026-12-11 with my partner. Find us a flight, tell me the weather there and what "
    "300 EUR is in US dollars.",
    "Book me a hotel in Tokyo for three nights from 2027-01-05, check the forecast and convert 50000 JPY to euros.",
    "We are four people going from New York to Rome on 2027-03-02. Which flights are there, is it going to rain, and "
    "what do 2 hotel nights cost in dollars?",
    "Plan a weekend in Oslo from 2026-12-18: a direct flight from Amsterdam, a hotel near the centre and the weather.",
]
LATENCY = {"search_flights": 1.5, "get_weather_forecast": 0.5, "convert_currency": 0.25, "search_hotels": 1.0}
latency_seconds = 0.2  # `--latency`: each tool sleeps this times its LATENCY


def search_flights(origin: str, destination: str, date: str, passengers: int = 1, cabin: str = "economy") -> str:
    """Search for scheduled flights between two airports on a given day, with their prices and seat availability.

    Args:
        origin: IATA code of the departure airport, e.g. "LIS" for Lisbon or "JFK" for New York.
        destination: IATA code of the arrival airport, e.g. "BER" for Berlin.
        date: The departure date in ISO 8601 format (YYYY-MM-DD).
        passengers: Number of adult passengers travelling together (1 to 9).
        cabin: The travel class to search. (choices: ["economy", "premium_economy", "business", "first"])
    """
    time.sleep(latency_seconds * LATENCY["search_flights"])
    flights = [{"flight": "TP 556", "departs": "07:25", "arrives": "11:40", "stops": 0, "price_eur": 189}]
    return json.dumps({"flights": flights, "currency": "EUR"})


def get_weather_forecast(location: str, days: int = 3, units: str = "metric") -> str:
    """Get the weather forecast for a city: the temperature range, the chance of rain and the wind for each day.

    Args:
        location: The city and its country, e.g. "Berlin, Germany", or a "latitude,longitude" pair.
        days: How many days ahead to forecast, starting today (1 to 10).
        units: The unit system of the temperatures and wind speeds. (choices: ["metric", "imperial"])
    """
    time.sleep(latency_seconds * LATENCY["get_weather_forecast"])
    return json.dumps(
        {"location": location, "units": units, "forecast": [{"day": "Fri", "min": 9, "max": 17, "rain": 0.2}]}
    )


def convert_currency(amount: float, source_currency: str, target_currency: str, date: str | None = None) -> str:
    """Convert an amount of money from one currency to another at the reference exchange rate of a day.

    Args:
        amount: The amount of money to convert, in the source currency (a positive number).
        source_currency: ISO 4217 code of the currency the amount is in, e.g. "EUR", "USD" or "JPY".
        target_currency: ISO 4217 code of the currency to convert the amount to.
        date: The day whose reference rate to use, in ISO 8601 format (YYYY-MM-DD); today's rate when omitted.
    """
    time.sleep(latency_seconds * LATENCY["convert_currency"])
    return json.dumps({"amount": amount, "from": source_currency, "to": target_currency, "rate": 1.0842})


def search_hotels(city: str, check_in: str, nights: int, guests: int = 2, sort_by: str = "price") -> str:
    """Search for hotels with free rooms in a city, with their nightly price, rating and distance to the centre.

    Args:
        city: The city to search in, with its country if the name is ambiguous, e.g. "Portland, Oregon".
        check_in: The day of arrival in ISO 8601 format (YYYY-MM-DD).
        nights: How many nights to stay (1 to 30).
        guests: How many guests share one room (1 to 4).
        sort_by: The order of the results. (choices: ["price", "rating", "distance"])
    """
    time.sleep(latency_seconds * LATENCY["search_hotels"])
    hotels = [{"name": "Hotel Central", "stars": 4, "price_per_night": 142, "rating": 8.7, "km_to_centre": 0.6}]
    return json.dumps({"city": city, "nights": nights, "hotels": hotels})


TOOLS = [search_flights, get_weather_forecast, convert_currency, search_hotels]
CALLS = {  # the arguments of each tool's scripted call
    "search_flights": {"origin": "LIS", "destination": "BER", "date": "2026-12-11", "passengers": 2},
    "get_weather_forecast": {"location": "Berlin, Germany", "days": 2},
    "convert_currency": {"amount": 300, "source_currency": "EUR", "target_currency": "USD"},
    "search_hotels": {"city": "Berlin, Germany", "check_in": "2026-12-11", "nights": 2},
}


def scripted_parse(tokenizer, ids, prefix=None, tools=None) -> dict:
    """Read a turn (`ids` after the context `prefix`): while its episode has made fewer than 2 rounds of calls, and up
    to 4 when a hash of the turn's ids is even, a call of the next tool of `tools` (the runner runs it only if the
    turn ended with its EOS); otherwise the turn's text."""
    rounds = tokenizer.decode(list(prefix or [])).count("<tool_response>")
    if rounds < 2 or (rounds < 4 and zlib.crc32(bytes(str(list(ids)), "ascii")) % 2 == 0):
        name = tools[rounds % len(tools)].__name__
        call = {"type": "function", "function": {"name": name, "arguments": CALLS[name]}}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


class TurnCap:
    """A turn source (`EpisodeRunner.run_joining`'s) whose turns end after at most `tokens` tokens, on an EOS: a turn
    that reaches the cap without one has its last token replaced by `eos` (as `generate`'s `forced_eos_token_id`
    ends a sequence at its length), so that episodes take their scripted turns instead of rambling through their
    budget. The replaced token was never fed to the model (a turn's last token is prefilled with the next context), so
    both arms see it alike. Everything else is the wrapped source's."""

    def __init__(self, source, tokens: int, eos: int, eos_token_ids):
        self.source, self.tokens, self.eos, self.eos_token_ids = source, tokens, eos, set(eos_token_ids)

    def poll(self, block: bool):
        return [(key, context, min(budget, self.tokens)) for key, context, budget in self.source.poll(block)]

    def turn_done(self, key, turn: list[int], logps: list[float]) -> bool | None:
        if len(turn) == self.tokens and turn[-1] not in self.eos_token_ids:
            turn = [*turn[:-1], self.eos]
        return self.source.turn_done(key, turn, logps)  # whether the episode comes back: the decoder keeps its cache

    def __getattr__(self, name: str):
        return getattr(self.source, name)


class PrefillCounter:
    """Counts the tokens of every forward with more than one input column (a prefill, not a decode step), by a
    forward pre-hook on `module`: `real` (the attention mask's ones in the new columns; all of them without a mask)
    and `computed` (rows x columns, padding included); and of every decode step (one input column), the key columns its
    rows attend over (`attended`: rows x the mask's width) and the real ones among them (`attended_real`)."""

    def __init__(self, module):
        self.real, self.computed, self.forwards = 0, 0, 0
        self.attended, self.attended_real = 0, 0
        self.handle = module.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        rows, columns = ids.shape if ids is not None else embeds.shape[:2]
        mask = kwargs.get("attention_mask")
        if columns <= 1:
            if mask is not None and mask.dim() == 2:
                self.attended += mask.numel()
                self.attended_real += int(mask.sum())
            return
        self.forwards += 1
        self.computed += rows * columns
        real = mask[:, -columns:].sum() if mask is not None and mask.dim() == 2 else rows * columns
        self.real += int(real)


# `--model`: the real SmolLM2-135M-Instruct, or a random-weight model of a family's cache layout (SmolLM2's tokenizer):
# Qwen3.5's 3 Gated DeltaNet layers to 1 of full attention, Gemma 3's 5 sliding-window layers to 1 of full attention
# (a window of 128, well inside the ~1,100-token contexts). Their turns are noise that `TurnCap` ends.
SHAPED = {
    "qwen3_5": (
        "Qwen3_5TextConfig",
        dict(
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
            linear_num_key_heads=4, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=128),
    ),
}  # fmt: skip
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "qwen3_5": "Qwen3.5-shaped", "gemma3": "Gemma-3-shaped"}


def load(device: str, tools: int, name: str = "smollm2"):
    """The `--model` (fp32, eval mode) on `device`, SmolLM2's tokenizer with TRL's Qwen2.5 tool template, and the
    first `tools` of `TOOLS`. A shaped model has 4 or 6 layers of width 128 and random weights (seed 0)."""
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_hf import offline_model_path

    path = offline_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    if name == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        config_class, layout = SHAPED[name]
        config = getattr(transformers, config_class)(
            vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
            num_hidden_layers=len(layout["layer_types"]), num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=4096,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **layout,
        )  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float()
    return model.to(device).eval(), tokenizer, TOOLS[:tools]


def system_tokens(tokenizer, tools) -> int:
    """The tokens of the system block (the instruction and the tool schemas), as the chat template renders it."""
    system = [{"role": "system", "content": SYSTEM}]
    return len(tokenizer.apply_chat_template(system, tools=tools, tokenize=True, return_dict=False))


def shared_prefix(rows: list[list[int]]) -> int:
    """The length of the longest prefix every row of `rows` starts with."""
    length = min(len(row) for row in rows)
    for i in range(length):
        if any(row[i] != rows[0][i] for row in rows):
            return i
    return length


def episode_inputs(args, tokenizer, tools):
    """The rows' prompts (`--prompts` x `--group`, groups together) as left-padded ids [N, P] and mask [N, P] on the
    device, and each row's tools."""
    from grpo_hf.rollout.prompts import tokenize_prompts

    prompts = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}] for text in PROMPTS]
    prompts = [prompt for prompt in prompts[: args.prompts] for _ in range(args.group)]
    row_tools = [list(tools)] * len(prompts)
    ids, mask, _ = tokenize_prompts(tokenizer, prompts, None, {}, tools=row_tools)
    return ids.to(args.device), mask.to(args.device), row_tools


def engine_of(args, arm: str, tokenizer, eos: list[int]):
    """The `loop` engine of `arm`: sampling at `--temperature`, the episode cache on in the `after` arm only."""
    from transformers import GenerationConfig

    from grpo_hf.rollout.loop import LoopEngine

    config = GenerationConfig(
        do_sample=True, temperature=args.temperature, top_p=1.0, top_k=0, max_new_tokens=args.max_completion_length,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
    )  # fmt: skip
    return LoopEngine(config, eos, episode_cache_bytes=int(args.cache_gb * 2**30) if ARMS[arm] else 0)


def rollout(args, arm: str) -> dict:
    """One rollout of the arm's episodes, measured (see the module docstring)."""
    import torch

    from grpo_hf.rollout import eos_token_ids_of
    from grpo_hf.rollout.episodes import EpisodeRunner

    global latency_seconds
    latency_seconds = args.latency
    model, tokenizer, tools = load(args.device, args.tools, args.model)
    eos = eos_token_ids_of(model, tokenizer)
    ids, mask, row_tools = episode_inputs(args, tokenizer, tools)  # [N, P] each
    runner = EpisodeRunner(tokenizer, max_completion_length=args.max_completion_length, eos_token_ids=eos)
    runner.parse = scripted_parse
    engine = engine_of(args, arm, tokenizer, eos)

    def decode(source) -> None:
        engine.decode_turns(model, TurnCap(source, args.turn_tokens, tokenizer.eos_token_id, eos))

    cuda = args.device == "cuda"
    with torch.no_grad():  # a warm-up forward (threads, allocator, kernels), uncounted
        model(input_ids=ids[:2, -64:], attention_mask=mask[:2, -64:])
    counter = PrefillCounter(model.get_decoder())
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    episodes = runner.run_joining(decode, ids, mask, row_tools)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    counter.handle.remove()
    lengths = (episodes.completion_mask + episodes.context_mask).sum(dim=1).tolist()  # [N] the episodes' own tokens
    return {
        "arm": arm, "seed": args.seed, "seconds": seconds, "rows": ids.size(0),
        "prefill_real": counter.real, "prefill_computed": counter.computed, "prefill_forwards": counter.forwards,
        "attended": counter.attended, "attended_real": counter.attended_real,
        "new_tokens": sum(lengths), "sampled_tokens": int(episodes.completion_mask.sum()),
        "turns": episodes.turns, "truncated": int(episodes.is_truncated.sum()),
        "shared_prefix": shared_prefix([row[keep.bool()].tolist() for row, keep in zip(ids, mask, strict=True)]),
        "system_tokens": system_tokens(tokenizer, tools),
        "episodes": [row[: int(n)].tolist() for row, n in zip(episodes.completion_ids, lengths, strict=True)],
        "peak_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss_mb(),
        "cache_stats": dict(engine.episode_cache.stats) if ARMS[arm] else None,
    }  # fmt: skip


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_arm(args, arm: str, seed: int, directory: str) -> dict:
    """One rollout of `arm` in a fresh process (`--worker`); its record."""
    out = Path(directory) / f"{arm}-{seed}.json"
    settings = ["--prompts", args.prompts, "--group", args.group, "--tools", args.tools, "--latency", args.latency,
                "--max-completion-length", args.max_completion_length, "--temperature", args.temperature,
                "--turn-tokens", args.turn_tokens, "--cache-gb", args.cache_gb, "--device", args.device,
                "--model", args.model]  # fmt: skip
    command = [sys.executable, __file__, "--worker", arm, "--seed", str(seed), "--out", str(out)]
    subprocess.run([*command, *map(str, settings)], check=True)
    return json.loads(out.read_text())


def summary(records: list[dict]) -> dict:
    """One arm's medians over repetitions, per episode where it says so."""
    median = lambda f: statistics.median(f(r) for r in records)  # noqa: E731
    return {
        "prefill": median(lambda r: r["prefill_real"] / r["rows"]),
        "computed": median(lambda r: r["prefill_computed"] / r["rows"]),
        "new": median(lambda r: r["new_tokens"] / r["rows"]),
        "turns": median(lambda r: sum(r["turns"]) / r["rows"]),
        "seconds": median(lambda r: r["seconds"]),
        "peak_mb": median(lambda r: r["peak_mb"]),
        "padding": median(lambda r: 1 - r["attended_real"] / r["attended"] if r["attended"] else 0.0),
        "shared_prefix": records[0]["shared_prefix"],
        "rows": records[0]["rows"],
    }


def table(runs: dict[str, list[dict]]) -> list[str]:
    """The markdown table of both arms, their ratios, the targets, the tokens compared and the cache's counters."""
    today, after = summary(runs["today"]), summary(runs["after"])
    lines = [
        "| arm | prefill tokens/episode | computed with padding/episode | new tokens/episode | turns/episode "
        "| shared prefix tokens | decode steps' padded key columns | s/rollout | peak MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, s in (("today", today), ("after", after)):
        lines.append(
            f"| {arm} | {s['prefill']:,.0f} | {s['computed']:,.0f} | {s['new']:,.1f} | {s['turns']:.2f} "
            f"| {s['shared_prefix']:,} | {s['padding']:.0%} | {s['seconds']:.2f} | {s['peak_mb']:,.0f} |"
        )
    ratio = lambda key: f"{after[key] / today[key]:.2f}x" if today[key] else "n/a"  # noqa: E731
    lines.append(
        f"| after/today | {ratio('prefill')} | {ratio('computed')} | {ratio('new')} | {ratio('turns')} | "
        f"| | {ratio('seconds')} | {ratio('peak_mb')} |"
    )
    floor = after["new"] + after["shared_prefix"] / after["rows"]  # the episode's own tokens + one prefix per batch
    met = lambda ok: "met" if ok else "missed"  # noqa: E731
    lines += [
        "",
        f"target: prefill tokens/episode <= 1.2 x (new tokens/episode + shared prefix/{after['rows']}) = "
        f"{1.2 * floor:,.0f}: after {after['prefill']:,.0f} ({after['prefill'] / floor:.2f}x), "
        f"{met(after['prefill'] <= 1.2 * floor)}",
        "target: prefill positions/episode (padding included) <= 1.2 x new tokens/episode = "
        f"{1.2 * after['new']:,.0f}: "
        f"after {after['computed']:,.0f} ({after['computed'] / after['new']:.2f}x), "
        f"{met(after['computed'] <= 1.2 * after['new'])}",
        f"target: s/rollout <= 0.5x today's: {ratio('seconds')}, {met(after['seconds'] <= 0.5 * today['seconds'])}",
    ]
    for today_run, after_run in zip(runs["today"], runs["after"], strict=True):
        same = sum(a == b for a, b in zip(today_run["episodes"], after_run["episodes"], strict=True))
        lines.append(f"same tokens, seed {after_run['seed']}: {same}/{after_run['rows']} episodes")
    lines += [f"episode cache, seed {r['seed']}: {r['cache_stats']}" for r in runs["after"]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2, help="Distinct prompts (default 2, at most 4).")
    parser.add_argument("--group", type=int, default=8, help="Episodes per prompt (default 8).")
    parser.add_argument("--tools", type=int, default=4, help="Tools in the system block (default 4: ~1,000 tokens).")
    parser.add_argument("--latency", type=float, default=0.2, help="Tool latency scale in seconds (default 0.2).")
    parser.add_argument("--max-completion-length", type=int, default=768, help="Tokens per episode (default 768).")
    parser.add_argument("--turn-tokens", type=int, default=48, help="Tokens per turn at most (default 48).")
    parser.add_argument("--temperature", type=float, default=0.7, help="Sampling temperature (default 0.7).")
    parser.add_argument(
        "--cache-gb", type=float, default=4.0, help="The after arm's cache GiB (default 4, as training's)."
    )
    parser.add_argument("--reps", type=int, default=3, help="Repetitions, the arms alternated (default 3).")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--model", choices=list(MODEL_NAMES), default="smollm2",
        help="SmolLM2-135M-Instruct (default), or a random-weight Qwen3.5-shaped (linear attention) or Gemma-3-shaped "
        "(sliding window) model.",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="2 rows, one tool, 12-token turns, one repetition.")
    parser.add_argument("--worker", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return Path(args.out).write_text(json.dumps(rollout(args, args.worker)))
    if args.smoke:
        args.prompts, args.group, args.tools, args.max_completion_length, args.reps = 1, 2, 1, 224, 1
        args.turn_tokens, args.latency = 12, 0.02
    runs = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as directory:
        for seed in range(args.reps):
            for arm in ARMS:
                runs[arm].append(run_arm(args, arm, seed, directory))
    first = runs["today"][0]
    print(f"{MODEL_NAMES[args.model]}, {args.device}, {first['rows']} episodes "
          f"({args.prompts} prompts x {args.group}), "
          f"system block {first['system_tokens']:,} tokens ({args.tools} tool schemas), "
          f"<= {args.max_completion_length} tokens per episode, {args.reps} repetition(s)")  # fmt: skip
    print("\n".join(table(runs)))


if __name__ == "__main__":
    main()
