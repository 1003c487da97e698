"""The ``moetrain`` command.

    moetrain train --config run.yaml [--set optim.lr=1e-3 --set steps=200 ...] [--strategy plan.json]
    moetrain plan --model m6-1T --cluster v100-32gb --nodes 60 --inter-node-gbps 35 --recommend

The config file (YAML or JSON) is one :class:`moetrain.config.TrainConfig` tree; ``--set`` overrides
a key by its dotted path (values parsed as YAML: ``1e-3``, ``true``, ``[0.9, 0.95]``). Everything is
validated before any training starts; a bad file, key or value stops with a one-line error.
"""

from __future__ import annotations

import argparse
import logging
import sys

from moetrain import __version__
from moetrain.checkpoint import CheckpointError
from moetrain.config.files import build_train_config
from moetrain.logs import LEVELS, attach_rank_log, configure_console
from moetrain.planner.cli import add_plan_parser

log = logging.getLogger("moetrain.cli")


# Exceptions that mean bad input (a config, a file, a checkpoint, a missing optional package) when
# raised before training starts: the command exits with 2; anything else, and these same errors once
# steps run (a full disk), is a failure of the run: exit code 1 (moetrain.failures lists the codes).
INPUT_ERRORS = (ValueError, CheckpointError, OSError, ImportError)


def _auto_split(config):
    """The planner's decision for ``scope.auto()`` modules when ``parallel.auto_gpu`` names the GPU
    type (the run's nodes and GPUs per node complete the cluster), else None."""
    if config.parallel.auto_gpu is None:
        return None
    from moetrain.planner.auto import RunAutoSplit
    from moetrain.planner.model import describe, run_batch_settings
    from moetrain.planner.settings import PlanSettings

    model = describe(config.model, None, config)
    settings = PlanSettings(**run_batch_settings(config, model))  # the costs at the run's batch, as `plan`
    return RunAutoSplit(config.parallel.auto_gpu, model, settings)


def _resume_override(value: str) -> str:
    """``--resume-from VALUE`` as a ``--set`` override: a step of ASCII digits is read in base 10
    (``00001000`` is step 1000, never YAML 1.1 octal); anything else is passed on as written."""
    if value.isascii() and value.isdigit():
        return f"resume_from={int(value, 10)}"
    return f"resume_from={value}"


def _train(args) -> int:
    import signal

    import torch.distributed as dist

    from moetrain.engine import Trainer, check_fits
    from moetrain.failures import (
        EXIT_BAD_INPUT,
        EXIT_FINISHED,
        EXIT_PREEMPTED,
        Interrupted,
        RunPosition,
        describe_failure,
        exit_code,
        is_lost_connection,
    )
    from moetrain.launch import report_to_launcher, stop_with_launcher
    from moetrain.parallel import read_launch_environment

    overrides = list(args.set) + ([_resume_override(args.resume_from)] if args.resume_from else [])
    try:
        config = build_train_config(args.config, overrides, args.strategy)
        launch = read_launch_environment()
        configure_console(args.log_level, launch.rank)
        check_fits(config, launch.world_size)
    except INPUT_ERRORS as error:  # main prints the line; under torchrun the launcher ends with it too
        report_to_launcher(str(error), EXIT_BAD_INPUT)
        raise
    position = RunPosition(rank=launch.rank)
    log_path = None

    def start_log_file(rank: int) -> None:  # once this run owns out_dir
        nonlocal log_path
        log_path = attach_rank_log(config.out_dir, rank, args.log_level)

    def interrupt(signum, frame) -> None:  # outside the training loop, which checkpoints on SIGTERM
        if trainer is not None and trainer.stop_requested:
            return  # another SIGTERM once the loop has stopped for the first: the stop goes on
        raise Interrupted(f"{signal.Signals(signum).name} before training started: nothing new to checkpoint")

    # Once a rank of several stops (pre-empted or failed), SIGTERM stays ignored until it exits:
    # srun --kill-on-bad-exit and torchrun SIGTERM the ranks still running when one has exited, and
    # a rank killed then would end with 143 instead of its code, maybe before releasing out_dir.
    previous = signal.signal(signal.SIGTERM, interrupt)
    trainer = watchdog = None
    stopping = False
    try:
        stop_with_launcher()  # under torchrun: SIGTERM when the launcher dies
        trainer = Trainer(
            config, position=position, on_out_dir_locked=start_log_file, auto=_auto_split(config)
        )
        trainer.train()
        if trainer.preempted:
            stopping = True
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        trainer.close()
        code = EXIT_PREEMPTED if trainer.preempted else EXIT_FINISHED
        if code == EXIT_PREEMPTED:
            report_to_launcher(f"SIGTERM: checkpoint saved at step {trainer.step}", code)
        return code
    except (Exception, Interrupted) as error:  # noqa: BLE001 - every failure becomes one line + the log file
        stopping = True
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        watchdog = position.watchdog  # after a failed set-up: stopped, having looked (Trainer)
        if watchdog is not None and trainer is not None:
            watchdog.look_now(error)  # a crashed rank; a stall the timeout found before the look
        code = exit_code(error, position, INPUT_ERRORS)
        line = describe_failure(error, position, position.model, log_path)
        if isinstance(error, Interrupted):
            log.warning("moetrain: stopped: %s", line)
        else:
            log.error("moetrain: error: %s", line, exc_info=error if log_path is not None else None)
        caused_by_others = is_lost_connection(error) or position.stall is not None
        report_to_launcher(line, code, log_path, caused_by_others=caused_by_others)
        return code
    finally:
        if not (stopping and launch.world_size > 1):  # one process: nobody else will signal it
            signal.signal(signal.SIGTERM, previous)
        if trainer is not None:
            trainer.release()
        trainer = position.model = None  # the model and its groups go before the groups are destroyed
        if dist.is_initialized():
            dist.destroy_process_group()
        if watchdog is not None:  # after a failure, rank 0 serving the store waits for the others' look
            watchdog.keep_store_for_the_others()


