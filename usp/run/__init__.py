"""The run's layout, resolved once: ``RunLayout``.

Before any process group exists, ``resolve_run`` turns the config and the launcher's world
into one frozen ``RunLayout``: dp x ring x ulysses, placement, ranks per node, the
balance (``parallel.balance=auto`` resolved), the all-to-all pipeline stages, device, dtype
and per-rank batch. It runs every rule that needs the world size, the device or the file
system (the config dataclasses check plain values themselves), one message per rule, and
raises ``ValueError`` before anything starts.

The model's ``auto`` keys (its shape from the data's vocabulary or a checkpoint's
config.json) are decided first, by ``model_shape.resolve_model``, where the command line
becomes a typed config (``usp.cli.to_config``): a ``ModelConfig`` holds no ``auto``.

One concept a file: ``model_shape`` (the model's ``auto`` keys), ``run_layout`` (the
``RunLayout`` data), ``preflight`` (the input checks),
``decide`` (balance, degrees, all-to-all stages, the loss chunk and MLP tiles; the accumulation is
``usp.planner.batch``'s), ``resolve`` (the resolver: checks, then decisions, then the
layout). The planner's table of an ``auto`` choice is text of ``usp.planner.report``, said by
the resolver, not held; so is the balance and why.

- Local spawn: the launching process resolves once and hands the layout to every rank.
- torchrun / Slurm (``usp-train``): before any process group rank 0 resolves for the
  launch's world and every other task checks its own config against that layout
  (``check_task``), the verdicts exchanged in the rendezvous store
  (``usp.launch.decide_together``): a layout that cannot fit is refused in a second.
- A library caller inside an existing group: ``resolve_run_group`` lets rank 0 resolve
  (only it runs topology detection for ``auto`` degrees), broadcasts the layout, and every
  task checks what is its own (data files, run directory, kernel on its device).

A run in length phases (``trainer.phases``) is resolved by ``resolve_phases`` into a
``PhasePlan`` (``phases``): a ``RunLayout`` per phase, each from ``resolve_run`` on that
phase's config (``usp.config.phase_config``), its steps and its gate; a run without phases
is ``PhasePlan.single`` of ``resolve_run``'s layout. ``resolve_phases_group`` is its
collective twin, ``check_phase_tasks`` what the other tasks of a torchrun/Slurm launch check.

The mesh, the model and the trainer take the layout; nothing downstream reads the degree,
placement, balance or chunk fields of ``cfg.parallel`` again (``tests/unit/test_run_layout.py``).
"""

from .model_shape import resolve_model
from .decide import (decide_a2a_chunks, decide_balance, decide_degrees, decide_eval_balance,
                     decide_expert_degree)
from .run_layout import RunLayout
from .preflight import (check_degrees_fit, check_hf_model, check_inputs, check_passkey_memory,
                        check_recompute, check_run_dir, check_run_masks, check_task)
from .resolve import resolve_eval, resolve_run, resolve_run_group, scheduler_hosts_notice
from .phases import Phase, PhaseGate, PhasePlan
from .phase_layouts import (check_gate, check_phase_tasks, resolve_phases, resolve_phases_group,
                            tiled_config)
from .worker_args import check_training_args, eval_args, training_args

__all__ = ["Phase", "PhaseGate", "PhasePlan", "RunLayout", "check_degrees_fit", "check_gate",
           "check_hf_model", "check_inputs", "check_passkey_memory", "check_phase_tasks",
           "check_recompute", "check_run_dir", "check_run_masks", "check_task",
           "check_training_args", "decide_a2a_chunks", "decide_balance", "decide_degrees",
           "decide_expert_degree",
           "decide_eval_balance", "eval_args", "resolve_eval", "resolve_model", "resolve_phases",
           "resolve_phases_group", "resolve_run", "resolve_run_group", "scheduler_hosts_notice",
           "tiled_config", "training_args"]
