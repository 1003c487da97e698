"""The SLURM templates in scripts/slurm/, run on a real single-node SLURM cluster on loopback
(tests/helpers/slurm_cluster.py), and their helpers (preflight.sh, bind_rank.py) on their own. The trainer
is replaced by a stub (TRAIN_CMD) that records the rank environment each template gives it and
checkpoints on SIGTERM like the trainer does; one job runs the real trainer.

Two clusters: a GPU one (2 fake GPUs: gres entries without a driver, so a test that needs the
preflight to see them counts SLURM's grant instead of asking torch) and a CPU-only one (no GPU
gres, partition ``cpu``) for README.md's CPU-only example. Skipped only where SLURM cannot be
installed (no root or no apt-get); each cluster starts in about a second once it is installed.
"""

from __future__ import annotations

import inspect
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moetrain.cli import build_train_config
from tests.helpers.dist_utils import free_port
from tests.helpers.paths import load_script
from tests.helpers.slurm_cluster import (
    REPO_PYTHON,
    REPO_ROOT,
    SEARCH_PATH,
    LocalSlurmCluster,
    SlurmClusterError,
    slurm_cluster_or_skip,
)

pytestmark = pytest.mark.serial  # times real waits and rates: run alone (tests/README.md)

SLURM_DIR = REPO_ROOT / "scripts" / "slurm"
TEMPLATES = sorted(SLURM_DIR.glob("*.sbatch"))
SHELL_SCRIPTS = [*TEMPLATES, SLURM_DIR / "launch_torchrun.sh", SLURM_DIR / "preflight.sh"]
GPUS = 2  # fake GPUs on the test node = ranks per node in the template runs

# The fake GPUs have no driver: in the jobs the preflight counts the GPUs SLURM gave the step.
FAKE_GPU_COUNT = r"""#!/bin/bash
IFS=, read -r -a gpus <<<"${CUDA_VISIBLE_DEVICES:-}"
echo "${#gpus[@]}"
"""

# Stands in for `python -m moetrain.cli train`: `stub.sh OUT_DIR --config ... [trainer args]`.
# Writes OUT_DIR/rank-$RANK.env (its rank environment and arguments) and .log (progress);
# runs RUN_TICKS x 0.1 s, and on SIGTERM "checkpoints" (1 s) and exits 0 (the trainer exits 75:
# test_per_task_template_sigterm_with_the_real_trainer_ends_75 runs it).
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
    echo "CPUS=$(grep Cpus_allowed_list /proc/self/status | cut -f 2)"
    echo "OMP_NUM_THREADS=${OMP_NUM_THREADS:-}"
    echo "NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-}"
    echo "TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-}"
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


@pytest.fixture(scope="module")
def cpu_cluster(tmp_path_factory) -> LocalSlurmCluster:
    """A cluster without GPUs whose partition is called ``cpu``, as in README.md's example."""
    root = tmp_path_factory.mktemp("slurm-cpu")
    with slurm_cluster_or_skip(root, gpus_per_node=0, partition="cpu") as running:
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


@pytest.fixture
def fake_gpu_count(tmp_path) -> Path:
    path = tmp_path / "gpu_count.sh"
    path.write_text(FAKE_GPU_COUNT)
    return path


def template_args(cluster: LocalSlurmCluster, template: str) -> list[str]:
    """Fits a template's #SBATCH requests (several 8-GPU nodes) onto the test node."""
    if template == "train_per_task":
        return cluster.sbatch_args(nodes=1, gpus_per_node=GPUS)
    return [*cluster.sbatch_args(nodes=1), f"--gpus-per-node={GPUS}"]


def torchrun_env(fake_gpu_count: Path, **extra: str) -> dict[str, str]:
    """The torchrun templates on the fake GPUs: the preflight counts SLURM's grant, and ranks are
    bound by core order (CPU_BIND=numa needs real GPUs: see test_m6_template_on_gpus_...)."""
    return {"GPU_COUNT_CMD": f"bash {fake_gpu_count}", "CPU_BIND": "cores", **rendezvous_port(), **extra}


