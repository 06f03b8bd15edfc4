"""usp.slurm: the job's rendezvous port and identity, its placement, requeue after a
preemption checkpoint (scontrol faked). Against a real Slurm: ``tests/slurm``."""

import subprocess

import pytest

from usp.launch import launcher_env
from usp.slurm import (PORT_BASE, PORT_SLOTS, PORT_STRIDE, identity, job_fields, job_port,
                       placement, rendezvous_port, requeue, tasks_per_node)


def test_job_ports_differ_per_job_and_step_and_stay_in_range():
    ports = {job_port(j, s) for j in range(1000, 1000 + PORT_SLOTS) for s in range(PORT_STRIDE)}
    assert len(ports) == PORT_SLOTS * PORT_STRIDE  # no two (job, step) of a window share one
    assert min(ports) == PORT_BASE and max(ports) < 32768  # below the ephemeral range
    assert job_port(12345, 0) != job_port(12346, 0) != job_port(12345, 1)


def test_master_port_overrides_the_jobs_port():
    env = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1"}
    assert rendezvous_port(env) == (job_port(4242, 1), "job 4242's port")
    assert rendezvous_port({**env, "MASTER_PORT": "29400"}) == (29400, "MASTER_PORT")
    assert rendezvous_port({}) == (29500, "default")
    assert identity(env) == "slurm job 4242 step 1"


@pytest.mark.parametrize("value,counts,text", [
    ("2(x2)", [2, 2], "2 nodes x 2 tasks"),
    ("3(x2),1", [3, 3, 1], "3 nodes, 3+3+1 tasks"),
    ("2", [2], "1 node x 2 tasks"),
    ("", [], ""),
])
def test_tasks_per_node(value, counts, text):
    env = {"SLURM_STEP_TASKS_PER_NODE": value}
    assert tasks_per_node(env) == counts and placement(env) == text


