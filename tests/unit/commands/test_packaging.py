"""Installing moetrain as a user does, outside this repository's virtual environment.

The wheel is what README's ``pip install --no-build-isolation .`` builds: setup.py run by pip in
this checkout against the test run's torch, so ninja finds ``make build``'s object files in
build/temp and only links (a fresh compile took ~4 of the suite's minutes). It is installed, not
editable, in a fresh virtualenv beside the same torch release, pip and build tools (hard links to
the test run's files, which pip sees installed), and from a directory that has its own ``models/``
package (as many user projects do) the installed ``moetrain`` command trains the LM (without the
``[m6]`` extra's Pillow: no warning) and the M6 model (with it) one step each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain._build_spec import TORCH_REQUIREMENT
from tests.helpers.paths import ROOT

BUILD_TOOLS = ["setuptools>=77", "wheel", "ninja", "pybind11", "numpy", "pyyaml"]  # no [m6] extra yet


def test_every_package_directory_is_listed_for_the_wheel():
    """A subpackage missing from pyproject's list imports here but not from the installed wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "moetrain").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert found - listed == set(), f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert "m6_moe" in listed


def test_version_floors_agree_between_the_makefile_and_pyproject():
    """A package pinned in both the Makefile's DEPS (what `make test` installs) and pyproject's
    extras carries the same version specifier in each."""
    import tomllib

    line = next(t for t in (ROOT / "Makefile").read_text().splitlines() if t.startswith("DEPS :="))
    split = re.compile(r"^([A-Za-z0-9_.-]+)\s*(.*)$")

    def specifiers(requirements) -> dict[str, str]:
        parsed = (split.match(r.strip()).groups() for r in requirements)
        return {name.lower(): spec for name, spec in parsed if spec}

    make = specifiers(line.split(":=", 1)[1].split())
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, requirements in extras.items():
        for name, spec in specifiers(requirements).items():
            if name in make:
                assert spec == make[name], f"{name}: [{extra}] has {spec}, Makefile DEPS {make[name]}"
    assert "sacrebleu" in make


WITHOUT_M6_EXTRA = """
import logging, sys
for name in ("PIL", "PIL.Image", "PIL.ImageDraw", "sacrebleu", "sacrebleu.metrics"):
    sys.modules[name] = None  # an import of these now fails as when they are not installed
logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(name)s: %(message)s")
from moetrain.registry import registered_models
assert "m6_moe" in registered_models()
from m6_moe import ensure_synthetic_dataset
from m6_moe.metrics import bleu4
for use in (lambda: ensure_synthetic_dataset(sys.argv[1], num_train=1, num_heldout=1, progress=False),
            lambda: bleu4(["a"], [["a"]])):
    try:
        use()
    except ImportError as error:
        print(error)
from moetrain.cli import main
print("exit", main(["train", "--config", "models/m6_moe/tiny.yaml", "--set", f"out_dir={sys.argv[1]}"]))
"""


