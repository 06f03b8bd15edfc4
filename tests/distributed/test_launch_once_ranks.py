"""Two torchrun-like ranks whose own detection would choose different degrees take rank 0's,
and a refusal on one rank reaches every rank (``usp.run.resolve_run_group``)."""

import json
from pathlib import Path

import torch.distributed as dist

from usp.launch import spawn_local
from usp.run import decide_degrees, resolve_run_group

from _auto_layout import RANK_ENVS, auto_cfg


def _group_worker(out_dir):
    rank = dist.get_rank()
    cfg = auto_cfg()
    alone = decide_degrees(cfg, 2, env=RANK_ENVS[rank])[:2]
    said = []
    run = resolve_run_group(cfg, "cpu", env=RANK_ENVS[rank], say=said.append)
    result = {"alone": alone, "decided": [run.ulysses, run.ring, run.dp], "said": said}

    broken = auto_cfg()
    if rank == 1:
        broken.data.seq_len = 16383  # only rank 1's config is broken
    try:
        resolve_run_group(broken, "cpu", env=RANK_ENVS[rank])
    except ValueError as e:
        result["refused"] = str(e)
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def test_torchrun_ranks_take_rank0s_degrees_and_share_refusals(tmp_path):
    spawn_local(_group_worker, 2, str(tmp_path), threads=1)
    r0, r1 = (json.loads((tmp_path / f"{i}.json").read_text()) for i in range(2))
    assert r0["alone"] != r1["alone"]  # each rank alone would have built another mesh
    u, r = r0["alone"]
    assert r0["decided"] == r1["decided"] == [u, r, 2 // (u * r)]
    # the balance chosen for parallel.balance=auto, then the planner's table, said once, by
    # rank 0
    assert len(r0["said"]) == 2 and r0["said"][0].startswith("usp: balance zigzag")
    assert "plan: world 2" in r0["said"][1]
    assert r1["said"] == []
    # rank 1's refusal reaches rank 0 too: nobody goes on to wait in a collective alone
    assert r0["refused"] == r1["refused"]
    assert r0["refused"].startswith("rank 1: sequence length 16383")
