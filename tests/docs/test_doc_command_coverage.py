"""Every documented command is run by a test: each runnable fenced block of README.md and docs/*.md
(``bash``, ``sh``, ``shell``, ``console``, ``python``, and untagged blocks with a line that starts
like a command; tests/helpers/doc_commands.py) is either in ``RUN_BY``, with the test that runs it,
or in ``NOT_RUN``, with one of ``REASONS``. A block is named by its page and key (its first command:
``doc_commands.block_key``). A new block without an entry fails, and so does an entry whose block is
gone, whose test does not exist or does not read the page, or whose reason does not fit its block.
"""

# ruff: noqa: E501 - RUN_BY's and NOT_RUN's keys are the pages' command lines, verbatim

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from tests.helpers.doc_commands import PYTHON_LANGUAGES, DocBlock, doc_blocks, documented_blocks
from tests.helpers.paths import ROOT

GPU = "needs a GPU"
SLURM = "needs SLURM"
NETWORK = "needs the network"
SETUP = "the set-up commands make demo/make test (run by CI itself)"
SKETCH = "a sketch with placeholder names"
REASONS = {  # reason: words one of which the block must contain (a sketch: names it never defines)
    GPU: ("cuda", "gpu"),
    SLURM: ("sbatch", "srun", "slurm"),
    NETWORK: ("pip install", "http", "download", "from_pretrained"),
    SETUP: ("make demo", "make test"),
    SKETCH: (),
}

EXAMPLES = "tests/docs/test_doc_examples.py"
PLANNER = "tests/unit/planner/test_planner.py"
ROUTING = "tests/unit/layers/test_node_limited_routing.py"

