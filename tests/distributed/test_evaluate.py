"""Held-out evaluation (``usp.eval.val_loss.held_out_accuracy``) on the real data path across ranks.

The models are oracles: the recall task puts every answer right after its query, so
predicting the next token of the global sequence (gathered over the SP group) answers
perfectly. Each oracle answers only the sequences its rule allows, so the accuracy
``evaluate`` reports shows which sequences it scored and how it counted them.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp.config import RecallData, ModelConfig, TrainerConfig
from usp.data.synthetic import BOS
from usp.launch import spawn_local
from usp.layout import SequenceLayout
from usp.mesh import SPMesh
from usp.data.dataset import build_dataset
from usp.config import RunConfig
from usp.data.batches import RowLayouts
from usp.eval.val_loss import held_out_accuracy

EVAL_BATCHES = 3
LAYOUTS = [(1, 2, 2), (2, 1, 2)]  # (dp, ulysses, ring) on 4 ranks


class Oracle(torch.nn.Module):
    """Predicts the next global token on the sequences ``rule(call, rows)`` allows ([B] bool,
    ``rows`` the full [B, L] sequences) and BOS, never an answer, on the others."""

    def __init__(self, layout: SequenceLayout, vocab: int, rule):
        super().__init__()
        self.layout, self.vocab, self.rule = layout, vocab, rule
        self.calls, self.modes = 0, []

    def forward(self, tokens, positions):
        self.modes.append(self.training)
        rows = self.layout.gather(tokens)  # [B, L/P] -> [B, L]
        following = torch.roll(rows, -1, dims=1)[:, positions]  # token at p + 1: [B, L/P]
        right = self.rule(self.calls, rows)  # [B]
        self.calls += 1
        pred = torch.where(right[:, None], following, torch.full_like(following, BOS))
        return F.one_hot(pred, self.vocab).float()  # [B, L/P, V]


def _key(row: torch.Tensor) -> bytes:
    return row.numpy().tobytes()


def _worker():
    cfg = RunConfig(model=ModelConfig(vocab_size=320, dim=64, n_heads=4, n_kv_heads=2),
                    data=RecallData(seq_len=128, batch_per_dp_rank=2, eval_batches=EVAL_BATCHES),
                    trainer=TrainerConfig(steps=16))
    data = build_dataset(cfg.data, cfg.model)
    cpu = torch.device("cpu")
    for dp, u, r in LAYOUTS:
        with SPMesh.build(ulysses=u, ring=r, dp=dp) as mesh:
            layout = SequenceLayout(mesh, seq_len=cfg.data.seq_len)
            layouts = RowLayouts(mesh, cfg.data.seq_len, "zigzag", cpu)
            # every sequence a training step draws, on any dp replica (full rows: no positions)
            trained = {_key(row) for step in range(cfg.trainer.steps) for d in range(dp)
                       for row in data.batch(step, cfg.data.batch_per_dp_rank, d, dp, None)[0]}
            seen: set[bytes] = set()

            def fresh(call, rows):  # right on a sequence neither trained on nor scored before
                keys = [_key(row) for row in rows]
                ok = torch.tensor([k not in trained and k not in seen for k in keys])
                seen.update(keys)
                return ok

            def score(rule):
                model = Oracle(layout, cfg.model.vocab_size, rule)
                acc = held_out_accuracy(model, data, cfg.data.batch_per_dp_rank, mesh, layouts)
                assert model.modes == [False] * EVAL_BATCHES and model.training, model.modes
                return acc

            where = f"dp={dp} ulysses={u} ring={r}"
            assert score(fresh) == 1.0, where
            assert score(lambda call, rows: torch.zeros(len(rows), dtype=torch.bool)) == 0.0, where
            first = score(lambda call, rows: torch.full((len(rows),), call == 0))
            assert abs(first - 1 / EVAL_BATCHES) < 1e-12, (where, first)
            # the rule tells training sequences apart: fresh's 1.0 is not vacuous
            train_rows = data.batch(0, cfg.data.batch_per_dp_rank, mesh.dp_rank, dp, None)[0]
            assert not fresh(0, train_rows).any(), where
            dist.barrier()


def test_evaluate_scores_held_out_batches_exactly():
    spawn_local(_worker, 4)
