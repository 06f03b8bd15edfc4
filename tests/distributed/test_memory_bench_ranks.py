"""The memory benchmark's measured training run on 4 ranks: the step probe's figures grow
with the length, and the planner's peak is within 15% of the measured one."""

from tools.lab.memory import StepMemory, measure_run
from tools.lab.memory_sweep import FEATURES, MemoryBench, Point, predict
from usp.launch import spawn_local


TINY = MemoryBench(vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                   lengths=(32, 128))


def _measure_two_lengths(root: str, out: str) -> None:
    import json
    import os

    import torch.distributed as dist

    got = {}
    for n in TINY.lengths:
        cfg = TINY.run_config(FEATURES["baseline"], n, os.path.join(root, str(n)))
        got[n] = [r.__dict__ for r in measure_run(cfg)]
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(got, f)


def test_measured_step_runs_on_ranks(tmp_path):
    import json

    out = tmp_path / "out.json"
    spawn_local(_measure_two_lengths, 4, str(tmp_path), str(out))
    got = {int(n): [StepMemory(**r) for r in recs]
           for n, recs in json.loads(out.read_text()).items()}
    cfg = TINY.run_config(FEATURES["baseline"], 32, "")
    state = 12 * cfg.model.num_params() / 4  # fp32 parameter + Adam m, v, sharded over 4
    short, long = got[32][-1], got[128][-1]
    assert len(got[32]) == TINY.steps
    for step in (short, long):
        assert step.before >= state  # the second step starts with the optimizer state
        assert step.peak > step.before > 0
    assert long.activations > short.activations  # 4x the tokens per rank
    assert long.peak > short.peak
    for n, step in ((32, short), (128, long)):  # the planner's peak, from shapes alone
        planned = predict(TINY, Point("baseline", n, 2, 2, step)).total
        assert 0.85 <= planned / step.peak <= 1.15, (n, planned / step.peak)
