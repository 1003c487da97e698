"""Fault: SIGTERM to a torchrun launch (a SLURM time limit or pre-emption). The ranks checkpoint and
stop; the job output ends with the "checkpoint saved" line and one launcher line, with no
traceback (plain torchrun prints ~30 lines of SignalException), and exit code 75, as one
``moetrain train`` process pre-empted the same way (test_exit_codes.py; before: 143 here, 0 there)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from moetrain.checkpoint import list_checkpoints
from moetrain.failures import EXIT_PREEMPTED
from tests.faults.launch import ROOT, tiny_config, write_config
from tests.helpers.dist_utils import free_port


@pytest.mark.timeout(120)
def test_sigterm_to_the_launcher_ends_with_one_line_and_a_checkpoint(tmp_path):
    out_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(out_dir, steps=100000, log_every=5))
    command = [
        sys.executable, "-m", "moetrain.cli", "launch", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "moetrain.cli", "train", "--config", str(config),
    ]  # fmt: skip
    proc = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    metrics = out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == EXIT_PREEMPTED, output
    assert "Traceback" not in output and "SignalException" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    saved = [line for line in lines if line.startswith("SIGTERM: checkpoint saved at step")]
    assert len(saved) == 1, output
    assert lines[-1].startswith(
        "moetrain: pre-empted: the launcher got signal 15; SIGTERM: checkpoint saved at"
    ), lines[-3:]
    step = int(saved[0].split("step ")[1].split(",")[0])
    assert [s for s, _ in list_checkpoints(out_dir / "checkpoints")][-1] == step
