"""An emulated two-node cluster on one machine: each "node" is a network namespace holding its
ranks, the two are joined by a veth pair whose both ends carry a ``tc tbf`` rate limit (the
inter-node link), and ranks of the same node talk over their namespace's loopback (unlimited).
Gloo runs over it unchanged: every rank binds its node's veth address (``GLOO_SOCKET_IFNAME``), so
traffic to a rank of the other node crosses the limited link and traffic inside a node does not.

Root only (``ip netns``, ``ip link``, ``tc``); ``tc netem`` (delay) is not needed and not used:
``tbf`` limits the rate, which is what makes the link the bottleneck. The namespaces are removed on
exit, also after Ctrl-C, SIGTERM or a failed rank (their veth pair goes with them).

Usage::

    python benchmarks/emulated_cluster.py --ranks-per-node 2 --rate-mbit 200 -- SCRIPT [ARGS...]

runs ``python SCRIPT ARGS`` once per rank with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and ``GLOO_SOCKET_IFNAME``
set for the launched process (the library reads none of them for its behaviour: the script passes
them to ``torch.distributed``). Exit status: the first failing rank's, else 0.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import int_in, positive_float, positive_int  # noqa: E402

NODES = 2


def can_emulate() -> str | None:
    """None when this process can build the cluster, else why not (one line)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' command (iproute2) is not installed"
    probe = f"moeprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


class EmulatedCluster:
    """Two namespaces ``<tag>n0`` / ``<tag>n1`` with veths ``<tag>v0`` / ``<tag>v1`` at 10.77.0.1 and
    10.77.0.2 (each namespace is its own network: the addresses collide with nothing), both ends
    limited to ``rate_mbit`` Mbit/s by ``tbf``. A name that exists already is an error (a
    concurrent run), and what this object did not make it never removes."""

    def __init__(self, rate_mbit: float, tag: str | None = None):
        self.rate_mbit = rate_mbit
        self.tag = tag or f"moe{os.getpid() % 100000}"
        self.namespaces = [f"{self.tag}n{i}" for i in range(NODES)]
        self.interfaces = [f"{self.tag}v{i}" for i in range(NODES)]
        self.addresses = [f"10.77.0.{i + 1}" for i in range(NODES)]
        self._made: list[tuple[str, ...]] = []  # what close() removes: only what this object made

    def __enter__(self) -> EmulatedCluster:
        try:
            for ns in self.namespaces:
                _run("ip", "netns", "add", ns)
                self._made.append(("ip", "netns", "del", ns))
            _run("ip", "link", "add", self.interfaces[0], "type", "veth", "peer", "name", self.interfaces[1])
            self._made.append(("ip", "link", "del", self.interfaces[0]))  # gone with its namespace once moved
            # burst: 1 ms at this rate, at least 16 KB (> MTU): a small bucket, so that even small
            # messages see the rate rather than the line speed of an empty bucket
            burst = max(int(self.rate_mbit * 1e6 / 8 / 1000), 16000)
            for ns, dev, address in zip(self.namespaces, self.interfaces, self.addresses, strict=True):
                _run("ip", "link", "set", dev, "netns", ns)
                _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                rate = f"{self.rate_mbit:g}mbit"
                _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "latency", "400ms")  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        while self._made:
            subprocess.run(self._made.pop(), capture_output=True)

    def __exit__(self, *exc) -> None:
        self.close()

    def launch(
        self, argv: list[str], ranks_per_node: int, port: int = 29517, timeout_s: float = 600.0
    ) -> int:
        """Runs ``python argv`` on every rank and waits; kills the others when one fails."""
        world = NODES * ranks_per_node
        procs = []
        try:
            for rank in range(world):
                node, local = divmod(rank, ranks_per_node)
                env = dict(os.environ)
                env.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(world),
                    LOCAL_RANK=str(local),
                    LOCAL_WORLD_SIZE=str(ranks_per_node),
                    MASTER_ADDR=self.addresses[0],
                    MASTER_PORT=str(port),
                    GLOO_SOCKET_IFNAME=self.interfaces[node],
                )
                command = ["ip", "netns", "exec", self.namespaces[node], sys.executable, *argv]
                procs.append(subprocess.Popen(command, env=env, start_new_session=True))
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                if failed:
                    return failed[0]
                if all(c == 0 for c in codes):
                    return 0
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the ranks did not finish within {timeout_s:.0f} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


@contextmanager
def _signals_raise():
    """SIGTERM and SIGHUP raise SystemExit, so the namespaces are removed on the way out."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_on_emulated_cluster(argv: list[str], ranks_per_node: int, rate_mbit: float, **launch_options) -> int:
    """Builds the cluster, runs ``python argv`` on every rank, removes the cluster."""
    with _signals_raise(), EmulatedCluster(rate_mbit) as cluster:
        return cluster.launch(argv, ranks_per_node, **launch_options)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks-per-node", type=positive_int, default=2)
    parser.add_argument(
        "--rate-mbit", type=positive_float, default=200.0, help="inter-node link, each direction"
    )
    parser.add_argument("--port", type=int_in(1, 65535), default=29517)
    parser.add_argument("--timeout", type=positive_float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the script to run after --")
    problem = can_emulate()
    if problem is not None:
        print(f"cannot emulate the cluster: {problem}", file=sys.stderr)
        return 2
    return run_on_emulated_cluster(
        command, args.ranks_per_node, args.rate_mbit, port=args.port, timeout_s=args.timeout
    )


if __name__ == "__main__":
    sys.exit(main())
