"""``configs/eval/``: what ``usp-eval`` scores (passkey retrieval over a length x depth grid,
loss by position), and which model it scores (a usp run directory, or ``model.pretrained``
/ the model group)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .checks import at_least

DEFAULT_DEPTHS = tuple(round(0.1 * i, 1) for i in range(11))  # 0, 0.1, ..., 1.0


@dataclass
class EvalConfig:
    """``eval.*``. ``lengths`` empty: the data's ``seq_len``. ``during_training``: usp-train
    scores the passkey grid at its validations (``passkey_acc/<L>`` in its metrics). ``haystack``: ``auto`` (the
    validation split's text when the data has one, else the protocol's filler),
    ``filler`` or ``text``. ``chat``: the passkey asked in chat form. ``tokenizer``: None (the run's, or the data's), ``bytes``, or a
    tokenizer directory."""

    run_dir: Optional[str] = None  # a usp run directory: its newest checkpoint is scored
    out: Optional[str] = None  # where the outputs go; None: run_dir (else the Hydra dir)
    lengths: list[int] = field(default_factory=list)
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    per_cell: int = 5  # passkey cases per (length, depth) cell
    key_digits: int = 5
    seed: int = 0
    passkey: bool = True
    position_loss: bool = True
    buckets: int = 16  # position buckets of position_loss
    windows: int = 4  # validation windows per length for position_loss
    haystack: str = "auto"
    tokenizer: Optional[str] = None
    # passkey as a conversation: haystack, needle and question the user's turn, the key the
    # assistant's, through the tokenizer's chat template (usp.eval.chat)
    chat: bool = False
    # usp-train: the passkey grid (lengths, depths, per_cell, key_digits, seed, haystack,
    # tokenizer above) scored at every validation (trainer.eval_every and the last step)
    during_training: bool = False

    def __post_init__(self) -> None:
        at_least("eval", 1, per_cell=self.per_cell, key_digits=self.key_digits,
                 buckets=self.buckets, windows=self.windows)
        bad = [d for d in self.depths if not 0.0 <= d <= 1.0]
        if bad:
            raise ValueError(f"eval.depths has {bad} outside [0, 1]: a depth is the needle's "
                             "place in the haystack, 0 the start and 1 the end; e.g. "
                             "eval.depths=[0,0.5,1]")
        if not self.depths:
            raise ValueError("eval.depths is empty; give at least one, e.g. eval.depths=[0.5]")
        short = [n for n in self.lengths if not (isinstance(n, int) and n >= 2)]
        if short:
            raise ValueError(f"eval.lengths has {short}: each length is a whole number of "
                             "tokens >= 2, e.g. eval.lengths=[1024,2048]")
        if self.haystack not in ("auto", "filler", "text"):
            raise ValueError(f"eval.haystack={self.haystack!r}: use auto, filler or text")
