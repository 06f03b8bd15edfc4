"""Run a torchrun command on a simulated multi-node cluster on this host (needs root).

Every node is a network namespace with its own host name; nodes talk over veth links
shaped with ``tc tbf`` (``tools.lab.simcluster``). Output lines are prefixed with
``[nodeI]``; the exit code is the worst of the nodes'. Everything is removed on exit,
including on errors, Ctrl-C, SIGTERM and SIGHUP.

    sudo python -m tools.simcluster --nodes 2 --nproc-per-node 2 --rate 1gbit -- \\
        -m usp.cli trainer.steps=3 logging=none parallel.ranks_per_node=null
    sudo python -m tools.simcluster --rate auto -- -m tools.bench_attention --quick

``--rate auto`` measures gloo throughput over loopback first and shapes the inter-node
links to 1/``--ratio`` of it (default 9: the NVLink/InfiniBand ratio of an H100 node,
450 GB/s vs 50 GB/s per GPU).
"""

from __future__ import annotations

import argparse
import signal
import sys

from tools.lab.simcluster import SimCluster, SimClusterError, interrupt_on_signal, preflight


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s [options] -- (-m module | script.py) [args...]")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--rate", default="auto",
                   help="inter-node link rate in tc units (1gbit, 800mbit) or 'auto': "
                        "loopback gloo throughput / --ratio (default)")
    p.add_argument("--ratio", type=float, default=9.0,
                   help="fast/slow ratio for --rate auto (NVLink/IB ~ 9)")
    p.add_argument("--burst", default=None, help="tbf burst (default: rate/250, >= 256 KiB)")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--queue-ms", type=float, default=100.0,
                   help="tbf queue of each shaped link (default 100; 30 avoids the slowdown of "
                        "large two-way exchanges, see SimCluster)")
    p.add_argument("--intra-rate", default=None,
                   help="also shape loopback inside each node (e.g. 9gbit with --rate 1gbit): "
                        "slower links at the same ratio, to match a GPU's compute/comm balance")
    p.add_argument("--timeout", type=float, default=None, help="kill everything after N s")
    if "--" not in argv:
        p.parse_args(argv)  # --help exits here
        p.error("put the command after `--`, e.g. -- -m usp.cli trainer.steps=3")
    split = argv.index("--")
    args, cmd = p.parse_args(argv[:split]), argv[split + 1:]
    if not cmd:
        p.error("no command after `--`")
    return args, cmd


def main(argv=None) -> int:
    args, cmd = parse_args(sys.argv[1:] if argv is None else argv)
    old = {s: signal.signal(s, interrupt_on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        preflight()
        with SimCluster(args.nodes, args.nproc_per_node, args.rate, args.burst, args.ratio,
                        args.mtu, intra_rate=args.intra_rate, queue_ms=args.queue_ms) as cluster:
            result = cluster.run(cmd, timeout=args.timeout)
        print(f"simcluster: node exit codes {result.node_returncodes}, "
              f"{result.seconds:.1f} s", flush=True)
        return result.returncode
    except (SimClusterError, ValueError) as e:
        print(f"simcluster: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("simcluster: interrupted; cleaned up", file=sys.stderr)
        return 130
    finally:
        for s, h in old.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
