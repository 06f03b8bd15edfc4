"""How usp-train finds its ranks: torchrun and Slurm variables, or a local spawn. Under
torchrun for real: ``e2e/test_launch_torchrun.py``."""

import pytest

from usp.launch import launcher_env
from usp.slurm import first_host


def test_plain_launch_has_no_env():
    assert launcher_env({}) is None
    assert launcher_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # salloc shell


def test_torchrun_env():
    info = launcher_env({"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5",
                         "MASTER_ADDR": "node0", "MASTER_PORT": "29400"})
    assert info == {"kind": "torchrun", "rank": 5, "world": 16, "local_rank": 5,
                    "master_addr": "node0", "master_port": 29400}


@pytest.mark.parametrize("nodelist,first", [
    ("gpu[012-015,020]", "gpu012"),
    ("gpu7", "gpu7"),
    ("a01,b02", "a01"),
    ("node[3,5]", "node3"),
])
def test_slurm_nodelist_first_host(nodelist, first):
    assert first_host(nodelist) == first


def test_slurm_env():
    info = launcher_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                         "SLURM_JOB_NODELIST": "h100-[07-08]"})
    assert (info["kind"], info["rank"], info["world"], info["local_rank"]) == ("slurm", 9, 16, 1)
    assert info["master_addr"] == "h100-07" and info["master_port"] == 29500


def test_local_ranks_take_omp_num_threads_when_the_environment_sets_it(monkeypatch):
    """A local spawn gives each rank ``threads``, else ``OMP_NUM_THREADS``, else the CPUs
    shared evenly: before, a one-rank run on two cores took two threads whatever
    ``OMP_NUM_THREADS`` said."""
    from usp.launch.local import threads_per_rank

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [threads_per_rank("cpu", n, None) for n in (1, 2, 4, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert [threads_per_rank("cpu", n, None) for n in (1, 4)] == [1, 1]
    assert threads_per_rank("cpu", 1, 3) == 3  # an explicit count still wins
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{bad}' is not a positive integer"):
            threads_per_rank("cpu", 1, None)


def test_a_bad_omp_num_threads_is_refused_before_the_local_job_is_decided(monkeypatch):
    """``prepare`` refuses it before the plan is decided, so that a refused command keeps
    no run directory (it was refused only when the ranks started, the directory kept)."""
    from usp.config.trainer import TrainerConfig
    from usp.launch.job import prepare

    decided = []
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two' is not a positive integer"):
        prepare(lambda *a: decided.append(a), TrainerConfig(device="cpu", nprocs=2))
    assert decided == []