RUN_BY = {
    ("README.md", "class Block(nn.Module):"): f"{EXAMPLES}::test_readme_swap_your_ffn_example",
    ("README.md", ".venv/bin/moetrain train --config configs/tiny_lm.yaml --set steps=300 --set optim.lr=1e-3"):
        "tests/docs/test_readme_train_block.py::test_the_readme_train_block_trains_with_each_command_in_order",
    ("README.md", "moetrain plan --model configs/m6_1t.yaml --cluster v100-32gb --nodes 60 --inter-node-gbps 35"):
        "tests/docs/test_plan_figures.py::test_quoted_figures_are_the_planners_output",
    ("docs/checkpoint.md", "ctx = ParallelContext(ep_size=4)"):
        f"{EXAMPLES}::test_checkpoint_example_saves_then_resumes_on_four_ranks",
    ("docs/expert_parallel.md", "python benchmarks/all_to_all.py --emulated-mbit 100 200 400 --json a2a.json"):
        "tests/distributed/test_emulated_cluster.py::test_the_documented_emulated_cluster_commands_run",
    ("docs/m6.md", 'config = M6Config.preset("1T")'): f"{EXAMPLES}::test_m6_1t_preset_counts_on_meta",
    ("docs/m6.md", "moetrain train --config models/m6_moe/tiny.yaml"):
        f"{EXAMPLES}::test_m6_pretrain_then_evaluate_and_generate",
    ("docs/m6.md", 'print(evaluate_captioning(model, ByteTokenizer(), "runs/m6_tiny/data"))'):
        f"{EXAMPLES}::test_m6_pretrain_then_evaluate_and_generate",
    ("docs/m6.md", "python -m m6_moe.index_command /data/m6/laion-zh.jsonl /data/m6/shards/part-*.jsonl"):
        f"{EXAMPLES}::test_m6_manifest_check_and_index_command_with_a_glob_and_prune",
    ("docs/m6.md", 'dataset = ManifestDataset("/data/m6/train.jsonl", image_size=224)'):
        f"{EXAMPLES}::test_m6_manifest_check_and_index_command_with_a_glob_and_prune",
    ("docs/m6.md", "generate(model, tokenizer, images=pixels_uint8_BCHW)"):
        f"{EXAMPLES}::test_m6_pretrain_then_evaluate_and_generate",
    ("docs/m6.md", "moetrain train --config captions.yaml"):
        "tests/docs/test_m6_walkthrough.py::test_walkthrough_trains_evaluates_and_generates",
    ("docs/moefy.md", "config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=64)"):
        "tests/docs/test_moefy_doc.py::test_the_documented_examples_run",
    ("docs/moefy.md", 'model.eval().save_pretrained("gpt2-moe")'):
        "tests/docs/test_moefy_doc.py::test_the_documented_examples_run",
    ("docs/moefy.md", "moetrain train --config scripts/examples/hf_moefy/config.yaml"):
        "tests/docs/test_moefy_doc.py::test_the_documented_commands_run",
    ("docs/own_model.md", "moetrain train --config scripts/examples/own_model/config.yaml"):
        "tests/docs/test_own_model_doc.py::test_documented_commands_train_resume_on_two_ranks_and_plan",
    ("docs/own_model.md", "moetrain plan --model scripts/examples/own_model/config.yaml --cluster a100-80gb --nodes 2 --ep-size 4"):
        "tests/docs/test_own_model_doc.py::test_documented_commands_train_resume_on_two_ranks_and_plan",
    ("docs/parallelize.md", "moetrain launch --standalone --nproc-per-node 4 scripts/examples/parallelize.py"):
        "tests/docs/test_parallelize_doc.py::test_documented_commands_run",
    ("docs/pipeline.md", "moetrain launch --standalone --nproc-per-node 2 -m moetrain.cli train --config configs/tiny_lm.yaml --set parallel.pp_size=2 --set parallel.pp_schedule=1f1b --set grad_accum=4 --set data.micro_batch_size=4 --set steps=3 --set log_every=1 --set out_dir=runs/pp2"):
        "tests/docs/test_pipeline_doc.py::test_documented_commands_run",
    ("docs/pipeline.md", "moetrain launch --standalone --nproc-per-node 2 -m moetrain.cli train --config models/m6_moe/tiny.yaml --set parallel.pp_size=2 --set parallel.pp_schedule=gpipe --set model.tie_embeddings=false --set grad_accum=2 --set data.micro_batch_size=4 --set data.num_workers=0 --set steps=2 --set log_every=1 --set checkpoint_every=2 --set out_dir=runs/m6pp2"):
        "tests/docs/test_pipeline_doc.py::test_documented_commands_run",
    ("docs/planner.md", "moetrain plan --model m6-1T --cluster v100-32gb --nodes 60 --inter-node-gbps 35"):
        f"{PLANNER}::test_the_commands_at_the_top_of_docs_planner_md_run",
    ("docs/planner.md", 'model, _ = resolve_model("m6-1T")'): f"{EXAMPLES}::test_planner_python_api_example",
    ("docs/planner.md", "moetrain train --config configs/tiny_lm.yaml --set steps=20 --set out_dir=runs/calib"):
        f"{EXAMPLES}::test_planner_calibrate_on_a_measured_run",
    ("docs/planner.md", "moetrain plan --model configs/m6_1t.yaml --cluster v100-32gb --nodes 60 --inter-node-gbps 35"):
        "tests/unit/planner/test_planner_node_limit.py::test_the_m6_1t_section_of_docs_planner_md_is_the_planner_s_output",
    ("docs/planner.md", "sed 's/num_prototypes: 2 /num_prototypes: 1 /' configs/m6_1t.yaml > m6_1t_top2.yaml"):
        "tests/unit/planner/test_planner_node_limit.py::test_the_m6_1t_section_of_docs_planner_md_is_the_planner_s_output",
    ("docs/planner.md", "moetrain plan --model m6-base --cluster v100-32gb --nodes 4 --mixed p100-16gb:4 --precision fp16 --global-batch 1024"):
        f"{PLANNER}::test_cli_mixed_cluster_reports_the_balanced_speedup",
    ("docs/recompute.md", "config = LMConfig("):
        "tests/unit/machinery/test_recompute_budget.py::test_documented_example_logs_the_plan",
    ("docs/routing.md", "layer = MoELayer(d_model=16, d_ff=32, num_experts=8, top_k=4, max_nodes_per_token=1)"):
        f"{ROUTING}::test_the_documented_example_runs",
    ("docs/routing.md", "python scripts/demo.py --steps 2400 --out-dir runs/node_limit_none --set model.moe.num_prototypes=1 --set parallel.local_world_size=1"):
        f"{ROUTING}::test_the_documented_quality_runs_start",
    ("docs/training.md", "moetrain train --config run.yaml --resume-from latest-valid"):
        f"{EXAMPLES}::test_training_resume_choices",
}  # fmt: skip

