"""Runs a function on several gloo ranks (CPU processes) with a hard timeout and a free port.

The ranks are forked from a fork server that has imported torch, moetrain and its engine once (Python's
``forkserver`` start method, with those modules preloaded): a rank starts in a fraction of a
second instead of the seconds a fresh interpreter takes to import torch, which is most of a small
distributed test's time on 2 cores. The server never runs a torch op, so no thread pool exists
when it forks; each rank gets the calling process's environment and ``sys.path`` as a spawned
process would.
"""

from __future__ import annotations

import io
import os
import queue as queue_module
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetrain.launch import free_port


def _serialize(value) -> bytes:
    """Results travel as bytes: tensors passed through a multiprocessing queue would be shared by file
    descriptors that vanish when the worker exits before the parent reads them."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


_CONTEXT = mp.get_context("forkserver")
# The engine (with DCP) and the pipelining package cost a rank about 2 CPU-seconds to import, more
# than most ranks compute: importing them once here halved the engine, pipeline and parallelize tests.
# The registry and the example LM (entry point): what a fault test's `moetrain train` rank imports.
_CONTEXT.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch.distributed.pipelining",
        "moetrain",
        "moetrain.cli",
        "moetrain.engine",
        "moetrain.registry",
        "moe_lm",
    ]
)


def start_forked(target, *args):
    """Starts ``target(*args)`` in a new process forked from the fork server; returns the
    ``multiprocessing`` process (not a daemon: it may start processes of its own)."""
    process = _CONTEXT.Process(target=target, args=args)
    process.start()
    return process


def _entry(fn, rank, world_size, port, results, args, environ):
    os.environ.clear()
    os.environ.update(environ)  # the caller's environment now, not the fork server's at its start
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        results.put((rank, "ok", _serialize(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Calls ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (processes); returns the
    per-rank results in rank order. Raises on any rank's exception or when ``timeout`` seconds
    pass (the ranks are killed, so a hang never blocks the suite).

    A store port taken between ``free_port`` and rank 0's bind (another test binding the same
    draw) is the one failure retried, with a new port, up to ``PORT_ATTEMPTS`` times."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _run_once(fn, world_size, args, timeout)
        except _PortTaken:
            continue
    return _run_once(fn, world_size, args, timeout)


PORT_ATTEMPTS = 3


class _PortTaken(RuntimeError):
    pass


def _run_once(fn, world_size: int, args: tuple, timeout: float) -> list:
    results = _CONTEXT.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        _CONTEXT.Process(target=_entry, args=(fn, r, world_size, port, results, args, environ))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"distributed test timed out after {timeout:.0f}s; ranks done: {sorted(outputs)}"
                )
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except queue_module.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outputs]
                if dead:
                    raise RuntimeError(
                        f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})"
                    ) from None
                continue
            if status == "error":
                if "EADDRINUSE" in value and "init_process_group" in value:
                    raise _PortTaken(f"rank {rank} could not serve the store on port {port}")
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(world_size)]
