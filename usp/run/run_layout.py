"""``RunLayout``: how one run is laid out on its ranks, the same frozen object on every rank."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig
from ..data.indexing import sample_indices
from ..dims.parallel import ParallelDims
from ..mesh import SPMesh
from ..rules import check_degrees, check_placement, check_ranks_per_node


@dataclass(frozen=True)
class RunLayout:
    """How one run is laid out on its ranks; the same object on every rank: the parallel
    dims, the batch, the dtype and the device, as plain data (no display text).

    ``world`` = ``dp * ring * ulysses`` ranks; ``a2a_chunks``: pipeline stages of the
    ulysses all-to-alls; ``ranks_per_node``: simulated nodes (None: the hosts the ranks run
    on place them); ``device``: "cpu" or "cuda", decided once by the launcher
    (``usp.launch.choose_device``); ``dtype``: ``trainer.dtype``; ``grad_accum``:
    micro-batches per optimizer step; ``loss_chunk``/``mlp_tiles``: the model's tilings as
    numbers (``model_config``); ``run_dir``: the folder of its checkpoints, metrics
    and records (``trainer.run_dir``, else the launcher's: Hydra's output folder).
    """

    world: int
    dp: int
    ring: int
    ulysses: int
    placement: str
    ranks_per_node: int | None
    balance: str
    kernel: str
    ring_impl: str
    a2a_chunks: int
    device: str
    dtype: str
    seq_len: int
    batch_per_dp_rank: int
    grad_accum: int = 1  # micro-batches per optimizer step
    run_dir: str | None = None  # where the run writes: rank 0's, decided once (resolve_run)
    expert_degree: int = 1  # ranks that share one copy of the experts (parallel.expert_degree)
    loss_chunk: int = 0  # model.loss_chunk, an auto one sized by the planner (decide_tiles)
    mlp_tiles: int = 1  # model.mlp_tiles, likewise
    norm_tiles: int = 1  # model.norm_tiles, likewise

    def __post_init__(self) -> None:
        if check_degrees(self.world, self.ulysses, self.ring, self.dp) != self.dp:
            raise ValueError(f"dp {self.dp} x ring {self.ring} x ulysses {self.ulysses} != "
                             f"world {self.world}")
        check_placement(self.placement)
        if self.world % self.expert_degree:
            raise ValueError(f"expert degree {self.expert_degree} does not divide world "
                             f"{self.world}")
        check_ranks_per_node(self.world, self.ranks_per_node, "parallel.ranks_per_node")

    @property
    def sp(self) -> int:
        """Ranks that share one sequence: ring x ulysses."""
        return self.ring * self.ulysses

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-batch over all dp ranks."""
        return self.batch_per_dp_rank * self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: every micro-batch of every dp rank."""
        return self.micro_batch * self.grad_accum

    def samples(self, consumed: int, micro: int, dp_rank: int) -> range:
        """Global sample ids of ``dp_rank``'s micro-batch ``micro`` of the optimizer step
        that starts after ``consumed`` samples: micro-batch k of the step takes its samples
        ``[k * micro_batch, (k + 1) * micro_batch)`` and each dp rank its own
        ``batch_per_dp_rank`` of them (``usp.data.indexing.sample_indices``)."""
        return sample_indices(consumed + micro * self.micro_batch, self.batch_per_dp_rank,
                              dp_rank)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def dims(self) -> ParallelDims:
        """The parallel dims of this layout (degrees, placement, a2a stages; messages cut in
        fragments where an axis crosses hosts over gloo), as the mesh is built from them."""
        return ParallelDims(dp=self.dp, ring=self.ring, ulysses=self.ulysses,
                            placement=self.placement, a2a_chunks=self.a2a_chunks)

    def build_mesh(self) -> SPMesh:
        """This layout's ``SPMesh`` (collective: every rank of the default group calls it)."""
        return SPMesh.from_dims(self.dims, ranks_per_node=self.ranks_per_node)

    def model_config(self, model: ModelConfig) -> ModelConfig:
        """``model`` with this layout's ``loss_chunk``, ``mlp_tiles`` and ``norm_tiles`` (an
        ``auto`` one as the resolver sized it): the config the model is built from."""
        return replace(model, loss_chunk=self.loss_chunk, mlp_tiles=self.mlp_tiles,
                       norm_tiles=self.norm_tiles)

    def attention_options(self) -> dict:
        """``usp_attention``'s keywords that the run decides (mesh and layout aside; the
        a2a stages travel in the mesh, ``build_mesh``)."""
        return dict(kernel=self.kernel, ring_impl=self.ring_impl)