NOT_RUN = {
    ("README.md", "make demo"): SETUP,
    ("docs/expert_parallel.md", "init_distributed()"): SKETCH,
    ("docs/gpu.md", "make gpu-check"): GPU,
    ("docs/gpu.md", "make clean && make build"): GPU,
    ("docs/gpu.md", "OMP_NUM_THREADS=2 .venv/bin/python -m pytest -q tests/gpu/test_cuda_kernels.py"): GPU,
    ("docs/gpu.md", ".venv/bin/python -m pytest -q tests/gpu/test_cuda_compile.py"): GPU,
    ("docs/gpu.md", "python benchmarks/moe_layer.py --device cuda --dtype bf16 [--json PATH]"): GPU,
    ("docs/offload.md", "config = LMConfig("): GPU,
    ("docs/offload.md", 'optimizer = OffloadOptimizer(groups, lr=3e-4, num_apply_groups=8, overlap="delayed", overlap_after_steps=100)'): SKETCH,
    ("docs/offload.md", 'model = MoETransformerLM(config).to("cuda", torch.float16)'): GPU,
    ("docs/offload.md", "inner = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=True)"): SKETCH,
    ("docs/own_model.md", 'register_model("my_moe_classifier", DigitSumConfig, build)'): SKETCH,
    ("docs/parallelize.md", "parallel = ParallelContext(ParallelConfig(ep_size=2, tp_size=2))"): SKETCH,
    ("docs/parallelize.md", "class Attention(nn.Module):"): SKETCH,
    ("docs/parallelize.md", "strategy = {"): SKETCH,
    ("docs/parallelize.md", "class Block(nn.Module):"): SKETCH,
    ("docs/parallelize.md", 'with torch.device("meta"):'): SKETCH,
    ("docs/parallelize.md", "with moetrain.experts_on_meta():"): SKETCH,
    ("docs/planner.md", "speeds = calibrate_speeds(step_fn, sizes=(2, 4, 8), group=dp_group)"): SKETCH,
}  # fmt: skip


def undefined_names(source: str) -> set[str]:
    """The names ``source`` reads but never binds (assignment, import, def, class, argument,
    ``for``/``with``/``except`` target) and that are not builtins: what a reader must supply."""
    tree = ast.parse(source)
    bound = set(dir(builtins))
    loaded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound


def _entry(block: DocBlock) -> str:
    return f"{block.where}: ({block.page!r}, {block.key!r})"


def uncovered(blocks: list[DocBlock], run_by: dict, not_run: dict) -> list[str]:
    """The blocks with no entry in ``run_by`` or ``not_run``."""
    return [_entry(b) for b in blocks if (b.page, b.key) not in run_by and (b.page, b.key) not in not_run]


def stale(blocks: list[DocBlock], entries) -> list[tuple[str, str]]:
    """The ``(page, key)`` entries no block has, and those in both maps."""
    present = {(b.page, b.key) for b in blocks}
    return sorted(set(entries) - present)


def missing_tests(run_by: dict, root: Path = ROOT) -> list[str]:
    """The tests of ``run_by`` whose file or function (``path::name`` or ``path::Class::name``) does
    not exist, or whose file never names the page it is said to run."""
    problems = []
    for (page, key), test_id in sorted(run_by.items()):
        path, *names = test_id.split("::")
        file = root / path
        if not file.is_file():
            problems.append(f"{test_id} ({page}: {key!r}): no file {path}")
            continue
        source = file.read_text(encoding="utf-8")
        scope: list[ast.stmt] = ast.parse(source).body
        for name in names:
            found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == name]
            if not found:
                problems.append(f"{test_id} ({page}: {key!r}): no {name} in {path}")
                break
            scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
        else:
            if Path(page).name not in source:
                problems.append(f"{test_id} ({page}: {key!r}): {path} never names {Path(page).name}")
    return problems


