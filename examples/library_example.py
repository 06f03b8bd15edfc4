"""The README's library example as a script: run it under torchrun on the CPU (gloo).

    torchrun --standalone --nproc-per-node 4 examples/library_example.py

Builds a ``dp x 2 x 2`` (dp x ring x ulysses) mesh, runs ``usp_attention`` on random q/k/v
sharded by the zigzag layout, gathers the output and checks it against single-process
dense attention on the full tensors. Rank 0 prints one line; every rank exits 0.
"""

import torch
import torch.distributed as dist

from usp import SequenceLayout, SPMesh, usp_attention
from usp.attention import local_attention

B, L, HQ, HKV, D = 2, 64, 4, 2, 16  # GQA: 2 query heads per KV head


def main() -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    torch.manual_seed(0)  # the same global q/k/v on every rank
    q = torch.randn(B, L, HQ, D)
    k = torch.randn(B, L, HKV, D)
    v = torch.randn(B, L, HKV, D)

    # `with` closes the mesh (barrier, then its subgroups) before the default group goes
    with SPMesh.build(ulysses=2, ring=2) as mesh:  # dp = world // 4
        layout = SequenceLayout(mesh, seq_len=L, balance="zigzag")
        # global [B, L, H, d] -> this rank's [B, L/P, H, d]
        q_local, k_local, v_local = (layout.shard(t, dim=1) for t in (q, k, v))
        out = usp_attention(q_local, k_local, v_local, mesh=mesh, layout=layout,
                            causal=True)
        full = layout.gather(out, dim=1)  # [B, L, HQ, D] on every rank, global order

    dense = local_attention(q, k, v, causal=True)  # [B, L, HQ, D], one process
    err = (full - dense).abs().max().item()
    if err > 1e-5:
        raise SystemExit(f"rank {dist.get_rank()}: usp_attention differs from dense "
                         f"attention by {err:.3e}")
    if dist.get_rank() == 0:
        print(f"ok: usp_attention on {dist.get_world_size()} ranks (dp {mesh.dp} x ring "
              f"{mesh.ring} x ulysses {mesh.ulysses}) matches dense attention, "
              f"max |diff| {err:.1e}")
    dist.destroy_process_group()  # the default group; the mesh's groups went with `with`


if __name__ == "__main__":
    main()
