"""Faults between ranks end within a bounded time, with one line on every surviving rank naming the
cause: a stopped rank (the watchdog names it in that line, the collective times out after
``dist_timeout_s``, also in an expert-parallel subgroup),
ranks started with different ``ep_size`` or ``steps`` (the start-up check names the key before any
group is built), an occupied rendezvous port under a per-task (srun-style) launch and under the
launcher with its static and its c10d rendezvous."""

from __future__ import annotations

import functools
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.faults.launch import (
    ROOT,
    Rank,
    error_lines,
    finish,
    start_rank,
    start_ranks,
    tiny_config,
    write_config,
)
from tests.helpers.dist_utils import free_port


def _survivor_after_stopping(procs: list[Rank], stopped: int, out_dir, timeout: float):
    """Stops rank ``stopped`` of two (SIGSTOP) once the run has logged 3 steps and the watchdogs
    have published a training step (steps take milliseconds: 2 s more), waits for the other rank
    to end; ``(its exit code, its stderr, seconds from the stop to its end)``."""
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.1)
    time.sleep(2)
    procs[stopped].send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        code, err = finish([procs[1 - stopped]], timeout=timeout)[0]
        return code, err, time.monotonic() - stopped_at
    finally:
        procs[stopped].kill()
        procs[stopped].communicate()


@pytest.mark.timeout(60)
def test_a_stopped_rank_is_named_and_the_others_end_within_the_timeout(tmp_path):
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, dist_timeout_s=6))
    code, err, elapsed = _survivor_after_stopping(start_ranks([config, config]), 1, out_dir, timeout=30)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("moetrain: error: rank 0, step "), lines
    # the cause, at the step the run reached (the heartbeat's own step, often older, beside it)
    assert re.search(r": rank 1 stopped making progress at step \d+[, ]", lines[0]), lines
    assert "stopped or gone: rank 1 (last heard" in err, err  # the watchdog's line
    assert elapsed < 6 + 10, elapsed  # the timeout, plus start-up slack


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_rank_stopped_inside_an_expert_parallel_exchange_ends_the_others_within_the_timeout(tmp_path):
    """Rank 1 stops as its MoE layer's forward of step 3 begins, so rank 0 waits in the exchange of
    the expert-parallel group (a subgroup, not the world): the subgroups get ``dist_timeout_s`` too."""
    settings = {"steps": 100, "dist_timeout_s": 6, "parallel.ep_size": 2}
    config = write_config(tmp_path, tiny_config(tmp_path / "run", **settings))
    procs = start_ranks([config, config], faults={1: "stop-in-moe@3"})
    try:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and not _is_stopped(procs[1].pid):
            time.sleep(0.05)
        assert _is_stopped(procs[1].pid), "rank 1 did not reach step 3"
        stopped_at = time.monotonic()
        code, err = finish(procs[:1], timeout=30)[0]
        elapsed = time.monotonic() - stopped_at
    finally:
        procs[1].kill()
        procs[1].communicate()
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    where = "moetrain: error: rank 0, step 3, forward of module blocks.0.ffn (MoELayer): "
    assert lines[0].startswith(where), lines
    assert "rank 1 stopped making progress at step 3, forward (last heard" in lines[0], lines
    assert elapsed < 6 + 10, elapsed  # dist_timeout_s, plus slack; torch's default would be 30 min


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (state T in /proc)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize("key,values", [("parallel.ep_size", (2, 1)), ("steps", (4, 5))])
@pytest.mark.timeout(60)
def test_ranks_started_differently_fail_fast_naming_the_key(tmp_path, key, values):
    configs = [
        write_config(tmp_path, tiny_config(tmp_path / "run", **{key: value}), f"rank{rank}.json")
        for rank, value in enumerate(values)
    ]
    start = time.monotonic()
    results = finish(start_ranks(configs), timeout=40)
    assert time.monotonic() - start < 30
    for rank, (code, err) in enumerate(results):
        lines = error_lines(err)
        assert code == 2 and len(lines) == 1, err
        assert (
            f"the ranks were started with different settings: {key} = {values[1]!r} on rank 1, " in lines[0]
        )
        assert f"{values[0]!r} on rank 0" in lines[0]
        assert lines[0].startswith(f"moetrain: error: rank {rank}, start-up checks:"), lines
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(60)
def test_an_occupied_rendezvous_port_is_named_on_every_rank(tmp_path):
    port = free_port()
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("0.0.0.0", port))
    squatter.listen()
    try:
        config = write_config(tmp_path, tiny_config(tmp_path / "run", dist_timeout_s=4))
        start = time.monotonic()
        results = finish(start_ranks([config, config], port=port), timeout=40)
        elapsed = time.monotonic() - start
    finally:
        squatter.close()
    (code0, err0), (code1, err1) = results
    assert code0 == 1 and error_lines(err0) == [
        "moetrain: error: rank 0, process-group set-up: RendezvousError: rank 0 cannot serve the rendezvous "
        f"on port {port}: the port is already in use (another job?): choose a free MASTER_PORT"
    ], err0
    assert code1 == 1 and len(error_lines(err1)) == 1, err1
    assert f"rank 1 could not reach the rendezvous at 127.0.0.1:{port} within 4 s" in err1
    assert elapsed < 25


