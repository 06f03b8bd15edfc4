"""The Slurm rendezvous (``usp.launch.init_from_env`` with a job identity): ranks of one job
step form their group; a rank that reaches another job's rendezvous, or a rank 0 whose port
is taken, fails at once with one line naming both sides and the fix. Before any process
group the tasks exchange their own checks' verdicts there (``start_together``): one refusal,
the same on every task. Under real Slurm (two
jobs on the same nodes): ``tests/slurm``."""

import multiprocessing as mp
import socket

import pytest

from usp.launch import free_port


def _join(info: dict, out, hold) -> None:
    import torch
    import torch.distributed as dist

    from usp.launch import RendezvousError, init_from_env

    try:
        init_from_env(info, "cpu", timeout_s=20)
        t = torch.ones(1)
        dist.all_reduce(t)
        out.put((info["identity"], info["rank"], f"ok {int(t.item())}"))
        hold.wait(timeout=60)  # keep the store up until every process has reported
        dist.destroy_process_group()
    except RendezvousError as e:
        out.put((info["identity"], info["rank"], f"refused: {e}"))


def _info(job: int, rank: int, port: int, world: int = 2) -> dict:
    return {"kind": "slurm", "rank": rank, "world": world, "local_rank": rank,
            "master_addr": "127.0.0.1", "master_port": port, "port_source": "MASTER_PORT",
            "identity": f"slurm job {job} step 0", "placement": ""}


def _vote(info: dict, out, hold) -> None:
    from usp.launch import rendezvous_store, start_together

    store = rendezvous_store(info, timeout_s=20)
    mine = info.get("refusal")
    out.put((info["identity"], info["rank"], start_together(store, info, mine, timeout_s=20)))
    hold.wait(timeout=60)


def _run(infos: list[dict], timeout: float = 60, target=_join) -> dict:
    ctx = mp.get_context("spawn")
    out, hold = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=target, args=(i, out, hold)) for i in infos]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in infos:
            ident, rank, what = out.get(timeout=timeout)
            results[(ident, rank)] = what
        return results
    finally:
        hold.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def test_a_jobs_ranks_form_their_group():
    port = free_port()
    res = _run([_info(7, 0, port), _info(7, 1, port)])
    assert set(res.values()) == {"ok 2"}


def test_a_rank_of_another_job_is_refused_and_the_job_goes_on():
    port = free_port()
    # job 8's two ranks and, on the same port, rank 1 of job 9 (its own rank 0 failed to bind)
    res = _run([_info(8, 0, port), _info(8, 1, port), _info(9, 1, port)])
    assert res[("slurm job 8 step 0", 0)] == res[("slurm job 8 step 0", 1)] == "ok 2"
    line = res[("slurm job 9 step 0", 1)]
    assert line.startswith("refused: rank 1 of slurm job 9 step 0 reached the rendezvous at "
                           f"127.0.0.1:{port}"), line
    assert "belongs to slurm job 8 step 0" in line and "unset MASTER_PORT" in line


def test_rank0_on_a_taken_port_says_so():
    with socket.socket() as s:  # another job's store holds the port
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = _run([_info(10, 0, port, world=1)])
    line = res[("slurm job 10 step 0", 0)]
    assert line.startswith(f"refused: rank 0 of slurm job 10 step 0: port {port} "
                           "(MASTER_PORT) on 127.0.0.1 is already taken"), line


@pytest.mark.parametrize("refusing", [[], [2], [0, 1, 2, 3]])
def test_every_task_gets_one_verdict(refusing):
    port = free_port()
    infos = [_info(11, r, port, world=4) for r in range(4)]
    for r in refusing:  # rank r's own check failed (say, its node lacks a data file)
        infos[r]["refusal"] = f"data.path: /scratch/tokens.bin missing (seen by rank {r})"
    verdicts = set(_run(infos, target=_vote).values())
    assert len(verdicts) == 1  # every task raises the same refusal, or none does
    verdict = verdicts.pop()
    if not refusing:
        assert verdict is None
    elif refusing == [2]:  # only rank 2 refused: it is named, with its own words
        assert verdict == ("rank 2 (of 1 refusing: 2): data.path: /scratch/tokens.bin missing "
                           "(seen by rank 2)")
    else:  # all refused: rank 0's words
        assert verdict == "data.path: /scratch/tokens.bin missing (seen by rank 0)"
