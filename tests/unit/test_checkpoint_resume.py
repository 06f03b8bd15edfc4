"""Resume-config checks (``usp.models.checkpoint.check_resume``): every changed fingerprint
field is named and refused, a changed parallel layout is accepted."""

import pytest

import usp.models.checkpoint as ck
from usp.train.fingerprint import run_fingerprint

from _checkpoint_cfg import run_cfg


def test_check_resume_names_every_changed_key():
    saved = run_fingerprint(run_cfg())
    now = run_fingerprint(run_cfg(optim={"lr": 1e-3}, data={"seq_len": 256},
                                  model={"dim": 128}))
    with pytest.raises(ValueError) as err:
        ck.check_resume(saved, now)
    msg = str(err.value)
    assert "\n" not in msg and "trainer.resume=false" in msg and "run_dir" in msg
    for key in ("optim.lr: 0.003 -> 0.001", "data.seq_len: 128 -> 256", "model.dim: 64 -> 128"):
        assert key in msg, msg
    assert "optim.min_lr" not in msg  # only what changed


@pytest.mark.parametrize("over", [{"optim": {"min_lr": 1e-4}}, {"trainer": {"steps": 7}},
                                  {"trainer": {"dtype": "bf16"}}, {"data": {"kind": "memmap"}},
                                  {"model": {"n_layers": 3}}])
def test_check_resume_refuses_each_fingerprint_field(over):
    with pytest.raises(ValueError, match="cannot resume"):
        ck.check_resume(run_fingerprint(run_cfg()), run_fingerprint(run_cfg(**over)))


def test_check_resume_accepts_a_changed_parallel_layout():
    saved = run_fingerprint(run_cfg(u=2, r=2))
    for u, r in ((4, 1), (1, 4), (1, 1)):
        ck.check_resume(saved, run_fingerprint(run_cfg(u=u, r=r)))  # no error
    ck.check_resume(saved, run_fingerprint(run_cfg(parallel={"balance": "contiguous"})))
