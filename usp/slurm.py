"""What usp reads from and asks of Slurm: the job's rendezvous port and identity, its node
list, its state, and requeueing it after a preemption checkpoint.

Pure functions of the environment, except ``job_fields`` and ``requeue``, which run
``scontrol`` (injectable ``run`` for tests). Nothing here imports torch.

- **Port.** With ``MASTER_PORT`` unset, a job's ranks meet on
  ``PORT_BASE + PORT_STRIDE * (job id mod PORT_SLOTS) + (step id mod PORT_STRIDE)``, a port in
  [20000, 32000): below Linux's ephemeral range (32768-60999), so an outgoing connection
  never holds it, and different for every job whose ids differ by less than 3000.
- **Identity.** ``slurm job J step S`` (``identity``): rank 0 publishes it at the
  rendezvous and every rank compares (``usp.launch``), so ranks of two jobs that share a
  port anyway never form one group.
- **Requeue.** ``requeue`` puts a preempted batch job back in the queue, unless Slurm is
  already ending it (a ``scancel``: JobState CANCELLED; the scheduler's own preemption
  requeues by itself).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Mapping

PORT_BASE, PORT_SLOTS, PORT_STRIDE = 20000, 3000, 4  # ports [20000, 32000)


def job_port(job_id: int, step_id: int = 0) -> int:
    """The rendezvous port of step ``step_id`` of job ``job_id`` (module docstring)."""
    return PORT_BASE + PORT_STRIDE * (job_id % PORT_SLOTS) + step_id % PORT_STRIDE


def rendezvous_port(env: Mapping[str, str]) -> tuple[int, str]:
    """(port, where it came from): ``MASTER_PORT`` when set, else the job's own port."""
    if env.get("MASTER_PORT"):
        return int(env["MASTER_PORT"]), "MASTER_PORT"
    if env.get("SLURM_JOB_ID"):
        step = env.get("SLURM_STEP_ID", "0")
        return (job_port(int(env["SLURM_JOB_ID"]), int(step) if step.isdigit() else 0),
                f"job {env['SLURM_JOB_ID']}'s port")
    return 29500, "default"


def identity(env: Mapping[str, str]) -> str:
    """``slurm job J step S``: what every rank of one job step shares and no other has."""
    return f"slurm job {env.get('SLURM_JOB_ID', '?')} step {env.get('SLURM_STEP_ID', '?')}"


def first_host(nodelist: str) -> str:
    """'gpu[012-015,020],cpu01' -> 'gpu012' (the first host of a Slurm node list)."""
    first = nodelist.split(",")[0]  # 'gpu[012-015' or 'cpu01'
    if "[" not in first:
        return first
    prefix, ranges = first.split("[", 1)
    return prefix + ranges.split("-")[0].rstrip("]")


def tasks_per_node(env: Mapping[str, str]) -> list[int]:
    """Tasks on each node of the step, from ``SLURM_TASKS_PER_NODE`` ('2(x3),1' ->
    [2, 2, 2, 1]); [] when unset."""
    counts: list[int] = []
    for part in filter(None, env.get("SLURM_STEP_TASKS_PER_NODE",
                                     env.get("SLURM_TASKS_PER_NODE", "")).split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def placement(env: Mapping[str, str]) -> str:
    """'2 nodes x 2 tasks' (or '2 nodes, 3+1 tasks') for messages; '' outside Slurm."""
    counts = tasks_per_node(env)
    if not counts:
        return ""
    nodes = f"{len(counts)} node{'s' if len(counts) > 1 else ''}"
    if len(set(counts)) == 1:
        return f"{nodes} x {counts[0]} task{'s' if counts[0] > 1 else ''}"
    return f"{nodes}, {'+'.join(map(str, counts))} tasks"


def under_submitit(env: Mapping[str, str]) -> bool:
    """True in a task started by submitit (hydra-submitit-launcher): its result file, not
    the exit code, is what the submitter reads."""
    return bool(env.get("SUBMITIT_FOLDER"))


Runner = Callable[..., subprocess.CompletedProcess]


def job_fields(job_id: str, run: Runner = subprocess.run) -> dict[str, str]:
    """``scontrol show job -o JOB`` as {key: value}; {} when scontrol fails."""
    try:
        p = run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True,
                text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    if p.returncode != 0:
        return {}
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", p.stdout))


def requeue(env: Mapping[str, str], run: Runner = subprocess.run) -> tuple[bool, str]:
    """Requeue this batch job after its preemption checkpoint: (requeued, one line saying
    what happened). Not requeued: outside a Slurm batch job, a job Slurm is already ending
    (``scancel``, the scheduler's own preemption), or ``scontrol requeue`` refused."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return False, "not a Slurm job: not requeued; run it again to resume"
    fields = job_fields(job, run)
    state, batch = fields.get("JobState"), fields.get("BatchFlag")
    if state is None:
        return False, f"job {job}: scontrol show job failed; not requeued"
    if batch == "0":
        return False, f"job {job} is not a batch job (srun outside sbatch): not requeued"
    if state != "RUNNING":
        return False, (f"job {job} is {state}: Slurm is ending it; not requeued (a preempted "
                       f"job with --requeue is requeued by Slurm itself)")
    try:
        p = run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"job {job}: scontrol requeue failed ({e}); not requeued"
    if p.returncode != 0:
        why = (p.stderr or p.stdout).strip().splitlines()
        return False, (f"job {job}: scontrol requeue refused ({why[-1] if why else p.returncode})"
                       f"; not requeued (submit with --requeue)")
    return True, f"job {job} requeued; it resumes from this checkpoint when it starts again"
