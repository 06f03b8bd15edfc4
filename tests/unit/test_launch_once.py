"""usp-train decides once, in one process: the device (and backend) in the launcher, the
run's layout (``usp.run.RunLayout``) on rank 0 (torchrun/Slurm) or in the parent of the
spawned ranks, with one call of the resolver per launch.

NCCL cannot start here, so CUDA is faked in the launching process and what the launcher
hands to its workers is captured (``usp.launch.local._run_once``) and replayed
in-process with recording fakes for ``set_device`` and ``init_process_group``.
The command refusing CUDA without a GPU: ``e2e/test_inputs_commands.py``; ranks that
take rank 0's degrees: ``distributed/test_launch_once_ranks.py``.
"""

import pytest
import torch
import torch.distributed as dist

import usp.planner
from usp.config import ModelConfig, ParallelConfig, TrainerConfig
from usp.launch import choose_device, cuda_index, init_from_env, launcher_env
import usp.run
from usp.run import RunLayout, decide_degrees, resolve_run
from usp.train.trainer import RunConfig

from _auto_layout import RANK_ENVS, auto_cfg


def fixed_cfg(device="cpu", nprocs=2) -> RunConfig:
    return RunConfig(parallel=ParallelConfig(ulysses_degree=1, ring_degree=2),
                     trainer=TrainerConfig(nprocs=nprocs, device=device))


# ---- pure functions ---------------------------------------------------------------------------


@pytest.mark.parametrize("setting,nprocs,available,count,want", [
    ("cpu", 4, True, 8, ("gloo", "cpu")),  # asked for the CPU on a GPU machine
    ("auto", 4, False, 0, ("gloo", "cpu")),
    ("auto", 4, True, 4, ("nccl", "cuda")),
    ("auto", 2, True, 8, ("nccl", "cuda")),
    ("cuda", 1, True, 1, ("nccl", "cuda")),
    ("auto", 1, False, 3, ("gloo", "cpu")),  # a count without a usable CUDA runtime
])
def test_choose_device(setting, nprocs, available, count, want):
    assert choose_device(setting, nprocs, available, count) == want


@pytest.mark.parametrize("setting,nprocs,available,count,needle", [
    ("cuda", 4, False, 0, "trainer.device=cuda but this process sees 0 CUDA GPUs"),
    ("cuda", 1, True, 0, "use trainer.device=cpu"),
    ("cuda", 4, True, 2, "4 ranks need one GPU each but 2 GPUs are visible; set trainer.nprocs=2"),
    ("auto", 8, True, 1, "8 ranks need one GPU each but 1 GPUs are visible; set trainer.nprocs=1"),
    ("gpu", 1, True, 1, "trainer.device must be one of auto, cpu, cuda, got 'gpu'"),
])
def test_choose_device_refuses(setting, nprocs, available, count, needle):
    with pytest.raises(ValueError) as e:
        choose_device(setting, nprocs, available, count)
    assert needle in str(e.value)


@pytest.mark.parametrize("local_rank,visible,index", [
    (5, 8, 5),  # torchrun: every GPU of the node visible to every rank
    (5, 1, 0),  # Slurm, one GPU per task: SLURM_LOCALID 5 sees only its own GPU as cuda:0
    (3, 2, 1),  # two GPUs per task
    (0, 1, 0),
])
def test_cuda_index(local_rank, visible, index):
    assert cuda_index(local_rank, visible) == index


def test_cuda_index_without_gpu_is_refused():
    with pytest.raises(ValueError, match="local rank 2 needs a GPU but 0 are visible"):
        cuda_index(2, 0)


# ---- torchrun / Slurm: init_from_env --------------------------------------------------------