def rendezvous_port() -> dict[str, str]:
    """A free rendezvous port: the templates' default (20000 + job id) would collide with a test
    cluster of another run on this machine, whose job ids count from 1 too. Like ``free_port`` it
    is drawn below the kernel's ephemeral range (a port inside it can be taken as the source port of
    any outgoing connection before torchrun binds it), and also below the templates' 20000."""
    return {"PORT": str(free_port(below=20000))}


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


bind_rank = load_script(SLURM_DIR / "bind_rank.py")


def node_cpus_split(ranks: int) -> list[str]:
    """What bind_rank.py should give each of ``ranks`` ranks on this machine, as the kernel's
    ``Cpus_allowed_list`` prints it (the torchrun step may use every CPU of the test node)."""
    cores = bind_rank.physical_cores(os.sched_getaffinity(0))
    return [bind_rank.format_cpu_list(bind_rank.cpus_for_rank(r, ranks, cores)) for r in range(ranks)]


def trainer_args(env: dict[str, str]) -> list[str]:
    """The arguments a rank got after ``--config``, as a stub recorded them."""
    args = shlex.split(env["ARGS"])
    assert args[0] == "--config", args
    return args


# ---- the templates and helpers as files ------------------------------------------------------------


def test_every_template_is_there():
    names = {path.name for path in TEMPLATES}
    assert {"train_torchrun.sbatch", "train_per_task.sbatch", "m6_1t_480gpu.sbatch"} <= names


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_the_test_jobs_time_limit_outlasts_the_templates_signal_lead(template):
    """The jobs here run under ``LocalSlurmCluster.sbatch_args``'s time limit, not the template's;
    one shorter than the template's ``--signal`` lead has SLURM SIGTERM the job steps seconds after
    they start (the M6 template's preflight and ranks were cancelled so, now and then, under a
    5-minute limit)."""
    signal = re.search(r"^#SBATCH --signal=(?:B:)?TERM@(\d+)", template.read_text(), re.MULTILINE)
    lead_s = int(signal.group(1))
    limit_minutes = inspect.signature(LocalSlurmCluster.sbatch_args).parameters["time"].default
    assert int(limit_minutes) * 60 >= lead_s + 300, (template.name, lead_s, limit_minutes)


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda path: path.name)
def test_script_is_valid_bash(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda path: path.name)
def test_template_runs_the_trainer_and_asks_for_sigterm(template):
    text = template.read_text()
    assert "TRAIN_CMD=${TRAIN_CMD:-python -m moetrain.cli train}" in text
    assert "#SBATCH --signal=TERM@" in text  # SIGTERM to the ranks, not to srun (see the templates)


# ---- bind_rank.py ----------------------------------------------------------------------------------


