"""Asynchronous GRPO (`max_staleness` > 0, docs/async.md): a producer thread samples and scores the next generation
batches while the trainer trains, with weights at most `max_staleness` optimizer steps older than the policy that
trains on them.

The pieces, each in one class:

- `WeightSnapshot`: the producer's own copy of the policy (the model's dtype, eval mode, no gradients; a `forward`
  patched on the instance to call the policy's own, as TRL's fused LM head is, dropped from the copy). At the start
  of each optimizer step the main thread stages a copy of the weights the policy has reached (`stage`); before a
  generation batch the producer loads exactly the version that batch is sampled by (`load`), so a batch is sampled
  by one version of the weights, and never sees them change under it. Version = optimizer steps taken.
- `ServerWeights`: in its place with a vLLM server, which holds the producer's weights: the main threads push each
  version at the start of its optimizer step, once no batch is being sampled, and a batch is sampled by the newest
  version pushed when it started (at least its admission version).
- `Lookahead`: the dataloader's batches, read ahead of Trainer's loop (`Trainer.get_batch_samples`), so that the
  producer gets the prompts of the next generation batches in the order the synchronous run reads them.
- `Producer`: the thread. It takes generation batch k once its prompts were read and the policy has taken
  `steps_before(k) - max_staleness` optimizer steps (admission control, AReaL's), samples it with that version's
  weights (`ExperienceMaker.sample_round`: nothing collective; the main thread gathers, computes the advantages and
  the log-probs), and hands it over, scored (`score_round`; with `pipelined`, in a scorer thread while the next
  batch is sampled), with the version that sampled it. No sample is ever dropped for being stale: admission bounds
  the staleness instead.
- `AsyncRollouts`: the trainer's side: reads ahead and submits, takes batch k (`train_batches`), checks and logs its
  staleness (`async/staleness_mean`, `async/staleness_max`) and the fractions of wall time the trainer waited for
  samples (`async/trainer_wait_fraction`) and the producer waited for admission (`async/producer_wait_fraction`),
  publishes the weights at the start of each optimizer step, pauses the producer for evaluation and stops it at the
  end. `Producing` is the trainer mixin that calls it.

Faults: whatever the producer raises is raised on the main thread when the trainer takes that batch (training stops
with it); a trainer that has waited `STALL_WARNING_SECONDS` for a batch warns, naming what the producer's threads
are doing; `close` (end of `train()`, an exception, Ctrl-C) stops them after the calls they are in and drops the
copy of the weights. A close cut short (a second Ctrl-C while it waits for the threads) is finished by the next
`train()`, which then starts a producer of its own.

Randomness: at `max_staleness` 0 the producer samples from torch's global generator as it stands, as the synchronous
run does: the producer and the trainer take turns, so the draws come in the synchronous run's order and the run is
the synchronous run's, bit for bit (tests/test_async.py). Above 0 each batch draws from a seed of its own
(`batch_seed`: the run's seed, the batch, the process), so a seed gives one run whatever the threads' timing (unless
the model itself draws while it trains: dropout).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from grpo_hf.models import own_copy
from grpo_hf.parallel import is_zero3
from grpo_hf.rewards.calling import needs_main_thread

logger = logging.getLogger(__name__)

# A trainer waiting this long for a generation batch warns, naming what the producer is doing (again each interval).
STALL_WARNING_SECONDS = 300.0
# `close` waits this long in all for the producer's threads to finish the calls they are in, then warns, naming them.
CLOSE_WAIT_SECONDS = 30.0


class WeightSnapshot:
    """The producer's copy of `model` (unwrapped), at one version at a time: the main thread stages each version's
    weights after the policy reaches it (`stage`), the producer loads the version a generation batch is sampled by
    (`load`), and the main thread releases the versions no batch still waiting needs (`release_before`). Only the
    tensors that train are staged (a LoRA policy's adapters, not its frozen base): the rest are the copy's own from
    the start. `saved`: versions from a checkpoint (a resumed run), {version: tensors}."""

    def __init__(self, model: nn.Module, version: int, on_load=None, saved: dict[int, list] | None = None):
        self.source = model
        self.model = own_copy(model)  # its forward runs its own weights (TRL's fused-LM-head patch dropped)
        self.model.requires_grad_(False)
        for param in self.model.parameters():
            param.grad = None
        self.model.eval()
        # the tensors a version changes: the policy's trainable parameters and its buffers, by position
        params = [p.requires_grad for p in model.parameters()]
        self._moving = [i for i, trains in enumerate(params) if trains] + list(
            range(len(params), len(params) + len(list(model.buffers())))
        )
        self.version, self.on_load = version, None
        self._lock = threading.Lock()
        self._sampling = threading.Lock()  # held by the producer's sampling, or by a refill (`exclusive`)
        self._staged: dict[int, tuple[list[torch.Tensor], Any]] = {}  # version -> (its tensors, CUDA event or None)
        self._copied = _cuda_event(self.model)  # the copy was made on the main thread's stream
        self._loaded = None  # CUDA: an event recorded after the last `load` wrote the copy, on the producer's stream
        if saved:
            for saved_version, tensors in saved.items():
                if len(tensors) == len(params) + len(list(model.buffers())):  # a checkpoint that kept every tensor
                    tensors = [tensors[i] for i in self._moving]
                self._staged[saved_version] = ([t.to(self.model.device) for t in tensors], _cuda_event(self.model))
            oldest = min(saved)
            self.version = oldest - 1  # so that `load(oldest)` takes the saved weights
            self.load(oldest)
        self.on_load = on_load  # told after each load (the producer's engine: `Sampler.weights_updated`)

    def _tensors(self, model: nn.Module) -> list[torch.Tensor]:
        tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
        return [tensors[i] for i in self._moving]

    def stage(self, version: int) -> None:
        """Main thread, once the policy reached `version`: a copy of the weights that train."""
        with torch.no_grad():
            tensors = [t.detach().clone() for t in self._tensors(self.source)]
        ready = _cuda_event(self.source)  # the producer's stream waits for these copies
        with self._lock:
            self._staged[version] = (tensors, ready)

    def load(self, version: int) -> int:
        """Producer thread, before a generation batch: the weights of `version` into the copy (none older than the
        copy's own: a run's first batches, whose versions precede the run, take the copy as it is); returns the
        version the copy now holds. Staged versions stay until `release_before` drops them."""
        with self._lock:
            if self._copied is not None:  # the copy itself, made on the main thread's stream
                torch.cuda.current_stream().wait_event(self._copied)
                self._copied = None
            if version > self.version:
                tensors, ready = self._staged[version]
                if ready is not None:  # staged on the trainer's stream, read on the producer's
                    torch.cuda.current_stream().wait_event(ready)
                    for tensor in tensors:
                        tensor.record_stream(torch.cuda.current_stream())
                with torch.no_grad():
                    torch._foreach_copy_(self._tensors(self.model), tensors)
                self._loaded = _cuda_event(self.model)  # what a reader on another stream waits for (`versions_from`)
                self.version = version
                if self.on_load is not None:
                    self.on_load(self.model)
            return self.version

    def release_before(self, version: int) -> None:
        """Main thread: the staged versions before `version` dropped (no batch still waiting is sampled by them)."""
        with self._lock:
            for older in [v for v in self._staged if v < version]:
                del self._staged[older]

    @contextlib.contextmanager
    def sampling(self, version: int):
        """Producer thread, around a generation batch's sampling: the weights of `version` loaded (`load`); yields the
        version the copy holds."""
        with self._sampling:
            yield self.load(version)

    def exclusive(self):
        """Main thread: no generation batch is sampled meanwhile (a dynamic-sampling refill)."""
        return self._sampling

    def versions_from(self, version: int) -> dict[int, list[torch.Tensor]]:
        """Main thread: the weights that train, of every version from `version` on that the copy holds or has
        staged, on the CPU (what a checkpoint keeps for the batches not yet trained on). On a GPU the copy's last
        `load` wrote it on the producer's stream: this stream waits for that write before reading the copy (the staged
        tensors were written on this one), and the read to the CPU returns only once done, before the next `load`."""
        with self._lock:
            held = {v: tensors for v, (tensors, _) in self._staged.items() if v >= version}
            if self.version >= version:
                if self._loaded is not None:
                    torch.cuda.current_stream().wait_event(self._loaded)
                held[self.version] = self._tensors(self.model)
            return {v: [t.detach().cpu().clone() for t in tensors] for v, tensors in sorted(held.items())}


def needed_versions(saved: dict[int, list] | None, version: int, staleness: int) -> dict[int, list] | None:
    """Of the producer's weights a checkpoint kept (`saved`, {version: tensors}), those a run resumed at optimizer
    step `version` with `max_staleness` = `staleness` may sample by; None if none. Every batch it has yet to train
    trains at step `version` or later, so it is admitted at `version - staleness` or later: older versions are never
    loaded. With the checkpoint's own staleness that is every version it kept; resumed at a lower one (3 -> 0), the
    oldest are dropped, and at 0 all of them: the copy starts as the policy's own weights, as in a run that starts.
    Resumed at a higher one, batches admitted before the oldest kept version take that one (fresher, never staler)."""
    needed = {v: tensors for v, tensors in (saved or {}).items() if v >= version - staleness}
    return needed or None


def _cuda_event(model: nn.Module):
    """An event recorded now on the current CUDA stream if `model` is on a GPU (what another stream waits for before
    reading what this one wrote), else None."""
    first = next(model.parameters(), None)
    if first is None or not first.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


class ServerWeights:
    """The weights a vLLM server samples with (`vllm_mode="server"`), in `WeightSnapshot`'s place: no copy in this
    process. The main threads push each version to the server as the policy reaches it (`stage`: process 0 sends it
    through the server's weight transport, every process takes part in the gathers, as in the synchronous run), while
    no generation batch of this process is under way (`sampling` holds a lock that `stage` waits for, and the
    processes meet before the push): no request of the run is in flight during a push, so the server needs no
    `/pause` (whose default mode would abort requests in flight). So each batch is sampled
    by one version, the newest pushed when it started: at least the version it was admitted at (pushed before the
    producer is told of it), perhaps newer (a producer behind the trainer, or after an evaluation, which pushes the
    current weights with the run's own engine: then the batch's recorded version understates its freshness, never
    overstates it)."""

    def __init__(self, model: nn.Module, version: int, accelerator):
        self.model, self.version, self.accelerator = model, version, accelerator
        self.engine = None
        self._lock = threading.Lock()

    def attach(self, engine) -> None:
        """The producer's vLLM engine (main thread): its server client, which sends this process's own requests, made
        and given the policy's weights now."""
        self.engine = engine
        engine.start(self.model, per_process=True)

    def stage(self, version: int) -> None:
        """Main thread, once the policy reached `version`: pushed to the server, once no batch is under way here."""
        with self._lock:
            if self.accelerator.num_processes > 1:
                self.accelerator.wait_for_everyone()  # no process's producer is sampling during the push
            self.engine.push_seconds.append(self.engine.backend.push(self.model))
            self.version = version

    @contextlib.contextmanager
    def sampling(self, version: int):
        """Producer thread, around a generation batch's sampling: no push meanwhile; yields the version the server
        holds (`version` or newer)."""
        with self._lock:
            yield self.version

    @contextlib.contextmanager
    def exclusive(self):
        """Main thread: no generation batch of any process is sampled meanwhile (a dynamic-sampling refill or an
        evaluation, which push the policy's weights with the run's own engine: later batches may then be sampled by
        newer weights than recorded). Every process's main thread comes here at the same point of the run."""
        with self._lock:
            if self.accelerator.num_processes > 1:
                self.accelerator.wait_for_everyone()  # every process's producer is between batches
            yield

    def release_before(self, version: int) -> None:
        """Nothing staged here: the server holds one version."""

    def versions_from(self, version: int) -> dict[int, list[torch.Tensor]]:
        """Nothing to keep in a checkpoint: a resumed run pushes its own weights, which every batch may be sampled by
        (they are at least as new as any the batches were admitted at)."""
        return {}


class Lookahead:
    """The batches of Trainer's epoch iterator, read `ahead` batches beyond what Trainer asked for."""

    def __init__(self):
        self.iterator: Iterator | None = None
        self.read: deque = deque()  # read from the iterator, not yet handed to Trainer

    def take(self, iterator: Iterator, num_batches: int, ahead: int) -> tuple[list, list]:
        """Trainer's `num_batches` next batches of `iterator` (fewer at the end of the epoch), and the batches read
        beyond them (up to `ahead`)."""
        if iterator is not self.iterator:  # a new epoch: what was read of the last one was past its end
            self.iterator, self.read = iterator, deque()
        while len(self.read) < num_batches + ahead:
            try:
                self.read.append(next(iterator))
            except StopIteration:
                break
        batches = [self.read.popleft() for _ in range(min(num_batches, len(self.read)))]
        return batches, list(self.read)


@dataclass
class _Request:
    rows: list[dict]  # this process's rows of the generation batch
    admit_at: int  # the version it is sampled by, and may start at
    seed: int | None  # its random draws' seed (None: torch's global generator as it stands)
    state: Any  # the trainer state its reward functions see (`AsyncRollouts.frozen_state`)


@dataclass
class _Handed:
    produced: Any  # `experience.Produced`
    version: int  # the weights' version that sampled it
    admission_wait: float  # seconds the producer waited to be allowed to start it
    scored: bool  # False: its reward functions are to run on the main thread (`Producer(scores=False)`)


class Producer:
    """The producer thread: generation batches in order, each sampled once admitted (see the module docstring).
    `pipelined`: a scorer thread of its own runs the reward functions of batch k while the producer samples batch
    k + 1 (when admitted), so that a slow reward does not hold the sampling up either. `lockstep` (max_staleness 0):
    batch k is sampled only once the trainer asks for it (`take`), so the producer and the trainer take turns as the
    synchronous run's steps do. `scores=False`: no reward function runs in these threads (sharded reward models, whose
    forwards are collective): the main thread scores each batch when it takes it. `names`: the reward functions', for
    the messages."""

    def __init__(self, sample, score, snapshot, version: int, stream=None, *, pipelined=False, lockstep=False,
                 scores=True, names=()):  # fmt: skip
        self.sample, self.score, self.snapshot, self.stream = sample, score, snapshot, stream
        self.lockstep, self.scores, self.names = lockstep, scores, list(names)
        self._changed = threading.Condition()
        self._requests: dict[int, _Request] = {}  # submitted, not yet started
        self._handed: dict[int, _Handed] = {}
        self._version = version  # the policy's, published after each optimizer step
        self._next: int | None = None  # the batch the producer takes next
        self._wanted = -1  # the last batch the trainer asked for (`take`)
        self._error: tuple[int, BaseException] | None = None
        self._closed = self._paused = False
        self._busy = 0  # batches being sampled or scored
        self._doing = {"sampler": "waiting for its first batch", "scorer": None}  # for the stall warning
        self.scoring = threading.Lock()  # held while reward functions run (a refill's too: never two at once)
        self._to_score: queue.SimpleQueue | None = queue.SimpleQueue() if pipelined and scores else None
        self._threads = [threading.Thread(target=self._run, name="grpo_hf-producer", daemon=True)]
        if self._to_score is not None:  # a daemon: interpreter exit never waits for a reward call in flight
            self._threads.append(threading.Thread(target=self._scorer, name="grpo_hf-scorer", daemon=True))
        for thread in self._threads:
            thread.start()

    # ---- the main thread -------------------------------------------------------------------------------------------
    def submit(self, k: int, request: _Request) -> None:
        """Generation batch k, sampled by the weights of version `request.admit_at` once the policy has reached it."""
        with self._changed:
            if self._next is None:
                self._next = k
            self._requests[k] = request
            self._changed.notify_all()

    def publish(self, version: int) -> None:
        """The policy took its `version`-th optimizer step (its weights were staged first)."""
        with self._changed:
            self._version = version
            self._changed.notify_all()

    def take(self, k: int) -> _Handed:
        """Batch k, once produced; what the producer raised instead is raised here. Nothing is sampled before the
        first call: Trainer sets torch's random state after reading the first batches of a resumed run, which must
        not land in the middle of a batch's draws."""
        waited = 0.0
        with self._changed:
            if k > self._wanted:
                self._wanted = k
                self._changed.notify_all()
            while k not in self._handed:
                if self._error is not None:
                    at, error = self._error
                    raise RuntimeError(f"The rollout producer failed on generation batch {at}: {error!r}") from error
                if self._closed:
                    raise RuntimeError("The rollout producer was stopped.")
                start = time.monotonic()
                self._changed.wait(STALL_WARNING_SECONDS)
                waited += time.monotonic() - start
                if k not in self._handed and self._error is None and waited >= STALL_WARNING_SECONDS:
                    logger.warning(
                        f"The trainer has waited {waited:.0f} s for generation batch {k}; the rollout producer is "
                        f"{self.doing}. A tool, a reward function or the engine may hang."
                    )
                    waited = 0.0
            return self._handed.pop(k)

    @contextlib.contextmanager
    def paused(self):
        """No generation batch under way for the duration (evaluation samples with the run's own sampler)."""
        with self._changed:
            self._paused = True
            while self._busy and self._error is None and not self._closed:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._paused = False
                self._changed.notify_all()

    def close(self) -> None:
        """Stop the threads after the calls they are in (waiting up to `CLOSE_WAIT_SECONDS` in all, then warning,
        naming what they are still doing), and drop the weights' copy. Batches not started are dropped."""
        timeout = CLOSE_WAIT_SECONDS
        with self._changed:
            self._closed = True
            self._requests.clear()
            self._handed.clear()
            self._changed.notify_all()
        if self._to_score is not None:
            self._to_score.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
        if alive := [thread.name for thread in self._threads if thread.is_alive()]:
            logger.warning(
                f"Training ended, and the rollout producer's threads ({', '.join(alive)}) are still {self.doing} "
                f"after {timeout:.0f} s. They are daemon threads: they stop with the process, and their results are "
                "dropped. A tool or a reward function that never returns keeps them alive: set reward_timeout."
            )
        self.snapshot = None

    @property
    def doing(self) -> str:
        """What the producer's threads are doing (the stall warning's words)."""
        with self._changed:
            return "; ".join(what for what in self._doing.values() if what)

    # ---- the producer's threads -------------------------------------------------------------------------------
    def _admitted(self) -> bool:
        request = self._requests.get(self._next) if self._next is not None else None
        if request is None or self._paused or self._version < request.admit_at or self._wanted < 0:
            return False
        return not self.lockstep or self._next <= self._wanted

    def _run(self) -> None:
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            while (taken := self._take_admitted()) is not None:
                k, request, admission_wait = taken
                try:
                    with self.snapshot.sampling(request.admit_at) as version:
                        with _seeded(request.seed, self.stream, lambda: self._closed):
                            sampled = self.sample(request.rows, request.state)
                        if self.stream is not None:  # the scorer and the trainer read it on their own streams
                            self.stream.synchronize()
                        with self._changed:
                            self._next = k + 1
                        if self._to_score is None:  # scored before anything samples again (environments: the next
                            self._score(k, sampled, version, admission_wait)  # rows reuse the instances it reads)
                except BaseException as error:  # noqa: B036  (raised on the main thread, in `take`)
                    self._failed(k, error)
                    return
                if self._to_score is not None:
                    self._to_score.put((k, sampled, version, admission_wait))

    def _take_admitted(self) -> tuple[int, _Request, float] | None:
        """The next admitted batch, its request and how long it waited to be admitted; None once stopped."""
        with self._changed:
            start = time.monotonic()
            while not self._closed and self._error is None and not self._admitted():
                self._doing["sampler"] = f"waiting to be allowed to start generation batch {self._next}"
                self._changed.wait()
            if self._closed or self._error is not None:
                self._doing["sampler"] = None
                return None
            k = self._next
            self._busy, self._doing["sampler"] = self._busy + 1, f"sampling generation batch {k}"
            return k, self._requests.pop(k), time.monotonic() - start

    def _scorer(self) -> None:
        while (item := self._to_score.get()) is not None:
            if self._closed:
                return
            self._score(*item)

    def _score(self, k: int, sampled, version: int, admission_wait: float) -> None:
        if self.scores:
            with self._changed:
                what = " and ".join(repr(name) for name in self.names) or "the reward functions"
                self._doing["scorer"] = f"running {what} on generation batch {k}"
            try:
                with self.scoring:
                    sampled = self.score(sampled)
            except BaseException as error:  # noqa: B036  (raised on the main thread, in `take`)
                self._failed(k, error)
                return
        with self._changed:
            self._handed[k] = _Handed(sampled, version, admission_wait, scored=self.scores)
            self._busy, self._doing["scorer"] = self._busy - 1, None
            if self._to_score is None:
                self._doing["sampler"] = None
            self._changed.notify_all()

    def _failed(self, k: int, error: BaseException) -> None:
        with self._changed:
            if self._error is None:
                self._error = (k, error)
            self._busy -= 1
            self._doing = {"sampler": f"stopped by an error on generation batch {k}", "scorer": None}
            self._changed.notify_all()


@contextlib.contextmanager
def _seeded(seed: int | None, stream, closed):
    """torch's generators seeded with `seed` for the duration, and restored after (None: left as they are), unless
    `closed()` by then: a producer thread still sampling after `train()` returned (see `Producer.close`) must not
    undo a seed the user set since."""
    if seed is None:
        yield
        return
    devices = [torch.cuda.current_device()] if stream is not None else []
    cpu = torch.get_rng_state()
    cuda = [torch.cuda.get_rng_state(device) for device in devices]
    torch.manual_seed(seed)
    try:
        yield
    finally:
        if not closed():
            torch.set_rng_state(cpu)
            for device, state in zip(devices, cuda, strict=True):
                torch.cuda.set_rng_state(state, device)


def _record_stream(value: Any, stream) -> None:
    """Every CUDA tensor in `value` (dataclasses, lists, tuples, dicts) marked as used on `stream`, so that the caching
    allocator does not hand its memory to the producer's stream while `stream` may still read it."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _record_stream(getattr(value, field.name), stream)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _record_stream(item, stream)
    elif isinstance(value, dict):
        for item in value.values():
            _record_stream(item, stream)


def batch_seed(seed: int, k: int, process_index: int, refill: int = 0) -> int:
    """The seed of generation batch k on a process (`refill` r > 0: of its r-th dynamic-sampling refill round): a
    hash of the run's seed, k, the process and r, nothing else."""
    mixed = seed * 0x9E3779B97F4A7C15 + k * 0xBF58476D1CE4E5B9 + process_index * 0x94D049BB133111EB
    return (mixed + refill * 0xD6E8FEB86659FD93) % 2**64 % 2**63


def async_unsupported_reason(args, *, sharded: bool, rollout_func: bool) -> str | None:
    """Why `max_staleness` > 0 cannot run with these settings, or None."""
    server = args.use_vllm and args.vllm_mode == "server"
    if args.use_vllm and not server:
        return (
            "vLLM in colocate mode shares this process (and its GPU memory) with the trainer, and its weights cannot "
            "change while the producer thread samples: use vllm_mode='server' (a vLLM server takes the weights "
            "after each optimizer step), grpo_hf's own engines (rollout_engine='auto', 'loop', 'generate'), or "
            "max_staleness=0 with colocate"
        )
    if sharded and not server:
        return (
            "under FSDP or DeepSpeed ZeRO-3 each process holds a shard of the weights, and the producer needs a whole "
            "copy: use DDP or ZeRO-2, or a vLLM server (use_vllm=True, vllm_mode='server': the weights are gathered "
            "for it on the main threads), with max_staleness > 0; or max_staleness=0"
        )
    if rollout_func:
        return "a rollout_func samples with the trainer's own model, not the producer's copy: use max_staleness=0"
    return None


class AsyncRollouts:
    """The trainer's side of asynchronous GRPO (see the module docstring). Built when training starts (after a
    resumed run has loaded its weights, `version` being its optimizer steps; `saved`: the producer's weights its
    checkpoint kept), closed when it ends. `state`: Trainer's `TrainerState`, as it stands (its `max_steps`; what
    the reward functions see is a copy, `frozen_state`)."""

    def __init__(self, args, accelerator, experience, make_sampler, model: nn.Module, version: int, *, state,
                 sharded_rewards: bool = False, saved=None):  # fmt: skip
        self.args, self.accelerator, self.experience, self.state = args, accelerator, experience, state
        self.per_batch = args.steps_per_generation * args.num_iterations  # micro-steps a generation batch serves
        stream = None
        if args.use_vllm:  # a vLLM server (colocate is refused): it holds the producer's weights
            self.snapshot = ServerWeights(model, version, accelerator)
            self.sampler = make_sampler(model)  # its engine reads the policy's config only
            self.snapshot.attach(self.sampler.engine_for(model))
        else:
            on_load = lambda copy_: self.sampler.weights_updated(copy_)  # noqa: E731
            saved = needed_versions(saved, version, args.max_staleness)  # a checkpoint of another max_staleness
            self.snapshot = WeightSnapshot(model, version, on_load, saved)
            self.sampler = make_sampler(self.snapshot.model)  # the producer's own engine, decoding the copy
            if args.max_staleness > 0 and version not in (saved or {}):  # the policy's own weights, staged too: the
                self.snapshot.stage(version)  # copy loads newer ones while batches admitted at this one are unread
            if accelerator.device.type == "cuda":
                stream = torch.cuda.Stream()
        sample = lambda rows, state_: experience.sample_round(rows, self.sampler, trainer_state=state_)  # noqa: E731
        # Rewards of one batch while the next is sampled, unless environments are reused by the next batch while
        # the rewards of this one read them
        pipelined = args.max_staleness > 0 and self.sampler.environments is None
        self.producer = Producer(
            sample, experience.score_round, self.snapshot, version, stream, pipelined=pipelined,
            lockstep=args.max_staleness == 0, scores=not sharded_rewards, names=experience.rewards.names,
        )  # fmt: skip
        self.published = version
        self.admitted: dict[int, int] = {}  # generation batch -> the version it is sampled by, until trained on
        self.next_submit = 0  # the first generation batch not yet submitted
        self.lookahead = Lookahead()
        self.last_take = time.monotonic()
        self.recorded = experience.sampler.record_logps  # the run's own sampler's setting, restored at `close`
        if args.dynamic_sampling and args.max_staleness > 0:  # refills join stale rows: their log-probs are needed
            experience.sampler.record_logps = True

    def seed_of(self, k: int, refill: int = 0) -> int | None:
        """The seed generation batch k (`refill` r > 0: its r-th refill round) draws from: None at max_staleness 0,
        where the draws come from torch's generator as it stands (`batch_seed`)."""
        if self.args.max_staleness == 0:
            return None
        return batch_seed(self.args.seed, k, self.accelerator.process_index, refill)

    def frozen_state(self, trains_at: int):
        """What the reward functions of a generation batch trained at optimizer step `trains_at` + 1 see: a copy of
        Trainer's state with `global_step` = `trains_at`, as the synchronous run's rewards see it (not the live
        state, whose step moves while the producer scores)."""
        frozen = copy.copy(self.state)
        frozen.global_step, frozen.log_history = trains_at, list(self.state.log_history)
        return frozen

    def read(self, iterator: Iterator, num_batches: int, micro_step: int, version: int) -> list:
        """Trainer's next `num_batches` dataloader batches (micro-steps `micro_step`, ...), at the start of the
        policy's optimizer step `version` + 1: the weights of `version` are published to the producer (here, once
        the last step's checkpoint has saved the random state), and the generation batches among the batches and
        those read ahead are submitted to it.

        Admission comes from the steps Trainer takes: within an epoch every optimizer step but the last has
        gradient_accumulation_steps micro-steps, and what is read ahead never crosses the epoch's end (`Lookahead`),
        so the batch `offset` micro-steps from now starts training after `version + offset // GA` steps, whatever
        the epoch's length. Batches the run will not train on (beyond `max_steps`) are not submitted."""
        if version > self.published:
            self.snapshot.stage(version)
            self.producer.publish(version)
            self.published = version
        s, accumulation = self.args.max_staleness, self.args.gradient_accumulation_steps
        batches, beyond = self.lookahead.take(iterator, num_batches, (s + 1) * self.per_batch)
        for offset, rows in enumerate(batches + beyond):
            m, trains_at = micro_step + offset, version + offset // accumulation
            if m % self.per_batch or (k := m // self.per_batch) < self.next_submit:
                continue
            if trains_at >= self.state.max_steps > 0:
                break
            self.admitted[k], self.next_submit = trains_at - s, k + 1
            request = _Request(rows, trains_at - s, self.seed_of(k), self.frozen_state(trains_at))
            self.producer.submit(k, request)
        return batches

    def train_batches(self, k: int, version: int, metrics) -> list:
        """Generation batch k's micro-batches, for the policy at `version` (its optimizer steps)."""
        start = time.monotonic()
        handed = self.producer.take(k)
        if self.accelerator.device.type == "cuda":  # made on the producer's stream: freed after this stream's use
            _record_stream(handed.produced, torch.cuda.current_stream())
        now = time.monotonic()
        elapsed, waited, self.last_take = max(now - self.last_take, 1e-9), now - start, now
        self.admitted.pop(k, None)  # the versions only this batch was sampled by are no longer needed
        self.snapshot.release_before(min(self.admitted.values(), default=version - self.args.max_staleness))
        local = torch.tensor([float(version - handed.version)], device=self.accelerator.device)
        stalenesses = self.accelerator.gather(local) if self.accelerator.num_processes > 1 else local
        staleness = int(stalenesses.max().item())
        if staleness > self.args.max_staleness:  # admission control makes this impossible: a bug if it happens
            raise RuntimeError(
                f"Generation batch {k} was sampled {staleness} optimizer steps before the policy trains on it, more "
                f"than max_staleness={self.args.max_staleness}. Please report this."
            )
        metrics["async/staleness_mean"].append(stalenesses.mean().item())
        metrics["async/staleness_max"].append(float(staleness))
        metrics["async/trainer_wait_fraction"].append(min(waited / elapsed, 1.0))
        metrics["async/producer_wait_fraction"].append(min(handed.admission_wait / elapsed, 1.0))
        produced = handed.produced
        if produced.failure is not None and needs_main_thread(produced.failure):
            self._score_on_main_thread(produced.failure)
            produced.failure, handed.scored = None, False
        if not handed.scored:  # collective reward models (sharded), or rewards that use signals: scored here
            with self.producer.scoring:
                produced = self.experience.score_round(produced)
        self.experience.refill_context = lambda r: self._refilling(k, r)  # noqa: E731
        try:
            return self.experience.produced_batches(produced, staleness)
        finally:
            self.experience.refill_context = None

    def _score_on_main_thread(self, error: BaseException) -> None:
        """A reward function failed in the scorer thread because it uses signals (math-verify's timeouts): from now
        on every batch is scored on the main thread, when the trainer takes it (no overlap of the rewards with
        training; the other reward functions of that batch run twice)."""
        if self.producer.scores:
            logger.warning(
                f"{error} Asynchronous GRPO scores the rewards on the main thread from now on: they no longer overlap "
                "training."
            )
        self.producer.scores = False

    @contextlib.contextmanager
    def _refilling(self, k: int, r: int):
        """Around dynamic sampling's r-th refill round of generation batch k, which the main thread samples with the
        policy now (the decision to refill needs every process's rewards): no producer batch is sampled meanwhile,
        and above max_staleness 0 the round draws from a seed of its own (the producer's threads share torch's
        generator); at 0 from the generator as it stands, as the synchronous run. The reward functions are not running
        in the producer's threads meanwhile either: they are never called twice at once."""
        cuda = torch.cuda.current_stream() if self.accelerator.device.type == "cuda" else None
        with self.snapshot.exclusive(), self.producer.scoring, _seeded(self.seed_of(k, refill=r), cuda, bool):
            yield

    def saved_weights(self) -> dict[int, list[torch.Tensor]]:
        """For a checkpoint: the producer's weights of each version the batches not yet trained on are sampled by
        (none at max_staleness 0: the policy's own). Those already submitted were admitted at the versions
        `admitted` holds; those not yet submitted at `steps_before - max_staleness` or later, and `steps_before` is
        at least the steps taken."""
        if self.args.max_staleness == 0:
            return {}
        floor = self.state.global_step - self.args.max_staleness
        return self.snapshot.versions_from(min(self.admitted.values(), default=floor))

    @contextlib.contextmanager
    def paused(self):
        """Evaluation: no generation batch under way meanwhile, on any process with a vLLM server (whose weights the
        evaluation's engine pushes)."""
        with self.producer.paused(), self.snapshot.exclusive():
            yield

    def close(self) -> None:
        """Stop the producer's threads, release its engine and restore the run's sampler. Again after a close that
        was cut short (a Ctrl-C while it waits for the threads), it finishes what that one left."""
        self.producer.close()
        if self.sampler is not None and self.sampler.engine is not None:
            self.sampler.engine.close()
        self.experience.sampler.record_logps = self.recorded
        self.snapshot = self.sampler = None


class Producing:
    """`GRPOTrainer`'s asynchronous side (a mixin, as `checkpoint.AtomicCheckpoints`): with a producer
    (`max_staleness` > 0, or `AsyncGRPOTrainer`) Trainer's batches are read ahead and the generation batches handed
    to it (`get_batch_samples`), the trainer takes them from it (`_produced`), evaluation pauses it, and the end of
    `train()` stops it. Reads the trainer's `args`, `accelerator`, `experience`, `model`, `state`, `_micro_step` and
    `_metrics`."""

    # True: a producer thread samples even at max_staleness=0 (`AsyncGRPOTrainer`), taking turns with the trainer
    _produce_always = False

    def _init_producer(self, rollout_func) -> None:
        """Refuse the settings a producer cannot run with, here, when one will run."""
        self.async_rollouts: AsyncRollouts | None = None  # while training runs with a producer
        self._saved_producer_weights = None  # a resumed run's: the producer's weights its checkpoint kept
        sharded = self.is_fsdp_enabled or is_zero3(self.accelerator)
        why = async_unsupported_reason(self.args, sharded=sharded, rollout_func=rollout_func is not None)
        if self.uses_producer and why is not None:
            raise ValueError(f"max_staleness={self.args.max_staleness}: {why}.")

    @property
    def uses_producer(self) -> bool:
        """Whether training samples in a producer thread: max_staleness > 0, or an `AsyncGRPOTrainer`."""
        return self.args.max_staleness > 0 or self._produce_always

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """Trainer's; with a producer, the dataloader is read ahead, and the generation batches among what was read
        go to the producer in the order the synchronous run samples them (`AsyncRollouts.read`)."""
        if not self.uses_producer:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        if self.async_rollouts is None:  # training has started: a resumed run's weights are loaded by now
            policy, sampler = self.accelerator.unwrap_model(self.model), self.experience.sampler
            saved, self._saved_producer_weights = self._saved_producer_weights, None
            args = (self.args, self.accelerator, self.experience, sampler.for_model, policy, self.state.global_step)
            sharded = self.is_fsdp_enabled or is_zero3(self.accelerator)
            reward_models = any(isinstance(getattr(f, "model", None), nn.Module) for f in self.reward_funcs)
            self.async_rollouts = AsyncRollouts(
                *args, state=self.state, sharded_rewards=sharded and reward_models, saved=saved
            )
        batches = self.async_rollouts.read(epoch_iterator, num_batches, self._micro_step, self.state.global_step)
        return batches, self._get_num_items_in_batch(batches, device)

    def _produced(self, k: int) -> list | None:
        """Generation batch k's micro-batches from the producer, or None without one running."""
        if self.async_rollouts is None:
            return None
        return self.async_rollouts.train_batches(k, self.state.global_step, self._metrics["train"])

    def train(self, *args, **kwargs):
        """Trainer's; the end, an exception or Ctrl-C stop the producer and drop its copy of the weights. Each
        `train()` starts its own producer (at its first batch): one an earlier `train()` left attached, because an
        interrupt cut its close short, is closed first."""
        self._stop_producer()
        if not self.uses_producer:  # a checkpoint's producer weights (one written above max_staleness 0): unused
            self._saved_producer_weights = None
        try:
            return super().train(*args, **kwargs)
        finally:
            self._stop_producer()

    def _stop_producer(self) -> None:
        """The producer closed, then detached: attached until its close has finished, so that an interrupt during the
        close (a second Ctrl-C while it waits for the threads) leaves it to the next `train()` to finish."""
        if self.async_rollouts is not None:
            self.async_rollouts.close()
            self.async_rollouts = None

    def evaluate(self, *args, **kwargs):
        """Trainer's; a producer pauses meanwhile (evaluation samples with the run's own sampler and environments)."""
        with self.async_rollouts.paused() if self.async_rollouts is not None else contextlib.nullcontext():
            return super().evaluate(*args, **kwargs)
