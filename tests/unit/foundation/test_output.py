"""Where output goes: library code only logs (silent with no handler), progress bars are log
records the command line's console handler draws, stdout holds only what a command prints."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from moetrain import progress
from moetrain.cli import main
from moetrain.logs import detach_handlers
from tests.helpers.paths import ROOT
from tests.unit.engine.test_engine import tiny


def test_progress_bar_logs_a_line_every_n_steps_and_times_only_this_run(monkeypatch, progress_log):
    now = {"t": 0.0}
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now["t"])
    stream = progress_log()  # not a terminal: one line every log_every steps, no redraws
    bar = progress.ProgressBar(100, "train", log_every=5, initial=90)
    for step in range(91, 96):
        now["t"] += 2.0
        bar.update(step, loss=1.0)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1 and "95/100" in lines[0] and "\r" not in stream.getvalue()
    assert lines[0].endswith("eta   10s")  # 5 steps in 10 s since the resume, 5 to go


def test_progress_bar_is_redrawn_in_place_on_a_terminal_with_records_above_it(progress_log):
    stream = progress_log(terminal=True)
    other = logging.getLogger("moetrain.progress.test")  # any record through the same handler
    bar = progress.ProgressBar(4, "work", width=4, log_every=2)
    bar.update(1, n=1)
    other.info("a message")
    bar.update(2, n=2)
    bar.close()
    first = "work [#...] 1/4 | n 1 | eta    0s"
    assert stream.getvalue() == (
        f"\r{first}"  # the bar
        + "\r" + " " * len(first) + "\r" + "a message\n" + first  # cleared, the message, the bar again
        + "\rwork [##..] 2/4 | n 2 | eta    0s"  # redrawn in place
        + "\n"  # close() ends the bar's line
    )  # fmt: skip


def test_progress_bar_on_a_terminal_at_warning_level_shows_nothing(progress_log):
    stream = progress_log(terminal=True, level=logging.WARNING)
    bar = progress.ProgressBar(2, "work", log_every=1)
    bar.update(1)
    bar.update(2)
    bar.close()
    assert stream.getvalue() == ""


def test_library_with_no_logging_handlers_writes_nothing(tmp_path):
    """A user's script that trains with the library and configures no logging: no output at all
    (a fresh interpreter: no test runner's handlers; Python's last resort would show warnings)."""
    script = (
        "import json, sys\n"
        "from moetrain.config import TrainConfig, config_from_dict\n"
        "from moetrain.engine import Trainer\n"
        "trainer = Trainer(config_from_dict(TrainConfig, json.loads(sys.argv[1])))\n"
        "assert len(trainer.train()) == 2\n"
        "trainer.close()\n"
    )
    config = json.dumps(tiny(tmp_path / "run", steps=2))
    done = subprocess.run(
        [sys.executable, "-c", script, config], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == ""
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 2  # it did train


def _train(tmp_path, *options: str) -> int:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(tiny(tmp_path / "run", steps=2)))
    try:
        return main(["train", "--config", str(path), *options])
    finally:
        detach_handlers()


def test_train_command_leaves_stdout_empty_and_shows_progress_on_stderr(tmp_path, capfd):
    assert _train(tmp_path) == 0
    out, err = capfd.readouterr()
    assert out == ""
    assert "train [" in err and "2/2 | loss" in err and "\r" not in err  # not a terminal: plain lines
    log_file = (tmp_path / "run" / "logs" / "rank_0.log").read_text()
    assert "moetrain.progress: train [" in log_file and "2/2 | loss" in log_file


def test_train_command_log_level_warning_hides_info_records(tmp_path, capfd):
    assert _train(tmp_path, "--log-level", "WARNING") == 0
    out, err = capfd.readouterr()
    assert out == "" and err == ""
    assert (tmp_path / "run" / "logs" / "rank_0.log").read_text() == ""


def test_detach_handlers_restores_levels_and_propagation(tmp_path, capfd):
    loggers = [logging.getLogger(name) for name in ("moetrain", "moetrain.progress")]
    before = [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers]
    _train(tmp_path)
    assert [(lg.level, lg.propagate, list(lg.handlers)) for lg in loggers] == before
