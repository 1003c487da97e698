"""Reading torchrun / SLURM launch environments, and a real torchrun launch."""

import json
import os
import random
import socket
import subprocess
import sys

import pytest

from moetrain import launch
from moetrain.parallel import first_host, read_launch_environment, tasks_per_node
from tests.helpers.dist_utils import free_port
from tests.helpers.paths import ROOT


def test_torchrun_environment():
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
    launch = read_launch_environment(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (5, 8, 1, 4)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("10.0.0.1", 1234, "torchrun")


def test_slurm_environment_one_task_per_gpu():
    env = {
        "SLURM_PROCID": "9",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_TASKS_PER_NODE": "8(x2)",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
    }
    launch = read_launch_environment(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (9, 16, 1, 8)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("gpu07", 29500, "slurm")


@pytest.mark.parametrize(
    "nodelist,host", [("node1", "node1"), ("a[3-5]", "a3"), ("gpu[007,9-12],cpu1", "gpu007"), ("x1,x2", "x1")]
)
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_bad_slurm_values_raise():
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        tasks_per_node("many")
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        first_host("[1-2]")
    assert read_launch_environment({}).launcher == "single"


@pytest.mark.timeout(180)
def test_free_port_is_drawn_below_the_ephemeral_range_and_skips_a_taken_port():
    """The OS's own pick lies in the ephemeral range, where any outgoing connection can take it
    before the store binds it (seen in CI as EADDRINUSE); ``free_port`` draws below that range."""
    low = int(launch.EPHEMERAL_RANGE_FILE.read_text().split()[0])
    assert low > launch.LOWEST_DRAWN_PORT  # the draw below the range is what this machine runs
    first = random.Random(7).randrange(launch.LOWEST_DRAWN_PORT, low)
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", first))
        except OSError:
            pytest.skip(f"port {first} is in use on this machine")
        holder.listen()
        port = launch.free_port(rng=random.Random(7))
    assert launch.LOWEST_DRAWN_PORT <= port < low
    assert port != first
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))
    assert (
        launch.LOWEST_DRAWN_PORT
        <= launch.free_port(below=launch.LOWEST_DRAWN_PORT + 100)
        < launch.LOWEST_DRAWN_PORT + 100
    )


def test_real_torchrun_launch(tmp_path):
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(ROOT / "tests/scripts/torchrun_ep.py"),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(torchrun, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_experts"] for r in reports] == [[0, 1], [2, 3]]
    assert all(
        r["launcher"] == "torchrun" and r["world"] == 2 and r["local_world_size"] == 2 for r in reports
    )


def _failure(exitcode, record=None, message=None, pid=100, timestamp=0):
    from types import SimpleNamespace

    data = {} if record is None else {"message": message, "timestamp": timestamp, "moetrain": record}
    return SimpleNamespace(exitcode=exitcode, error_file_data=data, pid=pid, timestamp=timestamp)


def test_the_launchers_last_line_prefers_a_ranks_own_failure_then_a_killed_rank():
    from moetrain.launch import failure_line

    own = {"exit_code": 2, "time": 5.0, "caused_by_others": False}
    lost = {"exit_code": 1, "time": 1.0, "caused_by_others": True}
    failures = {
        0: _failure(1, lost, "rank 0, step 3, forward: no rank stopped making progress; RuntimeError: ..."),
        1: _failure(2, own, "rank 1, model set-up: ValueError: bad; full traceback in r/logs/rank_1.log"),
    }
    assert failure_line(failures) == (
        "moetrain: error: rank 1, model set-up: ValueError: bad; full traceback in r/logs/rank_1.log",
        2,
    )
    failures = {0: _failure(1, lost, "rank 0, step 3, forward: rank 1 stopped ..."), 1: _failure(-9, pid=42)}
    assert failure_line(failures) == (
        "moetrain: error: rank 1 (pid 42) was killed by signal 9 (SIGKILL); rank 0 said: rank 0, step 3, "
        "forward: rank 1 stopped ...",
        1,
    )
    assert failure_line({0: _failure(3, pid=7)}) == (
        "moetrain: error: rank 0 (pid 7) ended with exit code 3 and no error line of moetrain's",
        3,
    )
    saved = {"exit_code": 75, "time": 1.0, "caused_by_others": False}
    failures = {
        0: _failure(75, saved, "SIGTERM: checkpoint saved at step 8"),
        1: _failure(75, saved, "SIGTERM: ..."),
    }
    assert failure_line(failures) == (
        "moetrain: pre-empted: SIGTERM: checkpoint saved at step 8, stopping",
        75,
    )


def _world_rank_sum(rank, world_size):
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return value.item()


def test_run_distributed_retries_when_the_store_port_is_taken(monkeypatch):
    """The suite's rank launcher: a store port taken before rank 0 binds it (the CI failure of
    2026-11-27) costs a retry on a new port, not the test."""
    from tests.helpers import dist_utils

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        draws = iter([taken])
        monkeypatch.setattr(dist_utils, "free_port", lambda: next(draws, None) or free_port())
        assert dist_utils.run_distributed(_world_rank_sum, 2, timeout=120) == [1.0, 1.0]
        assert next(draws, "spent") == "spent"