def fake_sysfs(root: Path, nodes: dict[int, str], siblings: dict[int, str]) -> Path:
    for node, cpulist in nodes.items():
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    for cpu, sibling_list in siblings.items():
        (root / "cpu" / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(sibling_list + "\n")
    return root


def test_cpu_lists_parse_and_format():
    assert bind_rank.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert bind_rank.format_cpu_list([11, 0, 1, 2, 3, 8, 10]) == "0-3,8,10-11"
    assert bind_rank.format_cpu_list([5]) == "5"


def test_bind_rank_keeps_hyperthreads_together_and_blocks_inside_numa_nodes(tmp_path):
    """Two sockets of two cores with two hyperthreads each, numbered as Linux often does:
    CPUs 0-3 are the first thread of every core, 4-7 their siblings, node 0 holds cores 0 and 1."""
    sysfs = fake_sysfs(
        tmp_path,
        nodes={0: "0-1,4-5", 1: "2-3,6-7"},
        siblings={cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)},
    )
    cores = bind_rank.physical_cores(set(range(8)), sysfs)
    assert cores == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [bind_rank.cpus_for_rank(r, 2, cores) for r in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [bind_rank.cpus_for_rank(r, 4, cores) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # uneven: the first ranks get a core more; every core is used once
    assert [bind_rank.cpus_for_rank(r, 3, cores) for r in range(3)] == [[0, 1, 4, 5], [2, 6], [3, 7]]
    # only the CPUs this process may use count (SLURM may have given it part of the node)
    assert bind_rank.physical_cores({2, 3, 6}, sysfs) == [[2, 6], [3]]
    with pytest.raises(ValueError, match="5 ranks on this node but only 4 physical core"):
        bind_rank.cpus_for_rank(0, 5, cores)


def test_bind_rank_without_sysfs_counts_each_cpu_as_a_core(tmp_path):
    assert bind_rank.physical_cores({3, 1, 2}, tmp_path / "missing") == [[1], [2], [3]]


def test_bind_rank_runs_the_command_with_the_rank_cpus():
    """End to end on this machine: the command runs with the CPU affinity of its block."""
    show = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    ranks = min(2, len(bind_rank.physical_cores(os.sched_getaffinity(0))))
    for rank, expected in enumerate(node_cpus_split(ranks)):
        env = dict(os.environ, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(ranks))
        result = subprocess.run(
            [sys.executable, str(SLURM_DIR / "bind_rank.py"), *show],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert result.returncode == 0, result.stderr
        assert eval(result.stdout) == bind_rank.parse_cpu_list(expected)  # noqa: S307 - a printed list
        assert f"bind_rank: local rank {rank} of {ranks} -> CPUs {expected}" in result.stderr


def test_bind_rank_without_torchrun_environment_says_what_is_missing():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    result = subprocess.run(
        [sys.executable, str(SLURM_DIR / "bind_rank.py"), "true"], env=env, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (torchrun sets them)" in result.stderr


# ---- preflight.sh ----------------------------------------------------------------------------------


def run_preflight(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir(exist_ok=True)
    base = {"PATH": f"{fakebin}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SLURM_DIR / "preflight.sh")],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_preflight_fails_a_node_with_fewer_gpus_than_asked(tmp_path):
    result = run_preflight(tmp_path, GPUS_PER_NODE="8", GPU_COUNT_CMD="echo 7")
    assert result.returncode == 1
    assert re.search(r"moetrain preflight: \S+: 7 GPU\(s\) visible, this job needs 8 per node", result.stderr)
    assert "GPUS_PER_NODE=0 for a CPU-only run" in result.stderr
    ok = run_preflight(tmp_path, GPUS_PER_NODE="8", GPU_COUNT_CMD="echo 8")
    assert ok.returncode == 0, ok.stderr
    assert "ok (GPUs: 8, CPU_BIND=none)" in ok.stdout


def test_preflight_refuses_a_gpu_count_with_a_leading_zero(tmp_path):
    """bash reads ``08`` as octal (an error inside ``[[ -gt ]]``, which skipped the GPU check)."""
    result = run_preflight(tmp_path, GPUS_PER_NODE="08", GPU_COUNT_CMD="echo 8")
    assert result.returncode == 1
    assert "GPUS_PER_NODE must be an integer >= 0, got '08'" in result.stderr


def test_preflight_reports_a_gpu_count_that_fails(tmp_path):
    result = run_preflight(tmp_path, GPUS_PER_NODE="2", GPU_COUNT_CMD="echo 'no driver' >&2; exit 3")
    assert result.returncode == 1
    assert "could not count GPUs with `echo 'no driver' >&2; exit 3`: no driver" in result.stderr


def test_preflight_default_count_is_torch(tmp_path):
    """Without GPU_COUNT_CMD the preflight asks the torch the ranks will use."""
    import torch

    env = {"GPUS_PER_NODE": "1", "PATH": f"{REPO_PYTHON.parent}:{os.environ['PATH']}"}
    result = run_preflight(tmp_path, **env)
    visible = torch.cuda.device_count()
    assert (result.returncode == 0) == (visible >= 1), result.stderr
    if visible == 0:
        assert "0 GPU(s) visible, this job needs 1 per node" in result.stderr


def test_preflight_skips_the_gpu_check_on_cpu_only_runs(tmp_path):
    result = run_preflight(tmp_path, GPUS_PER_NODE="0", GPU_COUNT_CMD="exit 1", CPU_BIND="cores")
    assert result.returncode == 0, result.stderr
    assert "ok (GPUs: not checked, CPU_BIND=cores)" in result.stdout


def test_preflight_needs_numactl_for_numa_binding(tmp_path):
    env = {"GPUS_PER_NODE": "0", "CPU_BIND": "numa", "PATH": f"{tmp_path / 'fakebin'}:/usr/bin:/bin"}
    if any(Path(d, "numactl").exists() for d in ("/usr/bin", "/bin")):
        pytest.skip("numactl is installed here")
    result = run_preflight(tmp_path, **env)
    assert result.returncode == 1
    assert "CPU_BIND=numa (torchrun --numa-binding) needs the numactl program" in result.stderr
    (tmp_path / "fakebin" / "numactl").write_text("#!/bin/sh\n")
    (tmp_path / "fakebin" / "numactl").chmod(0o755)
    assert run_preflight(tmp_path, **env).returncode == 0


def test_preflight_checks_out_dir_is_shared(tmp_path):
    out = tmp_path / "out"
    missing = run_preflight(tmp_path, GPUS_PER_NODE="0", OUT_DIR=str(out))
    assert missing.returncode == 1
    assert f"OUT_DIR={out} is not a writable directory on this node" in missing.stderr
    out.mkdir()
    other_fs = run_preflight(tmp_path, GPUS_PER_NODE="0", OUT_DIR=str(out), OUT_DIR_MARKER=".preflight-7")
    assert other_fs.returncode == 1
    assert "is not the file system the first node writes to (.preflight-7 is missing here)" in other_fs.stderr
    (out / ".preflight-7").touch()
    shared = run_preflight(tmp_path, GPUS_PER_NODE="0", OUT_DIR=str(out), OUT_DIR_MARKER=".preflight-7")
    assert shared.returncode == 0, shared.stderr


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
def test_torchrun_template_starts_one_bound_rank_per_gpu(cluster, tmp_path, stub, config, fake_gpu_count):
    """After a preflight on every node, one rank per GPU, each on its own block of the node's
    cores (CPU_BIND=cores), with as many OpenMP threads as the node has CPUs per rank."""
    assert (REPO_PYTHON.parent / "torchrun").exists(), "torchrun is installed next to the test python"
    out = tmp_path / "out"
    out.mkdir()
    job_id, state, output = cluster.run(
        SLURM_DIR / "train_torchrun.sbatch",
        "--set",
        "steps=3",
        sbatch_args=template_args(cluster, "train_torchrun"),
        # OMP_NUM_THREADS empty: the template's default, not the test run's
        env=torchrun_env(
            fake_gpu_count, TRAIN_CMD=f"bash {stub} {out}", CONFIG=str(config), OMP_NUM_THREADS=""
        ),
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert state == "COMPLETED", output
    assert f"rendezvous {cluster.node_name}:" in output
    assert f"moetrain preflight: {cluster.node_name}: ok (GPUs: {GPUS}, CPU_BIND=cores)" in output
    envs = [read_env(out / f"rank-{rank}.env") for rank in range(GPUS)]
    for rank, (env, cpus) in enumerate(zip(envs, node_cpus_split(GPUS), strict=True)):
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(GPUS), str(GPUS))
        assert env["CPUS"] == cpus, (rank, output)
        assert env["OMP_NUM_THREADS"] == str(max(1, cluster.cpus // GPUS))
        assert env["PWD"] == str(REPO_ROOT)
        assert env["ARGS"] == f"--config {config} --set steps=3"


@cluster_test
@pytest.mark.parametrize("template", ["train_per_task", "train_torchrun"])
def test_sigterm_reaches_every_rank(cluster, tmp_path, stub, config, fake_gpu_count, template):
    """What `#SBATCH --signal=TERM@120` and a pre-emption do: SIGTERM to every process of every
    step. Each rank checkpoints and exits; the job ends without waiting for its time limit."""
    out = tmp_path / "out"
    out.mkdir()
    job_id = cluster.submit(
        SLURM_DIR / f"{template}.sbatch",
        sbatch_args=template_args(cluster, template),
        env=torchrun_env(fake_gpu_count, TRAIN_CMD=f"bash {stub} {out}", CONFIG=str(config), RUN_TICKS="600"),
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
    # The torchrun launcher exits 128 + 15 after its ranks shut down on SIGTERM, with one line and no
    # SignalException traceback; the per-task ranks (the stub) exit 0.
    assert state == ("COMPLETED" if template == "train_per_task" else "FAILED"), output
    if template == "train_torchrun":
        assert "Traceback" not in output and "SignalException" not in output, output
        assert "moetrain: the launcher got signal 15 and stopped after its ranks" in output, output


@cluster_test
def test_per_task_template_sigterm_with_the_real_trainer_ends_75(cpu_cluster, tmp_path):
    """scancel --signal=TERM of the per-task template running the real trainer (2 ranks, CPU): every
    task checkpoints and exits 75. srun --kill-on-bad-exit takes the first task's 75 for a bad exit
    and SIGTERMs the other, which has stopped already and ignores it: the job ends FAILED with exit
    code 75 (before: 143, the last task killed by that SIGTERM), out_dir's lock released."""
    from tests.faults.launch import tiny_config, write_config

    run_dir = tmp_path / "run"
    config = write_config(tmp_path, tiny_config(run_dir, steps=100000, log_every=5, dist_timeout_s=60))
    job_id = cpu_cluster.submit(
        SLURM_DIR / "train_per_task.sbatch",
        sbatch_args=[
            *cpu_cluster.sbatch_args(nodes=1),
            "--gpus-per-node=0",
            "--ntasks-per-node=2",
            "--cpus-per-task=1",
        ],
        env={"CONFIG": str(config), "OMP_NUM_THREADS": "1", **rendezvous_port()},
        cwd=REPO_ROOT,
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 4:
        assert time.monotonic() < deadline, cpu_cluster.output(job_id)
        time.sleep(0.5)
    cpu_cluster.cancel(job_id, "TERM")
    state = cpu_cluster.wait(job_id, timeout=120)
    output = cpu_cluster.output(job_id)
    assert state == "FAILED" and cpu_cluster.job_info(job_id)["ExitCode"] == "75:0", output
    assert "Exited with exit code 75" in output and "Terminated" not in output, output  # no task killed
    assert "moetrain: srun exited with status 75" in output
    assert not (run_dir / ".lock").exists()
    assert (run_dir / "summary.json").exists()


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


# ---- the M6-1T template ------------------------------------------------------------------------


M6_TEMPLATE = SLURM_DIR / "m6_1t_480gpu.sbatch"
M6_CONFIG = REPO_ROOT / "configs" / "m6_1t.yaml"


def test_m6_template_keeps_the_process_group_timeout_above_its_checkpoint_window():
    text = M6_TEMPLATE.read_text()
    timeout = int(re.search(r"^DIST_TIMEOUT_S=\$\{DIST_TIMEOUT_S:-(\d+)\}$", text, re.MULTILINE).group(1))
    shutdown = int(
        re.search(r"^SHUTDOWN_TIMEOUT=\$\{SHUTDOWN_TIMEOUT:-(\d+)\}$", text, re.MULTILINE).group(1)
    )
    signal_lead = int(re.search(r"^#SBATCH --signal=TERM@(\d+)$", text, re.MULTILINE).group(1))
    assert shutdown < signal_lead < timeout


@cluster_test
def test_m6_template_preflight_stops_a_node_with_fewer_gpus(cluster, tmp_path, stub):
    """The node has 2 (fake) GPUs for SLURM but none that torch can use: the preflight stops the
    job before any rank starts, naming the node and the counts."""
    out = tmp_path / "out"
    out.mkdir()
    job_id, state, output = cluster.run(
        M6_TEMPLATE,
        sbatch_args=template_args(cluster, "m6_1t_480gpu"),
        env={"TRAIN_CMD": f"bash {stub} {out}", "OUT_DIR": str(tmp_path / "run")},
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert state == "FAILED", output
    assert (
        f"moetrain preflight: {cluster.node_name}: 0 GPU(s) visible, this job needs {GPUS} per node" in output
    )
    assert "preflight failed on the node(s) named above; no rank was started" in output
    assert not list(out.iterdir())
    assert not list((tmp_path / "run").glob(".preflight-*"))  # its marker file is gone
    assert "time limit" not in output  # 30 minutes: longer than the template's 600 s SIGTERM lead


@cluster_test
def test_m6_template_warns_when_the_time_limit_is_within_its_sigterm_lead(cluster, tmp_path, stub):
    """--time=5 (minutes) under the template's --signal=TERM@600: SLURM would SIGTERM the ranks
    seconds into the job; the batch shell says so in one line before the preflight."""
    job_id, state, output = cluster.run(
        M6_TEMPLATE,
        sbatch_args=[*cluster.sbatch_args(nodes=1, time="5"), f"--gpus-per-node={GPUS}"],
        env={"TRAIN_CMD": f"bash {stub} {tmp_path}", "GPU_COUNT_CMD": "echo 0"},
        cwd=REPO_ROOT,
        timeout=120,
    )
    warnings = [line for line in output.splitlines() if line.startswith("moetrain: warning:")]
    assert warnings == [
        "moetrain: warning: this job's time limit (5:00) is not longer than the template's SIGTERM lead "
        "(--signal=TERM@600): SLURM will SIGTERM the ranks within a minute of their start and they stop "
        "after one checkpoint; ask for a longer --time, or pass sbatch a shorter --signal=TERM@<seconds>"
    ], output


@pytest.mark.parametrize("template", ["train_torchrun.sbatch", "m6_1t_480gpu.sbatch"])
def test_a_torchrun_templates_signal_lead_variable_is_its_sbatch_signal(template):
    """launch_torchrun.sh's time-limit warning compares against SIGNAL_LEAD_S: the template's own
    #SBATCH --signal lead."""
    text = (SLURM_DIR / template).read_text()
    lead = re.search(r"^#SBATCH --signal=TERM@(\d+)", text, re.MULTILINE).group(1)
    assert re.search(r"^SIGNAL_LEAD_S=(\d+) ", text, re.MULTILINE).group(1) == lead


@cluster_test
def test_m6_template_on_gpus_asks_torchrun_for_numa_binding(cluster, tmp_path, fake_gpu_count):
    """The GPU path as far as it runs without GPUs: the preflight passes (GPUs counted, numactl
    present), and torchrun is asked for one rank per GPU with --numa-binding=exclusive and the
    trainer arguments (a fake torchrun records them; torch's binding itself needs real GPUs)."""
    fakebin = tmp_path / "fakebin"
    fakebin.mkdir()
    record = tmp_path / "torchrun.args"
    (fakebin / "torchrun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n')
    (fakebin / "numactl").write_text("#!/bin/sh\n")
    for program in fakebin.iterdir():
        program.chmod(0o755)
    run_dir = tmp_path / "run"
    job_id, state, output = cluster.run(
        M6_TEMPLATE,
        "--set",
        "steps=5",
        sbatch_args=template_args(cluster, "m6_1t_480gpu"),
        env={
            "PATH": f"{fakebin}:{SEARCH_PATH}",
            "GPU_COUNT_CMD": f"bash {fake_gpu_count}",
            "OUT_DIR": str(run_dir),
            "LAUNCH_CMD": "torchrun",
        },
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert state == "COMPLETED", output
    assert f"moetrain preflight: {cluster.node_name}: ok (GPUs: {GPUS}, CPU_BIND=numa)" in output
    args = record.read_text().splitlines()
    assert f"--nproc-per-node={GPUS}" in args and "--numa-binding=exclusive" in args
    assert "--no-python" in args and "bind_rank.py" not in " ".join(args)
    rank_command = args[args.index("--numa-binding=exclusive") + 1 :]
    assert rank_command[:4] == ["python", "-m", "moetrain.cli", "train"]
    assert rank_command[4:] == [
        "--config",
        "configs/m6_1t.yaml",
        "--set",
        f"out_dir={run_dir}",
        "--set",
        "dist_timeout_s=1800",
        "--set",
        "steps=5",
    ]
    # what the trainer would get parses into the M6-1T config with those settings
    train_config = build_train_config(str(M6_CONFIG), rank_command[7::2])
    assert (train_config.out_dir, train_config.dist_timeout_s, train_config.steps) == (str(run_dir), 1800, 5)
    assert (run_dir / "flight_recorder").is_dir()  # where torch's flight recorder dumps on a timeout


@cluster_test
def test_m6_template_cpu_only_binds_each_rank(cluster, tmp_path, stub):
    """GPUS_PER_NODE=0: no GPU check, ranks bound to blocks of the node's cores (CPU_BIND=cores)."""
    out = tmp_path / "out"
    out.mkdir()
    run_dir = tmp_path / "run"
    job_id, state, output = cluster.run(
        M6_TEMPLATE,
        sbatch_args=template_args(cluster, "m6_1t_480gpu"),
        env={
            "TRAIN_CMD": f"bash {stub} {out}",
            "OUT_DIR": str(run_dir),
            "GPUS_PER_NODE": "0",
            "RANKS_PER_NODE": "2",
            **rendezvous_port(),
        },
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert state == "COMPLETED", output + cluster.log_tails()
    assert "GPUS_PER_NODE=0: CPU-only run, no GPU check" in output
    assert f"moetrain preflight: {cluster.node_name}: ok (GPUs: not checked, CPU_BIND=cores)" in output
    for rank, cpus in enumerate(node_cpus_split(2)):
        env = read_env(out / f"rank-{rank}.env")
        assert (env["RANK"], env["WORLD_SIZE"], env["CPUS"]) == (str(rank), "2", cpus), output
        assert trainer_args(env) == [
            "--config",
            "configs/m6_1t.yaml",
            "--set",
            f"out_dir={run_dir}",
            "--set",
            "dist_timeout_s=1800",
        ]
        # the script's NCCL settings reach the ranks; flight-recorder dumps go to the shared OUT_DIR
        assert env["NCCL_IB_TIMEOUT"] == "22"
        assert env["TORCH_FR_DUMP_TEMP_FILE"] == f"{run_dir}/flight_recorder/rank_"


@pytest.mark.parametrize(
    ("template", "env", "message"),
    [
        (
            "m6_1t_480gpu",
            {"OUT_DIR": "runs/m6"},
            "OUT_DIR must be an absolute path (the same on every node), got 'runs/m6'",
        ),
        (
            "train_torchrun",
            {"OUT_DIR": "out"},
            "OUT_DIR must be an absolute path (the same on every node), got 'out'",
        ),
        ("train_torchrun", {"GPUS_PER_NODE": "eight"}, "GPUS_PER_NODE must be an integer >= 0, got 'eight'"),
        ("train_torchrun", {"RANKS_PER_NODE": "0"}, "RANKS_PER_NODE must be an integer >= 1, got '0'"),
        ("train_torchrun", {"CPU_BIND": "socket"}, "CPU_BIND must be one of numa, cores, none, got 'socket'"),
        (
            "m6_1t_480gpu",
            {"GPUS_PER_NODE": "0", "CPU_BIND": "numa"},
            "CPU_BIND=numa binds each rank near its GPU",
        ),
        (
            "train_torchrun",
            {"CONFIG": "configs/missing.yaml"},
            "config file 'configs/missing.yaml' not found",
        ),
    ],
)
def test_torchrun_templates_refuse_bad_settings(tmp_path, template, env, message):
    """Checked in the batch shell before any job step: one line naming the setting, exit 2, and
    nothing created (the shell runs here directly, as SLURM would start it)."""
    job_env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node1",
        **env,
    }
    result = subprocess.run(
        ["bash", str(SLURM_DIR / f"{template}.sbatch")],
        env=job_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetrain: ") and message in lines[0], result.stderr
    assert not (REPO_ROOT / "runs" / "m6").exists() and not (REPO_ROOT / "out").exists()


# ---- README.md's CPU-only cluster example ----------------------------------------------------------


def readme_cpu_only_commands() -> list[tuple[dict[str, str], list[str], Path, list[str]]]:
    """The commands of README.md's "CPU-only clusters" code block, each as (environment, sbatch
    options, template, trainer arguments)."""
    text = (SLURM_DIR / "README.md").read_text()
    section = text.split("## CPU-only clusters", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        sbatch = words.index("sbatch")
        env = dict(word.split("=", 1) for word in words[:sbatch])
        script = next(i for i, word in enumerate(words) if word.endswith(".sbatch"))
        commands.append((env, words[sbatch + 1 : script], REPO_ROOT / words[script], words[script + 1 :]))
    return commands


def test_readme_cpu_only_example_is_there():
    commands = readme_cpu_only_commands()
    assert [script.name for _, _, script, _ in commands] == ["train_torchrun.sbatch", "train_per_task.sbatch"]
    for _, options, _, _ in commands:
        assert "--partition=cpu" in options and "--gpus-per-node=0" in options


@cluster_test
def test_cpu_only_cluster_refuses_the_templates_gpu_request(cpu_cluster, tmp_path):
    """Why README.md's CPU-only example overrides --gpus-per-node: a cluster without GPUs refuses
    the templates' request for 8 per node."""
    with pytest.raises(SlurmClusterError, match="Invalid generic resource"):
        cpu_cluster.submit(
            SLURM_DIR / "train_torchrun.sbatch", sbatch_args=cpu_cluster.sbatch_args(), cwd=REPO_ROOT
        )


@cluster_test
def test_readme_cpu_only_torchrun_example_trains_and_checkpoints(cpu_cluster, tmp_path):
    """README.md's torchrun command on a CPU-only cluster, with the real trainer: the M6 tiny
    preset on 2 ranks bound to the cores of the node, the experts split between them (ep_size 2)."""
    env, options, script, args = readme_cpu_only_commands()[0]
    run_dir = tmp_path / "run"
    overrides = [
        "steps=6",
        f"out_dir={run_dir}",
        "checkpoint_every=3",
        "data.micro_batch_size=4",
        "threads=1",
        "log_every=1",
    ]
    job_id, state, output = cpu_cluster.run(
        script,
        *args,
        *(word for item in overrides for word in ("--set", item)),
        sbatch_args=[*options, *cpu_cluster.sbatch_args(nodes=1)],  # later options win: one node here
        env={**env, **rendezvous_port()},
        cwd=REPO_ROOT,
        timeout=240,
    )
    assert state == "COMPLETED", output
    assert "GPUS_PER_NODE=0: CPU-only run, no GPU check" in output
    for rank, cpus in enumerate(node_cpus_split(2)):
        assert f"bind_rank: local rank {rank} of 2 -> CPUs {cpus}" in output
    metrics = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    assert len(metrics) == 6
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_00000003", "step_00000006"]


@cluster_test
def test_readme_cpu_only_per_task_example_maps_ranks(cpu_cluster, tmp_path, stub):
    env, options, script, args = readme_cpu_only_commands()[1]
    out = tmp_path / "out"
    out.mkdir()
    fit = [*cpu_cluster.sbatch_args(nodes=1), "--cpus-per-task=1"]  # later options win: one small node
    job_id, state, output = cpu_cluster.run(
        script,
        *args,
        sbatch_args=[*options, *fit],
        env={**env, "TRAIN_CMD": f"bash {stub} {out}"},
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert state == "COMPLETED", output
    for rank in range(2):
        rank_env = read_env(out / f"rank-{rank}.env")
        assert (rank_env["RANK"], rank_env["WORLD_SIZE"], rank_env["CUDA_VISIBLE_DEVICES"]) == (
            str(rank),
            "2",
            "",
        )
