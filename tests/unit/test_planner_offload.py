"""The offloads in the planner (usp/planner/offload.py): the state left on the device, host
memory per node and its refusal, the copies and the host optimizer step in the step time.
Expected values are computed by hand for a tiny model (in the comments)."""

import pytest

from usp.config import ModelConfig, TrainerConfig
from usp.config.cluster import ClusterSpec, load_cluster
from usp.planner import CheckpointPolicy, memory_split
from usp.planner.cost import estimate
from usp.planner.offload import host_bytes, offload_time
from usp.planner.options import Search, StepPolicy
from usp.planner.plan import plan

# D 16, head_dim 8, 2 query heads, 1 KV head, F 32, V 64, untied. A block: q 256 + k 128 +
# v 128 + o 256 + MLP 3 x 16 x 32 = 1536 + two norms 32 = 2336; the root: embedding 1024 +
# LM head 1024 + final norm 16 = 2064; N = 2 x 2336 + 2064 = 6736.
TINY = ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=32,
                   tie_embeddings=False)
BOTH = CheckpointPolicy(enabled=True, offload=True, state_offload=True)


def _cluster(**kw) -> ClusterSpec:
    base = {"name": "tiny", "ranks_per_node": 2, "nodes": 1, "peak_flops": 1e15,
            "mem_bytes": 2**30, "host_mem_bytes": 2**30, "host_bw": 1e6, "host_adam_rate": 1e6}
    return ClusterSpec(**{**base, **kw})


def test_state_offload_leaves_the_gathered_parts_on_the_device():
    # W 2, bf16 (a 2; reduce-scatter's fp32 copy 4). Forward: root + two blocks gathered
    # (2064 + 4672) x 2 = 13472, the two in-flight fp32 shard copies 2 x 2336 x 4 / 2 = 9344:
    # 22816. Backward adds one block's grads 2336 x (2 + 4) = 14016, the root's 2064 x 2 = 4128
    # and a block's fp32 reduce-scatter output 2336 x 4 / 2 = 4672: 45632. The embedding's
    # backward: one block 4672, the root and its grads 8256, its output 4128: 17056.
    on = memory_split(TINY, 64, 1, 1, 2, dtype_bytes=2, policy=BOTH)
    assert on.state == 45632
    # without it the sharded 16 N / W = 53888 adds to the backward moment: 85504
    off = memory_split(TINY, 64, 1, 1, 2, dtype_bytes=2,
                       policy=CheckpointPolicy(enabled=True, offload=True))
    assert off.state == 85504 and on.total < off.total


def test_host_memory_per_node_is_ranks_times_state_and_inputs():
    # W 4 (ulysses 2 x dp 2), 2 ranks a node; L 64 -> T 32 per rank. Per rank: 16 N / 4 = 26944
    # and the 2 checkpointed inputs of a D T x batch 3 = 2 x 2 x 16 x 32 x 3 = 6144.
    assert host_bytes(TINY, _cluster(), 64, 2, 1, 2, 3, 2, BOTH) == 2 * (26944 + 6144)
    state_only = CheckpointPolicy(enabled=True, state_offload=True)
    assert host_bytes(TINY, _cluster(), 64, 2, 1, 2, 3, 2, state_only) == 2 * 26944
    assert host_bytes(TINY, _cluster(), 64, 2, 1, 2, 3, 2, CheckpointPolicy(True)) == 0
    # one rank alone on a node of 2 counts once
    assert host_bytes(TINY, _cluster(), 64, 1, 1, 1, 1, 2, state_only) == 16 * 6736


def test_plan_refuses_a_layout_short_of_host_memory_by_name():
    step = StepPolicy(checkpoint=BOTH, mem_fraction=0.9)
    # world 2 on one node, ulysses 2: per rank 16 N / 2 = 53888 + inputs 2 x 2 x 16 x 32 =
    # 2048, 111872 bytes a node > 0.9 x 100000
    with pytest.raises(ValueError, match=r"host_memory refused 1 .* needs 0\.1 MiB of host "
                                         r"memory per node .* > 0\.1 MiB \(90% of host_mem_bytes"):
        plan(TINY, _cluster(host_mem_bytes=100000), 64, search=Search(ulysses=2), step=step)
    fits = plan(TINY, _cluster(host_mem_bytes=124303), 64, search=Search(ulysses=2), step=step)
    assert fits.best.host == 111872  # 0.9 x 124303 = 111872.7
    assert "host memory per node 0.1 MiB" in fits.memory_text()
    assert "host memory" not in plan(TINY, _cluster(), 64, search=Search(ulysses=2)).memory_text()


def test_step_time_adds_the_copies_and_the_host_optimizer_step():
    kw = {"dtype_bytes": 2, "act_checkpoint": True}
    base = estimate(TINY, _cluster(), 64, 1, 1, 2, **kw)
    on = estimate(TINY, _cluster(), 64, 1, 1, 2, policy=BOTH, **kw)
    # host to device at 1e6 B/s: every fp32 shard twice (2 x 4 x 6736 / 2 = 26944) and the
    # two inputs (2048): 0.028992 s, hidden only behind the ~3e-9 s of compute; AdamW on
    # the host: 3368 params at 1e6/s, 0.003368 s
    assert on.step_s - base.step_s == pytest.approx(0.028992 + 0.003368, abs=1e-6)
    assert on.offload_s == pytest.approx(on.step_s - base.step_s, rel=1e-9)
    t = offload_time(TINY, _cluster(), 64, 1, 1, 2, 1, 2, BOTH, 0.0)
    assert (t.h2d_s, t.d2h_s) == pytest.approx((0.028992, (2048 + 13472) / 1e6))
    # a slower link: a longer step; enough compute hides all but one layer's copy
    slower = estimate(TINY, _cluster(host_bw=5e5), 64, 1, 1, 2, policy=BOTH, **kw)
    assert slower.step_s > on.step_s
    hidden = offload_time(TINY, _cluster(), 64, 1, 1, 2, 1, 2, BOTH, 1.0)
    assert hidden.exposed_s == pytest.approx((13472 / 2 + 1024) / 1e6)  # a layer + an input


def test_the_policy_and_the_cluster_files_carry_the_offload_fields():
    policy = CheckpointPolicy.from_trainer(TrainerConfig(activation_checkpointing=True,
                                                         state_offload=True))
    assert policy.state_offload and not policy.offload
    h100 = load_cluster("h100_ib")
    assert (h100.host_mem_bytes, h100.host_bw) == (2 * 2**40, 50e9)
    with pytest.raises(ValueError, match="host_bw must be a positive number"):
        _cluster(host_bw=0)


def test_the_longest_sequence_is_also_bounded_by_host_memory():
    """``longest_seq_len`` with the cluster: the offloads of the longest fit 90% of the
    node's host memory and one step more does not, where the device budget alone would
    allow far longer."""
    from usp.planner.fit import longest_seq_len

    step = StepPolicy(checkpoint=BOTH)
    roomy = _cluster(mem_bytes=2**34)
    budget = step.budget(roomy)
    device_only = longest_seq_len(TINY, budget, 1, 1, 2, step)
    small = _cluster(mem_bytes=2**34, host_mem_bytes=2**22)
    n = longest_seq_len(TINY, budget, 1, 1, 2, step, cluster=small)
    assert 0 < n < device_only
    limit = 0.9 * small.host_mem_bytes
    host = [host_bytes(TINY, small, k, 1, 1, 2, 1, 2, BOTH) for k in (n, n + 4)]
    assert host[0] <= limit < host[1]
