"""The project's lab: what usp runs to prove itself, not installed with usp.

Commands run from the repository root as ``python -m tools.<name> ...``; their logic is in
``tools.lab`` (simulated cluster, fault campaign, peers, sweeps, the cluster benchmark).
``tools`` imports usp; usp never imports ``tools``.
"""
