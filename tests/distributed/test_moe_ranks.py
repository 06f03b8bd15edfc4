"""Expert parallelism on gloo ranks, fp64: a mixture-of-experts block whose experts are spread
over expert groups of 2 and 4 of the 4 ranks (``usp.models.expert_placement.place_experts``,
FSDP over the ranks outside the group) gives every rank's output and every gradient (router,
each expert weight and bias, the input) of the same block run in one process on all the
ranks' tokens, for Qwen3-MoE's and gpt-oss's blocks; routing is uneven (some experts get no
row from some rank), and in one case every token goes to experts 0 and 1, so that the other
ranks receive no rows at all (their backward exchanges still run, their experts get zero
gradients)."""

import copy

import torch
import torch.distributed as dist

from usp import SPMesh
from usp.launch import spawn_local
from usp.models.expert_placement import place_experts
from usp.models.moe import GptOssMoeBlock, Qwen3MoeBlock

D, E, K, F, N_TOKENS = 12, 8, 2, 10, 9
WORLD = 4


def _blocks():
    torch.manual_seed(0)
    skewed = GptOssMoeBlock(D, E, K, F, init_std=0.3)
    with torch.no_grad():  # every token picks experts 0 and 1: the other ranks receive none
        skewed.router.bias.copy_(torch.tensor([50.0, 40.0] + [0.0] * (E - 2)))
    return {"qwen3_moe": Qwen3MoeBlock(D, E, K, F, norm_topk_prob=True, init_std=0.3),
            "gpt_oss": GptOssMoeBlock(D, E, K, F, init_std=0.3), "gpt_oss_skewed": skewed}


def _inputs():
    """Every rank's tokens [N_TOKENS, D] and output cotangents, drawn alike on every rank."""
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(WORLD, N_TOKENS, D, generator=gen, dtype=torch.float64)
    xs[3] = xs[3, :1].expand(N_TOKENS, D)  # one rank's tokens all alike: they pick the same 2
    return xs, torch.randn(WORLD, N_TOKENS, D, generator=gen, dtype=torch.float64)


def _reference(block, xs, cots):
    """Output [WORLD, n, D] and gradients of sum_r <y_r, cot_r> in one process."""
    x = xs.clone().requires_grad_(True)
    y, _ = block(x.reshape(-1, D))
    (y.reshape(xs.shape) * cots).sum().backward()
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    return y.detach().reshape(xs.shape), x.grad, grads


def _worker(degrees):
    rank = dist.get_rank()
    xs, cots = _inputs()
    with SPMesh.build(ulysses=2, ring=2) as mesh:
        for name, block in _blocks().items():
            block = block.double()
            ref_y, ref_dx, ref_grads = _reference(copy.deepcopy(block), xs, cots)
            for degree in degrees:
                ep = copy.deepcopy(block)
                assert place_experts(ep, mesh, degree, mp_policy=_fp64()) == 1
                assert (ep.ep.size, ep.ep.local) == (degree, E // degree)
                x = xs[rank].clone().requires_grad_(True)
                before = mesh.comm.bytes["expert"]
                y, _ = ep(x)
                # each rank's loss times the world size, as usp scales it for FSDP's mean
                (WORLD * (y * cots[rank]).sum()).backward()
                where = f"{name} at expert degree {degree}, rank {rank}"
                _check_bytes(ep, x, mesh.comm.bytes["expert"] - before, degree, where)
                torch.testing.assert_close(y, ref_y[rank], rtol=1e-12, atol=1e-12, msg=where)
                torch.testing.assert_close(x.grad, ref_dx[rank] * WORLD, rtol=1e-12,
                                           atol=1e-12, msg=where)
                for pname, p in ep.named_parameters():
                    grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    if pname.startswith("router."):  # replicated here: each rank's share
                        grad = grad.clone()
                        dist.all_reduce(grad)
                        grad /= WORLD
                    torch.testing.assert_close(grad, ref_grads[pname], rtol=1e-10,
                                               atol=1e-12, msg=f"{where}: {pname}")
    for degree in degrees:
        _check_labels(degree)


def _check_labels(degree: int) -> None:
    """Under ``placement=ring_inner`` (the [dp, ring, ulysses] order is not the rank order): the
    rows a DTensor says this rank holds (what DCP saves and the rank-by-rank load fills) are
    the rows it holds, for a dense weight FSDP shards over dp x sp and for an expert weight."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with SPMesh.build(ulysses=2, ring=2, placement="ring_inner", ranks_per_node=2) as mesh:
        dense = torch.nn.Linear(D, 8, dtype=torch.float64)
        block = _blocks()["qwen3_moe"].double()
        wants = (dense.weight.detach().clone(), block.experts.gate_up_proj.detach().clone())
        fully_shard(dense, mesh=mesh.submesh("fsdp"))
        place_experts(block, mesh, degree, mp_policy=_fp64())
        for p, want in zip((dense.weight, block.experts.gate_up_proj), wants):
            shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                                  p.placements)
            rows = want[offset[0]:offset[0] + shape[0]]
            assert torch.equal(p.to_local(), rows), (dist.get_rank(), p.placements, offset)


def _check_bytes(ep, x, sent: int, degree: int, where: str) -> None:
    """What the exchanges recorded (CommStats axis ``expert``): out, back, and the same two
    in backward, each the rows bound for (or from) other ranks, and the row counts; summed
    over the ranks, rows out equal rows back."""
    with torch.no_grad():
        owner = ep.route(ep.router(x)).indices.reshape(-1) // (E // degree)
    away = torch.tensor([(owner != ep.ep.index).sum().item() * D * 8, sent], dtype=torch.float64)
    dist.all_reduce(away)
    counts = E * 8 * dist.get_world_size()  # the int64 row counts every rank sends
    assert away[1] == 4 * away[0] + counts, (where, away.tolist(), counts)


def _fp64():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy()


def test_expert_parallel_block_equals_one_process():
    spawn_local(_worker, WORLD, [2, 4])
