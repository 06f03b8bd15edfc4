"""What the root-tier tests share: the skip mark for machines without root or the tools a
simulated cluster needs, and the network namespaces that exist (to prove none is left)."""

import os
import shutil
import subprocess

import pytest

needs_root = pytest.mark.skipif(
    os.name != "posix" or os.geteuid() != 0 or shutil.which("ip") is None
    or shutil.which("tc") is None or shutil.which("unshare") is None,
    reason="simcluster needs root and ip/tc/unshare (network namespaces, veth, tc tbf)",
)


def namespaces() -> set[str]:
    """The network namespaces that exist now (``ip netns list``)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}
