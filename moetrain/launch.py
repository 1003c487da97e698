"""``python -m moetrain.launch ARGS`` (or ``moetrain launch ARGS``): torchrun, with a quiet end on a
signal.

torchrun forwards SIGTERM (a SLURM time limit or pre-emption) to its ranks, waits up to
``--shutdown-timeout`` seconds for them (moetrain's ranks checkpoint and stop) and then raises
``SignalException``, which Python prints as a ~30-line traceback after the ranks' "checkpoint saved"
line. Here the same launch ends with one line and exit code ``128 + signal``; torchrun's own
shutdown warnings are kept to errors. A rendezvous that cannot start (its port in use, the store
unreachable) is one line too, exit code 1. ARGS are torchrun's, unchanged.

The c10d rendezvous (``--rdzv-backend=c10d --rdzv-endpoint=HOST:PORT``, the SLURM templates' choice)
needs a check of its own: when HOST's port is taken, torchrun falls back to joining whatever listens
there as a client and, when that is not a rendezvous store, waits forever in the connection. So on
the endpoint's host (unless ``--rdzv-conf is_host=...`` says otherwise) an occupied port is looked at
before torchrun starts: a rendezvous store answering there (another launcher of the same job on
this host hosts it) is fine, anything else ends the launch with the one-line error. The other
nodes' launchers then end with the job (srun ``--kill-on-bad-exit``).
"""

from __future__ import annotations

import errno
import logging
import socket
import subprocess
import sys

PORT_IN_USE = (
    "the rendezvous port is already in use (another job?): choose a free --master-port / --rdzv-endpoint port"
)
STORE_ANSWER_S = 3  # how long a rendezvous store already on the port may take to answer a client


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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the OS picks it; another process may take it
    before it is used): for single-machine runs and benchmarks."""
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


def _a_store_answers(host: str, port: int) -> bool:
    """Whether a c10d TCPStore answers a client at ``host:port`` within ``STORE_ANSWER_S`` seconds.

    Asked from a child process: a TCPStore client connected to something that is not a store never
    returns, and a thread stuck in it would abort this process at exit. The child's alarm (default
    action: terminate) starts after its torch import."""
    probe = (
        "import datetime, signal, sys; from torch.distributed import TCPStore; "
        f"signal.alarm({STORE_ANSWER_S}); "
        f"TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, "
        f"timeout=datetime.timedelta(seconds={STORE_ANSWER_S})).check(['moetrain-launch-probe'])"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", probe, host, str(port)], capture_output=True, timeout=STORE_ANSWER_S + 120
        )
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0


def c10d_port_problem(argv: list[str]) -> str | None:
    """The one-line reason the c10d rendezvous of torchrun arguments ``argv`` cannot start on this
    host (its port held by something that is not a rendezvous store), or None."""
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
    return None if not must_host and _a_store_answers(host, port) else PORT_IN_USE


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun_main

    argv = sys.argv[1:] if argv is None else argv
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    problem = None
    try:
        problem = c10d_port_problem(argv)
        if problem is None:
            torchrun_main(argv)
    except (DistError, RendezvousError) as error:
        problem = PORT_IN_USE if _says_in_use(error) else _first_line(error)
    except SignalException as error:
        signal_number = int(error.sigval)
        print(
            f"moetrain: the launcher got signal {signal_number} and stopped after its ranks (they checkpoint "
            "on SIGTERM)",
            file=sys.stderr,
        )
        return 128 + signal_number
    if problem is not None:
        print(f"moetrain: the launcher could not start the rendezvous: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
