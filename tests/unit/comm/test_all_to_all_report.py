"""``benchmarks/all_to_all.py --report``: the grid printed is the one the saved run ran on, and a
fit with a non-positive constant (noise on a loaded machine) predicts nothing for 60 x 8."""

from __future__ import annotations

import argparse
import itertools
import json

from tests.helpers.paths import ROOT, load_script


def _benchmark():
    return load_script(ROOT / "benchmarks" / "all_to_all.py", "all_to_all_benchmark")


def _rows(alpha: float, beta_intra: float, beta_inter: float) -> list[dict]:
    """Rows of every wire whose round trips follow ``alpha * messages + beta_intra * intra +
    beta_inter * inter`` exactly, so the fit (over the fp32 rows) returns these constants."""
    rows = []
    for algorithm, messages, intra_share in (("flat", 6, 0.5), ("hierarchical", 4, 1.5)):
        for payload, wire in itertools.product((16384, 65536, 262144, 1048576), ("fp32", "bf16", "fp16")):
            intra, inter = int(payload * intra_share), 2 * payload
            seconds = alpha * messages + beta_intra * intra + beta_inter * inter
            rows.append(
                {
                    "algorithm": algorithm, "wire": wire, "payload_bytes": payload,
                    "round_trip_ms": seconds * 1e3, "messages_per_rank": messages,
                    "intra_bytes_per_rank": intra, "cross_node_bytes_per_rank": payload,
                    "node_inter_bytes": inter,
                }
            )  # fmt: skip
    return rows


def _report(runs: dict, tmp_path, capsys) -> tuple[str, dict]:
    out = tmp_path / "fit.json"
    args = argparse.Namespace(ranks_per_node=4, inter_node_gbps=35.0, json=str(out))
    _benchmark().report(runs, args)
    return capsys.readouterr().out, json.loads(out.read_text())


def test_a_fit_with_a_negative_link_constant_predicts_nothing(tmp_path, capsys):
    runs = {"200mbit": {"rows": _rows(1e-3, 2e-7, -5e-8), "ranks_per_node": 2}}
    printed, saved = _report(runs, tmp_path, capsys)
    assert "emulated fit has a non-positive constant" in printed, printed
    assert "carried to 60 nodes" not in printed and "prediction_60x8" not in saved["fit_emulated"]


def test_a_good_fit_predicts_and_the_title_names_the_run_s_grid(tmp_path, capsys):
    runs = {"200mbit": {"rows": _rows(1e-4, 2e-9, 4e-8), "ranks_per_node": 2}}
    printed, saved = _report(runs, tmp_path, capsys)
    assert "world 4 = 2 nodes x 2" in printed, printed  # the run's grid, not --ranks-per-node 4
    assert "emulated fit carried to 60 nodes x 8" in printed
    assert saved["runs"]["200mbit"]["ranks_per_node"] == 2 and "prediction_60x8" in saved["fit_emulated"]