@pytest.mark.parametrize(
    "rendezvous",
    [
        pytest.param(("--master-port", "{port}"), id="static"),  # torchrun's static rendezvous
        pytest.param(  # the SLURM templates' rendezvous
            ("--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:{port}"), id="c10d", marks=pytest.mark.slow
        ),
    ],
)
@pytest.mark.timeout(60)
def test_an_occupied_rendezvous_port_under_the_torchrun_launcher_is_one_line(tmp_path, rendezvous):
    port = free_port()
    squatter = socket.socket()  # listens, never answers: torchrun's c10d client would wait forever
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("0.0.0.0", port))
    squatter.listen()
    config = write_config(tmp_path, tiny_config(tmp_path / "run"))
    command = [
        sys.executable, "-m", "moetrain.cli", "launch", "--nproc-per-node", "2",
        *(arg.format(port=port) for arg in rendezvous),
        "-m", "moetrain.cli", "train", "--config", str(config),
    ]  # fmt: skip
    try:
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=50)
    finally:
        squatter.close()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "moetrain: the launcher could not start the rendezvous: the rendezvous port is already in use "
        "(another job?): choose a free --master-port / --rdzv-endpoint port"
    )
    assert not (tmp_path / "run").exists()  # no rank was started


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_c10d_rendezvous_store_already_on_the_port_is_joined(tmp_path):
    """A second launcher of the same job on the endpoint's host finds the port taken by the first
    one's store: it joins it (torchrun's own fallback) instead of failing."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=30))
    C10dRendezvousBackend(store, "probe")  # the first launcher's rendezvous of this job (--rdzv-id)
    command = [
        sys.executable, "-m", "moetrain.cli", "launch", "--nnodes", "1", "--nproc-per-node", "1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=probe", "--no-python",
        sys.executable, "-c", "import os; print('rank', os.environ['RANK'])",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert result.returncode == 0 and "rank 0" in result.stdout, result.stderr
    assert store.num_keys() > 0  # the rendezvous went through this store


@pytest.mark.timeout(90)
def test_a_stopped_rank_serving_the_store_is_named_and_the_others_end(tmp_path):
    """Rank 0 serves the rendezvous store (per-task launch) and is stopped: a store client's calls
    then wait forever whatever the store's timeout, so the watchdog's own calls have a deadline
    and the survivor still ends after ``dist_timeout_s``, its line naming the store and rank 0."""
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, dist_timeout_s=12))
    code, err, elapsed = _survivor_after_stopping(start_ranks([config, config]), 0, out_dir, timeout=40)
    lines = error_lines(err)
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("moetrain: error: rank 1, step "), lines
    assert (
        "the rendezvous store did not answer within 5 s: rank 0, which serves it, is stopped or gone"
        in (lines[0])
    ), lines
    assert elapsed < 12 + 20, elapsed  # the timeout, plus the watchdog's store deadlines and slack


def _wait_for_rank_0_before_the_checkpoint_group(rank_0_pid: int, wait_s: float) -> None:
    """Rank 1's ``prepare``: its checkpoint writer builds its gloo group only once rank 0 has ended
    (its process gone or a zombie), or after ``wait_s`` seconds."""
    import moetrain.engine.setup as setup

    def until_rank_0_has_ended():
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{rank_0_pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return
            except FileNotFoundError:
                return
            time.sleep(0.2)

    built = setup.CheckpointWriter
    setup.CheckpointWriter = lambda *args, **kwargs: (until_rank_0_has_ended(), built(*args, **kwargs))[1]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_rank_waiting_in_a_store_call_is_not_taken_for_a_silent_one(tmp_path):
    """Rank 1 is slow to reach a new group, so rank 0 waits in the group's rendezvous (a ``get`` on
    the store) and times out. Rank 0 kept beating meanwhile (the watchdog's own store connection:
    on the groups' connection its heartbeats waited behind that ``get``), so rank 1, failing later,
    does not blame rank 0 for stopping. Rank 1 builds the group once rank 0 has ended (the store
    gone with it): after a fixed 12 s, gloo's connect to a rank 0 that had given up the group but
    still kept the store sometimes waited four times ``dist_timeout_s`` (a 60 s test in 3 runs of 10)."""
    config = write_config(tmp_path, tiny_config(tmp_path / "run", steps=5, dist_timeout_s=8))
    port = free_port()
    rank_0 = start_rank(config, 0, 2, port)
    waiting = functools.partial(_wait_for_rank_0_before_the_checkpoint_group, rank_0.pid, 60)
    (code0, err0), (code1, err1) = finish(
        [rank_0, start_rank(config, 1, 2, port, prepare=waiting)], timeout=90
    )
    for code, err in ((code0, err0), (code1, err1)):
        assert code == 1 and len(error_lines(err)) == 1, err
    assert error_lines(err0)[0].startswith("moetrain: error: rank 0, model set-up: "), err0
    assert "rank 0 stopped making progress" not in err1 and "rank 0 (last heard" not in err1, err1
