"""Starting real `moetrain train` processes for the fault tests: one per rank, launched the way
srun starts tasks (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT per process, rank 0 serving the
rendezvous), with a fault injected through ``tests/faults/inject.py`` when asked.

Each rank is its own OS process (its own gloo connections, signal handlers, exit code and stderr)
forked from the tests' fork server (``tests/helpers/dist_utils.py``), which has imported torch and
moetrain once: what ``python tests/faults/inject.py FAULT train ...`` does, without a fresh
interpreter's seconds of imports per rank."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers.dist_utils import free_port, start_forked

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


class Rank:
    """A rank's process started by :func:`start_rank`, with what the tests use of
    ``subprocess.Popen``: ``pid``, ``poll()``, ``wait()``, ``send_signal()``, ``kill()``,
    ``returncode`` (negative: the signal that ended it) and ``communicate()``, whose
    ``(stdout, stderr)`` text is read from the rank's files once it has ended. Its
    ``/proc/<pid>/environ`` and ``cmdline`` are the fork server's, not the rank's."""

    def __init__(self, args: list[str], environ: dict[str, str], prepare: Callable[[], None] | None):
        self.args = args
        self.returncode = None
        self._files = tempfile.TemporaryDirectory(prefix="moetrain-rank-")
        self._paths = tuple(os.path.join(self._files.name, name) for name in ("stdout", "stderr"))
        for path in self._paths:
            Path(path).touch()  # empty if the rank is killed before it opens them
        self._output = None
        self._process = start_forked(_rank_main, args, environ, prepare, *self._paths)
        self.pid = self._process.pid

    def poll(self) -> int | None:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
            self._process.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._process.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        if self._output is None:
            self._output = tuple(Path(path).read_text() for path in self._paths)
            self._files.cleanup()
        return self._output


def _rank_main(args, environ, prepare, stdout_path, stderr_path) -> None:
    """The forked rank: ``python inject.py FAULT train ...`` (``args``) in ``environ``, from ``ROOT``,
    stdout and stderr to the files; ``prepare()`` (a test's own change) before moetrain's ``main``."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        opened = os.open(path, os.O_WRONLY)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - as an interpreter's, block-buffered
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(ROOT)
    sys.argv = args[1:]
    from moetrain.cli import main
    from tests.faults.inject import install

    install(sys.argv[1])
    if prepare is not None:
        prepare()
    try:
        code = main(sys.argv[2:])
    except SystemExit as stop:  # argparse's exit
        code = stop.code
    except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    atexit._run_exitfuncs()  # the fork server's child ends with os._exit, which runs none
    sys.exit(code)


def start_rank(
    config: Path, rank: int, world: int, port: int, extra_args=(), fault=None, prepare=None
) -> Rank:
    """Rank ``rank`` of ``world`` (srun-style environment, rendezvous on ``port``) training with
    ``config``; ``fault``: one of ``inject.py``'s; ``prepare``: a picklable callable the rank calls
    before moetrain's ``main`` (a test's own change to the rank's code)."""
    args = [sys.executable, str(INJECT), fault or "none", "train", "--config", str(config), *extra_args]
    return Rank(args, rank_environment(rank, world, port), prepare)


def start_ranks(configs: list[Path], extra_args=(), faults=None, port=None, prepare=None) -> list[Rank]:
    """One process per config (config i is rank i's), srun-style environment; ``faults``: rank ->
    fault; ``prepare``: as :func:`start_rank`'s, on every rank."""
    port = port or free_port()
    return [
        start_rank(config, rank, len(configs), port, extra_args, (faults or {}).get(rank), prepare)
        for rank, config in enumerate(configs)
    ]


def finish(procs: list[Rank | subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
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
