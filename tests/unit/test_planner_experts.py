"""The planner prices a mixture of experts (usp.planner.experts): a rank gathers E/N experts
of expert degree N, a sparse MLP's activations are the routed copies and the experts'
intermediates, the dispatch/combine all-to-alls move (N-1)/N of k n D bytes each on the link
the expert group spans; plan ranks the expert degrees beside the layouts, auto picks one that
divides the world and the experts, and a degree that divides neither is refused naming both."""

from __future__ import annotations

import dataclasses

import pytest

from usp.config import ModelConfig
from usp.config.cluster import ClusterSpec
from usp.models.families import check_priced
from usp.planner import CheckpointPolicy, memory_split
from usp.planner.cost import estimate
from usp.planner.experts import expert_a2a_bytes, mlp_memory
from usp.planner.options import Search
from usp.planner.plan import plan
from usp.rules import check_expert_degree

# 4 layers, 2 of them sparse: 8 experts of 8 a layer, 2 a token; dim 16; the dense MLP and
# the vocabulary small, so that a sparse block is the largest one FSDP gathers at every degree
MOE = ModelConfig(vocab_size=32, dim=16, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=8,
                  n_experts=8, experts_per_token=2, expert_ffn_dim=8, norm_topk_prob=True,
                  sparse_layers=[1, 3])
EXPERTS_OF_A_LAYER = 3 * 16 * 8 * 8  # gate, up, down of 8 experts: 3072 weights
CLUSTER = ClusterSpec(ranks_per_node=4, nodes=2, intra_bw=400e9, inter_bw=25e9)
L = 4096


def test_a_rank_gathers_its_share_of_the_experts_and_shards_the_same_state():
    """At expert degree N a block FSDP gathers holds 8/N experts: in bf16 the state's peak
    (two blocks gathered, one block's bf16 gradient and its fp32 copy: 2 + 2 + 2 + 4 bytes a
    weight) falls by 10 bytes for each expert weight a rank no longer gathers; the sharded
    fp32 state (E/N experts over W/N ranks) is the same at every N."""
    state = {n: memory_split(MOE, L, 2, 2, 2, dtype_bytes=2, expert_degree=n).state
             for n in (1, 2, 4, 8)}
    for n in (2, 4, 8):
        assert state[1] - state[n] == pytest.approx(10 * EXPERTS_OF_A_LAYER * (1 - 1 / n))
    # the embedding's backward (blocks' gradients sharded, one block gathered) is no peak here;
    # a dense model's state does not move with the expert degree it cannot take
    dense = dataclasses.replace(MOE, n_experts=None, experts_per_token=None,
                                expert_ffn_dim=None, norm_topk_prob=None, sparse_layers=None)
    assert memory_split(dense, L, 2, 2, 2).state == memory_split(dense, L, 1, 2, 4).state


def test_a_sparse_mlp_saves_its_routed_copies_and_tiles_them():
    """Per token of a sparse layer, bf16: router logits and fp32 softmax 6 x 8 experts, the
    routed copies in and out 2 x 2 x 2 x 16, the experts' four intermediates 4 x 2 x 2 x 8 =
    48 + 128 + 128 = 304 bytes; with 4 tiles nothing is saved and a tile is a quarter."""
    saved, fwd, bwd = mlp_memory(MOE, 1, 1024, 2, degree=1)
    assert saved == 304 * 1024 and fwd == saved  # untiled forward: what it saves
    assert bwd == (2 * 2 * 2 * 8 + 2 * 2 * 2 * 16) * 1024  # two expert grads, copies' grads
    # an exchange (N > 1) adds its send and receive buffers, [n k, D] each
    assert mlp_memory(MOE, 1, 1024, 2, degree=4)[1] - fwd == 2 * 2 * 2 * 16 * 1024
    tiled = dataclasses.replace(MOE, mlp_tiles=4)
    t_saved, t_fwd, _ = mlp_memory(tiled, 1, 1024, 2, degree=1)
    assert t_saved == 0 and t_fwd == fwd / 4
    # the dense layers keep the dense MLP: 4 x 2 bytes x 8 a token
    assert mlp_memory(MOE, 0, 1024, 2)[0] == 4 * 2 * 8 * 1024
    whole = memory_split(MOE, L, 1, 2, 2, expert_degree=2)
    assert memory_split(tiled, L, 1, 2, 2, expert_degree=2).activations < whole.activations


