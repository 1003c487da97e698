"""Starting real `moetrain train` processes for the fault tests: one per rank, launched the way
srun starts tasks (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT per process, rank 0 serving the
rendezvous), with a fault injected through ``tests/faults/inject.py`` when asked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.dist_utils import free_port

ROOT = Path(__file__).resolve().parents[2]
INJECT = Path(__file__).with_name("inject.py")


def tiny_config(out_dir: Path, **overrides) -> dict:
    """A 1-layer MoE LM that runs a step in milliseconds."""
    config = {
        "model": {
            "name": "moe_lm",
            "d_model": 32,
            "num_layers": 1,
            "num_heads": 2,
            "max_seq_len": 16,
            "moe": {"d_ff": 32, "num_experts": 4, "top_k": 2},
        },
        "data": {"micro_batch_size": 4, "seq_len": 16},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "steps": 6,
        "out_dir": str(out_dir),
        "threads": 1,
        "log_every": 1,
        "device": "cpu",
        "dist_timeout_s": 30,
    }
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config


def write_config(directory: Path, config: dict, name: str = "run.json") -> Path:
    path = directory / name
    path.write_text(json.dumps(config))
    return path


def rank_environment(rank: int, world: int, port: int) -> dict[str, str]:
    """A per-task (srun-style) launch's environment of ``rank`` on this host: rank 0 serves the
    rendezvous store on ``port``."""
    return {
        **os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }  # fmt: skip


def start_ranks(configs: list[Path], extra_args=(), faults=None, port=None) -> list[subprocess.Popen]:
    """One process per config (config i is rank i's), srun-style environment."""
    port = port or free_port()
    world = len(configs)
    procs = []
    for rank, config in enumerate(configs):
        env = rank_environment(rank, world, port)
        fault = (faults or {}).get(rank)
        command = [
            sys.executable,
            str(INJECT),
            fault or "none",
            "train",
            "--config",
            str(config),
            *extra_args,
        ]
        procs.append(
            subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process; kills whatever is still running after ``timeout``."""
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            err += "\n<killed by the test: did not end in time>"
        results.append((proc.returncode, err))
    return results


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("moetrain: error:")]
