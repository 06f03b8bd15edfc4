"""The Slurm rendezvous (``usp.launch.init_from_env`` with a job identity): ranks of one job
step form their group; a rank that reaches another job's rendezvous, or a rank 0 whose port
is taken, fails at once with one line naming both sides and the fix. Before any process
group rank 0 decides and every task checks and votes there (``decide_together``): one
outcome, the same on every task. Under real Slurm (two jobs on the same nodes):
``tests/slurm``."""

import multiprocessing as mp
import socket

import pytest

from usp.launch import free_port
from usp.launch.starter import start_method


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
    """``decide_together`` with scripted outcomes: rank 0 decides {"layout": 1} unless
    ``decide_fails``; a rank with ``refusal`` fails its own check. A refused rank 0 leaves
    at once (it serves the store under Slurm): no other task may lose the verdict to that."""
    from usp.launch import SharedRefusal, decide_together, rendezvous_store

    def decide():
        if info.get("decide_fails"):
            raise ValueError("ulysses (3) x ring (1) = 3 does not divide world size 4")
        return {"layout": 1}

    def check(value):
        assert value == {"layout": 1}
        if info.get("refusal"):
            raise FileNotFoundError(info["refusal"])

    store = rendezvous_store(info, timeout_s=20)
    try:
        got = decide_together(store, info, decide, check, timeout_s=20)
    except SharedRefusal as e:
        got = f"refused: {e}"
    out.put((info["identity"], info["rank"], got))
    if info["rank"] != 0 or not isinstance(got, str):  # (a starting rank 0 keeps its store)
        hold.wait(timeout=60)


def _run(infos: list[dict], timeout: float = 60, target=_join) -> dict:
    # forked from the server that imported torch and usp once (as spawn_local's ranks), not
    # spawned: a spawned task imported torch afresh, about 2 s of the 2 cores each
    ctx = mp.get_context(start_method())
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


@pytest.mark.parametrize("refusing", [[], [2], "rank 0"])
def test_every_task_gets_one_verdict(refusing):
    port = free_port()
    infos = [_info(11, r, port, world=4) for r in range(4)]
    if refusing == "rank 0":  # rank 0's layout cannot fit: no other task checks anything
        infos[0]["decide_fails"] = True
    else:
        for r in refusing:  # rank r's own check failed (its node lacks a data file)
            infos[r]["refusal"] = f"data.path: /scratch/tokens.bin missing (seen by rank {r})"
    verdicts = [v for _, v in sorted(_run(infos, target=_vote).items())]
    assert len(set(map(str, verdicts))) == 1  # every task the same outcome
    if not refusing:
        assert verdicts[0] == {"layout": 1}  # rank 0's decision, on every task
    elif refusing == [2]:  # only rank 2 refused: it is named, with its own words
        assert verdicts[0] == ("refused: rank 2 (of 1 refusing: 2): data.path: "
                               "/scratch/tokens.bin missing (seen by rank 2)")
    else:
        assert verdicts[0] == ("refused: ulysses (3) x ring (1) = 3 does not divide world "
                               "size 4")
