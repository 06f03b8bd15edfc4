"""The runner of length phases around plain trainers (``usp.train.phase_runner``): the trainer,
its step and its checkpoints know no phases, read from their source; the position a
checkpoint records for the run and what the runner makes of a phase's end. A trainer driven
alone by a stop of its own: ``tests/distributed/test_trainer_stop_ranks.py``; runs of
phases: ``tests/distributed/test_phases_ranks.py``."""

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest

import usp.train.checkpointer
import usp.train.trainer
from usp.config import RunConfig
from usp.run import RunLayout
from usp.run.phases import Phase, PhaseGate, PhasePlan
from usp.train.checkpointer import Position
from usp.train.phase_runner import PhasePosition, PhaseStop

# words of the runner's vocabulary that a trainer, its step and its checkpoints never use
PHASE_WORDS = {"phase", "phases", "plan", "until", "gate", "reference", "starts"}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree``'s module, classes and functions."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _words(name: str) -> set[str]:
    """``PhasePlan`` -> {phase, plan}; ``phase_end`` -> {phase, end}."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {w.lower() for w in re.split(r"[_\W]+", spaced) if w}


def _phase_words(module) -> dict[str, int]:
    """Each identifier, attribute, argument, keyword, import and string (docstrings and
    comments aside) of ``module``'s source that says a word of ``PHASE_WORDS``, with its
    line."""
    tree = ast.parse(Path(module.__file__).read_text())
    skip = _docstrings(tree)
    found = {}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name, node.asname or ""]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in skip):
            names = [node.value]
        for name in names:
            if _words(name) & PHASE_WORDS:
                found[name] = getattr(node, "lineno", 0)
    return found


@pytest.mark.parametrize("module", [usp.train.trainer, usp.train.checkpointer],
                         ids=lambda m: m.__name__)
def test_the_trainer_and_its_checkpoints_know_no_phases(module):
    """``Trainer`` (its ``loop``, ``train_step``, ``forward_backward``), ``Stop``, ``Leg``,
    ``Checkpointer`` and ``Position``: no name, import or string of theirs says phase, plan,
    until, gate, reference or starts; the runner tells a trainer what it needs."""
    assert _phase_words(module) == {}


def test_the_source_check_finds_what_it_looks_for():
    import usp.train.phase_runner

    found = _phase_words(usp.train.phase_runner)
    assert {"PhasePlan", "phase_end", "until", "reference_val_loss"} <= set(found)


def _stop(*steps: int, at: PhasePosition = PhasePosition(), gate=None) -> PhaseStop:
    """Phase ``at.phase`` of a plan of phases of ``steps`` steps each, at 64 x 2**k tokens,
    the phase run from ``at`` under ``gate``."""
    cfg = RunConfig()
    run = RunLayout(world=1, dp=1, ring=1, ulysses=1, placement="ulysses_inner",
                    ranks_per_node=None, balance="zigzag", kernel="torch", ring_impl="usp",
                    a2a_chunks=1, device="cpu", dtype="fp32", seq_len=64, batch_per_dp_rank=8)
    plan = PhasePlan(tuple(Phase(k, cfg, replace(run, seq_len=64 * 2 ** k), n,
                                 until=gate if k == at.phase else None)
                           for k, n in enumerate(steps)))
    return PhaseStop(plan, at)


def test_a_phases_end_hands_on_the_next_phases_position():
    """At the first phase's end (step 4, 32 samples of 64 tokens): its final validation loss
    becomes the reference, and the checkpoint records the next phase's position, nothing
    consumed and no global batch of its own yet; a step inside the phase records its own."""
    stop = _stop(4, 3)
    assert not stop.final and stop.labels({}, early=False) == {"phase_end": "steps"}
    inside = stop.record({"val_loss": 2.0}, Position(3, 24, 1), ends=False)
    assert inside == {"skipped_steps": 1, "consumed": 24, "phase": 0, "starts": [0],
                      "tokens_before": 0, "reference_val_loss": None}
    end = stop.after({"val_loss": 2.5}, Position(4, 32, 1), ends=True)
    assert end == PhasePosition(4, 0, 1, 1, (0, 4), 32 * 64, 2.5)
    assert stop.record({"val_loss": 2.5}, Position(4, 32, 1), ends=True) == {
        "skipped_steps": 1, "consumed": 0, "phase": 1, "starts": [0, 4],
        "tokens_before": 32 * 64, "reference_val_loss": 2.5, "global_batch": None}


def test_the_last_phase_keeps_its_position_and_a_run_without_phases_no_label():
    last = _stop(4, 3, at=PhasePosition(4, 0, 0, 1, (0, 4), 2048, 2.5))
    assert last.final
    assert last.after({}, Position(7, 24, 0), ends=True) == PhasePosition(
        7, 24, 0, 1, (0, 4), 2048, 2.5)
    one = _stop(30)
    assert one.final and one.labels({}, early=False) == {}
    # its last step records its final validation loss, as the first phase's always did
    assert one.record({"val_loss": 1.5}, Position(30, 240, 0), ends=True)[
        "reference_val_loss"] == 1.5


def test_the_gate_reads_the_phases_length_and_the_first_phases_loss():
    gate = PhaseGate(passkey_acc=0.9, val_loss_within=0.1)
    stop = _stop(4, 3, at=PhasePosition(4, 0, 0, 1, (0, 4), 2048, 2.0), gate=gate)
    assert stop.holds(6, {"passkey_acc/128": 0.95, "short_val_loss": 2.1})
    assert not stop.holds(6, {"passkey_acc/64": 1.0, "passkey_acc/128": 0.5,
                              "short_val_loss": 2.1})
    assert not stop.holds(6, {"passkey_acc/128": 1.0, "short_val_loss": 2.3})
    assert stop.labels({}, early=True) == {"phase_end": "gate"}
    assert not _stop(4, 3).holds(2, {"passkey_acc/64": 1.0})  # no gate: never early
