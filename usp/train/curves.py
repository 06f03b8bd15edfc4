"""``curves.png``: a run's metrics against step (``Metrics.plot`` writes it).

Three panels: the losses (training loss every step, ``val_loss`` and ``short_val_loss``
where a validation measured them), the accuracies (the recall task's answer accuracy every
step, ``passkey_acc/<L>`` per length where measured) and throughput. Each length phase's
start is a dotted line labelled with its phase.
"""

from __future__ import annotations

from pathlib import Path

Series = tuple[str, list[int], list[float]]  # (label, steps, values)


def _series(records: list[dict], key: str, label: str | None = None) -> list[Series]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [(label or key, [s for s, _ in pts], [v for _, v in pts])] if pts else []


def curve_series(records: list[dict]) -> dict[str, list[Series]]:
    """Panel name -> its curves, from ``metrics.jsonl``'s records (step 0's validation
    included): ``loss``, ``accuracy`` (may be empty) and ``throughput``."""
    passkey = sorted({k for r in records for k in r if k.startswith("passkey_acc/")},
                     key=lambda k: int(k.split("/")[1]))
    return {
        "loss": (_series(records, "loss", "training loss") + _series(records, "val_loss")
                 + _series(records, "short_val_loss")),
        "accuracy": (_series(records, "acc", "answer accuracy")
                     + [s for k in passkey for s in _series(records, k, f"passkey L={k[12:]}")]),
        "throughput": _series(records, "tokens_per_s", "tokens/s"),
    }


def phase_marks(records: list[dict]) -> list[tuple[float, str]]:
    """(x, label) of each phase after the first: between its first step and the step
    before it, labelled ``phase K``."""
    steps = [r for r in records if "loss" in r]
    return [(a["step"] + 0.5, f"phase {b['phase']}") for a, b in zip(steps, steps[1:])
            if a.get("phase") != b.get("phase")]


def curves_png(records: list[dict], path: Path) -> Path | None:
    """Draw ``curve_series`` and ``phase_marks`` as ``path``; None without a training step."""
    if not any("loss" in r for r in records):  # only step 0's validation
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {k: v for k, v in curve_series(records).items() if v}
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    style = {"loss": dict(ylabel="loss (nats per target)", yscale="log", title="losses"),
             "accuracy": dict(ylabel="accuracy", ylim=(0, 1.02), title="accuracy"),
             "throughput": dict(ylabel="tokens/s", title="throughput")}
    for ax, (name, curves) in zip(axes[0], panels.items()):
        for label, steps, values in curves:
            dense = label in ("training loss", "answer accuracy", "tokens/s")
            ax.plot(steps, values, label=label, **({} if dense else dict(marker="o", ms=3)))
        ax.set(xlabel="step", **style[name])
        for x, label in phase_marks(records):
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
            ax.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), fontsize=8,
                        rotation=90, va="top", ha="right", color="grey")
        if len(curves) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
