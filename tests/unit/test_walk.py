"""One path, read forward: the walk from a console script (``usp.cli.train_main``,
``eval_main``, ``plan_main``) to what the ranks run reads as parse (``usp.cli``), resolve
(``usp.run``), launch (``usp.launch.job``), train (the worker, ``usp.train.phase_runner.train``),
and never re-enters a usp module it left: nothing below the CLI calls back up into it.

Every Python call of a command run in this process is traced (``sys.setprofile``), the
launcher's spawn replaced by a recorder (no process starts). At each call into a usp module,
the usp modules on the call stack must not already hold it below another one: a callback
A -> B -> A is named with its stack. Frames of other packages (Hydra calling the app, the
standard library) pass through: the walk is usp's own modules."""

from __future__ import annotations

import sys

import pytest
from hydra.core.global_hydra import GlobalHydra

import usp.cli as cli
import usp.eval.command  # noqa: F401 -- imported before the trace, as the commands import it
import usp.launch.job
import usp.train.command  # noqa: F401
from usp.run import PhasePlan, RunLayout
from usp.train.phase_runner import train

from _eval_runs import byte_corpus


def _usp(frame) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if name == "usp" or name.startswith("usp.") else None


def trace(fn) -> tuple[list[str], list[str]]:
    """Run ``fn()`` under the profiler: (the usp modules in the order the walk first entered
    them, the callbacks: each the stack of usp modules that came back to one it had left,
    then the function called)."""
    stack: list[str | None] = []  # the module of every Python frame entered since the start
    order: list[str] = []
    back: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            mod = _usp(frame)
            if mod is not None:
                below = [m for m in stack if m is not None]
                if below and below[-1] != mod and mod in below:
                    runs = [m for i, m in enumerate(below) if i == 0 or below[i - 1] != m]
                    back.append(" -> ".join(runs + [mod]) + f" ({frame.f_code.co_name})")
                if mod not in order:
                    order.append(mod)
            stack.append(mod)
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return order, back


@pytest.fixture
def command(monkeypatch, tmp_path):
    """``command(entry, *overrides)``: run the console script ``usp.cli.<entry>`` on the
    overrides (Hydra's folder and logging kept in ``tmp_path``) under ``trace``; returns
    (its exit status, the modules in order, the callbacks, the spawns: (worker, args)
    each)."""
    spawned = []

    def spawn(worker, nprocs, *args, **kwargs):  # the launcher's local spawn, recorded
        spawned.append((worker, args))
        return 0

    monkeypatch.setattr(usp.launch.job, "run_local", spawn)

    def run(entry, *overrides):
        monkeypatch.setattr(sys, "argv", [entry, f"hydra.run.dir={tmp_path / 'hydra'}",
                                          "hydra/job_logging=disabled",
                                          "hydra/hydra_logging=disabled", *overrides])
        status = [0]

        def main():
            try:
                getattr(cli, entry)()
            except SystemExit as e:
                status[0] = e.code
            finally:
                GlobalHydra.instance().clear()

        order, back = trace(main)
        return status[0], order, back, spawned
    return run


def test_usp_train_walks_parse_resolve_launch_train_without_coming_back(command, tmp_path):
    status, order, back, spawned = command("train_main", f"trainer.run_dir={tmp_path / 'run'}")
    assert status == 0
    assert not back, "calls back up:\n" + "\n".join(back)
    [(worker, (cfg, plan))] = spawned  # every rank runs train(plan.cfg, plan)
    assert worker is train and isinstance(plan, PhasePlan) and cfg is plan.cfg
    assert order[0] == "usp.cli"
    # parse (the model's auto keys the resolver's), the launcher, which asks the resolver
    assert (order.index("usp.run.model_shape") < order.index("usp.launch.job")
            < order.index("usp.run.resolve"))


def test_a_refused_usp_train_walks_the_same_path(command, tmp_path):
    status, order, back, spawned = command("train_main", "parallel.ulysses_degree=3",
                                           f"trainer.run_dir={tmp_path / 'run'}")
    assert status == 2 and spawned == []
    assert not back, "calls back up:\n" + "\n".join(back)
    assert "usp.run.resolve" in order


def test_usp_eval_walks_the_same_launcher(command, tmp_path):
    corpus = byte_corpus(tmp_path / "bytes")
    status, order, back, spawned = command(
        "eval_main", "data=memmap", f"data.path={corpus}", "data.seq_len=128",
        "model.vocab_size=auto", "eval.lengths=[128]", "eval.depths=[0.5]", "eval.per_cell=1",
        "eval.key_digits=3", "eval.windows=2", f"eval.out={tmp_path / 'out'}")
    assert status == 0
    assert not back, "calls back up:\n" + "\n".join(back)
    [(worker, (job, run))] = spawned
    assert worker.__module__ == "usp.eval.command" and isinstance(run, RunLayout)


def test_usp_plan_walks_parse_then_the_planner(command):
    status, order, back, spawned = command("plan_main", "model=llama3_8b", "cluster=h100_ib",
                                           "nodes=4", "data.seq_len=1048576")
    assert status == 0 and spawned == []
    assert not back, "calls back up:\n" + "\n".join(back)
    assert "usp.run.model_shape" in order and "usp.planner.report" in order


def _module(name: str, source: str) -> dict:
    """The globals of a module named ``name`` holding ``source``'s functions."""
    space = {"__name__": name}
    exec(source, space)
    return space


def test_the_trace_sees_a_callback():
    """The checker must be able to fail: A calls B with one of A's functions, which B
    calls (A -> B -> A), as the console script handing its app to Hydra's runner did."""
    a = _module("usp.fake_cli", "def app():\n    return 1\n"
                                "def main():\n    return runner(app) + runner(len)\n")
    b = _module("usp.fake_app", "def runner(task):\n    return task() if task is not len "
                                "else 0\n")
    a["runner"] = b["runner"]
    order, back = trace(a["main"])
    assert order == ["usp.fake_cli", "usp.fake_app"]
    assert back == ["usp.fake_cli -> usp.fake_app -> usp.fake_cli (app)"]
    order, back = trace(lambda: b["runner"](len))  # called and returned: no callback
    assert not back, "calls back up:\n" + "\n".join(back)
