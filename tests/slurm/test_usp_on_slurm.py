"""usp under a real Slurm (2 nodes x 2 tasks, ``tools.lab.slurmcluster``), as a user runs it:
``sbatch recipes/slurm/train.sbatch ...`` and ``usp-train -m hydra/launcher=slurm ...``.

Every training case is compared with the same run launched locally (4 ranks, the recipe's
simulated nodes of 2 ranks: the same mesh), loss by loss. Preemption is sent as Slurm sends
it (``scancel --signal``, which reaches every process of the step, wandb's service too: its
default, offline, stays on); the requeued job is released at once (Slurm would hold it about
120 s) and must resume exactly."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from tools.lab.slurmcluster import SlurmClusterError

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "recipes" / "slurm" / "train.sbatch"
# 16 steps: a preemption at step 4, and the submitit test's second one 4 steps after the
# resume (step 9 or 10), leave 6 or more steps for Slurm's signal to land before the run ends
# (24 before: the 8 more steps, in the local reference and both preempted jobs, were only
# time)
STEPS = 16
# the recipe's ranks_per_node=2 places the local run as 2 simulated nodes; under Slurm the
# real nodes give the same placement (and usp says it ignored the recipe's value)
# 256 tokens (the recipe's 512 halved): start-up and restarts are what these tests time
RUN = ["recipe=tiny_cpu", "parallel.ulysses_degree=2", "parallel.ring_degree=2", "data.seq_len=256",
       f"trainer.steps={STEPS}", "trainer.ckpt_every=0", "data.batch_per_dp_rank=2"]
TWO_BY_TWO = ("--nodes=2", "--ntasks-per-node=2")


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl (a step logged twice keeps its last value)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec:
            out[rec["step"]] = rec["loss"]
    return out


def local_run(run_dir: Path, args: list[str], nprocs: int = 4) -> dict[int, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SUBMITIT"))}
    p = subprocess.run([sys.executable, "-m", "usp.cli", *args, f"trainer.nprocs={nprocs}",
                        f"trainer.run_dir={run_dir}", f"hydra.run.dir={run_dir}/hydra"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return losses(run_dir)


def wait_for_step(cluster, job: int, run_dir: Path, step: int, timeout: float = 120) -> None:
    """Until ``run_dir`` logged ``step`` (the job must still run)."""
    deadline = t0 = time.monotonic()
    deadline += timeout
    while max(losses(run_dir), default=0) < step:
        state = cluster.job(job)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), (state, cluster.output(job)[-3000:])
        assert time.monotonic() < deadline, f"job {job} did not log step {step} in {timeout} s"
        time.sleep(0.2)
    print(f"step {step} logged after {time.monotonic() - t0:.1f} s")


def preempt_and_requeue(cluster, job: int, sig: str, restarts: int,
                        before_release: list[str] | None = None, timeout: float = 60) -> None:
    """``scancel --signal=sig`` to every task; the job checkpoints, requeues itself
    (``trainer.requeue``) and waits as PENDING; release it (no 120 s hold) and see it run."""
    t0 = time.monotonic()
    cluster.signal(job, sig)
    deadline = time.monotonic() + timeout
    while True:
        info = cluster.job(job)
        if int(info.get("Restarts", 0)) >= restarts and info["JobState"] == "PENDING":
            break
        assert info["JobState"] in ("RUNNING", "COMPLETING", "PENDING", "REQUEUED"), \
            (info["JobState"], cluster.output(job)[-3000:])
        assert time.monotonic() < deadline, f"job {job} not requeued after SIG{sig}: {info}"
        time.sleep(0.3)
    if before_release:
        p = cluster.run(before_release)
        assert p.returncode == 0, p.stderr
    t1 = time.monotonic()
    cluster.release(job)
    cluster.wait_running(job, timeout=timeout)
    print(f"SIG{sig}: requeued (pending) after {t1 - t0:.1f} s, running again "
          f"{time.monotonic() - t1:.1f} s after the release")


def sbatch(cluster, workdir: Path, args: list[str], *options: str) -> int:
    workdir.mkdir(parents=True, exist_ok=True)
    return cluster.sbatch([*options, str(TEMPLATE), *args], chdir=workdir)


def task_lines(out: str, needle: str) -> list[str]:
    return [line for line in out.splitlines() if needle in line]


def exited(out: str, code: int) -> int:
    """How many tasks srun saw exit with ``code`` ('node0: tasks 0-1: Exited with exit code
    75' counts 2)."""
    count = 0
    for m in re.finditer(rf"tasks? ([0-9,-]+): Exited with exit code {code}\b", out):
        for part in m.group(1).split(","):
            lo, _, hi = part.partition("-")
            count += int(hi or lo) - int(lo) + 1
    return count


# ---- hydra-submitit-launcher: usp-train -m hydra/launcher=slurm ------------------------------

SUBMITIT = ["hydra/launcher=slurm", "hydra.launcher.nodes=2", "hydra.launcher.tasks_per_node=2",
            "hydra.launcher.gpus_per_node=null", "hydra.launcher.cpus_per_task=1",
            "hydra.launcher.mem_gb=null", "hydra.launcher.timeout_min=30"]


def submit(cluster, tmp: Path, args: list[str]) -> subprocess.Popen:
    """The submitter, as a user starts it (inside the cluster's client namespace); it waits
    for the job's result."""
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        cluster.client([sys.executable, "-m", "usp.cli", "-m", *SUBMITIT,
                        f"hydra.sweep.dir={tmp / 'sweep'}", *args]),
        cwd=tmp, env=cluster.client_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def the_job(cluster, submitter: subprocess.Popen, before: set[int], timeout: float = 60) -> int:
    """The job the submitter submitted: the one not among the ids ``before`` it started."""
    deadline = time.monotonic() + timeout
    while not (new := {int(j["JobId"]) for j in cluster.jobs()} - before):
        assert submitter.poll() is None, submitter.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "the submitter submitted no job"
        time.sleep(0.3)
    return new.pop()


def job_ids(cluster) -> set[int]:
    return {int(j["JobId"]) for j in cluster.jobs()}


def finished(submitter: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out, _ = submitter.communicate(timeout=timeout)
    finally:
        if submitter.poll() is None:
            submitter.kill()
    return submitter.returncode, out, time.monotonic() - t0



# ---- the jobs that need no nodes of their own, side by side ----------------------------------

# how long each wait of a job run side by side may take (5 jobs' tasks, two submitters and the
# local run share the cores: a start-up takes several times as long as alone)
SLOW = 180


def sbatch_preempted(cluster, tmp: Path) -> dict:
    """The shipped template, preempted by USR1 at step 4, requeued and run to the end."""
    run_dir = tmp / "run"
    job = sbatch(cluster, tmp, [*RUN, f"trainer.run_dir={run_dir}"], *TWO_BY_TWO)
    wait_for_step(cluster, job, run_dir, 4, SLOW)
    preempt_and_requeue(cluster, job, "USR1", restarts=1, timeout=SLOW)
    info = cluster.wait(job, timeout=2 * SLOW)
    return {"job": job, "info": info, "out": cluster.output(job), "losses": losses(run_dir)}


def scancelled(cluster, tmp: Path) -> dict:
    """A plain ``scancel`` once the job logged step 3."""
    run_dir = tmp / "run"
    job = sbatch(cluster, tmp, [*RUN, f"trainer.run_dir={run_dir}"], *TWO_BY_TWO)
    wait_for_step(cluster, job, run_dir, 3, SLOW)
    cluster.cancel(job)
    info = cluster.wait(job, timeout=SLOW)
    time.sleep(2)  # the tasks' last lines
    return {"job": job, "info": info, "out": cluster.output(job), "losses": losses(run_dir)}


def refused(cluster, tmp: Path) -> dict:
    """ulysses 3 on 4 tasks, through the template."""
    job = sbatch(cluster, tmp, ["recipe=tiny_cpu", "parallel.ulysses_degree=3",
                                "parallel.ring_degree=1", f"trainer.run_dir={tmp / 'run'}"],
                 *TWO_BY_TWO)
    info = cluster.wait(job, timeout=2 * SLOW)
    return {"job": job, "info": info, "out": cluster.output(job)}


def running_together(cluster, done: threading.Event) -> list[set[int]]:
    """The jobs seen RUNNING at once, every 0.5 s until ``done``."""
    seen = []
    while not done.wait(0.5):
        try:
            jobs = cluster.jobs()
        except (SlurmClusterError, subprocess.TimeoutExpired):  # a busy slurmctld: next time
            continue
        seen.append({int(j["JobId"]) for j in jobs if j["JobState"] == "RUNNING"})
    return seen


@pytest.fixture(scope="module")
def side_by_side(slurm_cluster, tmp_path_factory) -> dict:
    """The batch jobs that need no node to themselves, submitted at once, each followed by a
    thread of its own, beside the local reference run: the template's job preempted once, a
    job ended by a plain scancel, a refused one. Their tasks' start-ups and Slurm's waits
    overlap (as tests of their own, one after another, they and a fourth job that only ran
    beside another took about 2 min on 2 cores in CI). name -> what its scenario returned,
    or the exception it raised (raised again by the test that reads it); "running": the sets
    of jobs seen RUNNING together."""
    tmp = tmp_path_factory.mktemp("side_by_side")
    cluster = slurm_cluster
    scenarios = {"reference": lambda: local_run(tmp / "local" / "run", RUN),
                 "sbatch": lambda: sbatch_preempted(cluster, tmp / "sbatch"),
                 "scancel": lambda: scancelled(cluster, tmp / "scancel"),
                 "refused": lambda: refused(cluster, tmp / "refused")}
    done = threading.Event()
    with ThreadPoolExecutor(len(scenarios) + 1) as pool:
        watch = pool.submit(running_together, cluster, done)
        futures = {name: pool.submit(fn) for name, fn in scenarios.items()}
        wait(futures.values())
        done.set()
    results = {name: f.exception() or f.result() for name, f in futures.items()}
    results["running"] = watch.result()
    return results


def result(side_by_side: dict, name: str):
    got = side_by_side[name]
    if isinstance(got, BaseException):
        raise got
    return got


@pytest.fixture(scope="module")
def reference(side_by_side) -> dict[int, float]:
    """The uninterrupted run, launched locally: 4 ranks, the same mesh."""
    losses_ = result(side_by_side, "reference")
    assert sorted(losses_) == list(range(1, STEPS + 1))
    return losses_


def test_sbatch_preempted_by_usr1_then_sigterm_resumes_exactly(side_by_side, reference):
    """The shipped template: trains bit-identically to the local run across a preemption
    (USR1, the template's time-limit warning), checkpointing at the next step, requeueing
    itself and resuming; wandb (offline) stays on. The scheduler's own SIGTERM, and a second
    preemption of a resumed job, are the submitit test's (usp handles every signal alike)."""
    got = result(side_by_side, "sbatch")
    info, out = got["info"], got["out"]
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-3000:]
    assert got["losses"] == reference  # every step, bit for bit
    preempted = task_lines(out, "preempted by")
    assert len(preempted) == 1, out[-3000:]  # rank 0's line, once
    assert len(task_lines(out, "requeued; it resumes from this checkpoint")) == 1
    assert exited(out, 75) == 4  # every task
    assert "Terminated" not in out  # no task killed by the requeue while it finished
    assert len(task_lines(out, "resumed from")) == 1
    # the recipe's simulated nodes gave way to the job's real ones, said once per start
    assert len(task_lines(out, "parallel.ranks_per_node=2 ignored under Slurm")) == 2
    assert "2 nodes x 2 tasks" in out
    assert "Traceback" not in out, out[-3000:]  # nor did the killed wandb service cost one


def test_a_plain_scancel_is_not_requeued(side_by_side):
    """``scancel`` (no --signal) ends the job: usp still checkpoints on the SIGTERM, but does
    not requeue a job its user cancelled."""
    got = result(side_by_side, "scancel")
    info = got["info"]
    assert info["JobState"] == "CANCELLED" and int(info.get("Restarts", 0)) == 0, info
    assert "Slurm is ending it; not requeued" in got["out"], got["out"][-3000:]


def test_two_jobs_on_the_same_nodes_train_alike(side_by_side, reference):
    """Each job takes its own rendezvous port (usp.slurm.job_port): 2 x 2 jobs sharing both
    nodes at once train alike. The preempted job and the scancelled one ran at once (submitted
    together); the first finished equal to the local run bit for bit at every step, the
    second equal to it at every step it logged before its cancel."""
    jobs = {name: result(side_by_side, name) for name in ("sbatch", "scancel")}
    a, c = jobs["sbatch"]["job"], jobs["scancel"]["job"]
    running = side_by_side["running"]
    assert any({a, c} <= seen for seen in running), running
    assert jobs["sbatch"]["info"]["JobState"] == "COMPLETED", jobs["sbatch"]["out"][-3000:]
    assert jobs["sbatch"]["losses"] == reference
    stopped = jobs["scancel"]["losses"]
    assert len(stopped) >= 3 and stopped == {s: reference[s] for s in stopped}


def test_degrees_that_cannot_fit_are_refused_once_before_any_group(side_by_side):
    """ulysses 3 on 4 tasks: every task exits 2 at once; one line, from rank 0, with the count."""
    got = result(side_by_side, "refused")
    info, out = got["info"], got["out"]
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, out[-3000:])
    errors = task_lines(out, "usp-train: error:")
    assert len(errors) == 1, out[-3000:]
    assert "ulysses" in errors[0] and errors[0].endswith("(all 4 tasks stop with this error)")
    assert errors[0].startswith("0: ")  # srun --label: task 0 said it
    assert exited(out, 2) == 4 and "Traceback" not in out
    print(f"refused: job ran {info['RunTime']} (start-up of 4 tasks on 2 cores included)")


