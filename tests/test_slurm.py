"""The SLURM templates in scripts/slurm/, run on a real single-node SLURM cluster on loopback
(tests/slurm_cluster.py). The trainer is replaced by a stub (TRAIN_CMD) that records the rank
environment each template gives it and checkpoints on SIGTERM like the trainer does.

Skipped only where SLURM cannot be installed (no root or no apt-get). The cluster is shared by the
tests of this module; it starts in about a second once the packages are installed.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import REPO_PYTHON, REPO_ROOT, LocalSlurmCluster, slurm_cluster_or_skip

SLURM_DIR = REPO_ROOT / "scripts" / "slurm"
TEMPLATES = sorted(SLURM_DIR.glob("*.sbatch"))
GPUS = 2  # fake GPUs on the test node = ranks per node in the template runs

# Stands in for `python -m moetrain.cli train`: `stub.sh OUT_DIR --config ... [trainer args]`.
# Writes OUT_DIR/rank-$RANK.env (its rank environment and arguments) and .log (progress);
# runs RUN_TICKS x 0.1 s, and on SIGTERM "checkpoints" (1 s) and exits 0, as the trainer does.
STUB = r"""#!/bin/bash
out=$1/rank-$RANK
shift
{
    echo "RANK=$RANK"
    echo "LOCAL_RANK=$LOCAL_RANK"
    echo "WORLD_SIZE=$WORLD_SIZE"
    echo "LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE"
    echo "MASTER_ADDR=$MASTER_ADDR"
    echo "MASTER_PORT=$MASTER_PORT"
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-}"
    echo "PWD=$PWD"
    echo "ARGS=$*"
} > "$out.env"
checkpoint() { echo "got SIGTERM" >> "$out.log"; sleep 1; echo "checkpointed" >> "$out.log"; exit 0; }
trap checkpoint TERM
echo "started" >> "$out.log"
for _ in $(seq "${RUN_TICKS:-0}"); do sleep 0.1; done
echo "finished" >> "$out.log"
"""


def cluster_test(function):
    return pytest.mark.slow(pytest.mark.timeout(300)(function))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> LocalSlurmCluster:
    with slurm_cluster_or_skip(tmp_path_factory.mktemp("slurm"), gpus_per_node=GPUS) as running:
        yield running


@pytest.fixture
def stub(tmp_path) -> Path:
    path = tmp_path / "stub.sh"
    path.write_text(STUB)
    return path


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\n")
    return path


def template_args(cluster: LocalSlurmCluster, template: str) -> list[str]:
    """Fits a template's #SBATCH requests (several 8-GPU nodes) onto the test node."""
    if template == "train_per_task":
        return cluster.sbatch_args(nodes=1, gpus_per_node=GPUS)
    return [*cluster.sbatch_args(nodes=1), f"--gpus-per-node={GPUS}"]


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def wait_for_files(paths: list[Path], cluster: LocalSlurmCluster, job_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"job {job_id} ({cluster.state(job_id)}) did not create {paths} in {timeout} s\n"
                f"{cluster.output(job_id)}"
            )
        time.sleep(0.2)


# ---- the templates as files ------------------------------------------------------------------------


