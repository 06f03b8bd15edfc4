"""curves.png's content (``usp.train.curves``): the validation losses and passkey accuracy
where they were measured, beside the training loss, and each phase's start labelled."""

from usp.train.curves import curve_series, curves_png, phase_marks

RECORDS = [
    {"step": 0, "val_loss": 5.6, "passkey_acc/128": 0.0, "passkey_acc/512": 0.0, "phase": 1},
    {"step": 1, "loss": 5.5, "tokens_per_s": 100.0, "phase": 1},
    {"step": 2, "loss": 4.0, "tokens_per_s": 110.0, "phase": 1, "val_loss": 4.1,
     "passkey_acc/128": 0.5, "passkey_acc/512": 0.0},
    {"step": 3, "loss": 6.0, "tokens_per_s": 50.0, "phase": 2},
    {"step": 4, "loss": 3.0, "tokens_per_s": 55.0, "phase": 2, "val_loss": 3.2,
     "short_val_loss": 3.5, "passkey_acc/128": 1.0, "passkey_acc/512": 0.75},
]


def test_the_curves_hold_every_measured_metric_at_its_steps(tmp_path):
    series = {name: {label: (steps, values) for label, steps, values in curves}
              for name, curves in curve_series(RECORDS).items()}
    assert series["loss"] == {"training loss": ([1, 2, 3, 4], [5.5, 4.0, 6.0, 3.0]),
                              "val_loss": ([0, 2, 4], [5.6, 4.1, 3.2]),
                              "short_val_loss": ([4], [3.5])}
    assert series["accuracy"] == {"passkey L=128": ([0, 2, 4], [0.0, 0.5, 1.0]),
                                  "passkey L=512": ([0, 2, 4], [0.0, 0.0, 0.75])}
    assert phase_marks(RECORDS) == [(2.5, "phase 2")]
    assert curves_png(RECORDS, tmp_path / "c.png").stat().st_size > 0
    recall = [{"step": s, "loss": 1.0, "acc": 0.5, "tokens_per_s": 9.0} for s in (1, 2)]
    assert [c[0] for c in curve_series(recall)["accuracy"]] == ["answer accuracy"]
    assert phase_marks(recall) == [] and curves_png(RECORDS[:1], tmp_path / "x.png") is None