def bad_excuses(blocks: list[DocBlock], not_run: dict) -> list[str]:
    """The ``not_run`` entries whose reason is not one of ``REASONS`` or does not fit the block: a
    sketch must be a Python block with names it never defines; another reason's block must
    contain one of its words."""
    problems = []
    for block in blocks:
        reason = not_run.get((block.page, block.key))
        if reason is None:
            continue
        if reason not in REASONS:
            problems.append(f"{_entry(block)}: {reason!r} is not one of {sorted(REASONS)}")
        elif reason == SKETCH:
            if block.language not in PYTHON_LANGUAGES or not undefined_names(block.text):
                problems.append(
                    f"{_entry(block)}: a sketch is a Python block that uses names it never defines"
                )
        elif not any(word in block.text.lower() for word in REASONS[reason]):
            problems.append(f"{_entry(block)}: {reason!r}, yet the block names none of {REASONS[reason]}")
    return problems


def test_every_documented_block_is_run_by_a_test_or_excused():
    missing = uncovered(documented_blocks(), RUN_BY, NOT_RUN)
    assert not missing, (
        "documented blocks that no test runs; add each to RUN_BY in tests/docs/test_doc_command_coverage.py "
        f"with the test that runs it, or to NOT_RUN with one of {sorted(REASONS)}:\n" + "\n".join(missing)
    )


def test_every_entry_names_a_block_the_pages_still_have():
    gone = stale(documented_blocks(), [*RUN_BY, *NOT_RUN])
    assert not gone, f"entries whose block changed its first command or was removed: {gone}"
    assert not set(RUN_BY) & set(NOT_RUN), set(RUN_BY) & set(NOT_RUN)


def test_every_named_test_exists_and_reads_its_page():
    problems = missing_tests(RUN_BY)
    assert not problems, "\n".join(problems)


def test_every_reason_is_a_fixed_one_that_fits_its_block():
    problems = bad_excuses(documented_blocks(), NOT_RUN)
    assert not problems, "\n".join(problems)


PAGE = """# A page

```bash
# set-up first
make demo   # comment
```

```python
import torch
from x import (
    a,
)
print(a, torch)  # shown
```

```
output only
```

```
$ moetrain plan --model m \\
    --nodes 2
a line of output
```

- A list item:

  ```
  OMP_NUM_THREADS=2 python tool.py
  ```

```yaml
steps: 2
```

```bash
make demo
```
"""


def test_blocks_are_found_and_keyed_and_every_kind_of_problem_is_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE, encoding="utf-8")
    blocks = doc_blocks(page)
    assert [(b.line, b.language, b.key) for b in blocks] == [
        (3, "bash", "make demo"),
        (8, "python", "print(a, torch)"),
        (20, "", "moetrain plan --model m"),
        (28, "", "OMP_NUM_THREADS=2 python tool.py"),
        (36, "bash", "make demo #2"),
    ]
    run_by = {("page.md", "print(a, torch)"): "t.py::test_a"}
    not_run = {
        ("page.md", "make demo"): SETUP,
        ("page.md", "moetrain plan --model m"): SKETCH,
        ("page.md", "OMP_NUM_THREADS=2 python tool.py"): "too slow",
        ("page.md", "gone"): GPU,
    }
    assert uncovered(blocks, run_by, not_run) == ["page.md:36: ('page.md', 'make demo #2')"]
    assert stale(blocks, [*run_by, *not_run]) == [("page.md", "gone")]
    problems = bad_excuses(blocks, not_run)
    assert len(problems) == 2, problems
    assert "a sketch is a Python block" in problems[0] and "'too slow' is not one of" in problems[1]
    assert bad_excuses(blocks, {("page.md", "print(a, torch)"): SKETCH})  # every name defined: no sketch
    assert undefined_names("import torch\nx = torch.ones(2)\nfor i in y:\n    f(i, x)\n") == {"y", "f"}

    (tmp_path / "t.py").write_text(
        "def test_a():\n    pass\n\n\nclass TestB:\n    def test_c(self):\n        pass\n"
    )
    (tmp_path / "u.py").write_text('class TestB:\n    def test_c(self):\n        "runs page.md"\n')
    tests = ["t.py::test_a", "t.py::TestB::test_c", "u.py::TestB::test_c", "u.py::test_a", "v.py::test_a"]
    run_by = {("page.md", str(number)): test for number, test in enumerate(tests, start=1)}
    assert missing_tests(run_by, tmp_path) == [
        "t.py::test_a (page.md: '1'): t.py never names page.md",
        "t.py::TestB::test_c (page.md: '2'): t.py never names page.md",
        "u.py::test_a (page.md: '4'): no test_a in u.py",
        "v.py::test_a (page.md: '5'): no file v.py",
    ]
