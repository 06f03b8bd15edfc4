"""Imported by the forkserver alone (``usp.launch.starter.PRELOAD``), before it serves:
the server ignores the signals a job's processes get together (``JOB_SIGNALS``), so that a
signal meant for the ranks leaves it alive to report their exit codes to the launcher. Its
ranks take the default handlers back as they start (``starter._adopt``). Nothing else
imports this module."""

import signal

from .starter import server_ignores

_IGNORED = {sig: signal.signal(sig, signal.SIG_IGN) for sig in server_ignores()}
