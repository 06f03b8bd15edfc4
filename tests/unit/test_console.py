"""``usp.train.console.Console``: rank 0 prints a step line every ``trainer.log_every``
steps and at each validation; other ranks print nothing."""

from usp.train.console import Console


def _record(step, **more):
    return {"step": step, "loss": 1.5, "lr": 0.001, "peak_mem_kind": "rss_step", **more}


def test_logs_every_log_every_steps_and_each_validation(capsys):
    c = Console(rank=0, log_every=3, progress=False, steps=10, start=0)
    assert [s for s in range(1, 11) if c.should_log(_record(s))] == [3, 6, 9]
    assert c.should_log(_record(5, val_loss=2.0))
    c.log(_record(3))
    c.log(_record(4))
    assert capsys.readouterr().out == "step=3 loss=1.5 lr=0.001 peak_mem_kind=rss_step\n"
    c.close()
    c.close()  # twice: nothing


def test_log_every_zero_logs_validations_only():
    c = Console(rank=0, log_every=0, progress=False, steps=10, start=0)
    assert not any(c.should_log(_record(s)) for s in range(1, 11))
    assert c.should_log(_record(10, val_loss=2.0))


def test_other_ranks_print_nothing(capsys):
    c = Console(rank=1, log_every=1, progress=True, steps=10, start=0)
    assert c.bar is None and not c.should_log(_record(1, val_loss=2.0))
    c.log(_record(1))
    assert capsys.readouterr().out == ""
