"""Data parallelism and sharding: gradients averaged without DDP's reducer, the reference model and generation under
FSDP2, and processes that fail or stop together.

The shared-prompt-prefix forward calls the decoder and the LM head directly (`logprobs.shared_prefix_logits`), not
the model's `forward`, so under DDP it bypasses the wrapper and DDP's reducer never hears of the backward. The
trainer then averages the gradients itself, once per optimizer step, exactly as DDP would (a sum over processes
divided by their number, with a missing gradient counted as zero), in buckets so that the flat copy stays small.

A process that fails alone leaves the others waiting in their next collective. `stop_together` makes a failure in
user code (a reward function) stop every process with the same message; `check_same_dataset` catches, before the
first step, a dataset that differs between processes. A process that dies without a word (SIGKILL, a lost node) is
named by the others, and ends them within `fault_timeout` seconds, however long the collective timeout: each process
beats in the launcher's store from a thread (`Heartbeat`), and inside `train` the same thread ends the process when a
peer's heartbeat, or the store, has been silent that long (`PeerWatch`, `watching_peers`); after a collective fails
sooner, `name_lost_peers` says whose heartbeat stopped.

Under FSDP2 the reference model is sharded like the policy, one decoder layer per shard unit
(`prepare_reference`), and generation gathers each of the policy's units once per rollout, not once per token
(`fsdp2_gathered`). docs/distributed.md says what each layout shards and what was tested. TR-DPO's update of the
reference model mixes the policy's parameters into it (`mix_parameters_`), once they are gathered.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


@torch.no_grad()
def average_gradients(params: Iterable[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
    """Replace each trainable parameter's `.grad` by its mean over all processes (one all-reduce per bucket).

    Every process must call it with the same parameters in the same order. A parameter without a gradient on
    this process contributes zeros (another process may have one), and ends with the mean like the others.
    """
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= bucket_bytes:
            _all_reduce_mean(bucket)
            bucket, size = [], 0
    if bucket:
        _all_reduce_mean(bucket)


def _all_reduce_mean(grads: list[torch.Tensor]) -> None:
    """One all-reduce over the flattened `grads` (grouped by dtype), divided by the process count, copied back."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])  # [n] one buffer for the whole bucket
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for grad in same:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def stop_together(failure: BaseException | None, accelerator, doing: str) -> None:
    """Every process calls this after work that may fail on some processes only (user code: reward functions).

    If any process failed, every process raises, naming the process(es) and the error, instead of the healthy
    ones waiting in the next collective for one that is gone (until a timeout, or for ever). One collective.
    """
    if accelerator.num_processes == 1:
        if failure is not None:
            raise failure
        return
    from accelerate.utils import gather_object

    report = None if failure is None else f"{type(failure).__name__}: {failure}"
    reports, machines = zip(*gather_object([(report, this_machine())]), strict=True)
    failed = [(rank, report) for rank, report in enumerate(reports) if report is not None]
    if failed:
        several = len(set(machines)) > 1  # name the machine too, where the job spans several
        where = "; ".join(
            f"process {rank}{f' on {machines[rank]}' if several else ''}: {report}" for rank, report in failed
        )
        raise RuntimeError(
            f"Failed while {doing} on {len(failed)} of {len(reports)} processes ({where}). Every "
            "process stops here, so that none waits for the others."
        ) from failure


def this_machine() -> str:
    """`node N (host)`: the launcher's node rank (torchrun's and accelerate's `GROUP_RANK`) and the host name."""
    import socket

    return f"node {os.environ.get('GROUP_RANK', '?')} ({socket.gethostname()})"


HEARTBEAT_S = 2.0  # how often each process says it is alive
PEER_LOST_EXIT_CODE = 69  # sysexits' EX_UNAVAILABLE: a process ended itself because a peer or the main node is gone
_LOST_LINK = re.compile(r"connection (closed|reset|refused)|by peer|timed? ?out|broken pipe|aborted", re.IGNORECASE)


