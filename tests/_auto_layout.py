"""Two ranks whose own detection would choose different degrees
(``unit/test_launch_once.py``, ``distributed/test_launch_once_ranks.py``)."""

from usp.config import RecallData, ModelConfig, ParallelConfig, TrainerConfig
from usp.planner import ClusterSpec
from usp.train.trainer import RunConfig

# Two ranks, auto degrees, on a cluster where what detection reads decides the answer:
# rank 0's torchrun variables say both ranks share a node, rank 1's say one rank per node.
RANK_ENVS = [{"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"},
             {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}]


def auto_cfg() -> RunConfig:
    h100 = ClusterSpec(name="h100_ib", ranks_per_node=8, nodes=4, intra_bw=450e9,
                       inter_bw=50e9, peak_flops=989e12, mem_bytes=80 * 2**30, mfu=0.5,
                       hbm_bw=3.35e12)
    return RunConfig(model=ModelConfig(n_heads=8, n_kv_heads=8),
                     # dp fixed at 1: the planner chooses between the two SP degrees,
                     # which is what differs with the detected topology
                     parallel=ParallelConfig(ulysses_degree="auto", ring_degree="auto",
                                             dp_degree=1),
                     cluster=h100, data=RecallData(seq_len=16384, batch_per_dp_rank=1),
                     trainer=TrainerConfig(nprocs=2, device="cpu"))
