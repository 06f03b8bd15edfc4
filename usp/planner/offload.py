"""The two offloads priced: what they leave on the device, what they put in host memory and
what their copies and the host's optimizer step add to a step.

- ``trainer.state_offload`` (FSDP2's ``CPUOffloadPolicy``, ``usp.train.build``): the sharded
  fp32 parameters and gradients and AdamW's m and v (``16 N / W``) live in host memory. On
  the device stays what FSDP2 unshards, as without offload (torch's
  ``_fully_shard/_fsdp_param.py``: ``all_gather_inputs`` copies the fp32 shard to the device
  and casts it; ``_fsdp_collectives.py``: the reduce-scatter output is copied to host memory
  on the post-reduce stream): the root and two blocks gathered in the compute dtype, each
  in-flight gather's fp32 shard copy (``4 block / W``), in backward one block's and the
  root's unsharded gradients (``a``, plus the fp32 copy reduce-scatter sends when
  ``a < 4``) and a block's fp32 reduce-scatter output before its copy out.
- ``trainer.activation_offload`` (``usp.models.offload``): every checkpointed block's input,
  ``a D T`` per sequence, is copied to host memory in forward and back in backward.

Host memory per node (``host_bytes``) is the node's ranks times both; the planner refuses a
layout that needs more than the usable share of ``ClusterSpec.host_mem_bytes``
(``plan.check_host``).

Step time (``offload_time``), what the code runs: the copies go over each GPU's host link
(``ClusterSpec.host_bw`` per direction, full duplex) on side streams (FSDP2's all-gather
copy-in and post-reduce streams; the activation offload's copy stream), so they hide behind
the step's compute, except the first block's parameters (forward waits for them) and the
last block's gradients (the optimizer step waits for them): per direction the exposed time
is ``max(one layer's copy, all copies - compute)``, the two directions concurrent. H2D per
sequence: each block's fp32 shard twice (forward and backward's gathers; a recomputed block
reuses backward's) and the checkpointed inputs; D2H: the inputs per sequence, the fp32
gradient shards once a step. The optimizer step runs on the host after backward with the
device idle: ``N / W`` parameters at ``ClusterSpec.host_adam_rate``, added whole. Contention
of the host link with the data loader and of host memory bandwidth between the ranks is
not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..config.cluster import ClusterSpec

FP32 = 4
ADAM_STATE = 16  # bytes/param sharded: fp32 parameter, fp32 gradient, Adam m and v


def device_state_bytes(block: float, root: float, world: int, dtype_bytes: int,
                       tied_bytes: float) -> tuple[float, float, float]:
    """The ``state`` term on the device with the state offloaded, at its three moments
    (``memory.state_bytes``'s: forward, backward, the embedding's backward), for the largest
    gathered ``block`` and the ``root`` (parameters, ``memory.gathered_blocks``) on ``world``
    ranks; ``tied_bytes``: the tied embedding's extra gradients (``2 a V D``) or 0."""
    a, W = dtype_bytes, world
    low = FP32 if a < FP32 else 0  # the fp32 copy reduce-scatter sends below fp32
    gathered = (root + 2 * block) * a
    copies = 2 * block * FP32 / W  # the fp32 shards copied in for the two gathers in flight
    state_f = gathered + copies
    state_b = gathered + copies + block * (a + low) + root * a + block * FP32 / W
    state_e = block * a + 2 * root * a + root * FP32 / W + tied_bytes
    return state_f, state_b, state_e


def host_state_bytes(model: ModelConfig, world: int) -> float:
    """Host bytes per rank of the offloaded state: ``16 N / W``."""
    return ADAM_STATE * model.num_params() / world


def checkpointed_layers(model: ModelConfig, policy) -> int:
    """The layers whose input a checkpoint keeps under ``policy`` (``CheckpointPolicy``)."""
    return sum(policy.checkpointed(i) for i in range(model.n_layers))


def host_bytes_per_rank(model: ModelConfig, seq_len: int, dp: int, ring: int, ulysses: int,
                        batch: int, dtype_bytes: int, policy) -> float:
    """Host memory one rank's offloads hold: ``16 N / W`` with ``policy.state_offload``, and
    with ``policy.offload`` every checkpointed layer's input, ``a D T B`` each."""
    world, T = dp * ring * ulysses, seq_len / (ring * ulysses)
    state = host_state_bytes(model, world) if policy.state_offload else 0.0
    acts = 0.0
    if policy.offload:
        acts = checkpointed_layers(model, policy) * batch * dtype_bytes * model.dim * T
    return state + acts


def host_bytes(model: ModelConfig, cluster: ClusterSpec, seq_len: int, dp: int, ring: int,
               ulysses: int, batch: int, dtype_bytes: int, policy) -> float:
    """Host memory per node: its ranks (``ranks_per_node``, fewer when the world is
    smaller) times ``host_bytes_per_rank``."""
    ranks = min(cluster.ranks_per_node, dp * ring * ulysses)
    return ranks * host_bytes_per_rank(model, seq_len, dp, ring, ulysses, batch, dtype_bytes,
                                       policy)


@dataclass(frozen=True)
class OffloadTime:
    """Seconds the offloads add to a step (module docstring)."""

    h2d_s: float  # host-to-device copies, hidden or not
    d2h_s: float  # device-to-host copies, hidden or not
    exposed_s: float  # the copies' time the compute does not hide
    optimizer_s: float  # AdamW on the host (state offload), added whole

    @property
    def added_s(self) -> float:
        return self.exposed_s + self.optimizer_s


def offload_time(model: ModelConfig, cluster: ClusterSpec, seq_len: int, dp: int, ring: int,
                 ulysses: int, seqs: float, dtype_bytes: int, policy,
                 compute_s: float) -> OffloadTime:
    """``OffloadTime`` of one step of ``seqs`` sequences per dp rank (one at a time) under
    ``policy`` (``CheckpointPolicy``), beside ``compute_s`` seconds of compute."""
    world, T = dp * ring * ulysses, seq_len / (ring * ulysses)
    n, nl, bw = model.num_params(), model.n_layers, cluster.host_bw
    shard = FP32 * n / world if policy.state_offload else 0.0  # every block's fp32 shards
    one = dtype_bytes * model.dim * T if policy.offload else 0.0  # a checkpointed input
    act = checkpointed_layers(model, policy) * one
    h2d = (seqs * (2 * shard + act)) / bw
    d2h = (seqs * act + shard) / bw
    first = (shard / nl + one) / bw  # one layer's copy: no compute beside it yet
    longest = max(h2d, d2h)
    exposed = max(first, longest - compute_s) if longest else 0.0
    opt = n / world / cluster.host_adam_rate if policy.state_offload else 0.0
    return OffloadTime(h2d, d2h, exposed, opt)
