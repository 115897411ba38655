"""The trainer's count of a vLLM server's workers (`vllm_server.server_transfer`), which sizes the weight-transfer
group (1 + workers ranks): it must be the count vLLM's weight-transfer engines number themselves by, data parallel
index x workers per engine + rank in the engine, checked here against a loop over every worker of the layout."""

import pytest

from grpo_hf.rollout.vllm_server import server_transfer


def _info(tp: int, pp: int, pcp: int, dp: int, with_world_size: bool) -> dict:
    parallel = {"tensor_parallel_size": tp, "pipeline_parallel_size": pp, "prefill_context_parallel_size": pcp}
    parallel |= {"data_parallel_size": dp, "decode_context_parallel_size": 2}  # decode CP shares the TP workers
    if with_world_size:  # vLLM's /server_info carries it (tp x pp x pcp)
        parallel["world_size"] = tp * pp * pcp
    return {"vllm_config": {"parallel_config": parallel, "weight_transfer_config": {"backend": "gloo"}}}


def _ranks(tp: int, pp: int, pcp: int, dp: int) -> list[int]:
    """The group ranks vLLM's workers take (vllm/distributed/weight_transfer/nccl_common.py, grpo_hf's gloo engine)."""
    ranks = []
    for dp_index in range(dp):
        for rank_in_engine in range(tp * pp * pcp):
            ranks.append(1 + dp_index * (tp * pp * pcp) + rank_in_engine)
    return ranks


@pytest.mark.parametrize("with_world_size", [True, False])
@pytest.mark.parametrize(
    "layout", [(1, 1, 1, 1), (1, 1, 1, 8), (2, 1, 1, 4), (2, 2, 1, 2), (2, 1, 2, 2), (1, 1, 2, 1)]
)
def test_the_group_has_a_rank_for_every_worker(layout, with_world_size):
    backend, workers = server_transfer(_info(*layout, with_world_size))
    ranks = _ranks(*layout)
    assert backend == "gloo"
    assert sorted(ranks) == list(range(1, 1 + workers))  # every worker's rank in the group, none past its size


def test_a_server_without_a_parallel_config_has_one_worker():
    assert server_transfer({}) == (None, 1)
