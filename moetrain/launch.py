"""``python -m moetrain.launch ARGS`` (or ``moetrain launch ARGS``): torchrun, with a quiet end on a
signal.

torchrun forwards SIGTERM (a SLURM time limit or pre-emption) to its ranks, waits up to
``--shutdown-timeout`` seconds for them (moetrain's ranks checkpoint and stop) and then raises
``SignalException``, which Python prints as a ~30-line traceback after the ranks' "checkpoint saved"
line. Here the same launch ends with one line and exit code ``128 + signal``; torchrun's own
shutdown warnings are kept to errors. A rendezvous that cannot start (its port in use, the store
unreachable) is one line too, exit code 1. ARGS are torchrun's, unchanged.
"""

from __future__ import annotations

import logging
import sys


def _first_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except (DistError, RendezvousError) as error:
        in_use = "EADDRINUSE" in str(error)
        reason = (
            "the rendezvous port is already in use (another job?): choose a free --master-port / "
            "--rdzv-endpoint port"
            if in_use
            else _first_line(error)
        )
        print(f"moetrain: the launcher could not start the rendezvous: {reason}", file=sys.stderr)
        return 1
    except SignalException as error:
        signal_number = int(error.sigval)
        print(
            f"moetrain: the launcher got signal {signal_number} and stopped after its ranks (they checkpoint "
            "on SIGTERM)",
            file=sys.stderr,
        )
        return 128 + signal_number
    return 0


if __name__ == "__main__":
    sys.exit(main())
