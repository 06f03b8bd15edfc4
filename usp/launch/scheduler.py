"""The launcher's environment: rank, world and rendezvous address from torchrun or Slurm."""

from __future__ import annotations

import os

from .. import slurm


def launcher_env(env=None) -> dict | None:
    """Rank/world/master from torchrun or Slurm variables, or None for a plain local launch."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also sets MASTER_ADDR/PORT)
        info = {"kind": "torchrun", "rank": int(env["RANK"]), "world": int(env["WORLD_SIZE"]),
                "local_rank": int(env.get("LOCAL_RANK", 0)),
                "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
                "master_port": int(env.get("MASTER_PORT", 29500))}
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps ONE store (same MASTER_PORT) across --max-restarts: a
            # restarted group must key its rendezvous by attempt, or gloo reads the dead
            # attempt's addresses ("connectFullMesh failed ... Connection refused")
            info["store_prefix"] = f"usp/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return info
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:  # srun / submitit
        nodelist = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1"))
        port, port_source = slurm.rendezvous_port(env)
        return {"kind": "slurm", "rank": int(env["SLURM_PROCID"]),
                "world": int(env["SLURM_NTASKS"]), "local_rank": int(env.get("SLURM_LOCALID", 0)),
                "master_addr": env.get("MASTER_ADDR", slurm.first_host(nodelist)),
                "master_port": port, "port_source": port_source,
                "identity": slurm.identity(env), "placement": slurm.placement(env)}
    return None