# ---- a job of its own: a node drained under it ------------------------------------------------


def test_a_job_continues_on_fewer_nodes_with_the_global_batch_kept(slurm_cluster, tmp_path_factory):
    """Elastic: a 2 x 2 job (dp 2 x ulysses 2, one micro-batch per step) is preempted, a node
    is drained, and the requeued job (``--nodes=1-2``) continues on 1 x 2 (dp 1 x ulysses 2):
    the checkpoint resharded, ``trainer.global_batch_tokens`` kept by two micro-batches, the
    data continued at the same sample. Every loss equals the uninterrupted 2 x 2 run's to
    1e-4 relative."""
    tmp = tmp_path_factory.mktemp("elastic")
    # T = 256 tokens x 4 sequences x dp 2 = 2048: K = 1 at dp 2, K = 2 at dp 1
    args = ["recipe=tiny_cpu", "parallel.ulysses_degree=2", "parallel.ring_degree=1",
            "data.seq_len=256", "data.batch_per_dp_rank=4", "trainer.global_batch_tokens=2048",
            "trainer.steps=16", "trainer.ckpt_every=0"]
    reference = local_run(tmp / "local", args)
    run_dir = tmp / "run"
    job = sbatch(slurm_cluster, tmp, [*args, f"trainer.run_dir={run_dir}"],
                 "--nodes=1-2", "--ntasks-per-node=2")
    assert slurm_cluster.wait_running(job)["NumNodes"] == "2"
    wait_for_step(slurm_cluster, job, run_dir, 5)
    node = slurm_cluster.node_names[1]
    slurm_cluster.drain(node, "elastic test")
    try:
        # a requeued job keeps the task count of its first start (4 = 2 nodes x 2): the user
        # lowers it while it waits, and the job starts on the one node left
        preempt_and_requeue(slurm_cluster, job, "USR1", restarts=1, before_release=[
            "scontrol", "update", f"JobId={job}", "NumNodes=1-2", "NumTasks=2"])
        assert slurm_cluster.job(job)["NumNodes"] == "1"
        info = slurm_cluster.wait(job, timeout=240)
    finally:
        slurm_cluster.resume(node)
    out = slurm_cluster.output(job)
    assert info["JobState"] == "COMPLETED", out[-3000:]
    got = losses(run_dir)
    assert sorted(got) == sorted(reference) == list(range(1, 17))
    worst = max(abs(got[s] - reference[s]) / abs(reference[s]) for s in reference)
    assert worst <= 1e-4, worst
    resumed = task_lines(out, "resumed from")
    assert len(resumed) == 1 and "a step is 8 samples: dp 1 x 2 micro-batch(es) of 4" in resumed[0]
    print(f"elastic: 2 x 2 -> 1 x 2, worst relative loss difference {worst:.2e}")


