"""Reading a config file (moetrain.config.files, moetrain.config.loading): the config's folder is on
sys.path only while the modules under ``imports`` import; YAML 1.2 integers (``010`` is 10, also for
``--resume-from``); a key given twice, a value JSON cannot hold (a date, ``!!binary``, ``!!set``) and a
list as ``model.name`` are one-line errors naming the key."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from moetrain import cli
from moetrain.config.files import build_train_config, load_config_file, parse_yaml
from tests.helpers.paths import ROOT

BASE = (ROOT / "configs" / "tiny_lm.yaml").read_text(encoding="utf-8")


def _config(folder, text: str, name: str = "run.yaml") -> str:
    """``text`` written as config file ``name`` in ``folder``; returns its path."""
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def _without(key: str) -> str:
    """The tiny LM config without its top-level line for ``key``."""
    return "".join(line for line in BASE.splitlines(keepends=True) if not line.startswith(f"{key}:"))


@pytest.fixture
def module_names(monkeypatch):
    """Names for modules a test writes beside its config; sys.path and sys.modules as they were after."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    names = ["shadowing_mod_cfgtest", "beside_mod_cfgtest"]
    yield names
    for name in names:
        sys.modules.pop(name, None)


def test_a_config_without_imports_leaves_its_folder_off_sys_path(tmp_path, module_names):
    shadow = module_names[0]
    (tmp_path / f"{shadow}.py").write_text("raise RuntimeError('code beside the config ran')\n")
    build_train_config(_config(tmp_path, BASE), [])
    assert str(tmp_path) not in sys.path
    assert importlib.util.find_spec(shadow) is None  # a later `import` cannot run the file


def test_imports_are_read_beside_the_config_and_the_folder_leaves_sys_path(tmp_path, module_names):
    shadow, beside = module_names
    (tmp_path / f"{shadow}.py").write_text("raise RuntimeError('code beside the config ran')\n")
    (tmp_path / f"{beside}.py").write_text("LOADED = True\n")
    build_train_config(_config(tmp_path, f"imports: [{beside}]\n" + BASE), [])
    assert sys.modules[beside].LOADED and sys.modules[beside].__file__ == str(tmp_path / f"{beside}.py")
    assert str(tmp_path) not in sys.path
    assert importlib.util.find_spec(shadow) is None


def test_a_missing_import_is_an_error_and_the_folder_leaves_sys_path(tmp_path, module_names):
    with pytest.raises(ValueError, match="^imports: cannot import 'beside_mod_cfgtest'"):
        build_train_config(_config(tmp_path, f"imports: [{module_names[1]}]\n" + BASE), [])
    assert str(tmp_path) not in sys.path


def test_integers_are_yaml_1_2_decimal_with_leading_zeros():
    assert parse_yaml("[010, 00001000, -007, 0o17, 0x1f, 1_000, 0, 1e-4]") == [
        10,
        1000,
        -7,
        15,
        31,
        1000,
        0,
        1e-4,
    ]
    assert parse_yaml("[0b11, '010', 1:30]") == ["0b11", "010", "1:30"]  # no YAML 1.1 binary or base 60


def test_config_ints_with_leading_zeros_are_decimal(tmp_path):
    config = build_train_config(_config(tmp_path, _without("steps") + "seed: 010\nsteps: 0200\n"), [])
    assert (config.seed, config.steps) == (10, 200)
    config = build_train_config(_config(tmp_path, BASE), ["resume_from=00001000", "seed=010"])
    assert (config.resume_from, config.seed) == (1000, 10)


@pytest.mark.parametrize(
    "given,override",
    [
        ("00001000", "resume_from=1000"),
        ("0100", "resume_from=100"),
        ("latest-valid", "resume_from=latest-valid"),
    ],
    ids=["zeros", "octal-looking", "a-name"],
)
def test_resume_from_digits_are_a_base_10_step(given, override, monkeypatch, tmp_path):
    seen = []

    def record(config, overrides, strategy=None):
        seen.append(overrides)
        raise ValueError("recorded")

    monkeypatch.setattr(cli, "build_train_config", record)
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml"), "--resume-from", given]) == 2
    assert seen == [[override]]


@pytest.mark.parametrize(
    "text,named",
    [
        (BASE + "seed: 1\nseed: 2\n", r"duplicate key 'seed' on line \d+ \(first given on line \d+\)"),
        (
            BASE.replace("  lr: 3.0e-3\n", "  lr: 3.0e-3\n  lr: 1.0e-3\n"),
            r"duplicate key 'lr' on line 23 \(first given on line 22\)",
        ),
    ],
    ids=["top-level", "nested"],
)
def test_a_key_given_twice_is_an_error_naming_it_and_its_line(text, named, tmp_path):
    path = _config(tmp_path, text)
    with pytest.raises(ValueError, match=f"^config {path} is not valid YAML: {named}") as error:
        build_train_config(path, [])
    assert "\n" not in str(error.value)


def test_a_key_given_twice_in_json_is_an_error_naming_it(tmp_path):
    path = _config(tmp_path, '{"steps": 1, "steps": 2}', "run.json")
    with pytest.raises(ValueError, match=f"^config {path} is not valid JSON: duplicate key 'steps'$"):
        load_config_file(path)


def test_a_merged_key_may_be_overridden():
    assert parse_yaml("a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\n")["d"] == {"b": 3, "c": 2}


@pytest.mark.parametrize(
    "value,reason",
    [
        ("2024-01-01", "a date is not allowed here; quote it to make a string"),
        ("!!binary aGVsbG8=", r"binary data \(!!binary\) is not allowed here; allowed: strings, numbers"),
        ("!!set {a, b}", r"a set \(!!set\) is not allowed here; write a list"),
    ],
    ids=["date", "binary", "set"],
)
def test_a_value_json_cannot_hold_is_an_error_naming_the_key(value, reason, tmp_path):
    path = _config(tmp_path, _without("out_dir") + f"out_dir: {value}\n")
    with pytest.raises(ValueError, match=f"^config {path}: out_dir: {reason}"):
        build_train_config(path, [])


def test_a_date_given_by_set_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"^--set optim\.betas\[0\]: a date is not allowed here"):
        build_train_config(_config(tmp_path, BASE), ["optim.betas=[2024-01-01, 0.9]"])


def test_a_list_as_model_name_is_an_error_naming_the_models(tmp_path):
    path = _config(tmp_path, BASE.replace("name: moe_lm", "name: [moe_lm]"))
    with pytest.raises(ValueError, match=r"^model\.name must be one of .*'moe_lm'.*, got \['moe_lm'\]$"):
        build_train_config(path, [])