def test_the_expert_all_to_alls_move_what_leaves_the_rank():
    """(N-1)/N of the k n copies of D bf16 values, 2 sparse layers, dispatch and combine in
    forward and backward and once more recomputed (checkpointing): 6 a layer; none at N=1."""
    n = L / (2 * 2)  # tokens of a rank at ring 2 x ulysses 2
    assert expert_a2a_bytes(MOE, n, 1, 2, 6) == 0
    assert expert_a2a_bytes(MOE, n, 4, 2, 6) == 3 / 4 * 2 * 1024 * 16 * 2 * 2 * 6
    inside = estimate(MOE, CLUSTER, L, 2, 2, 1, expert_degree=2)  # ranks 0-1: one node
    assert inside.expert_a2a_bytes == 1 / 2 * 2 * 2048 * 16 * 2 * 2 * 6  # 2048 tokens a rank
    assert inside.expert_link == "intra" and inside.expert_a2a_s > 0
    across = estimate(MOE, CLUSTER, L, 1, 2, 4, expert_degree=8)  # 8 ranks: two nodes
    assert across.expert_link == "inter"
    assert across.expert_a2a_s / across.expert_a2a_bytes > \
        inside.expert_a2a_s / inside.expert_a2a_bytes  # the slower link
    none = estimate(MOE, CLUSTER, L, 2, 2, 1, expert_degree=1)
    assert (none.expert_a2a_s, none.expert_a2a_bytes, none.expert_link) == (0, 0, "-")
    assert none.step_s < inside.step_s  # same compute, plus the exchange


def test_auto_ranks_every_degree_that_divides_the_world_and_the_experts():
    six = dataclasses.replace(MOE, n_experts=6)  # world 8: degrees 1 and 2 only
    p = plan(six, CLUSTER, L, search=Search(expert=None))
    assert {c.expert for c in p.candidates} == {1, 2}
    assert 8 % p.best.expert == 0 and 6 % p.best.expert == 0
    # where every expert on every rank does not fit, auto takes a degree that does
    tight = CLUSTER.replace(mem_bytes=int(memory_split(
        MOE, L, 1, 2, 4, expert_degree=8, policy=CheckpointPolicy(True)).total / 0.9) + 1)
    fit = plan(MOE, tight, L, search=Search(dp=1, ring=2, ulysses=4, expert=None))
    assert [c.expert for c in fit.candidates] == [8]
    assert {d.rule for d in fit.dropped} == {"memory"}


def test_a_degree_that_does_not_divide_both_is_refused_naming_the_numbers():
    """The planner asks the runtime's rule (usp.rules.check_expert_degree) of a fixed degree,
    before it prices anything; auto offers only what that rule accepts."""
    six = dataclasses.replace(MOE, n_experts=6)
    with pytest.raises(ValueError, match=r"parallel.expert_degree=4 must divide the ranks \(8\) "
                                         r"and the experts of each sparse layer \(model.n_"
                                         r"experts=6\); degrees that do: \[1, 2\]"):
        plan(six, CLUSTER, L, search=Search(expert=4))
    for degree in {c.expert for c in plan(six, CLUSTER, L, search=Search(expert=None)).candidates}:
        check_expert_degree(degree, 8, 6)
    # transformers' experts (model.hf) are not spread: auto ranks degree 1 only
    hf = dataclasses.replace(MOE, hf="qwen3_moe", qk_norm=True)
    assert {c.expert for c in plan(hf, CLUSTER, L, search=Search(expert=None)).candidates} == {1}
    with pytest.raises(ValueError, match="expert_degree=2: model.hf=qwen3_moe computes"):
        plan(hf, CLUSTER, L, search=Search(expert=2))


def test_what_is_priced_is_no_longer_refused():
    check_priced(dataclasses.replace(MOE, arch="qwen3_moe", qk_norm=True), "usp-plan")
    gpt_oss = ModelConfig(hf="gpt_oss", pretrained="/absent", qkv_bias=True)
    with pytest.raises(ValueError, match="model.hf=gpt_oss is one, but its config states no "
                                         "experts"):
        check_priced(gpt_oss, "usp-plan")