def test_m6_registers_without_its_optional_packages_and_names_the_extra_when_they_are_needed(tmp_path):
    """Pillow and sacrebleu are the ``[m6]`` extra: a base install registers ``m6_moe`` on every
    command without them and without a warning; an M6 run that needs them stops with one line."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_M6_EXTRA, str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr and "failed to register" not in done.stderr, done.stderr
    pillow = (
        "the M6 model reads and draws images with Pillow, which is not installed (pip install 'moetrain[m6]')"
    )
    assert done.stdout.splitlines() == [
        pillow,
        "BLEU-4 needs the 'sacrebleu' package, which is not installed (pip install 'moetrain[m6]')",
        "exit 2",
    ]
    errors = [line for line in done.stderr.splitlines() if line.startswith("moetrain: error:")]
    assert len(errors) == 1 and pillow in errors[0] and "Traceback" not in done.stderr


def _run(command: list[str], cwd: Path, timeout: float, env: dict | None = None) -> str:
    result = subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result.stdout + result.stderr


def _site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(
        subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    )


def _link_distributions(names: list[str], site_packages: Path) -> set[str]:
    """Installs the distributions ``names`` and those they require (their extras left out) into
    ``site_packages`` as hard links to this interpreter's files, RECORD included, so pip sees them
    installed: the test run's torch in a second where ``pip install torch`` unpacks and byte-compiles
    ~900 MB in ~45 s. Files outside the distribution's site-packages (console scripts) are left out;
    a file on another filesystem is copied. Returns the canonical names installed."""
    import shutil
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    done, todo = set(), list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        key = canonicalize_name(dist.metadata["Name"])
        if key in done:
            continue
        done.add(key)
        base = Path(dist.locate_file("")).resolve()
        for file in dist.files or ():
            source = Path(dist.locate_file(file)).resolve()
            if not source.is_relative_to(base) or not source.is_file():
                continue
            target = site_packages / source.relative_to(base)
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, target)
            except OSError:
                shutil.copy2(source, target)
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return done


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_wheel_in_a_fresh_virtualenv_trains_next_to_a_users_models_package(tmp_path):
    import torch
    from packaging.requirements import Requirement

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, 120)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "--disable-pip-version-check", "--quiet"]
    torch_release = torch.__version__.split("+")[0]
    # pip and the build tools linked as torch is (ensurepip and pip's install of them took ~8 s)
    tools = [Requirement(tool).name for tool in BUILD_TOOLS]
    linked = _link_distributions(["pip", "torch", *tools], _site_packages(python))
    assert "torch" in linked and "sympy" in linked and "numpy" in linked
    assert "pillow" not in linked  # the first run below is without the [m6] extra
    _run([*pip, "install", f"torch=={torch_release}", *BUILD_TOOLS], tmp_path, 600)  # all there already

    env = {**os.environ, "MAX_JOBS": "2"}
    env.pop("PYTHONPATH", None)
    wheels = tmp_path / "wheels"
    build = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet", "wheel"]
    _run([*build, "--no-build-isolation", "--no-deps", "-w", str(wheels), str(ROOT)], tmp_path, 900, env)
    (wheel,) = wheels.glob("moetrain-*.whl")
    _run([*pip, "install", str(wheel)], tmp_path, 300, env)
    listing = _run([str(python), "-m", "pip", "show", "--files", "moetrain"], tmp_path, 60, env)
    assert "__editable__" not in listing and "moetrain/_C" in listing
    metadata = _run(
        [str(python), "-c", "import importlib.metadata as m; print(m.requires('moetrain'))"],
        tmp_path,
        60,
        env,
    )
    torch_requirement = re.search(r"'(torch[<>=!~][^']*)'", metadata).group(1)  # pip orders the specifiers
    assert set(torch_requirement[len("torch") :].split(",")) == set(
        TORCH_REQUIREMENT[len("torch") :].split(",")
    )
    assert "moetrain/_csrc/bindings.cpp" in listing  # the sources that build travels with the wheel

    project = tmp_path / "user_project"  # a user's project with its own `models` package
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text("USERS_OWN_MODELS = True\n")
    moetrain = str(venv / "bin" / "moetrain")
    lm = {
        "model": {"name": "moe_lm", "d_model": 32, "num_layers": 1, "num_heads": 2, "max_seq_len": 16,
                  "moe": {"d_ff": 32, "num_experts": 4, "top_k": 2}},
        "data": {"micro_batch_size": 2, "seq_len": 16}, "steps": 1, "out_dir": str(project / "runs" / "lm"),
        "threads": 1, "device": "cpu",
    }  # fmt: skip
    (project / "lm.json").write_text(json.dumps(lm))
    output = _run([moetrain, "train", "--config", "lm.json"], project, 300, env)
    assert "failed to register" not in output  # m6_moe registers without Pillow (the [m6] extra)
    _run([*pip, "install", "pillow"], tmp_path, 300)
    m6 = ROOT / "models" / "m6_moe" / "tiny.yaml"
    overrides = ["steps=1", "data.micro_batch_size=2", "model.num_layers=1", "threads=1", "device=cpu",
                 f"out_dir={project / 'runs' / 'm6'}"]  # fmt: skip
    _run(
        [moetrain, "train", "--config", str(m6), *(x for o in overrides for x in ("--set", o))],
        project,
        300,
        env,
    )
    for run in ("lm", "m6"):
        metrics = (project / "runs" / run / "metrics.jsonl").read_text().splitlines()
        assert json.loads(metrics[-1])["step"] == 1
    probe = "import m6_moe, moetrain, models; print(moetrain.__file__, models.USERS_OWN_MODELS)"
    where = _run([str(python), "-c", probe], project, 60, env)
    assert "site-packages" in where and "True" in where
