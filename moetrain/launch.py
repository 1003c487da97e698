"""``python -m moetrain.launch ARGS`` (or ``moetrain launch ARGS``): torchrun, with a quiet end on a
signal.

torchrun forwards SIGTERM (a SLURM time limit or pre-emption) to its ranks, waits up to
``--shutdown-timeout`` seconds for them (moetrain's ranks checkpoint and stop) and then raises
``SignalException``, which Python prints as a ~30-line traceback after the ranks' "checkpoint saved"
line. Here the same launch ends with one line and exit code ``128 + signal``; torchrun's own
shutdown warnings are kept to errors. ARGS are torchrun's, unchanged.
"""

from __future__ import annotations

import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
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