class PeerWatch:
    """The watchdog's judgement, apart from its thread and its clock: which peers stopped beating, for how long.

    Each `check(store, now)` reads every process's heartbeat counter and its `training` count (how many `train` calls
    it is inside, see `Heartbeat.watching`) in one `multi_get`. A peer is judged only while it is training: one that
    has not started yet, or has left `train` (the normal end, which processes reach at slightly different times), is
    not dead, however old its last beat. A training peer whose counter has not moved for more than `bound` seconds
    is named; so is the store, when it has not answered for more than `bound` seconds (it lives on the main node)."""

    def __init__(self, rank: int, world_size: int, bound: float, where: str):
        self.rank, self.world_size, self.bound, self.where = rank, world_size, bound, where
        self.moved: dict[int, tuple[int, float]] = {}  # peer -> (its counter, when it last changed)
        self.answered_at: float | None = None
        self.keys: list[str] = []

    def check(self, store, now: float) -> str:
        """'' while every training peer beats; else a line naming the silent peers (node, host, pid), or the store."""
        peers = [rank for rank in range(self.world_size) if rank != self.rank]
        try:
            if not self.keys:  # made once (`add` 0 creates a missing key), so that multi_get never waits for one
                keys = [f"grpo_hf/{kind}/{rank}" for rank in peers for kind in ("training", "beat")]
                for key in keys:
                    store.add(key, 0)
                self.keys = keys
            values = [int(value) for value in store.multi_get(self.keys)]
        except Exception as error:
            self.moved.clear()  # nobody could beat meanwhile: once the store answers again, every count starts over
            self.answered_at = now if self.answered_at is None else self.answered_at
            if now - self.answered_at <= self.bound:
                return ""
            return (
                f"{self.where} has not answered for {now - self.answered_at:.0f} s ({type(error).__name__}): the main "
                "node is gone, or its launcher."
            )
        self.answered_at = None
        silent = []
        for rank, training, beat in zip(peers, values[0::2], values[1::2], strict=True):
            if training <= 0:  # not started, or ended cleanly: not watched
                self.moved.pop(rank, None)
                continue
            count, since = self.moved.get(rank, (None, now))
            since = now if beat != count else since
            self.moved[rank] = (beat, since)
            if now - since > self.bound:
                silent.append(rank)
        if not silent:
            return ""
        quiet = max(now - self.moved[rank][1] for rank in silent)
        return (
            f"{'; '.join(self.name(store, rank) for rank in silent)}: no heartbeat for {quiet:.0f} s (fault_timeout="
            f"{self.bound:g} s), so gone (killed, or its node lost) or hung."
        )

    @staticmethod
    def name(store, rank: int) -> str:
        try:
            return f"process {rank} on {store.get(f'grpo_hf/who/{rank}').decode()}"
        except Exception:
            return f"process {rank}"


def end_this_process(problem: str) -> None:
    """Log `problem` (a peer is gone) and end this process with `PEER_LOST_EXIT_CODE`, now: the main thread may be
    inside a collective that will not return for `ddp_timeout` (or ever), so no exception could reach it."""
    logger.error(
        f"A process of this run is gone: {problem} This process exits with code {PEER_LOST_EXIT_CODE} now, without "
        "waiting for its collective to time out: relaunch the job to resume from its last checkpoint."
    )
    with contextlib.suppress(Exception):
        logging.shutdown()  # flushes every handler
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(PEER_LOST_EXIT_CODE)


