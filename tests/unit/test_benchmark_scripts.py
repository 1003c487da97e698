"""``benchmarks/*.py`` as a user runs them: every script at its smallest settings exits 0, prints its
table's header and writes its ``--json`` keys, or, where it cannot run here (no DeepSpeed, no GPU),
refuses in one line; a bad number is argparse's one line naming the flag, exit status 2, before any
work; a write that fails part-way keeps the previous file (``--json``, ``fit_links.py --write``);
``checkpoint_stall.py --dir`` leaves the directory's files alone; ``m6_data.py index`` below 500,000
records divides by the records it measured; ``node_limited.py`` times its algorithms round by round."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.paths import ROOT, load_script

BENCHMARKS = ROOT / "benchmarks"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
TINY_LAYER = ["--tokens", "32", "--d-model", "16", "--d-ff", "16"]
ONCE = ["--repeats", "1", "--warmup", "0"]
ONE_THREAD = ["--threads", "1"]


def _can_emulate() -> str | None:
    return load_script(BENCHMARKS / "emulated_cluster.py", "emulated_cluster_probe").can_emulate()


def _a2a_rows(alpha: float, beta_intra: float, beta_inter: float) -> list[dict]:
    """fp32 rows of ``benchmarks/all_to_all.py`` whose round trips follow the alpha-beta model exactly."""
    rows = []
    for algorithm, messages, intra_share in (("flat", 6, 0.5), ("hierarchical", 4, 1.5)):
        for payload in (16384, 65536, 262144, 1048576):
            intra, inter = int(payload * intra_share), 2 * payload
            seconds = alpha * messages + beta_intra * intra + beta_inter * inter
            rows.append({"algorithm": algorithm, "wire": "fp32", "payload_bytes": payload,
                         "round_trip_ms": seconds * 1e3, "messages_per_rank": messages,
                         "intra_bytes_per_rank": intra, "cross_node_bytes_per_rank": payload,
                         "node_inter_bytes": inter})  # fmt: skip
    return rows


def _write_a2a_report(path) -> str:
    runs = {"200mbit": {"rows": _a2a_rows(1e-4, 2e-9, 4e-8), "ranks_per_node": 2}}
    path.write_text(json.dumps({"benchmark": "all_to_all", "runs": runs}))
    return str(path)


def _case(script: str, flags: list[str], header: str, keys: set[str] | None, slow: bool = False):
    return pytest.param(script, flags, header, keys, id=script.replace(" ", "-"),
                        marks=[pytest.mark.slow] if slow else [])  # fmt: skip


# script (a subcommand after a space), its flags ("{tmp}": the test's directory), the start of the
# first line it prints, the keys its --json holds (None: it has no --json); slow: over ~10 s.
CASES = [
    _case("cpu_adam.py", ["--numel", "1000", "--reps", "1", "--warmup", "0", "--threads", "1"],
          "CPU AdamW step", {"benchmark", "rows", "speedup_vs_best_torch", "roofline_fraction"}),
    _case("moe_layer.py", [*TINY_LAYER, "--experts", "4", *ONCE, "--threads", "1"], "MoELayer fwd+bwd, T=32",
          {"benchmark", "config", "machine", "results"}),
    _case("decode.py", ["--batch", "1", "--new-tokens", "2", "--beams", "2", "--rounds", "1", *ONE_THREAD],
          "M6 tiny preset", {"benchmark", "config", "machine", "results"}),
    _case("offload_step.py", ["--device", "cpu", "--params", "64", *ONCE, "--threads", "1"], "{",
          {"benchmark", "step_s", "roofline_s", "step_over_roofline"}),
    _case("offload_overlap.py", ["--params", "64", "--steps", "1", "--rounds", "1", "--threads", "1"], "{",
          {"speedup", "hidden_fraction", "delayed_over_predicted"}),
    _case("checkpoint_stall.py", ["--d-model", "16", "--layers", "1", "--experts", "2", "--d-ff", "16",
                                  "--batch", "1", "--rounds", "1", "--warmup", "0", "--threads", "1"],
          "checkpoint stall, MoE LM", {"median", "ratios", "rounds", "weight_mb"}),
    _case("grouped_mm.py", [*ONCE, "--threads", "1"], "expert GEMMs forward", {"machine", "results"}),
    _case("fit_links.py", ["{tmp}/a2a.json", "--rate", "200"], "200mbit: node link", None),
    _case("emulated_cluster.py", ["--ranks-per-node", "1", "--", "-c", "print('rank up')"], "rank up", None),
    _case("pipeline_bubble.py", ["--forward-ms", "1", "--steps", "1"], "pipeline bubble, gloo",
          {"machine", "rows"}, slow=True),
    _case("moe_layer_ep.py", [*TINY_LAYER, "--experts", "2", "--chunks", "1", "2", *ONCE],
          "MoELayer fwd+bwd, expert parallel", {"benchmark", "config", "runs"}, slow=True),
    _case("log_every.py", ["--rounds", "1", "--steps", "1"], "step time, MoE LM",
          {"step_ms_log_every_1", "step_ms_log_every_50", "ratio_1_over_50"}, slow=True),
    _case("compile.py", [*ONCE, "--threads", "1"], "torch.compile (inductor, fullgraph) vs eager",
          {"machine", "results"}, slow=True),
    _case("parallelize_classifier.py", ["--steps", "1", "--warmup", "0"], "classifier 64->256->256",
          {"measured", "prediction"}, slow=True),
    _case("all_to_all.py", ["--sizes-kib", "1", *ONCE], "all-to-all round trip",
          {"benchmark", "runs", "fit_loopback"}, slow=True),
    _case("m6_data.py index", ["--records", "10000", "--batches", "1", "--opens", "1"],
          "manifest: 10,000 records", {"mode", "records", "new", "old", "old_extrapolated_rss"}, slow=True),
    _case("m6_data.py workers", ["--workers", "1", "--steps", "1", "--rounds", "1"],
          "M6 tiny, micro-batch 16", {"mode", "workers", "policies"}, slow=True),
    _case("node_limited.py", ONCE, "node-limited routing at world 8", {"benchmark", "rows"}, slow=True),
]  # fmt: skip


# scripts that refuse to run here, the line they refuse with, and whether they could run instead
REFUSALS = [
    ("deepspeed_moe.py", "DeepSpeed is not importable", importlib.util.find_spec("deepspeed") is not None),
    ("profile_moe_layer.py", "needs a GPU", torch.cuda.is_available()),
]


def _run(script: str, flags: list[str], cwd, timeout: float = 300, **options) -> subprocess.CompletedProcess:
    name, *mode = script.split()
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *mode, *flags],
        cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout, **options,
    )  # fmt: skip


def test_every_benchmark_script_has_a_smoke_case():
    covered = {case.values[0].split()[0] for case in CASES} | {name for name, _, _ in REFUSALS}
    assert covered == {path.name for path in BENCHMARKS.glob("*.py") if not path.name.startswith("_")}


@pytest.mark.benchmarks  # make test-benchmarks (CI), not make test: ~2 minutes of CPU
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("script", "flags", "header", "keys"), CASES)
def test_a_benchmark_runs_at_its_smallest_settings(script, flags, header, keys, tmp_path):
    if script == "emulated_cluster.py" and (problem := _can_emulate()) is not None:
        pytest.skip(f"covered by tests/distributed/test_emulated_cluster.py; here: {problem}")
    if script == "fit_links.py":
        _write_a2a_report(tmp_path / "a2a.json")
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    out = tmp_path / "out.json"
    done = _run(script, flags + (["--json", str(out)] if keys is not None else []), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(header), done.stdout[:500]
    if keys is not None:
        saved = json.loads(out.read_text())
        assert keys <= set(saved), sorted(saved)
        if script == "m6_data.py index":
            _check_m6_index(saved)
        if script == "node_limited.py":
            _check_node_limited(saved, done.stdout)
    assert {p.name for p in tmp_path.iterdir()} <= {"out.json", "a2a.json"}  # no temporary file left


def _check_m6_index(saved: dict) -> None:
    """At 10,000 records the in-memory way's manifests are 10,000 records (not the 100k and 500k
    of a full run), and its bytes per record are its RSS over those records."""
    assert list(saved["old"]) == ["10000"]
    old = saved["old"]["10000"]
    assert old["per_record"] == pytest.approx(old["rss_delta"] / 10_000)
    assert saved["old_extrapolated_rss"] == pytest.approx(old["per_record"] * 10_000)
    assert saved["old_extrapolated_s"] == pytest.approx(old["seconds"])


def _check_node_limited(saved: dict, printed: str) -> None:
    """Each timed row carries the medians of the per-round ratios, and the table prints them."""
    timed = [row for row in saved["rows"] if "flat_layer_ms" in row]
    assert len(timed) == 6
    table = printed.split("time per layer", 1)[1]
    assert "ratios: median of the per-round ratios" in table.splitlines()[0]
    for row in timed:
        assert f"{row['dedup_over_flat']:.2f} | {row['dedup_over_hier']:>12.2f}" in table


@pytest.mark.parametrize(("script", "refusal", "runs_here"), REFUSALS, ids=[case[0] for case in REFUSALS])
def test_a_benchmark_that_cannot_run_here_refuses_in_one_line(script, refusal, runs_here, tmp_path):
    if runs_here:
        pytest.skip(f"{script} can run here: not a refusal")
    done = _run(script, [], cwd=tmp_path, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and refusal in errors[0], done.stderr
    assert "Traceback" not in done.stderr


BAD_FLAGS = [
    ("moe_layer.py", [*TINY_LAYER, "--repeats", "0"], "--repeats", "must be an integer >= 1, got 0"),
    ("moe_layer.py", [*TINY_LAYER, "--repeats", "1", "--warmup", "-5"], "--warmup", ">= 0, got -5"),
    ("moe_layer.py", [*TINY_LAYER, *ONCE, "--threads", "0"], "--threads", ">= 1, got 0"),
    ("moe_layer.py", [*TINY_LAYER, *ONCE, "--experts", "1"], "--top-k", "must be <= --experts (1), got 2"),
    ("cpu_adam.py", ["--numel", "0", "--reps", "1", "--warmup", "0"], "--numel", ">= 1, got 0"),
    ("log_every.py", ["--steps", "0", "--rounds", "1"], "--steps", ">= 1, got 0"),
    ("decode.py", ["--rounds", "0", "--batch", "1", "--new-tokens", "1"], "--rounds", ">= 1, got 0"),
    ("offload_step.py", ["--device", "cpu", "--params", "4", *ONCE], "--params", "must be a number >= 8"),
    ("offload_step.py", ["--device", "cpu", "--params", "64", *ONCE, "--threads", "0"], "--threads", "got 0"),
    ("offload_overlap.py", ["--params", "64", "--steps", "1", "--rounds", "0"], "--rounds", ">= 1, got 0"),
    ("checkpoint_stall.py", ["--rounds", "0", "--d-model", "16", "--d-ff", "16"], "--rounds", ">= 1, got 0"),
    ("all_to_all.py", ["--sizes-kib", "0", *ONCE], "--sizes-kib", ">= 1, got 0"),
    ("all_to_all.py", ["--emulated-mbit", "200", "--ranks-per-node", "0", "--sizes-kib", "16", *ONCE],
     "--ranks-per-node", ">= 1, got 0"),
    ("m6_data.py", ["index", "--records", "9999"], "--records", "must be an integer >= 10000"),
    ("m6_data.py", ["workers", "--workers", "0", "--steps", "1", "--rounds", "1"], "--workers", "got 0"),
    ("node_limited.py", ["--repeats", "0"], "--repeats", ">= 1, got 0"),
    ("pipeline_bubble.py", ["--steps", "0"], "--steps", ">= 1, got 0"),
    ("fit_links.py", ["{tmp}/missing.json", "--rate", "200"], "all_to_all_json", "no readable file"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("script", "flags", "flag", "message"), BAD_FLAGS, ids=[f"{case[0]} {case[2]}" for case in BAD_FLAGS]
)
def test_a_bad_number_is_one_argparse_line(script, flags, flag, message, tmp_path, monkeypatch, capsys):
    """In this process (argparse stops before any work): exit status 2, one error line naming the flag."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put benchmarks/ on it
    module = load_script(BENCHMARKS / script, f"benchmark_{script[:-3]}")
    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    monkeypatch.setattr(sys, "argv", [script, *flags])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    assert f"argument {flag}:" in errors[0] and message in errors[0], errors[0]


