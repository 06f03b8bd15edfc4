"""The fault tier end to end: a real usp-train run whose rank is SIGKILLed, restarted by the
launcher (``trainer.max_restarts=1``), ends with the reference run's loss.

The other faults are tested closer to their code (test_faults_trainer, test_restarts,
test_checkpoint_files, test_inputs, test_clean_exit). The campaign's SIGTERM row is not run
here: each of its checks has a test of its own, at usp-train's level or closer to the code:
SIGTERM to usp-train's launcher reaches every rank and returns their code
(distributed/test_restarts.py), usp-train exits 75 with a checkpoint of the very step it
stopped at and resumes from it with no step lost or repeated (e2e/test_wandb_preemption.py,
SIGTERM to the launcher and wandb's service), the resumed losses equal the uninterrupted
run's (distributed/test_faults_trainer_ranks.py; at (2, 2) on 4 ranks, bit for bit,
slurm/test_usp_on_slurm.py). The whole campaign, with its table in the README, is
``python -m tools.fault_campaign``.
"""

from tools.lab.faults import campaign

# The fault strikes once step 9 is logged; 16 steps (of the tool's 24) leave 7 steps for the
# kill to land before the run would end on its own.
SHORTER = ("trainer.steps=16",)


def test_a_killed_rank_restarts_and_loses_only_the_steps_since_its_checkpoint(tmp_path):
    rows = campaign(tmp_path, ["kill_rank"], extra=SHORTER, log=lambda s: None)
    assert [r.fault for r in rows] == ["none (reference run)",
                                       "SIGKILL one rank, trainer.max_restarts=1"]
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]  # the reference's loss
    assert "1 restart" in rows[1].happened
    # resumed from the newest periodic checkpoint (every 6 steps): at most 5 steps again
    assert 0 <= rows[1].steps_lost < 6, rows[1]
