"""MetricsLogger with a wandb that fails: the first failing or hanging call prints one warning
and turns wandb off, metrics.jsonl keeps every record, and close() is bounded in time.

A fake ``wandb`` module stands in (``sys.modules``); the real service killed under a real
launch is tests/e2e/test_wandb_preemption.py."""

import json
import sys
import threading
import time
import types

import pytest

from usp.config import LoggingConfig
from usp.train import metrics
from usp.train.metrics import MetricsLogger

CFG = LoggingConfig(wandb="offline", jsonl=True, plot=False, progress=False)


class FakeWandb(types.ModuleType):
    """``wandb`` with one run; ``calls`` lists every call, in order. ``fail`` maps a call
    ("init", "log", "summary", "finish") to the exception it raises (for "log": from the
    second log on); ``hang`` names calls that block until ``release`` is set."""

    def __init__(self, fail=None, hang=()):
        super().__init__("wandb")
        self.fail, self.hang = fail or {}, set(hang)
        self.calls: list[str] = []
        self.release = threading.Event()
        self.summary = types.SimpleNamespace(update=lambda d: self._call("summary"))

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.hang:
            self.release.wait()
        if name in self.fail and not (name == "log" and self.calls.count("log") == 1):
            raise self.fail[name]

    def init(self, **kw):
        self._call("init")
        return self

    def log(self, values: dict, step: int) -> None:
        self._call("log")

    def finish(self) -> None:
        self._call("finish")

    def teardown(self) -> None:
        self._call("teardown")


@pytest.fixture
def fake(monkeypatch, request):
    wandb = FakeWandb(**getattr(request, "param", {}))
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    yield wandb
    wandb.release.set()  # frees a thread left waiting on a hung call


def _warnings(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("warning:")]


def _run(tmp_path, steps=range(1, 6)) -> MetricsLogger:
    logger = MetricsLogger(CFG, tmp_path, rank=0, run_config={})
    for step in steps:
        logger.log({"step": step, "loss": 1.0 / step})
    return logger


def test_a_healthy_wandb_gets_every_call(tmp_path, fake, capsys):
    logger = _run(tmp_path)
    logger.finish({"step": 5})
    logger.close()
    # the service stopped at close, not in wandb's exit hook (on Slurm it may be dead by then)
    assert fake.calls == ["init", *["log"] * 5, "summary", "finish", "teardown"]
    assert _warnings(capsys) == []


@pytest.mark.parametrize("fake", [{"fail": {"log": ConnectionResetError("Connection lost")}}],
                         indirect=True)
def test_a_lost_service_turns_wandb_off_and_the_records_go_on(tmp_path, fake, capsys):
    logger = _run(tmp_path)  # the second log raises
    logger.finish({"step": 5})
    logger.close()
    # wandb let go once (teardown drops its exit hook, finish gives the console back),
    # then nothing more reaches it
    assert fake.calls == ["init", "log", "log", "teardown", "finish"]
    assert [r["step"] for r in logger.records()] == [1, 2, 3, 4, 5]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"step": 5}
    assert _warnings(capsys) == [
        "warning: wandb failed (ConnectionResetError: Connection lost); wandb logging is off "
        "for the rest of this run; metrics.jsonl keeps every metric"]


@pytest.mark.parametrize("fake", [{"fail": {"init": RuntimeError("no service")}},
                                  {"fail": {"summary": BrokenPipeError(32, "Broken pipe")}}],
                         indirect=True)
def test_init_or_summary_failing_warns_once(tmp_path, fake, capsys):
    logger = _run(tmp_path)
    logger.finish({"step": 5})
    logger.close()
    failed = next(iter(fake.fail))
    if failed == "init":  # no run: wandb's service (were one started) let go, nothing else
        assert fake.calls == ["init", "teardown"]
    else:
        assert fake.calls == ["init", *["log"] * 5, "summary", "teardown", "finish"]
    assert [r["step"] for r in logger.records()] == [1, 2, 3, 4, 5]
    (line,) = _warnings(capsys)
    assert type(fake.fail[failed]).__name__ in line


@pytest.mark.parametrize("fake", [{"hang": {"finish"}}], indirect=True)
def test_a_hanging_finish_cannot_hold_the_exit(tmp_path, fake, capsys, monkeypatch):
    monkeypatch.setattr(metrics, "WANDB_WAIT_S", 0.5)
    monkeypatch.setattr(metrics, "WANDB_RELEASE_S", 0.5)
    logger = _run(tmp_path)
    t0 = time.perf_counter()
    logger.close()
    assert time.perf_counter() - t0 < 3.0  # finish 0.5 s, letting go 0.5 s
    assert "teardown" in fake.calls  # wandb's exit hook, which would wait too, is dropped
    (line,) = _warnings(capsys)
    assert line.startswith("warning: wandb failed (no answer in 0.5 s); ")
    logger.close()  # wandb is off: nothing more to wait for
    assert fake.calls == ["init", *["log"] * 5, "finish", "teardown", "finish"]