def _fsize_limit(limit: int):
    """For ``preexec_fn``: files of the child grow to ``limit`` bytes, then writes fail (EFBIG:
    Python ignores SIGXFSZ), standing in for a full disk or a kill part-way through a write."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_json_output_that_fails_part_way_keeps_the_previous_file(tmp_path):
    out = tmp_path / "out.json"
    out.write_text('{"previous": "good run"}\n')
    flags = ["--numel", "1000", "--reps", "20", "--warmup", "0", "--threads", "1", "--json", str(out)]
    done = _run("cpu_adam.py", flags, cwd=tmp_path, timeout=120, preexec_fn=_fsize_limit(1024))
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert json.loads(out.read_text()) == {"previous": "good run"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]  # no temporary file left


def test_fit_links_write_that_fails_part_way_keeps_the_library_source(tmp_path):
    """``--write`` rewrites ``moetrain/comm/chunk_cost.py``; run on a copy, with a file-size limit
    below that file's size: the copy keeps its bytes (old code: truncated, unparsable)."""
    (tmp_path / "benchmarks").mkdir()
    for path in BENCHMARKS.glob("*.py"):
        shutil.copy(path, tmp_path / "benchmarks")
    source = tmp_path / "moetrain" / "comm" / "chunk_cost.py"
    source.parent.mkdir(parents=True)
    shutil.copy(ROOT / "moetrain" / "comm" / "chunk_cost.py", source)
    before = source.read_bytes()
    assert len(before) > 4096
    report = _write_a2a_report(tmp_path / "a2a.json")
    done = subprocess.run(
        [sys.executable, str(tmp_path / "benchmarks" / "fit_links.py"), report, "--rate", "200", "--write"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120, preexec_fn=_fsize_limit(4096),
    )  # fmt: skip
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert source.read_bytes() == before
    assert sorted(p.name for p in source.parent.iterdir()) == ["chunk_cost.py"]


def test_an_atomic_write_keeps_the_files_permission_bits(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    cli = load_script(BENCHMARKS / "_cli.py", "benchmarks_cli")
    path = tmp_path / "source.py"
    path.write_text("old\n")
    path.chmod(0o640)
    cli.write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and path.stat().st_mode & 0o777 == 0o640
    cli.write_json(tmp_path / "new.json", {"a": 1})
    assert json.loads((tmp_path / "new.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "source.py"]


def test_checkpoint_stall_dir_keeps_what_the_directory_holds(tmp_path):
    """``--dir DIR``: the checkpoints go to a fresh directory under DIR, removed afterwards; files
    the user keeps in DIR/sync or DIR/async are not touched (old code deleted both)."""
    for name in ("sync", "async"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "notes.txt").write_text("precious")
    flags = ["--d-model", "16", "--layers", "1", "--experts", "2", "--d-ff", "16", "--batch", "1",
             "--rounds", "1", "--warmup", "0", "--threads", "1", "--dir", str(tmp_path)]  # fmt: skip
    done = _run("checkpoint_stall.py", flags, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        "async", "async/notes.txt", "sync", "sync/notes.txt",
    ]  # fmt: skip


def test_node_limited_times_the_three_algorithms_round_by_round(monkeypatch):
    """``_layers_ms`` runs flat, hierarchical and node_dedup once each per round, in turn (warm-up
    rounds included), and returns each one's times of the timed rounds."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    node_limited = load_script(BENCHMARKS / "node_limited.py", "benchmark_node_limited")
    monkeypatch.setattr(node_limited.dist, "barrier", lambda: None)
    monkeypatch.setattr(node_limited.dist, "all_reduce", lambda tensor, op=None: None)
    calls = []

    class Layer:
        def __init__(self, name):
            self.name = name

        def __call__(self, x):
            calls.append(self.name)
            return x.sum()

    names = ("flat", "hierarchical", "node_dedup")
    args = argparse.Namespace(warmup=1, repeats=2)
    samples = node_limited._layers_ms({n: Layer(n) for n in names}, torch.ones(2, 2), torch.ones(()), args)
    assert calls == list(names) * 3
    assert {name: len(times) for name, times in samples.items()} == dict.fromkeys(names, 2)