def test_every_template_is_there():
    names = {path.name for path in TEMPLATES}
    assert {"train_torchrun.sbatch", "train_per_task.sbatch", "m6_1t_480gpu.sbatch"} <= names


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_template_is_valid_bash(template):
    result = subprocess.run(["bash", "-n", str(template)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_template_runs_the_trainer_and_asks_for_sigterm(template):
    text = template.read_text()
    assert "TRAIN_CMD=${TRAIN_CMD:-python -m moetrain.cli train}" in text
    assert "#SBATCH --signal=TERM@" in text  # SIGTERM to the ranks, not to srun (see the templates)


# ---- the cluster itself ------------------------------------------------------------------------


@cluster_test
def test_two_task_job_completes(cluster, tmp_path):
    script = tmp_path / "two_tasks.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=1\n"
        "#SBATCH --ntasks=2\n"
        f"srun bash -c 'echo \"$SLURM_PROCID $SLURM_NTASKS $SLURM_NNODES\" > {tmp_path}/task-$SLURM_PROCID'\n"
        f"echo batch done > {tmp_path}/batch\n"
    )
    job_id, state, output = cluster.run(script, timeout=60)
    assert state == "COMPLETED", output
    assert (tmp_path / "task-0").read_text().split() == ["0", "2", "1"]
    assert (tmp_path / "task-1").read_text().split() == ["1", "2", "1"]
    assert (tmp_path / "batch").read_text() == "batch done\n"


# ---- the templates on the cluster ------------------------------------------------------------------


@cluster_test
def test_per_task_template_maps_slurm_tasks_to_ranks(cluster, tmp_path, stub, config):
    out = tmp_path / "out"
    out.mkdir()
    export = f"--export=ALL,TRAIN_CMD=bash {stub} {out},CONFIG={config}"
    job_id, state, output = cluster.run(
        SLURM_DIR / "train_per_task.sbatch",
        "--set",
        "steps=3",
        sbatch_args=[*template_args(cluster, "train_per_task"), export],
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert state == "COMPLETED", output
    envs = [read_env(out / f"rank-{rank}.env") for rank in range(GPUS)]
    for rank, env in enumerate(envs):
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == str(GPUS)
        assert env["LOCAL_WORLD_SIZE"] == str(GPUS)
        assert env["MASTER_ADDR"] == cluster.node_name
        assert env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # every rank sees the node's GPUs, picks LOCAL_RANK
        assert env["PWD"] == str(REPO_ROOT)
        assert env["ARGS"] == f"--config {config} --set steps=3"


@cluster_test
def test_torchrun_template_starts_one_rank_per_gpu(cluster, tmp_path, stub, config):
    assert (REPO_PYTHON.parent / "torchrun").exists(), "torchrun is installed next to the test python"
    out = tmp_path / "out"
    out.mkdir()
    job_id, state, output = cluster.run(
        SLURM_DIR / "train_torchrun.sbatch",
        "--set",
        "steps=3",
        sbatch_args=template_args(cluster, "train_torchrun"),
        env={"TRAIN_CMD": f"bash {stub} {out}", "CONFIG": str(config)},
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert state == "COMPLETED", output
    assert f"rendezvous {cluster.node_name}:" in output
    envs = [read_env(out / f"rank-{rank}.env") for rank in range(GPUS)]
    for rank, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(GPUS), str(GPUS))
        assert env["PWD"] == str(REPO_ROOT)
        assert env["ARGS"] == f"--config {config} --set steps=3"


@cluster_test
@pytest.mark.parametrize("template", ["train_per_task", "train_torchrun"])
def test_sigterm_reaches_every_rank(cluster, tmp_path, stub, config, template):
    """What `#SBATCH --signal=TERM@120` and a pre-emption do: SIGTERM to every process of every
    step. Each rank checkpoints and exits; the job ends without waiting for its time limit."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = cluster.submit(
        SLURM_DIR / f"{template}.sbatch",
        sbatch_args=template_args(cluster, template),
        env={"TRAIN_CMD": f"bash {stub} {out}", "CONFIG": str(config), "RUN_TICKS": "600"},
        cwd=REPO_ROOT,
    )
    logs = [out / f"rank-{rank}.log" for rank in range(GPUS)]
    wait_for_files(logs, cluster, job_id)
    cluster.cancel(job_id, "TERM")
    state = cluster.wait(job_id, timeout=60)
    output = cluster.output(job_id)
    for log in logs:
        lines = log.read_text().splitlines()
        assert "checkpointed" in lines and "finished" not in lines, (log.name, lines, output)
    # torchrun exits 1 after shutting its ranks down on SIGTERM; the per-task ranks exit 0.
    assert state == ("COMPLETED" if template == "train_per_task" else "FAILED"), output


@cluster_test
def test_batch_shell_survives_sigterm(cluster, tmp_path, stub, config):
    """A SIGTERM that reaches the batch shell (scancel --batch, --signal=B:...) must not end the job
    nor reach srun (which would SIGKILL the ranks): the ranks run on to their end."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = cluster.submit(
        SLURM_DIR / "train_per_task.sbatch",
        sbatch_args=template_args(cluster, "train_per_task"),
        env={"TRAIN_CMD": f"bash {stub} {out}", "CONFIG": str(config), "RUN_TICKS": "30"},
        cwd=REPO_ROOT,
    )
    logs = [out / f"rank-{rank}.log" for rank in range(GPUS)]
    wait_for_files(logs, cluster, job_id)
    cluster.cancel(job_id, "TERM", scope="batch")
    state = cluster.wait(job_id, timeout=60)
    output = cluster.output(job_id)
    assert state == "COMPLETED", output
    assert "batch shell got SIGTERM" in output
    for log in logs:
        assert log.read_text().splitlines() == ["started", "finished"], output


@cluster_test
def test_sbatch_trains_a_tiny_model_and_checkpoints(cluster, tmp_path):
    """The real trainer on the M6 tiny preset through the per-task template: 2 ranks with the
    experts split (ep_size 2)."""
    out_dir = tmp_path / "run"
    config = tmp_path / "tiny.yaml"
    config.write_text((REPO_ROOT / "models" / "m6_moe" / "tiny.yaml").read_text())
    overrides = [
        "--set",
        "steps=6",
        "--set",
        "parallel.ep_size=2",
        "--set",
        f"out_dir={out_dir}",
        "--set",
        "checkpoint_every=3",
        "--set",
        "data.micro_batch_size=4",
        "--set",
        "threads=1",
        "--set",
        "log_every=1",
    ]
    job_id, state, output = cluster.run(
        SLURM_DIR / "train_per_task.sbatch",
        *overrides,
        sbatch_args=[*template_args(cluster, "train_per_task"), f"--export=ALL,CONFIG={config}"],
        cwd=REPO_ROOT,
        timeout=240,
    )
    assert state == "COMPLETED", output
    metrics = [line for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert len(metrics) == 6
    checkpoints = sorted(p.name for p in (out_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000003", "step_00000006"]
