"""The slurm tier's cluster: a real slurmctld and two slurmd in network namespaces
(``tools.lab.slurmcluster``), one per test module; every test in it is skipped, with the
reason, where root or slurm-wlm/munge is missing."""

import signal

import pytest

from tools.lab.simcluster import interrupt_on_signal
from tools.lab.slurmcluster import SlurmCluster, SlurmClusterError, preflight


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A 2-node cluster (8 CPUs each), torn down after the module, on failure and on
    SIGTERM/SIGHUP (raised as KeyboardInterrupt, as in ``tools.slurmcluster``)."""
    try:
        preflight()
    except SlurmClusterError as e:
        pytest.skip(f"tier slurm: {e}")
    old = {s: signal.signal(s, interrupt_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with SlurmCluster(nodes=2, workdir=tmp_path_factory.mktemp("slurm")) as cluster:
            yield cluster
    finally:
        for s, h in old.items():
            signal.signal(s, h)