@pytest.fixture
def fake_dist(monkeypatch):
    """Calls to set_device / init_process_group, in order, instead of running them."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(("set_device", i)))
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.append(("init", backend, kw["rank"])))
    return calls


def fake_gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_slurm_task_with_one_visible_gpu_uses_cuda0(monkeypatch, fake_dist):
    fake_gpus(monkeypatch, 1)  # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES holds one GPU
    info = launcher_env({"SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
                         "SLURM_JOB_NODELIST": "h100-[07-08]"})
    assert init_from_env(info, "cuda", store=dist.HashStore()) == torch.device("cuda", 0)
    assert fake_dist == [("set_device", 0), ("init", "nccl", 11)]


def test_torchrun_rank_drives_its_local_gpu(monkeypatch, fake_dist):
    fake_gpus(monkeypatch, 8)
    info = launcher_env({"RANK": "13", "WORLD_SIZE": "16", "LOCAL_RANK": "5"})
    assert init_from_env(info, "cuda", store=dist.HashStore()) == torch.device("cuda", 5)
    assert fake_dist == [("set_device", 5), ("init", "nccl", 13)]


def test_init_from_env_joins_on_the_decided_device_only(monkeypatch, fake_dist):
    fake_gpus(monkeypatch, 8)  # GPUs visible, but the run was decided onto the CPU
    info = launcher_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert init_from_env(info, "cpu", store=dist.HashStore()) == torch.device("cpu")
    assert fake_dist == [("init", "gloo", 1)]
    with pytest.raises(ValueError, match="device_type must be one of cpu, cuda, got 'auto'"):
        init_from_env(info, "auto", store=dist.HashStore())  # a setting, not a decision


def test_init_from_env_refuses_cuda_without_gpu_before_joining(monkeypatch, fake_dist):
    fake_gpus(monkeypatch, 0)
    info = launcher_env({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="local rank 0 needs a GPU but 0 are visible"):
        init_from_env(info, "cuda", store=dist.HashStore())
    assert fake_dist == []  # never joined the group


def test_a_task_without_a_gpu_refuses_rank_0s_cuda_layout(monkeypatch):
    from usp.run import check_task

    fake_gpus(monkeypatch, 8)
    run = resolve_run(fixed_cfg("auto"), 2, "cuda")  # rank 0 saw GPUs: the run is on cuda
    fake_gpus(monkeypatch, 0)  # this task sees none; alone, auto would have chosen the CPU
    with pytest.raises(ValueError, match="the run computes on cuda .* this task sees 0 CUDA"):
        check_task(fixed_cfg("auto"), run)
    check_task(fixed_cfg("auto"), resolve_run(fixed_cfg("auto"), 2, "cpu"))


# ---- local spawn: what the launcher hands to its ranks --------------------------------------


@pytest.fixture
def local_launch(monkeypatch, fake_dist):
    """``launch(cfg, gpus)``: ``cli.run_training`` as a plain local launch on a machine with
    ``gpus`` fake GPUs. Each spawned rank is replayed in this process; returns, per rank, the
    calls it made (set_device, init, then ("train", cfg, run)), or [] when nothing was
    spawned. ``launch.resolved`` counts the calls of the resolver in the launching process."""
    import usp.cli as cli  # here, not at the top: spawned ranks need not import Hydra

    for k in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(k, raising=False)
    spawned = []
    import usp.launch.local as launcher

    def run_once(worker_args, nprocs, grace_s):  # what run_local would start, not started
        spawned.append((launcher._worker, worker_args, nprocs))
        return 0, "ok", ""

    monkeypatch.setattr(launcher, "_run_once", run_once)
    import usp.train.command as command

    monkeypatch.setattr(command, "train",  # a run without phases: a plan of one layout
                        lambda cfg, plan: fake_dist.append(("train", cfg, plan[0].run)))
    resolved = []
    real_resolve = usp.run.phase_layouts.resolve_run

    def counting_resolve(*a, **kw):
        resolved.append(a)
        return real_resolve(*a, **kw)

    monkeypatch.setattr(usp.run.phase_layouts, "resolve_run", counting_resolve)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)

    def launch(cfg, gpus):
        fake_gpus(monkeypatch, gpus)
        cli.run_training(cfg)
        per_rank = []
        for fn, args, nprocs in spawned:
            for rank in range(nprocs):  # what torch.multiprocessing would run on each rank
                fake_dist.clear()
                fn(rank, *args)
                per_rank.append(list(fake_dist))
        return per_rank

    launch.resolved = resolved
    return launch


@pytest.mark.parametrize("device,gpus,backend,cuda", [
    ("auto", 4, "nccl", True),
    ("cuda", 2, "nccl", True),
    ("cpu", 4, "gloo", False),
    ("auto", 0, "gloo", False),
])
def test_local_launch_backend_and_device_per_rank(local_launch, device, gpus, backend, cuda):
    cfg = fixed_cfg(device, nprocs=2)
    ranks = local_launch(cfg, gpus)
    assert len(ranks) == 2
    assert len(local_launch.resolved) == 1  # resolved once, in the launching process
    run = ranks[0][-1][2]
    assert isinstance(run, RunLayout) and run.device == ("cuda" if cuda else "cpu")
    for rank, calls in enumerate(ranks):
        want = [("set_device", rank)] if cuda else []  # rank i -> cuda:i, before the group
        assert calls == want + [("init", backend, rank), ("train", cfg, run)]


@pytest.mark.parametrize("device,gpus,needle", [
    ("cuda", 0, "trainer.device=cuda but this process sees 0 CUDA GPUs"),
    ("auto", 1, "2 ranks need one GPU each but 1 GPUs are visible"),
    ("cuda", 1, "set trainer.nprocs=1 (or fewer) or trainer.device=cpu"),
    ("tpu", 4, "trainer.device must be one of"),
])
def test_local_launch_refuses_before_spawning(local_launch, device, gpus, needle):
    with pytest.raises(ValueError) as e:
        local_launch(fixed_cfg(device, nprocs=2), gpus)
    assert needle in str(e.value)


def test_flash_attn_refused_when_ranks_run_on_cpu(monkeypatch):
    fake_gpus(monkeypatch, 8)  # a GPU machine, but trainer.device=cpu
    cfg = fixed_cfg("cpu")
    cfg.parallel.kernel = "flash_attn"
    with pytest.raises(ValueError, match="parallel.kernel=flash_attn .* on cpu: kernel='flash_attn' is CUDA only"):
        resolve_run(cfg, 2, "cpu")
    with pytest.raises(ValueError, match="flash_attn' needs float16 or bfloat16"):
        resolve_run(cfg, 2, "cuda")  # fp32 is refused too
    cfg.trainer.dtype = "bf16"
    run = resolve_run(cfg, 2, "cuda")
    assert (run.ulysses, run.ring, run.device, run.dtype) == (1, 2, "cuda", "bf16")


@pytest.mark.parametrize("change,match", [
    (dict(dim=96, n_heads=8, n_kv_heads=2), "head dim 12 is not a multiple of 8"),  # torch, cuda
    (dict(dim=2560, n_heads=8, n_kv_heads=2), "head dim 320 > 256"),  # bf16 flash op limit
])
def test_preflight_refuses_kernel_shapes_on_cuda(change, match):
    cfg = fixed_cfg("cuda")
    cfg.model = ModelConfig(vocab_size=320, ffn_dim=64, **change)
    cfg.trainer.dtype = "bf16"
    with pytest.raises(ValueError, match=f"parallel.kernel=torch .* on cuda: .*{match}"):
        resolve_run(cfg, 2, "cuda")
    resolve_run(cfg, 2, "cpu")  # the CPU kernel takes any head dim
    cfg.parallel.ring_impl = "ring_flash_attn"
    with pytest.raises(ValueError, match="ring_flash_attn"):
        resolve_run(cfg, 2, "cpu")  # a CUDA-only ring engine on CPU ranks


# ---- auto degrees, decided once -------------------------------------------------------------


def test_rank_envs_alone_would_disagree():
    """The premise of the tests below: per-rank detection gives different meshes."""
    u0 = decide_degrees(auto_cfg(), 2, env=RANK_ENVS[0])[:2]
    u1 = decide_degrees(auto_cfg(), 2, env=RANK_ENVS[1])[:2]
    assert u0 != u1


def test_local_spawn_ranks_get_the_parents_layout(local_launch, monkeypatch, capsys):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    want = decide_degrees(auto_cfg(), 2)[:2]  # what the parent's own detection says
    ranks = local_launch(auto_cfg(), 0)
    assert len(ranks) == 2 and len(local_launch.resolved) == 1
    assert capsys.readouterr().out.count("plan: world 2") == 1  # the parent printed the plan
    u, r = want
    for calls in ranks:
        _, cfg, run = calls[-1]  # what this rank trains with
        assert (run.ulysses, run.ring, run.dp) == (u, r, 2 // (u * r))
        assert cfg.parallel.ulysses_degree == "auto"  # the config is not rewritten