def test_submitit_preempted_by_usr2_then_sigterm_resumes_exactly(slurm_cluster, reference,
                                                                 tmp_path):
    """submitit asks Slurm for SIGUSR2 before the time limit: usp checkpoints, requeues the job
    itself (no submitit timeout budget needed), and again at the scheduler's own SIGTERM once
    resumed; the submitter, still waiting, gets the requeued job's result; every loss equals
    the local run's."""
    run_dir = tmp_path / "run"
    before = job_ids(slurm_cluster)
    submitter = submit(slurm_cluster, tmp_path, [*RUN, f"trainer.run_dir={run_dir}"])
    try:
        job = the_job(slurm_cluster, submitter, before)
        wait_for_step(slurm_cluster, job, run_dir, 4)
        preempt_and_requeue(slurm_cluster, job, "USR2", restarts=1)
        wait_for_step(slurm_cluster, job, run_dir, max(losses(run_dir)) + 4)
        preempt_and_requeue(slurm_cluster, job, "TERM", restarts=2)
        info = slurm_cluster.wait(job, timeout=180)
        rc, out, after = finished(submitter, timeout=60)
    finally:
        if submitter.poll() is None:
            submitter.kill()
    assert info["JobState"] == "COMPLETED", info
    assert rc == 0, out[-3000:]
    assert losses(run_dir) == reference
    print(f"submitit: the submitter returned {after:.1f} s after the job completed")


def test_submitit_refusal_reaches_the_submitter(slurm_cluster, tmp_path):
    """A refusal under submitit is the job's result: the submitter ends with usp's message,
    instead of polling a job that left no result."""
    before = job_ids(slurm_cluster)
    submitter = submit(slurm_cluster, tmp_path, ["recipe=tiny_cpu", "parallel.ulysses_degree=3",
                                                 "parallel.ring_degree=1",
                                                 f"trainer.run_dir={tmp_path / 'run'}"])
    try:
        job = the_job(slurm_cluster, submitter, before)
        info = slurm_cluster.wait(job, timeout=120)
        rc, out, after = finished(submitter, timeout=60)
    finally:
        if submitter.poll() is None:
            submitter.kill()
    assert rc != 0 and "does not divide world size 4" in out, out[-3000:]
    assert "(all 4 tasks stop with this error)" in out
    print(f"submitit refusal: job {info['JobState']} {info['ExitCode']}, the submitter ended "
          f"{after:.1f} s after")
