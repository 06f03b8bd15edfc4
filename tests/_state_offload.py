"""The state offload's CPU stand-in, shared by ``distributed/test_memory_features.py`` and
``distributed/test_hf_train_ranks.py``.

``trainer.state_offload`` is CUDA only and refused on CPU by preflight. ``train_as_cuda`` runs
the very path on gloo: preflight's offload rule is asked as for CUDA, FSDP2's
``CPUOffloadPolicy`` (``pin_memory=False`` on a CPU mesh) reaches every ``fully_shard``, and
each call is recorded with the policy it got and whether FSDP marked every parameter of the
module offloaded, for the test to assert (on CPU the tensors live in host memory either way)."""

import json
from pathlib import Path
from unittest import mock


def _recorder(calls: list):
    """``fully_shard`` that records, per call, the policy it got and whether FSDP marked every
    parameter of the module offloaded to host memory (and not pinned: a CPU mesh)."""
    from torch.distributed.fsdp import fully_shard

    def shard(module, **kw):
        out = fully_shard(module, **kw)
        params = out._get_fsdp_state()._fsdp_param_group.fsdp_params
        calls.append({"policy": type(kw.get("offload_policy")).__name__,
                      "offloaded": all(p.offload_to_cpu and not p.pin_memory for p in params)})
        return out

    return shard


def train_as_cuda(cfg) -> None:
    """``train(cfg)`` on this rank with preflight's offload rule asked as for CUDA; writes the
    ``fully_shard`` calls to ``<run_dir>/shard_calls_<rank>.json``."""
    import torch.distributed as dist

    from usp.run import preflight
    from usp.train.phase_runner import train

    as_cuda, calls = preflight.check_recompute, []
    with mock.patch("usp.train.build.fully_shard", _recorder(calls)), \
            mock.patch.object(preflight, "check_recompute",
                              lambda cfg, device: as_cuda(cfg, "cuda")):
        train(cfg)
    Path(cfg.trainer.run_dir, f"shard_calls_{dist.get_rank()}.json").write_text(json.dumps(calls))


def shard_calls(run_dir, rank: int) -> list[tuple[str, bool]]:
    """(policy name, every parameter offloaded) of each ``fully_shard`` call of ``rank``."""
    calls = json.loads(Path(run_dir, f"shard_calls_{rank}.json").read_text())
    return [(c["policy"], c["offloaded"]) for c in calls]
