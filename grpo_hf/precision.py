"""Mixed precision that keeps every update: fp32 master weights, and a guard that counts lost updates.

A bf16 weight w has a spacing of |w| x 2^-8 to 2^-7 (1.2e-4 at w = 0.03); an update smaller than half of
it rounds away. Adam's steps are about the learning rate (1e-6 .. 1e-5 in RL fine-tuning), so with bf16
weights and a plain optimizer almost every update is lost (measured: 98% of SmolLM2-135M's weights
unchanged after one AdamW step at lr 1e-5) and the policy does not learn. DeepSpeed and FSDP mixed
precision keep fp32 master weights; plain DDP or one device with a model loaded in bf16 does not.

- `MasterWeights` gives an optimizer fp32 master copies of its low-precision parameters. The optimizer
  updates the masters; after each step they are written back, rounded, into the model's parameters, in
  place (a captured CUDA graph sees the new weights). Forward, backward and generation keep running on
  the bf16 weights at full speed. Cost: 4 bytes per trainable low-precision parameter (plus the fp32
  gradient during the step, converted 256 MiB of tensors per kernel while the bf16 gradients are freed).
- `LostUpdateProbe` measures, on a fixed sample of elements of every parameter the optimizer updates, the
  fraction whose value did not change in a step although its gradient was non-zero.
- `predicted_lost_fraction` predicts that fraction before training for Adam-like optimizers, whose
  step is about the learning rate: an element loses its update when half its spacing exceeds the lr.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

LOW_PRECISION = (torch.bfloat16, torch.float16)
_STATE_KEY = "grpo_hf_master_weights"
GRADIENT_BATCH_BYTES = 1 << 28  # fp32 gradients made per foreach kernel: the extra memory of `MasterWeights`' step


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class MasterWeights:
    """fp32 master copies for the low-precision parameters of `optimizer`, which then updates the masters.

    Attach before the first step: each bf16/fp16 parameter in `optimizer.param_groups` is replaced by an
    fp32 copy. Hooks on the optimizer move the gradients in (fp32) before each step and the rounded
    masters out after it, and put the masters into the optimizer's `state_dict`, so a resumed run
    continues from the exact fp32 values.
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("MasterWeights must be attached before the optimizer's first step (it has state).")
        self.params: list[torch.Tensor] = []  # the model's low-precision parameters
        self.masters: list[torch.Tensor] = []  # their fp32 copies, which the optimizer updates
        for group in optimizer.param_groups:
            for i, param in enumerate(group["params"]):
                if param.dtype in LOW_PRECISION:
                    master = torch.nn.Parameter(param.detach().clone().float())
                    group["params"][i] = master
                    self.params.append(param)
                    self.masters.append(master)
        optimizer.register_step_pre_hook(self._gradients_in)
        optimizer.register_step_post_hook(self._weights_out)
        optimizer.register_state_dict_post_hook(self._save)
        optimizer.register_load_state_dict_pre_hook(self._load)

    def __len__(self) -> int:
        return len(self.params)

    @torch.no_grad()
    def _gradients_in(self, optimizer, args, kwargs) -> None:
        """fp32 copies of the gradients, a batch of tensors per kernel (`_batches`), each batch's low-precision
        gradients freed as soon as it is copied: the extra memory is one batch."""
        with_grad = [
            (param, master) for param, master in zip(self.params, self.masters, strict=True) if param.grad is not None
        ]
        for master in self.masters:
            master.grad = None
        for batch in _batches(with_grad):
            grads = [torch.empty_like(master) for _, master in batch]
            _copy_all(grads, [param.grad for param, _ in batch])
            for (param, master), grad in zip(batch, grads, strict=True):
                master.grad, param.grad = grad, None

    @torch.no_grad()
    def _weights_out(self, optimizer, args, kwargs) -> None:
        _copy_all(self.params, self.masters)  # round to nearest, in place
        for master in self.masters:
            master.grad = None

    def _save(self, optimizer, state_dict: dict) -> dict:
        state_dict[_STATE_KEY] = [master.detach().clone() for master in self.masters]
        return state_dict

    @torch.no_grad()
    def _load(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop(_STATE_KEY, None)
        if saved is None:  # a checkpoint without masters: start them from the model's weights
            for param, master in zip(self.params, self.masters, strict=True):
                master.copy_(param)
        else:
            if len(saved) != len(self.masters):
                raise ValueError(
                    f"The checkpoint holds {len(saved)} fp32 master weights but this optimizer has "
                    f"{len(self.masters)}: it was saved for another model or set of trainable parameters."
                )
            for master, value in zip(self.masters, saved, strict=True):
                master.copy_(value)
        return state_dict


def _batches(pairs: list) -> list[list]:
    """`pairs` (param, master) in consecutive batches of at most `GRADIENT_BATCH_BYTES` of fp32 (one pair at least)."""
    batches, size = [[]], 0
    for pair in pairs:
        nbytes = pair[1].numel() * 4
        if batches[-1] and size + nbytes > GRADIENT_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(pair)
        size += nbytes
    return [batch for batch in batches if batch]


def _copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """`target.copy_(source)` for each pair (casting), as one foreach kernel where the tensors allow (plain tensors
    on one device), else one copy each (FSDP2's DTensors)."""
    if targets and not any(hasattr(t, "to_local") for t in (*targets, *sources)):
        torch._foreach_copy_(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):
        target.copy_(source)


def _sample_index(tensor: torch.Tensor, size: int, generator: torch.Generator) -> torch.Tensor:
    """`size` random element indices of `tensor` (with replacement: no [numel] permutation is ever allocated), or
    all of them when it has fewer."""
    numel = _local(tensor).numel()
    index = torch.randint(numel, (size,), generator=generator) if numel > size else torch.arange(numel)
    return index.to(tensor.device)


class LostUpdateProbe:
    """The fraction of a step's updates lost to rounding, on up to `sample_size` elements of each tensor.

    `before()` records the sampled values and which of them have a non-zero gradient; `after()` returns the
    fraction of those whose value did not change. Call them around `optimizer.step()` (the trainer does it
    with the optimizer's step hooks). Sampling makes it cheap: a few thousand elements per tensor.
    """

    def __init__(self, params: list[torch.Tensor], sample_size: int = 1024, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.params = [p for p in params if _local(p).numel() > 0]
        self.index = [_sample_index(p, sample_size, generator) for p in self.params]
        self._before: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    @torch.no_grad()
    def before(self) -> None:
        self._before = []
        for param, index in zip(self.params, self.index, strict=True):
            grad = param.grad
            values = _local(param).reshape(-1)[index].clone()
            has_grad = (
                torch.zeros_like(values, dtype=torch.bool) if grad is None else _local(grad).reshape(-1)[index] != 0
            )
            self._before.append((values, has_grad))

    @torch.no_grad()
    def after(self) -> float:
        """Lost updates / non-zero gradients over the sampled elements (0.0 when no gradient was non-zero)."""
        if self._before is None:
            raise RuntimeError("LostUpdateProbe.after() needs a before() call first.")
        lost = torch.zeros((), dtype=torch.long)
        total = torch.zeros((), dtype=torch.long)
        for param, index, (values, has_grad) in zip(self.params, self.index, self._before, strict=True):
            unchanged = _local(param).reshape(-1)[index] == values
            lost += (unchanged & has_grad).sum().cpu()
            total += has_grad.sum().cpu()
        self._before = None
        return float(lost) / float(total) if total > 0 else 0.0


@torch.no_grad()
def predicted_lost_fraction(params: list[torch.Tensor], step_size: float, sample_size: int = 1024) -> float:
    """The fraction of elements (sampled) whose update of size `step_size` would round away in their own dtype.

    An element x loses an update of size s when s < spacing(x) / 2, with spacing(x) the gap to the next
    representable number away from zero. For Adam-like optimizers the step is about the learning rate.
    """
    generator = torch.Generator().manual_seed(0)
    lost, total = 0, 0
    for param in params:
        if _local(param).numel() == 0:
            continue
        values = _local(param).detach().reshape(-1)[_sample_index(param, sample_size, generator)].abs()
        spacing = torch.nextafter(values, torch.full_like(values, float("inf"))) - values
        lost += int((spacing.float() / 2 > step_size).sum())
        total += values.numel()
    return lost / total if total else 0.0


def lost_updates_message(fraction: float, when: str, dtypes: set[torch.dtype], lr: float, masters: bool) -> str:
    """What went wrong and how to fix it, for the warning or error of the lost-update guard."""
    names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    fix = (
        "set fp32_master_weights=True (the default), "
        if not masters
        else "raise the learning rate, or keep fp32 weights, "
    )
    return (
        f"{fraction:.1%} of the parameter updates {when} are lost to rounding: the optimizer updates {names} "
        f"values with steps of about lr={lr:g}, smaller than half their spacing, so they do not change. To fix it, "
        f"{fix}load the model in float32 and train with bf16=True (autocast), or use DeepSpeed / FSDP mixed "
        "precision. To silence it, raise lost_update_threshold (lost_update_check_steps=0 stops the measurements)."
    )


class PrecisionGuard:
    """Fits `optimizer` with fp32 master weights (when asked and needed) and the lost-update checks.

    - `master_weights`: attach `MasterWeights` if any parameter is bf16/fp16.
    - Before training: for Adam-like optimizers (`adam_like`), `predicted_lost_fraction` at `learning_rate`
      on the values the optimizer updates; above `threshold` it warns or raises (`action`).
    - At the first optimizer step and then every `check_every` steps (0: never): `LostUpdateProbe`, whose
      fraction goes to `record` (the trainer logs it as `precision/lost_updates`) and is held to `threshold`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        master_weights: bool,
        learning_rate: float,
        adam_like: bool,
        check_every: int,
        threshold: float,
        action: str,
        record,
    ):
        has_low = any(p.dtype in LOW_PRECISION for group in optimizer.param_groups for p in group["params"])
        self.masters = MasterWeights(optimizer) if master_weights and has_low else None
        updated = [p for group in optimizer.param_groups for p in group["params"]]  # masters where attached
        self.dtypes = {p.dtype for p in updated}
        self.lr, self.threshold, self.action, self.record = learning_rate, threshold, action, record
        self.predicted = predicted_lost_fraction(updated, learning_rate) if adam_like else None
        if self.predicted is not None and self.predicted > threshold:
            self._report(self.predicted, "predicted from the weights' dtypes and the learning rate")
        self.check_every, self.steps, self.measuring = check_every, 0, False
        if check_every > 0:
            self.probe = LostUpdateProbe(updated)
            optimizer.register_step_pre_hook(self._before)
            optimizer.register_step_post_hook(self._after)

    @classmethod
    def from_config(cls, optimizer: torch.optim.Optimizer, args, deepspeed: bool, scaler, *, record) -> PrecisionGuard:
        """The guard a `GRPOConfig` asks for. Under `deepspeed`, or with an fp16 loss `scaler`, precision is managed
        already: no master weights. Under DeepSpeed no lost-update probe either: its optimizer updates fp32 partitions
        of its own, not the parameters the probe reads (which ZeRO-3 empties on each process)."""
        optim = str(getattr(args.optim, "value", args.optim))
        return cls(
            optimizer,
            master_weights=args.fp32_master_weights and not (deepspeed or scaler is not None),
            learning_rate=args.learning_rate,
            adam_like="adam" in optim or "lion" in optim,
            check_every=0 if deepspeed else args.lost_update_check_steps,
            threshold=args.lost_update_threshold,
            action=args.on_lost_updates,
            record=record,
        )

    def describe(self) -> str:
        where = (
            f"fp32 master weights for {len(self.masters)} bf16/fp16 tensors" if self.masters else "no master weights"
        )
        predicted = "" if self.predicted is None else f", predicted lost updates {self.predicted:.2%}"
        return f"precision: the optimizer updates {sorted(map(str, self.dtypes))} ({where}{predicted})"

    def _before(self, optimizer, args, kwargs) -> None:
        self.measuring = self.steps % self.check_every == 0
        if self.measuring:
            self.probe.before()

    def _after(self, optimizer, args, kwargs) -> None:
        if self.measuring:
            fraction = self.probe.after()
            self.record(fraction)
            if fraction > self.threshold:
                self._report(fraction, f"measured at optimizer step {self.steps + 1}")
        self.steps += 1

    def _report(self, fraction: float, when: str) -> None:
        message = lost_updates_message(fraction, when, self.dtypes, self.lr, self.masters is not None)
        if self.action == "raise":
            raise RuntimeError(message + " (on_lost_updates='raise')")
        logger.warning(message)
