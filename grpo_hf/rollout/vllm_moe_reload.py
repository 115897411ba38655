"""An in-place weight reload of an MoE model on vLLM's CPU build that gives the weights a fresh load gives. Runs inside
vLLM's workers: colocated (`VLLMEngine.push`, through `collective_rpc`) and in a server started with grpo_hf's gloo
weight-transfer engine (`vllm_gloo`, when the worker builds it: every reload of that server is covered, from the
network and from files).

What goes wrong in vLLM 0.32.0 without it (paths under `vllm/model_executor/`):
- At start-up, `UnquantizedFusedMoEMethod.process_weights_after_loading` calls `_setup_kernel`
  (`layers/fused_moe/unquantized_fused_moe_method.py:166-205`), which builds the MoE kernel and then runs its experts'
  own step, `self.moe_kernel.fused_experts.process_weights_after_loading(layer)` (line 205). The CPU experts'
  (`layers/fused_moe/experts/cpu_moe.py:208-218`) zero-pad the experts' intermediate size to a multiple of 32
  (`_pad_moe_intermediate`) and prepack both weights into their grouped-gemm layout (`cpu_prepack_moe_weight`: the
  same shape, the elements in another order).
- A reload (`reload_weights`, or `start_weight_update` ... `finish_weight_update`) loads the checkpoint's weights into
  a fresh copy of each layer, runs the same `process_weights_after_loading` on it and copies the result into the
  start-up storage (`model_loader/reload/layerwise.py:371-398`, `_copy_and_restore_kernel_tensors` at 416-433). This
  time `moe_kernel` is set, so `_setup_kernel` takes its weight-update branch (`is_weight_update`, line 187) and skips
  the experts' step (`if not is_weight_update`, lines 191-205): the storage receives the weights in checkpoint order,
  which the kernel reads as prepacked (wrong weights, no error); where padding changed the shape the copy fails
  instead (`RuntimeError: The size of tensor a (128) must match the size of tensor b (96)`).

The fix here: each such layer's quant method processes a reload the way it processed the first load (its `moe_kernel`
is dropped first, so `_setup_kernel` builds a kernel and runs the experts' step again, and vLLM's reload copies padded,
prepacked weights into the start-up storage). It touches only layers whose experts are vLLM's CPU grouped-gemm
experts (`CPUUnquantizedExperts` and its x86 and Arm kinds); a GPU's experts keep vLLM's path. A vLLM whose classes are
not laid out as above is left alone, with the reason logged. A first load is what vLLM itself does at start-up, so the
fix stays right if a later vLLM processes reloads fully too.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

MARK = "_grpo_hf_reload_as_first_load"
"""Set on a quant method whose reloads are processed as its first load: installing twice wraps once."""


def exact_moe_reload(worker_or_model) -> int:
    """Make every later reload of the model's CPU MoE experts exact; returns the number of MoE layers covered (0: none
    to cover, or a vLLM laid out otherwise). Takes a vLLM worker (what `collective_rpc` passes) or the model."""
    model = worker_or_model.get_model() if hasattr(worker_or_model, "get_model") else worker_or_model
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError as error:
        logger.info(f"vLLM MoE reload left as it is: {error}")
        return 0
    if not hasattr(UnquantizedFusedMoEMethod, "_setup_kernel"):
        logger.info("vLLM MoE reload left as it is: UnquantizedFusedMoEMethod has no _setup_kernel in this vLLM")
        return 0
    covered = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, UnquantizedFusedMoEMethod):
            continue
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        if not getattr(method, MARK, False):
            method.process_weights_after_loading = _as_first_load(method)
            setattr(method, MARK, True)
        covered += 1
    return covered


def _as_first_load(method):
    """`method.process_weights_after_loading`, with the kernel of the previous load dropped first."""
    process = method.process_weights_after_loading  # bound to `method`

    def process_as_first_load(layer) -> None:
        method.moe_kernel = None  # `_setup_kernel` then builds the kernel and runs the experts' pad and prepack
        process(layer)

    return process_as_first_load
