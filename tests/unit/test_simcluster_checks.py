"""tools.simcluster's checks that need no root: the preflight refusals, rate parsing, and
the tc queue on every shaped link."""

import pytest

from tools.lab.simcluster import SimCluster, SimClusterError, preflight, rate_to_bytes_per_s


def test_refuses_when_not_root():
    everything = {t: f"/usr/bin/{t}" for t in ("ip", "tc", "unshare")}
    with pytest.raises(SimClusterError, match="needs root"):
        preflight(euid=1000, which=everything.get)
    with pytest.raises(SimClusterError, match=r"missing: tc \("):
        preflight(euid=0, which={**everything, "tc": None}.get)
    preflight(euid=0, which=everything.get)  # root with every tool: no refusal


def test_rate_parsing():
    assert rate_to_bytes_per_s("1gbit") == 1.25e8
    assert rate_to_bytes_per_s("800mbit") == 1e8
    assert rate_to_bytes_per_s("50mbps") == 5e7
    with pytest.raises(ValueError, match="bad rate"):
        rate_to_bytes_per_s("fast")
    with pytest.raises(ValueError, match="bad rate 'fast'"):
        SimCluster(rate="fast")  # refused before any namespace exists


def test_queue_reaches_every_shaped_link_and_a_bad_one_is_refused(monkeypatch):
    import tools.lab.simcluster as sc
    from tools.lab.cluster import ClusterBench

    calls = []
    monkeypatch.setattr(sc, "_sh", lambda *args, **kw: calls.append(args))
    sc._tbf("ns", "eth0", "300mbit", "262144b", 30.0)
    assert calls[-1][-4:] == ("burst", "262144b", "latency", "30ms")
    assert SimCluster(queue_ms=30).queue_ms == 30 and SimCluster().queue_ms == 100
    with pytest.raises(ValueError, match="queue_ms must be > 0"):
        SimCluster(queue_ms=0)  # refused before any namespace exists
    with pytest.raises(ValueError, match="queue_ms must be > 0"):
        ClusterBench(queue_ms=-1.0)
