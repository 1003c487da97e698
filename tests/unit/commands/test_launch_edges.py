"""Edges of ``moetrain launch`` and of what a rank reads at start: bad torchrun arguments, a rank's own
exit code, odd pids in a run lock, bad launch environment variables and SLURM node lists."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from moetrain.cli import main
from moetrain.failures import EXIT_BAD_INPUT, EXIT_RUN_FAILED
from moetrain.launch import argument_problem, failure_line
from moetrain.parallel import first_host, read_launch_environment
from moetrain.run_dir import LOCK_NAME, RunLock


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--nproc-per-node", "abc", "x.py"], "--nproc-per-node"),
        (["--nproc-per-node", "0", "x.py"], "--nproc-per-node"),
        (["--nproc-per-node", "-2", "x.py"], "--nproc-per-node"),
        (["--nnodes", "0", "--nproc-per-node", "1", "x.py"], "--nnodes"),
        (["--nnodes", "2:1", "--nproc-per-node", "1", "x.py"], "--nnodes"),
    ],
)
def test_bad_torchrun_arguments_are_one_line_naming_the_flag(argv, flag):
    problem = argument_problem(argv)
    assert problem is not None and problem.startswith(f"{flag} must be") and "\n" not in problem
    assert argument_problem(["--nproc-per-node", "1", "--nnodes", "1:2", "x.py"]) is None


def test_launch_with_bad_nproc_per_node_exits_2_with_one_line(tmp_path, capsys):
    code = main(["launch", "--log-dir", str(tmp_path), "--nproc-per-node", "0", str(tmp_path / "x.py")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT
    assert len(err) == 1 and err[0].startswith("moetrain: error: --nproc-per-node must be")


@pytest.mark.parametrize("exitcode,expected", [(2, 2), (255, 255), (256, EXIT_RUN_FAILED)])
def test_a_rank_without_a_report_passes_on_its_exit_code(tmp_path, exitcode, expected):
    failure = ProcessFailure(local_rank=0, pid=123, exitcode=exitcode, error_file=str(tmp_path / "none.json"))
    line, code = failure_line({0: failure})
    assert code == expected
    assert f"exit code {exitcode}" in line


def _lock_with_pid(tmp_path, pid, age: float) -> RunLock:
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": 0}))
    then = time.time() - age
    os.utime(path, (then, then))
    return RunLock(tmp_path)


@pytest.mark.parametrize("pid", [2**64, -1, 0, "12", None])
def test_a_lock_with_an_impossible_pid_is_unreadable_and_taken_over(tmp_path, pid):
    lock = _lock_with_pid(tmp_path, pid, age=10)
    lock.acquire()
    try:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        lock.release()


def test_a_fresh_lock_with_a_huge_pid_is_refused_naming_the_lock(tmp_path):
    lock = _lock_with_pid(tmp_path, 2**64, age=0)
    with pytest.raises(ValueError, match=f"in use by another run .*lock {tmp_path / LOCK_NAME}"):
        lock.acquire()


@pytest.mark.parametrize(
    "env,message",
    [
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1", "MASTER_PORT": "auto"},
            "MASTER_PORT must be an integer in 1..65535, got 'auto'",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"},
            "MASTER_PORT must be an integer in 1..65535",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2x"}, "WORLD_SIZE must be an integer >= 1, got '2x'"),
        ({"RANK": "3", "WORLD_SIZE": "2"}, r"RANK must be an integer in 0..1 \(WORLD_SIZE=2\), got '3'"),
        ({"RANK": "-1", "WORLD_SIZE": "0"}, "WORLD_SIZE must be an integer >= 1, got '0'"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK must be an integer in 0..1"),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "2"}, "SLURM_PROCID must be an integer in 0..1"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "x"}, "LOCAL_RANK must be an integer >= 0"),
    ],
)
def test_bad_launch_variables_are_one_line_naming_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        read_launch_environment(env)


@pytest.mark.parametrize(
    "nodelist,host",
    [
        ("rack[1-2]-node[01-04]", "rack1-node01"),
        ("node[01-04]-ib", "node01-ib"),
        ("node[01-04]-ib,cpu1", "node01-ib"),
        ("n[1-2],m[3-4]", "n1"),
        ("gpu[03-05,9],cpu1", "gpu03"),
    ],
)
def test_first_host_keeps_the_rest_of_a_bracketed_name(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["[1-2]", "node[01-04", "node[]", ",node1"])
def test_first_host_refuses_what_is_not_a_node_list(nodelist):
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        first_host(nodelist)
