"""``python -m moetrain.launch ARGS`` (or ``moetrain launch ARGS``): torchrun, ending with one line.

ARGS are torchrun's. Plain torchrun ends a failed run with its own traceback and a failure summary
(60-70 lines of stderr after the ranks' own lines) and a signal with a ~30-line ``SignalException``
traceback. Here the ranks' output is unchanged and the launcher adds one line at the end, nothing
else; torchrun's own records and the detail of a failure (its summary, the traceback) go to
``launcher.log`` in torchrun's log directory (``--log-dir``; when not given, a new temporary
directory, named in that line).

- A rank of ``moetrain train`` that fails, or stops after checkpointing on SIGTERM, writes its one
  line and exit code to the reply file torchrun gives it (torchelastic's error-file protocol,
  :func:`report_to_launcher`). A failed run ends with the line of the rank that failed first on its
  own (not one that only lost its connection to it), naming that rank's log file, or with the rank
  that died of a signal (``kill -9``, the OOM killer) and what a survivor said about it; the exit
  code is that rank's (see :mod:`moetrain.failures`: 2 bad input, 1 run failure).
- SIGTERM (a SLURM time limit or pre-emption): torchrun forwards it to its ranks, which checkpoint
  and stop; the launch exits with ``EXIT_PREEMPTED`` (75), as one ``moetrain train`` process does,
  when a rank reported the checkpoint, else with ``128 + signal``.
- A rendezvous that cannot start (its port in use, the store unreachable) is one line too, exit
  code 1. The rendezvous store lost once the ranks run (the launcher hosting it killed, its node
  gone) is one line as well: the ranks are stopped with SIGTERM, and the launch exits 75 when a rank
  reported the checkpoint, else 1.
- A rank of ``moetrain train`` stops when its launcher dies: it asks the kernel for SIGTERM when its
  parent dies (:func:`stop_with_launcher`), so a ``kill -9`` of the launcher makes its ranks
  checkpoint and stop instead of training on as orphans holding ``out_dir``.

The c10d rendezvous (``--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT``, the SLURM templates' choice)
needs a check of its own: when HOST's port is taken, torchrun falls back to joining whatever listens
there as a client and, when that is not a rendezvous store, waits forever in the connection. So on
the endpoint's host (unless ``--rdzv-conf is_host=...`` says otherwise) an occupied port is looked at
before torchrun starts: a rendezvous store holding this job's rendezvous (``--rdzv-id``; another
launcher of the same job on this host hosts it) is fine, anything else (another job's store
included) ends the launch with the one-line error. The other nodes' launchers then end with the job
(srun ``--kill-on-bad-exit``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from moetrain.validation import is_int

log = logging.getLogger(__name__)

PORT_IN_USE = (
    "the rendezvous port is already in use (another job?): choose a free --master-port / --rdzv-endpoint port"
)
STORE_ANSWER_S = 3  # how long a rendezvous store already on the port may take to answer a client
LOST_STORE = "the launcher lost the rendezvous store (its host is gone?)"
LAUNCHER_PID = "MOETRAIN_LAUNCHER_PID"  # set by main for its ranks: the process that started them
PR_SET_PDEATHSIG = 1  # prctl(2)


def _first_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


def _says_in_use(error: BaseException | None) -> bool:
    """Whether ``error`` or an error it was raised from is a failed bind to a taken port."""
    while error is not None:
        if "EADDRINUSE" in str(error) or getattr(error, "errno", None) == errno.EADDRINUSE:
            return True
        error = error.__cause__ or error.__context__
    return False


def _is_this_host(host: str) -> bool:
    """Whether ``host`` (a name or an address) names this machine."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        wanted, mine = (
            {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
            for name in (host, socket.gethostname())
        )
    except (OSError, UnicodeError):
        return False
    return any(address.startswith("127.") or address == "::1" for address in wanted) or bool(wanted & mine)


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_DRAWN_PORT = 10000


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None, below: int | None = None) -> int:
    """A TCP port nothing listens on at ``host`` now, for single-machine runs, tests and benchmarks.

    Drawn at random below the kernel's ephemeral range (``ip_local_port_range``, from
    ``LOWEST_DRAWN_PORT``; and below ``below`` when given): a port the OS hands out for ``bind(0)``
    lies inside that range, where any outgoing connection on the machine (another run's store
    clients, a package download) may take it as its source port before the store binds it, which
    ends the run with EADDRINUSE. A port below the range is only taken by a process that binds it
    on purpose. Where the range is unknown (not Linux) or nothing below it is free after 200 draws,
    the OS picks."""
    rng = rng or random.Random()
    try:
        upper = int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        upper = LOWEST_DRAWN_PORT
    if below is not None:
        upper = min(upper, below)
    for _ in range(200 if upper > LOWEST_DRAWN_PORT else 0):
        port = rng.randrange(LOWEST_DRAWN_PORT, upper)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _port_is_taken(port: int) -> bool:
    """Whether a listening socket holds ``port`` on this host (TCPStore's server could not bind it)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False


def _a_store_answers(host: str, port: int, run_id: str) -> bool:
    """Whether a c10d TCPStore at ``host:port`` holds the rendezvous of ``run_id`` (``--rdzv-id``:
    its key ``torch.rendezvous.<run_id>``, written by the launcher that created the store as it
    starts) within ``STORE_ANSWER_S`` seconds. Another job's store answers too, without that key.

    Asked from a child process: a TCPStore client connected to something that is not a store never
    returns, and a thread stuck in it would abort this process at exit. The child's alarm (default
    action: terminate) starts after its torch import."""
    probe = (
        "import datetime, signal, sys; from torch.distributed import TCPStore; "
        f"signal.alarm({STORE_ANSWER_S + 1}); "
        f"TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, "
        f"timeout=datetime.timedelta(seconds={STORE_ANSWER_S})).wait(['torch.rendezvous.' + sys.argv[3]])"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", probe, host, str(port), run_id],
            capture_output=True,
            timeout=STORE_ANSWER_S + 120,
        )
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def c10d_port_problem(argv: list[str]) -> str | None:
    """The one-line reason the c10d rendezvous of torchrun arguments ``argv`` cannot start on this
    host (its port held by something that is not this job's rendezvous store), or None."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
    from torch.distributed.run import parse_args

    args = parse_args(argv)
    if args.standalone or args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
        return None
    conf = dict(item.strip().split("=", 1) for item in args.rdzv_conf.split(",") if "=" in item)
    is_host = conf.get("is_host", "").strip().lower()  # the user may say whether this node hosts
    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
    if port == 0 or is_host in ("0", "false", "f", "no", "n"):
        return None
    must_host = is_host in ("1", "true", "t", "yes", "y")
    if not (must_host or _is_this_host(host)) or not _port_is_taken(port):
        return None
    return None if not must_host and _a_store_answers(host, port, args.rdzv_id) else PORT_IN_USE


def report_to_launcher(line: str, code: int, log_path=None, caused_by_others: bool = False) -> None:
    """Under torchrun: writes this rank's one line and exit code into the reply file its agent
    named (``TORCHELASTIC_ERROR_FILE``, torchelastic's error-file protocol), where :func:`main`
    reads it; nothing under any other launcher. ``caused_by_others``: this rank failed because
    another one went away or stopped (a lost connection, a timeout with the watchdog's finding):
    its line is not the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    from moetrain.failures import EXIT_PREEMPTED

    record = {
        "message": line,
        "timestamp": int(time.time()),
        "moetrain": {
            "exit_code": code,
            "log": None if log_path is None else str(log_path),
            "time": time.time(),
            "caused_by_others": caused_by_others and code != EXIT_PREEMPTED,
        },
    }
    temporary = f"{path}.moetrain.tmp"
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(temporary).write_text(json.dumps(record), encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        log.debug("could not write the launcher's reply file %s: %s", path, error)


def _rank_reports(failures: dict) -> list[tuple[int, dict, str]]:
    """``(rank, moetrain record, line)`` of the failures whose rank wrote a reply file."""
    found = []
    for rank, failure in sorted(failures.items()):
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        record = data.get("moetrain")
        if isinstance(record, dict) and isinstance(data.get("message"), str):
            found.append((rank, record, data["message"]))
    return found


def failure_line(failures: dict, killed_by_launcher: frozenset[int] = frozenset()) -> tuple[str, int]:
    """The launcher's last line and exit code for the failed ranks of torchrun's
    ``ChildFailedError.failures`` (global rank -> ``ProcessFailure``). ``killed_by_launcher``: the
    pids torchrun SIGKILLed itself, at the end of its shutdown timeout (:class:`_ForcedKills`): a
    rank that did not end on SIGTERM (stopped, hung), not one that something else killed."""
    from moetrain.failures import EXIT_PREEMPTED, EXIT_RUN_FAILED

    reports = _rank_reports(failures)
    if reports and all(record["exit_code"] == EXIT_PREEMPTED for _, record, _ in reports):
        return f"moetrain: pre-empted: {reports[0][2]}, stopping", EXIT_PREEMPTED
    reports = [r for r in reports if r[1]["exit_code"] != EXIT_PREEMPTED]
    reported = {rank for rank, _, _ in reports}
    killed = sorted(  # a rank killed by something else first: the launcher's kills came after
        (failure.pid in killed_by_launcher, failure.timestamp, rank, failure)
        for rank, failure in failures.items()
        if rank not in reported and failure.exitcode < 0
    )
    own = sorted((r for r in reports if not r[1].get("caused_by_others")), key=lambda r: (r[1]["time"], r[0]))
    lost = sorted((r for r in reports if r[1].get("caused_by_others")), key=lambda r: (r[1]["time"], r[0]))
    if own:
        rank, record, line = own[0]
        return f"moetrain: error: {line}", int(record["exit_code"])
    if killed:
        by_launcher, _, rank, failure = killed[0]
        number = -failure.exitcode
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        text = f"moetrain: error: rank {rank} (pid {failure.pid}) " + (
            f"stopped responding and was killed by the launcher ({name}) after its shutdown timeout"
            if by_launcher
            else f"was killed by signal {number} ({name})"
        )
        if lost:
            text += f"; rank {lost[0][0]} said: {lost[0][2]}"
        return text, EXIT_RUN_FAILED
    if lost:
        rank, record, line = lost[0]
        return f"moetrain: error: {line}", int(record["exit_code"])
    rank, failure = min(failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    return (
        f"moetrain: error: rank {rank} (pid {failure.pid}) ended with exit code {failure.exitcode} and "
        "no error line of moetrain's",
        failure.exitcode if 0 < failure.exitcode < 256 else EXIT_RUN_FAILED,
    )


class _ForcedKills(logging.Handler):
    """Collects the pids of the ranks torchrun SIGKILLs at the end of its shutdown timeout, from
    its warning ``Unable to shutdown process <pid> via <signal>, forcefully exiting via <signal>``."""

    def __init__(self) -> None:
        super().__init__()
        self.pids: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("Unable to shutdown process") and record.args:
            with contextlib.suppress(TypeError, ValueError):
                self.pids.add(int(record.args[0]))


def _workers_started(log_dir: Path, since: float) -> bool:
    """Whether torchrun started ranks under ``log_dir`` since ``since`` (it makes a
    ``<run id>_*/attempt_<n>`` directory for every start)."""
    for path in log_dir.glob("*/attempt_*"):
        try:
            if path.stat().st_mtime >= since - 1:
                return True
        except OSError:
            continue
    return False


def _preempted_line(log_dir: Path, since: float) -> str | None:
    """A rank's "checkpoint saved" report among the reply files written under ``log_dir`` since
    ``since`` (after torchrun forwarded a signal), or None."""
    from moetrain.failures import EXIT_PREEMPTED

    for path in sorted(log_dir.rglob("error.json")):
        try:
            if path.stat().st_mtime < since - 1:
                continue
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        record = data.get("moetrain") if isinstance(data, dict) else None
        if isinstance(record, dict) and record.get("exit_code") == EXIT_PREEMPTED:
            return str(data.get("message"))
    return None


def argument_problem(argv: list[str]) -> str | None:
    """What is wrong with torchrun's arguments ``argv`` (one line naming the flag), or None. torchrun
    itself ends these with a traceback (or, for ``--nproc-per-node 0``, starts no rank)."""
    from torch.distributed.run import (
        config_from_args,
        determine_local_world_size,
        parse_args,
        parse_min_max_nnodes,
    )

    args = parse_args(argv)
    try:
        nproc = determine_local_world_size(args.nproc_per_node)
    except ValueError as error:
        nproc = f"{args.nproc_per_node!r} ({_first_line(error)})"
    if not is_int(nproc) or nproc < 1:
        return f"--nproc-per-node must be an integer >= 1 or one of cpu, gpu, xpu, auto, got {nproc}"
    try:
        low, high = parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        low = high = 0
    if not 0 < low <= high:
        return f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {args.nnodes!r}"
    try:
        config_from_args(args)
    except (ValueError, AssertionError) as error:
        return _first_line(error)
    return None


def _log_dir(argv: list[str]) -> tuple[list[str], Path]:
    """torchrun's ``--log-dir`` of ``argv``; when not given, a new temporary directory, added to
    the arguments."""
    from torch.distributed.run import parse_args

    given = parse_args(argv).log_dir
    if given:
        return argv, Path(given)
    directory = tempfile.mkdtemp(prefix="moetrain-launch-")
    return ["--log-dir", directory, *argv], Path(directory)


def _send_torch_records_to(path: Path, *handlers: logging.Handler) -> logging.Handler:
    """torchrun's loggers (``torch.distributed.*``) write to ``path`` only, not to stderr, and to
    ``handlers``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    names = ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher", __name__)
    for name in names:
        logger = logging.getLogger(name)
        for each in (handler, *handlers):
            logger.addHandler(each)
        logger.propagate = False
    return handler


def _is_alive(pid: str | None) -> bool:
    """Whether process ``pid`` (decimal text) exists; True when ``pid`` is not given."""
    if not pid or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process: it exists
    return True


def stop_with_launcher() -> None:
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set) on Linux: the kernel sends this rank SIGTERM
    when its launcher (the parent process) dies (``prctl(PR_SET_PDEATHSIG)``), so a ``kill -9`` of
    the launcher makes its ranks checkpoint and stop (exit 75) instead of training on as orphans
    that hold ``out_dir``'s lock. A launcher already gone when this is called (this process's parent
    changed meanwhile, or ``moetrain launch``'s process, ``MOETRAIN_LAUNCHER_PID``, no longer
    exists: it died before this rank got here) gets this rank that SIGTERM at once. A no-op
    elsewhere."""
    if not sys.platform.startswith("linux") or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    parent = os.getppid()
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    except (OSError, AttributeError) as error:
        log.debug("no SIGTERM when the launcher dies: %s", error)
        return
    if os.getppid() != parent or not _is_alive(os.environ.get(LAUNCHER_PID)):
        os.kill(os.getpid(), signal.SIGTERM)


def launch(argv: list[str] | None = None) -> tuple[int, str | None]:
    """torchrun with ``argv`` (default ``sys.argv[1:]``): ``(exit code, the one line that ends the
    launch on stderr, or None when it succeeded)``; the command line prints the line."""
    from torch.distributed import DistError, DistNetworkError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
    from torch.distributed.run import main as torchrun_main

    from moetrain.failures import EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_RUN_FAILED

    argv = sys.argv[1:] if argv is None else argv
    argv, log_dir = _log_dir(argv)
    detail = log_dir / "launcher.log"
    forced_kills = _ForcedKills()
    handler = _send_torch_records_to(detail, forced_kills)
    bad_arguments = argument_problem(argv)
    if bad_arguments is not None:
        return EXIT_BAD_INPUT, f"moetrain: error: {bad_arguments}"
    started = time.time()
    problem = None
    os.environ[LAUNCHER_PID] = str(os.getpid())  # for the ranks (stop_with_launcher)
    try:
        problem = c10d_port_problem(argv)
        if problem is None:
            torchrun_main(argv)
    except ChildFailedError as error:
        log.error("%s\n%s", error.format_msg(), traceback.format_exc())
        line, code = failure_line(error.failures, frozenset(forced_kills.pids))
        return code, f"{line} (launcher detail: {detail})"
    except (DistError, RendezvousError) as error:
        if not _workers_started(log_dir, started):
            problem = PORT_IN_USE if _says_in_use(error) else _first_line(error)
        else:  # once the ranks ran: torchrun stopped them (SIGTERM: they checkpoint) before raising
            lost = isinstance(error, (DistNetworkError, RendezvousConnectionError))
            what = LOST_STORE if lost else f"the rendezvous failed once the ranks ran: {_first_line(error)}"
            log.error("%s\n%s", what, traceback.format_exc())
            saved = _preempted_line(log_dir, started)
            if saved is not None:
                return EXIT_PREEMPTED, f"moetrain: pre-empted: {what}; {saved} (launcher detail: {detail})"
            return (
                EXIT_RUN_FAILED,
                f"moetrain: error: {what}; no rank reported a checkpoint (launcher detail: {detail})",
            )
    except SignalException as error:
        signal_number = int(error.sigval)
        saved = _preempted_line(log_dir, started)
        if saved is not None:
            return EXIT_PREEMPTED, f"moetrain: pre-empted: the launcher got signal {signal_number}; {saved}"
        return 128 + signal_number, (
            f"moetrain: the launcher got signal {signal_number} and stopped after its ranks; no rank "
            f"reported a checkpoint (launcher detail: {detail})"
        )
    finally:
        handler.flush()
    if problem is not None:
        return 1, f"moetrain: the launcher could not start the rendezvous: {problem}"
    return 0, None


if __name__ == "__main__":  # python -m moetrain.launch (the SLURM scripts); as moetrain launch does
    exit_code, last_line = launch()
    if last_line is not None:
        print(last_line, file=sys.stderr)
    sys.exit(exit_code)