MODEL_COMMANDS = {
    "eval": "score a trained checkpoint on data (options depend on the model: add --config to see them)",
    "generate": "generate from a trained checkpoint (options depend on the model: add --config to see them)",
}


def _model_command(kind: str, argv: list[str]) -> int:
    """``moetrain eval`` / ``moetrain generate``: generic options (``--config``, ``--set``,
    ``--checkpoint``), then the options of the config's model, whose registry entry provides the
    command (an object with ``add_arguments(parser)`` and ``run(args, config) -> exit code``)."""
    from moetrain.registry import spec_for_config

    generic = argparse.ArgumentParser(prog=f"moetrain {kind}", add_help=False)
    generic.add_argument("--config")
    generic.add_argument("--set", action="append", default=[])
    known, _ = generic.parse_known_args(argv)
    parser = argparse.ArgumentParser(prog=f"moetrain {kind}", description=MODEL_COMMANDS[kind])
    parser.add_argument(
        "--config", required=True, help="the YAML or JSON TrainConfig the model was trained with"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a run's checkpoint directory (its newest checkpoint is used) or one step_XXXXXXXX directory",
    )
    if known.config is None:
        parser.parse_args(argv)  # --help, or the error naming --config
        return 2
    config = build_train_config(known.config, known.set)
    spec = spec_for_config(config.model)
    command = getattr(spec, "evaluate" if kind == "eval" else "generate")
    if command is None:
        raise ValueError(f"model {spec.name!r} offers no `moetrain {kind}` command")
    command.add_arguments(parser)
    args = parser.parse_args(argv)
    configure_console(getattr(args, "log_level", "INFO"), 0)
    return command.run(args, config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moetrain", description="Mixture-of-Experts training toolkit")
    parser.add_argument("--version", action="version", version=f"moetrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    from moetrain.config_reference import train_config_reference

    train = commands.add_parser(
        "train",
        help="train a model from a config file",
        description="Trains a model from a config file (the keys are listed below).",
        epilog=train_config_reference(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", required=True, help="YAML or JSON TrainConfig file")
    train.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key"
    )
    train.add_argument(
        "--strategy",
        metavar="FILE",
        help="a JSON/YAML strategy file ('strategy' patterns and 'parallel' sizes, e.g. the output of "
        "`moetrain plan --recommend --json`): replaces parallel.strategy and the sizes it gives",
    )
    train.add_argument(
        "--resume-from",
        metavar="STEP",
        help="resume from this step's checkpoint, 'latest' (the default) or 'latest-valid' (the newest "
        "that verifies); same as --set resume_from=...",
    )
    train.add_argument(
        "--log-level",
        choices=LEVELS,
        default="INFO",
        help="records shown on rank 0's stderr and written to out_dir/logs/rank_<r>.log (default INFO)",
    )
    train.set_defaults(run=_train)
    add_plan_parser(commands)
    from moetrain.hf_export import add_export_parser  # moetrain export-hf (docs/moefy.md)

    add_export_parser(commands)
    launch = commands.add_parser(
        "launch",
        help="torchrun with a one-line end on SIGTERM (arguments: torchrun's)",
        add_help=False,
    )
    launch.set_defaults(run=None)
    for kind, summary in MODEL_COMMANDS.items():
        commands.add_parser(kind, help=summary, add_help=False)
    arguments = sys.argv[1:] if argv is None else argv
    if arguments[:1] == ["launch"]:
        from moetrain.launch import launch

        code, line = launch(arguments[1:])
        if line is not None:
            print(line, file=sys.stderr)
        return code
    if arguments[:1] and arguments[0] in MODEL_COMMANDS:
        try:
            return _model_command(arguments[0], arguments[1:])
        except INPUT_ERRORS as error:
            print(f"moetrain: error: {error}", file=sys.stderr)
            return 2
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, CheckpointError, OSError, ImportError) as error:
        # Bad input (config, checkpoint, files, a missing optional package): one line, no traceback.
        print(f"moetrain: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
