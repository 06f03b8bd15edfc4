"""``curves.png``: a run's metrics against step (``Metrics.plot`` writes it)."""

from __future__ import annotations

from pathlib import Path


def curves_png(records: list[dict], path: Path) -> Path | None:
    """Loss and answer accuracy against step, as ``path``; None without a training step."""
    recs = [r for r in records if "loss" in r]  # not step 0's validation alone
    if not recs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in recs]
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    for a, b in zip(recs, recs[1:]):  # the phase boundaries (trainer.phases)
        if a.get("phase") != b.get("phase"):
            for axis in ax:
                axis.axvline(a["step"] + 0.5, color="grey", linestyle=":", linewidth=1)
    ax[0].plot(steps, [r["loss"] for r in recs])
    ax[0].set(xlabel="step", ylabel="loss (answer tokens)" if "acc" in recs[0] else "loss",
              yscale="log", title="training loss")
    if "acc" in recs[0]:
        ax[1].plot(steps, [r["acc"] for r in recs])
        ax[1].set(xlabel="step", ylabel="answer accuracy", ylim=(0, 1.02),
                  title="long-range answer accuracy")
    else:
        ax[1].plot(steps, [r["tokens_per_s"] for r in recs])
        ax[1].set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