class Heartbeat:
    """Which processes are still there: a process killed without a word (SIGKILL, a lost node) or hung leaves the
    others waiting in a collective until `ddp_timeout` (30 min by default), then with an error that names an address
    at best (gloo: `Connection closed by peer [10.0.0.2]:41234`), or none (a timeout).

    Each process of a multi-process run writes who it is (`node N (host)`, its pid) into the launcher's key-value store
    (torchrun's, at MASTER_ADDR:MASTER_PORT; the one the process group was made with) and, from a daemon thread, adds 1
    to its own counter there every `HEARTBEAT_S` seconds; the thread only talks to the store, never joins a collective,
    and beats on while the main thread saves a checkpoint or waits in a collective (gloo's and NCCL's waits release
    the GIL). While `watching` (inside `train`), the same thread is the watchdog: every `bound / 12` seconds (at least
    every beat) a `PeerWatch` reads the peers' counters, and when one has not moved for `fault_timeout` seconds, or the
    store has not answered for as long, `end_this_process` names it and exits. So a dead peer is noticed within
    `fault_timeout` (plus a check's interval, and the store's 10 s timeout when the main node vanished without closing
    its connections), however long `ddp_timeout` is, and healthy waits longer than that bound survive.

    After a collective failed (gloo notices a peer whose connection closed at once), `lost()` reads every counter
    twice, `wait_s` apart, to name who is gone before that."""

    def __init__(self, rank: int, world_size: int, address: str, port: int, period: float = HEARTBEAT_S):
        self.rank, self.world_size, self.address, self.port, self.period = rank, world_size, address, port, period
        self.where = f"the launcher's store at {address}:{port} (on the main node, machine rank 0)"
        self.watch: PeerWatch | None = None
        self.store = self._connect()
        self.store.set(f"grpo_hf/who/{rank}", f"{this_machine()}, pid {os.getpid()}")
        import threading

        self.closed = threading.Event()
        threading.Thread(target=self._beat, name="grpo_hf-heartbeat", daemon=True).start()

    def close(self) -> None:
        """Stop beating (the others then judge this process only while it is inside `watching`)."""
        self.closed.set()

    def _connect(self):
        import datetime

        return dist.TCPStore(
            self.address, self.port, is_master=False, timeout=datetime.timedelta(seconds=10), wait_for_workers=False
        )

    def _beat(self) -> None:
        import time

        next_check = 0.0
        while not self.closed.is_set():
            with contextlib.suppress(Exception):  # a store that does not answer: the watch counts for how long
                self.store.add(f"grpo_hf/beat/{self.rank}", 1)
            watch = self.watch
            if watch is not None and time.monotonic() >= next_check:
                try:
                    problem = watch.check(self.store, time.monotonic())
                except Exception as error:  # a bug here must not stop the beats: the others would take this for dead
                    logger.warning(f"The heartbeat's watchdog failed ({type(error).__name__}: {error}); it goes on.")
                    problem = ""
                next_check = time.monotonic() + max(self.period, watch.bound / 12)
                if problem and self.watch is watch:  # still watching: not at the end of train meanwhile
                    end_this_process(problem)
            self.closed.wait(self.period)

    @contextlib.contextmanager
    def watching(self, fault_timeout: float) -> Iterator[None]:
        """Inside the block this process counts as training (its `training` count in the store is up by 1, so the
        others judge its heartbeat) and watches the training peers; at its end (the normal end of `train`, or an
        error) it stops watching, then says so, before the process group is torn down."""
        try:
            self.store.add(f"grpo_hf/training/{self.rank}", 1)
        except Exception as error:  # the others will not judge this process; it still watches them
            logger.warning(f"{self.where} did not answer ({type(error).__name__}: {error}) at the start of training.")
        self.watch = PeerWatch(self.rank, self.world_size, fault_timeout, self.where)
        try:
            yield
        finally:
            self.watch = None
            with contextlib.suppress(Exception):  # the store may be gone with the main node
                self.store.add(f"grpo_hf/training/{self.rank}", -1)

    def lost(self, wait_s: float | None = None) -> str:
        """One line naming the processes (node, host, pid) whose heartbeat stopped, or the store that went."""
        import time

        wait_s = 3 * self.period if wait_s is None else wait_s
        try:
            store = self._connect()  # a connection of its own: the beating thread's may be mid-call
            before = [store.add(f"grpo_hf/beat/{rank}", 0) for rank in range(self.world_size)]
            time.sleep(wait_s)
            after = [store.add(f"grpo_hf/beat/{rank}", 0) for rank in range(self.world_size)]
            silent = [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
            names = [f"process {r} on {store.get(f'grpo_hf/who/{r}').decode()}" for r in silent]
        except Exception as error:
            return f"{self.where} does not answer ({type(error).__name__}): the main node is gone, or its launcher."
        if not names:
            return ""
        return f"{'; '.join(names)}: no heartbeat for {wait_s:g} s, so gone (killed, or its node lost) or hung."


_HEARTBEAT: Heartbeat | None = None


def start_heartbeat(accelerator) -> None:
    """The process's `Heartbeat`, started once (a daemon thread for the process's life) in a multi-process run whose
    launcher gave a store address (MASTER_ADDR, MASTER_PORT); a failure to start it is logged, never raised."""
    global _HEARTBEAT
    if _HEARTBEAT is not None or accelerator.num_processes == 1 or "MASTER_PORT" not in os.environ:
        return
    try:
        address, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"])
        _HEARTBEAT = Heartbeat(accelerator.process_index, accelerator.num_processes, address, port)
    except Exception as error:
        logger.warning(f"No heartbeat (a dead peer will not be named): {type(error).__name__}: {error}")


def watching_peers(fault_timeout: float | None) -> contextlib.AbstractContextManager:
    """The heartbeat's watchdog for the block (`Heartbeat.watching`): a peer silent for `fault_timeout` seconds ends
    this process; nothing with one process, without a heartbeat, or with `fault_timeout` None."""
    if _HEARTBEAT is None or fault_timeout is None:
        return contextlib.nullcontext()
    return _HEARTBEAT.watching(fault_timeout)


def name_lost_peers(error: BaseException) -> str:
    """After `error` in a multi-process run: a line naming the processes that stopped answering, when `error` is a
    collective's failure (a lost connection, a timeout) and the heartbeat knows whom; else ''."""
    if _HEARTBEAT is None or not (isinstance(error, dist.DistError) or _LOST_LINK.search(str(error))):
        return ""
    return _HEARTBEAT.lost()


def check_same_dataset(dataset, accelerator, name: str = "train_dataset") -> None:
    """Raise unless every process holds the same dataset (same length, same prompts at a few rows): accelerate gives
    each process its share of every batch, so a dataset filtered or split per process would make the processes
    train on different data, or run different numbers of steps and hang."""
    if accelerator.num_processes == 1 or not hasattr(dataset, "__len__"):
        return
    from accelerate.utils import gather_object

    n = len(dataset)
    rows = sorted({0, n // 2, n - 1}) if n else []
    signature = (n, [repr(dataset[i]["prompt"]) if "prompt" in dataset[i] else "" for i in rows])
    signatures = gather_object([signature])
    if any(other != signatures[0] for other in signatures):
        lengths = ", ".join(f"process {rank}: {length} rows" for rank, (length, _) in enumerate(signatures))
        raise ValueError(
            f"{name} differs between processes ({lengths}; or different prompts at rows {rows}). Every process "
            "must load the same dataset: accelerate hands each process its share of each batch. Do not filter, "
            "shuffle or split it per process (e.g. by rank) before passing it to the trainer."
        )


def is_zero3(accelerator) -> bool:
    """Whether DeepSpeed ZeRO-3 shards the parameters (a forward outside the engine's must gather them first)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


def is_fsdp2(accelerator) -> bool:
    """Whether the model is sharded by FSDP2 (`fully_shard`: DTensor parameters, one shard unit per wrapped module)."""
    return bool(getattr(accelerator, "is_fsdp2", False))


def prepare_reference(model: torch.nn.Module, accelerator) -> torch.nn.Module:
    """The frozen reference model placed as the policy is: partitioned by DeepSpeed (TRL's helper; ZeRO-3 shards it),
    sharded one decoder layer per unit under FSDP2 (`fsdp2_shard_reference`), wrapped under FSDP1 (TRL's helper), or
    put on the device."""
    state = accelerator.state
    if getattr(state, "deepspeed_plugin", None) is not None:
        from trl.models.utils import prepare_deepspeed

        return prepare_deepspeed(model, accelerator)
    if is_fsdp2(accelerator):
        return fsdp2_shard_reference(model, accelerator)
    if getattr(state, "fsdp_plugin", None) is not None:
        from trl.models.utils import prepare_fsdp

        return prepare_fsdp(model, accelerator)
    return accelerator.prepare_model(model, evaluation_mode=True)


def fsdp2_shard_reference(model: torch.nn.Module, accelerator) -> torch.nn.Module:
    """The reference model sharded as accelerate shards the policy under FSDP2: each module the plugin's auto-wrap
    policy picks (a decoder layer) is a shard unit of its own, the rest is the root's; in eval mode.

    So a reference forward gathers one layer at a time, where one unit for the whole model (TRL's `prepare_fsdp`)
    gathers the whole reference on every process. Every unit reshards after its forward: with no backward to come,
    keeping one gathered (FSDP2's default for the root) would keep it whole for the rest of the run.
    """
    from accelerate.utils import get_module_children_bottom_up
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    plugin = accelerator.state.fsdp_plugin
    plugin.set_auto_wrap_policy(model)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {
        "reshard_after_forward": True,
        "offload_policy": plugin.cpu_offload,
        "mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(),
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
    }
    for module in get_module_children_bottom_up(model)[:-1]:  # the model itself last
        if policy is not None and policy(module):
            fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    return model.eval()


@contextlib.contextmanager
def fsdp2_gathered(model: torch.nn.Module) -> Iterator[None]:
    """Every FSDP2 shard unit of `model` all-gathered once for the whole block, and resharded at its end.

    Generation calls the model once per token; FSDP2 would gather each unit's weights in every forward and free them
    after it, so a rollout would cost (units x tokens) all-gathers. Here it costs one per unit, whatever the length,
    and each process holds the full weights for the block's duration (as ZeRO-3's gathered generation does). The
    units' own reshard-after-forward settings are restored afterwards (FSDP2 keeps them on its parameter groups).
    """
    from torch.distributed.fsdp import FSDPModule

    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    groups = [group for unit in units for group in unit._get_fsdp_state()._fsdp_param_groups]
    saved = [group.post_forward_mesh_info for group in groups]  # None: the unit stays gathered after a forward
    for group in groups:
        group.post_forward_mesh_info = None
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for group, info in zip(groups, saved, strict=True):
            group.post_forward_mesh_info = info
        for unit in units:
            unit.reshard()


def sum_over_processes(accelerator, value: int) -> int:
    """`value` summed over all processes (every process must call it), or `value` itself with one process."""
    if accelerator.num_processes == 1:
        return value
    return int(accelerator.reduce(torch.tensor(value, device=accelerator.device), "sum").item())


@torch.no_grad()
def mix_parameters_(targets: Iterator[torch.Tensor], sources: Iterator[torch.Tensor], alpha: float) -> None:
    """TR-DPO's reference update (arXiv:2404.09656), in place: target <- alpha * source + (1 - alpha) * target,
    computed as `target.mul_(1 - alpha).add_(source, alpha=alpha)` (as TRL). Pairs the tensors in order."""
    for target, source in zip(targets, sources, strict=True):
        if target.shape != source.shape:
            raise ValueError(
                f"cannot mix a {tuple(source.shape)} parameter into a {tuple(target.shape)} one: the reference and "
                "the policy must have the same architecture and unsharded parameters"
            )
        target.mul_(1.0 - alpha).add_(source.to(target.dtype), alpha=alpha)
