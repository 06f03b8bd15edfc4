"""The fault tier end to end: real usp-train runs hit by SIGTERM and by a killed rank.

The other faults are tested closer to their code (test_faults_trainer, test_restarts,
test_checkpoint_files, test_inputs, test_clean_exit); the whole campaign, with its table in
the README, is ``python -m tools.fault_campaign``.
"""

from tools.lab.faults import campaign

# The campaign's faults strike once step 9 is logged; 16 steps (of the tool's 24) leave 7
# steps for SIGTERM to reach the ranks before the run would end on its own.
SHORTER = ("trainer.steps=16",)


def test_sigterm_and_a_killed_rank_lose_nothing(tmp_path):
    rows = campaign(tmp_path, ["sigterm", "kill_rank"], extra=SHORTER, log=lambda s: None)
    assert [r.fault for r in rows] == ["none (reference run)", "SIGTERM to usp-train",
                                       "SIGKILL one rank, trainer.max_restarts=1"]
    assert all(r.ok for r in rows), [r for r in rows if not r.ok]
    assert rows[1].steps_lost == 0  # preemption saves the step it stopped at
    assert "rc 75" in rows[1].happened and "1 restart" in rows[2].happened