def test_slurm_launch_env_carries_port_identity_and_placement():
    info = launcher_env({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "77",
                         "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "n[0-1]",
                         "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
    assert (info["master_addr"], info["master_port"]) == ("n0", job_port(77, 0))
    assert info["identity"] == "slurm job 77 step 0"
    assert info["placement"] == "2 nodes x 2 tasks"


class FakeScontrol:
    """``scontrol show job -o`` answers with ``state``; ``scontrol requeue`` with ``requeue_rc``."""

    def __init__(self, state="RUNNING", batch="1", requeue_rc=0):
        self.state, self.batch, self.requeue_rc, self.calls = state, batch, requeue_rc, []

    def __call__(self, argv, **kw):
        self.calls.append(argv)
        if argv[1] == "show":
            out = (f"JobId={argv[-1]} JobName=usp JobState={self.state} Reason=None "
                   f"BatchFlag={self.batch} Restarts=0 NodeList=n[0-1]\n")
            return subprocess.CompletedProcess(argv, 0, out, "")
        return subprocess.CompletedProcess(argv, self.requeue_rc, "",
                                           "" if not self.requeue_rc else "Requested operation is presently disabled")


def test_job_fields_parse_one_line():
    fields = job_fields("9", FakeScontrol())
    assert fields["JobState"] == "RUNNING" and fields["NodeList"] == "n[0-1]"


def test_requeue_a_running_batch_job():
    fake = FakeScontrol()
    ok, line = requeue({"SLURM_JOB_ID": "9"}, fake)
    assert ok and "job 9 requeued" in line
    assert fake.calls[-1] == ["scontrol", "requeue", "9"]


@pytest.mark.parametrize("fake,env,why", [
    (FakeScontrol(state="CANCELLED"), {"SLURM_JOB_ID": "9"}, "is CANCELLED"),
    (FakeScontrol(batch="0"), {"SLURM_JOB_ID": "9"}, "not a batch job"),
    (FakeScontrol(requeue_rc=1), {"SLURM_JOB_ID": "9"}, "presently disabled"),
    (FakeScontrol(), {}, "not a Slurm job"),
])
def test_no_requeue_when_slurm_ends_the_job_or_refuses(fake, env, why):
    ok, line = requeue(env, fake)
    assert not ok and why in line and "not requeued" in line
    assert ["scontrol", "requeue", "9"] not in fake.calls or fake.requeue_rc


def test_scheduler_hosts_replace_a_recipes_simulated_nodes():
    from usp.config import RunConfig
    from usp.run import resolve_run, scheduler_hosts_notice

    cfg = RunConfig()
    cfg.parallel.ranks_per_node = 2  # tiny_cpu's simulated nodes
    line = scheduler_hosts_notice(cfg, "2 nodes x 2 tasks")
    assert line == ("parallel.ranks_per_node=2 ignored under Slurm: the mesh uses the job's "
                    "hosts (2 nodes x 2 tasks)")
    assert resolve_run(cfg, 4, "cpu", env={}, scheduler_hosts=True).ranks_per_node is None
    assert resolve_run(cfg, 4, "cpu", env={}).ranks_per_node == 2
    assert cfg.parallel.ranks_per_node == 2  # the config is not rewritten
    cfg.parallel.ranks_per_node = None
    assert scheduler_hosts_notice(cfg, "2 nodes x 2 tasks") is None  # nothing set: nothing said


# ---- usp-train's last line in a launched task (usp.cli._refuse) ------------------------------


def _task(monkeypatch, rank: int, submitit: bool = False) -> None:
    import os

    for key in list(os.environ):
        if key.startswith(("SLURM_", "SUBMITIT_", "RANK", "WORLD_SIZE", "LOCAL_RANK")):
            monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", str(rank))
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    if submitit:
        monkeypatch.setenv("SUBMITIT_FOLDER", "/tmp/submitit/%j")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_refusal_decided_together_is_printed_once_by_rank_0(monkeypatch, capsys, rank):
    from usp.cli import _refuse
    from usp.launch import SharedRefusal

    _task(monkeypatch, rank)
    with pytest.raises(SystemExit) as ex:
        _refuse("usp-train", SharedRefusal("ulysses (3) x ring (1) = 3 does not divide 4"))
    assert ex.value.code == 2
    said = capsys.readouterr().err
    assert said == ("usp-train: error: ulysses (3) x ring (1) = 3 does not divide 4 (all 4 "
                    "tasks stop with this error)\n" if rank == 0 else "")


def test_a_ranks_own_error_is_printed_by_that_rank(monkeypatch, capsys):
    from usp.cli import _refuse

    _task(monkeypatch, 3)  # e.g. a file missing on its node once training runs
    with pytest.raises(SystemExit) as ex:
        _refuse("usp-train", FileNotFoundError("/scratch/tokens.bin"))
    assert ex.value.code == 2
    assert capsys.readouterr().err == "usp-train: error: rank 3: /scratch/tokens.bin\n"


@pytest.mark.parametrize("rank", [0, 1])
def test_under_submitit_the_error_is_the_tasks_result(monkeypatch, capsys, rank):
    from usp.cli import JobError, _refuse
    from usp.launch import SharedRefusal

    _task(monkeypatch, rank, submitit=True)
    with pytest.raises(JobError, match=r"^usp-train: error: bad degrees \(all 4 tasks"):
        _refuse("usp-train", SharedRefusal("bad degrees"))
    with pytest.raises(JobError, match=rf"^usp-train: error: rank {rank}: lost a peer"):
        _refuse("usp-train", RuntimeError("lost a peer"), status=1)


def test_a_one_task_job_that_spawned_its_ranks_requeues_after_a_preemption(monkeypatch, capsys):
    import signal

    from usp import slurm
    from usp.launch import job

    _task(monkeypatch, 0)
    monkeypatch.setenv("SLURM_NTASKS", "1")  # usp-train spawns trainer.nprocs ranks itself
    asked = []
    monkeypatch.setattr(slurm, "requeue", lambda env: asked.append(env["SLURM_JOB_ID"]) or (
        True, "job 5 requeued; it resumes from this checkpoint when it starts again"))
    before = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as ex:
            job._local_exit(75, requeue=True)
        assert ex.value.code == 75 and asked == ["5"]
        assert "usp: job 5 requeued" in capsys.readouterr().out
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # the requeue ends the step
        monkeypatch.setenv("SUBMITIT_FOLDER", "/tmp/submitit/%j")
        with pytest.raises(job.JobError, match="the ranks exited with 1"):
            job._local_exit(1, requeue=True)  # a failure: the submitter gets it as the result
        assert asked == ["5"]  # no requeue for a failure
    finally:
        signal.signal(signal.SIGTERM, before)
