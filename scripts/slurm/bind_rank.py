"""Runs a command pinned to this rank's share of the node's CPU cores.

    python scripts/slurm/bind_rank.py COMMAND [ARGS...]

The torchrun templates start every rank through it when ``CPU_BIND=cores`` (the default on
CPU-only nodes): torchrun sets ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; rank ``i`` of ``n`` on a
node gets the ``i``-th of ``n`` contiguous blocks of the physical cores this process may use,
then ``exec``\\s COMMAND with that CPU affinity (inherited by every thread it starts).

Cores are ordered by NUMA node, then by their lowest CPU number, and the hyperthreads of a core
always stay together, so with as many ranks per NUMA node as on every other node each block lies
inside one NUMA node. Memory then comes from that node too: Linux places a page on the node of
the CPU that first touches it, and the offloaded optimizer's state (fp32 master weights and Adam
moments, streamed through once per step by the memory-bandwidth-bound CPU Adam) is first touched
by the rank's own threads. When the cores do not divide evenly, the first ``cores % n`` ranks get
one core more.

Topology comes from sysfs (``/sys/devices/system/node/node*/cpulist`` and each CPU's
``topology/thread_siblings_list``); without it every CPU counts as one core on NUMA node 0.

Prints one line to stderr (``bind_rank: local rank 1 of 2 -> CPUs 4-7``); exits 2 with one line
when the environment is incomplete or there are fewer cores than ranks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SYSFS = Path("/sys/devices/system")


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's list format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def format_cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``"0-3,8"``."""
    ranges: list[str] = []
    cpus = sorted(cpus)
    start = previous = cpus[0]
    for cpu in [*cpus[1:], None]:
        if cpu is not None and cpu == previous + 1:
            previous = cpu
            continue
        ranges.append(str(start) if start == previous else f"{start}-{previous}")
        if cpu is not None:
            start = previous = cpu
    return ",".join(ranges)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def physical_cores(allowed: set[int], sysfs: Path = SYSFS) -> list[list[int]]:
    """The allowed CPUs grouped into physical cores (hyperthread siblings together), ordered by
    NUMA node, then by each core's lowest CPU number."""
    node_of: dict[int, int] = {}
    for cpulist in sysfs.glob("node/node[0-9]*/cpulist"):
        node = int(cpulist.parent.name.removeprefix("node"))
        for cpu in parse_cpu_list(_read(cpulist) or ""):
            node_of[cpu] = node
    cores: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(allowed):
        siblings = _read(sysfs / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list")
        group = sorted((set(parse_cpu_list(siblings or "")) | {cpu}) & allowed)
        cores.setdefault(tuple(group), group)
    return sorted(cores.values(), key=lambda core: (node_of.get(core[0], 0), core[0]))


def cpus_for_rank(local_rank: int, local_world_size: int, cores: list[list[int]]) -> list[int]:
    """The CPUs of block ``local_rank`` of ``local_world_size`` contiguous blocks of ``cores``
    (the first ``len(cores) % local_world_size`` blocks one core larger)."""
    if len(cores) < local_world_size:
        raise ValueError(
            f"{local_world_size} ranks on this node but only {len(cores)} physical core(s) to bind them "
            f"to: start fewer ranks per node (RANKS_PER_NODE) or set CPU_BIND=none"
        )
    base, extra = divmod(len(cores), local_world_size)
    start = local_rank * base + min(local_rank, extra)
    stop = start + base + (1 if local_rank < extra else 0)
    return sorted(cpu for core in cores[start:stop] for cpu in core)


def _local_rank_from_env() -> tuple[int, int]:
    names = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")
    values = [os.environ.get(name, "") for name in names]
    if not all(value.isdigit() for value in values):
        raise ValueError(
            f"LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (torchrun sets them), got "
            f"{', '.join(f'{n}={v!r}' for n, v in zip(names, values, strict=True))}"
        )
    local_rank, local_world_size = (int(value) for value in values)
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK must be in [0, {local_world_size}), got {local_rank}")
    return local_rank, local_world_size


def main(argv: list[str]) -> int:
    if not argv:
        print("bind_rank: usage: bind_rank.py COMMAND [ARGS...]", file=sys.stderr)
        return 2
    try:
        local_rank, local_world_size = _local_rank_from_env()
        cpus = cpus_for_rank(local_rank, local_world_size, physical_cores(os.sched_getaffinity(0)))
    except ValueError as error:
        print(f"bind_rank: {error}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, cpus)
    print(
        f"bind_rank: local rank {local_rank} of {local_world_size} -> CPUs {format_cpu_list(cpus)}",
        file=sys.stderr,
        flush=True,
    )
    os.execvp(argv[0], argv)
    return 127  # not reached: execvp raises OSError if the command cannot be run


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
