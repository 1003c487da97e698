"""The M6-1T figures quoted in README.md, configs/m6_1t.yaml, the 480-GPU sbatch script, its README
and docs/planner.md are the planner's output (scripts/update_plan_figures.py writes them; here it
checks them)."""

from __future__ import annotations

import pytest

from tests.helpers.paths import ROOT, load_script

SCRIPT = ROOT / "scripts" / "update_plan_figures.py"


@pytest.fixture(scope="module")
def figures():
    return load_script(SCRIPT)


def test_quoted_figures_are_the_planners_output(figures, capsys):
    assert figures.main(["--check"]) == 0, capsys.readouterr().err


def test_a_changed_figure_is_reported_and_the_script_restores_it(figures, tmp_path, monkeypatch, capsys):
    copies = {}
    for name in ("README", "CONFIG", "SBATCH", "SLURM_README", "PLANNER_DOC"):
        original = getattr(figures, name)
        copies[name] = tmp_path / name.lower() / original.name  # two README.md
        copies[name].parent.mkdir()
        copies[name].write_text(original.read_text(encoding="utf-8"), encoding="utf-8")
        monkeypatch.setattr(figures, name, copies[name])
    monkeypatch.setattr(figures, "ROOT", tmp_path)
    config = copies["CONFIG"].read_text(encoding="utf-8")
    budget = next(line for line in config.splitlines() if line.startswith("recompute_budget_mb:")).split()[1]
    copies["CONFIG"].write_text(
        config.replace(f"recompute_budget_mb: {budget}", "recompute_budget_mb: 1"), encoding="utf-8"
    )
    readme = copies["README"].read_text(encoding="utf-8")
    copies["README"].write_text(readme.replace("GPU memory per GPU", "GPU memory", 1), encoding="utf-8")
    slurm = copies["SLURM_README"].read_text(encoding="utf-8")
    size = figures.CHECKPOINT_SIZE.search(slurm).group(0)
    copies["SLURM_README"].write_text(slurm.replace(size, "33.00 GiB per rank (14.00 TiB per run)"), "utf-8")
    doc = copies["PLANNER_DOC"].read_text(encoding="utf-8")
    copies["PLANNER_DOC"].write_text(doc.replace("x fewer messages", "x fewer messages!", 1), "utf-8")
    assert figures.main(["--check"]) == 1
    stale = "readme/README.md, config/m6_1t.yaml, slurm_readme/README.md, planner_doc/planner.md"
    assert f"out of date: {stale};" in capsys.readouterr().err
    assert figures.main([]) == 0
    assert copies["CONFIG"].read_text(encoding="utf-8") == config
    assert copies["README"].read_text(encoding="utf-8") == readme
    assert copies["SLURM_README"].read_text(encoding="utf-8") == slurm
    assert copies["PLANNER_DOC"].read_text(encoding="utf-8") == doc


def test_missing_markers_are_one_line(figures, tmp_path):
    with pytest.raises(
        SystemExit, match="the marker lines '# plan-figures:begin' and '# plan-figures:end' are"
    ):
        figures.replace_between("no markers here\n", ["x"], "# ", tmp_path / "f.yaml")
