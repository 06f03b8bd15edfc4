"""Faults in the training loop, the pure rules (usp.train.faults): the non-finite guard's
stop and skip modes, and the preemption handler. The training loop on ranks:
``distributed/test_faults_trainer_ranks.py``."""

import math
import os
import signal

import pytest

from usp.train.faults import NonFiniteError, NonFiniteGuard, Preemption


def test_guard_stop_names_step_and_value():
    guard = NonFiniteGuard("stop")
    assert guard.check(1, 2.5, 0.3) is False
    with pytest.raises(NonFiniteError, match=r"non-finite grad norm \(nan\) at step 7"):
        guard.check(7, 2.5, math.nan)
    with pytest.raises(NonFiniteError, match=r"non-finite loss \(inf\) at step 8"):
        guard.check(8, math.inf, math.nan)  # the loss is named first


def test_guard_skip_counts_and_stops_after_consecutive_skips():
    guard = NonFiniteGuard("skip", max_consecutive=3)
    assert [guard.check(s, v, 1.0) for s, v in ((1, math.nan), (2, 1.0), (3, math.inf))] \
        == [True, False, True]
    assert guard.skipped == 2
    assert guard.check(4, math.nan, 1.0) is True  # 2 in a row
    with pytest.raises(NonFiniteError, match=r"at step 5 \(3 consecutive"):
        guard.check(5, math.nan, 1.0)


def test_guard_refuses_unknown_mode():
    with pytest.raises(ValueError, match="on_nonfinite='ignore' is not one of stop, skip"):
        NonFiniteGuard("ignore")


def test_preemption_handler_only_records_and_is_restored():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with Preemption("SIGTERM,SIGUSR1") as p:
            assert not p.requested
            os.kill(os.getpid(), signal.SIGUSR1)
            assert p.received == signal.SIGUSR1 and p.requested
            assert seen == []  # the previous handler is replaced, not chained
        os.kill(os.getpid(), signal.SIGUSR1)  # back to the previous handler
        assert seen == [signal.SIGUSR1]
        assert Preemption("").signals == []  # "" = off
    finally:
        signal.signal(signal.SIGUSR1, previous)
