"""usp's attention benchmark with DeepSpeed-Ulysses as the peer row (the lab's comparison).

The flags are ``python -m usp.bench.attention``'s, plus ``--no-deepspeed`` (usp rows only);
DeepSpeed comes from the ``bench`` extra and is skipped with a message when missing. Run from
the repository root; under the simulated cluster:

    python -m tools.bench_attention --quick
    python -m tools.bench_attention --layouts 4x1 --a2a-chunks 1,2,4 --seq-len 2048
    sudo python -m tools.simcluster --rate 300mbit -- -m tools.bench_attention --layouts 2x1
"""

from __future__ import annotations

import sys

from tools.lab.deepspeed_ulysses import deepspeed_peer
from usp.bench import attention


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    with_peer = "--no-deepspeed" not in argv
    argv = [a for a in argv if a != "--no-deepspeed"]
    attention.main(argv, peer=deepspeed_peer if with_peer else None)


if __name__ == "__main__":
    main()
