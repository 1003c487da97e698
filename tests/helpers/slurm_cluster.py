"""A throw-away single-node SLURM cluster on loopback, for tests that submit real sbatch jobs.

``local_slurm_cluster(tmp_path)`` is a context manager that

1. installs Debian's ``slurmctld``, ``slurmd`` and ``munge`` with apt-get when they are missing
   (only as root with apt-get present; otherwise it raises ``SlurmUnavailable`` with the reason),
2. writes a fresh munge key and starts its own ``munged`` (own socket, key, state and log files
   under the temp dir; a system munged, if any, is neither used nor touched),
3. writes ``slurm.conf`` (+ ``gres.conf``) under the temp dir: this host as the only node, two free
   loopback ports, every state / spool / log path under the temp dir, no cgroups
   (``proctrack/linuxproc``, ``task/none``), one partition (``debug`` unless named) as the default,
4. starts ``slurmctld -D`` and ``slurmd -D`` as child processes and waits until the node is idle,
5. yields a ``LocalSlurmCluster`` whose ``submit`` / ``wait`` / ``run`` drive jobs, and
6. on exit cancels its jobs and stops exactly the processes it started (the daemons, and any job
   step or task process still carrying this cluster's ``SLURM_CONF`` in its environment), also
   when the body raised.

Every step has a deadline; a failure raises ``SlurmClusterError`` with the daemon log tails.

Every slurm command (including ``srun`` inside jobs, which inherit the submitter's environment)
finds the cluster through ``SLURM_CONF``; ``cluster.env()`` is that environment.

Running repository code in a job (the job runs as root on this machine, in ``cwd``; ``python`` on
its PATH is the test interpreter, ``REPO_PYTHON``, so the templates' default TRAIN_CMD works)::

    with local_slurm_cluster(tmp_path, gpus_per_node=2) as cluster:
        job = cluster.submit(
            REPO_ROOT / "scripts/slurm/train_per_task.sbatch", "--set", "steps=2",
            sbatch_args=cluster.sbatch_args(nodes=1, gpus_per_node=2),  # 2 ranks on this node
            env={"CONFIG": str(config)},  # a config whose out_dir is under tmp_path
            cwd=REPO_ROOT,
        )
        assert cluster.wait(job, timeout=240) == "COMPLETED", cluster.output(job)

In pytest, ``slurm_cluster_or_skip(path)`` is the same context manager but turns
``SlurmUnavailable`` into ``pytest.skip``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from moetrain.launch import free_port
from tests.helpers.paths import ROOT

REPO_ROOT = ROOT
# The interpreter running the tests (the repo's .venv when run via `make test`): jobs that run
# repository code should use it, with ``cwd=REPO_ROOT``.
REPO_PYTHON = Path(sys.executable)

DEBIAN_PACKAGES = ("slurmctld", "slurmd", "munge")
REQUIRED_PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scontrol", "sinfo", "scancel")
# Jobs find the test interpreter's `python` and `torchrun` first; Debian puts the daemons in
# /usr/sbin, which is not on PATH for every user.
SEARCH_PATH = os.pathsep.join(
    [str(REPO_PYTHON.parent), os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"]
)

TERMINAL_JOB_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)

APT_TIMEOUT_S = 300
COMMAND_TIMEOUT_S = 30
STARTUP_TIMEOUT_S = 60
SHUTDOWN_TIMEOUT_S = 15
UNIX_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes; keep a margin
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class SlurmUnavailable(RuntimeError):
    """SLURM is not installed and cannot be installed here (the message says why)."""


class SlurmClusterError(RuntimeError):
    """The local cluster failed to start or a job could not be driven (message includes log tails)."""


def _which(program: str) -> str | None:
    return shutil.which(program, path=SEARCH_PATH)


def _missing_programs() -> list[str]:
    return [p for p in REQUIRED_PROGRAMS if _which(p) is None]


def ensure_slurm_installed() -> None:
    """Install the Debian packages when a program is missing; ``SlurmUnavailable`` if impossible."""
    missing = _missing_programs()
    if not missing:
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"SLURM programs {missing} are missing and installing them needs root")
    apt_get = _which("apt-get")
    if apt_get is None:
        raise SlurmUnavailable(f"SLURM programs {missing} are missing and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [apt_get, "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES]
    result = _run_quiet(install, env, APT_TIMEOUT_S)
    if result.returncode != 0:  # stale or empty package lists: refresh once, then retry
        _run_quiet([apt_get, "update"], env, APT_TIMEOUT_S)
        result = _run_quiet(install, env, APT_TIMEOUT_S)
    missing = _missing_programs()
    if result.returncode != 0 or missing:
        raise SlurmUnavailable(
            f"`{' '.join(install)}` failed (exit {result.returncode}; still missing {missing}):\n"
            f"{result.stdout[-2000:]}"
        )


def _run_quiet(argv: list[str], env: Mapping[str, str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as error:
        raise SlurmUnavailable(f"`{' '.join(argv)}` did not finish within {timeout} s") from error


def _real_memory_mib() -> int:
    """MemTotal from /proc/meminfo in MiB, less 5 % so slurmd never finds less than configured."""
    text = Path("/proc/meminfo").read_text()
    kib = int(re.search(r"^MemTotal:\s+(\d+)\s+kB", text, re.MULTILINE).group(1))
    return int(kib / 1024 * 0.95)


def _terminate_with_parent() -> None:
    """In a daemon's child process before exec: SIGTERM it when the test process dies, so a test
    run killed outright (no ``finally``) leaves no daemons behind. Linux only; elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as error:
        return f"<cannot read {path}: {error}>"


class LocalSlurmCluster:
    """Handle on a running local cluster: build with ``local_slurm_cluster``, not directly."""

    def __init__(
        self, root: Path, *, cpus: int, gpus_per_node: int, real_memory_mib: int, partition: str = "debug"
    ):
        self.root = root
        self.node_name = socket.gethostname().split(".")[0]
        self.cpus = cpus
        self.gpus_per_node = gpus_per_node
        self.real_memory_mib = real_memory_mib
        self.partition = partition
        self.conf_dir = root / "etc"
        self.conf_path = self.conf_dir / "slurm.conf"
        self.state_dir = root / "state"
        self.spool_dir = root / "spool"
        self.log_dir = root / "log"
        self.job_dir = root / "jobs"
        self.munge_dir = root / "munge"
        self.fake_gpu_dir = root / "fake-gpus"
        self._short_socket_dir: str | None = None
        self._processes: dict[str, subprocess.Popen] = {}
        self._outputs: dict[str, Path] = {}

    # ----- environment ------------------------------------------------------------------------

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment without inherited ``SLURM_*`` variables (a test run inside a
        real job must not leak that job's ids), ``SLURM_CONF`` pointing at this cluster and the
        test interpreter's bin dir first on ``PATH`` (so a job's ``python`` is the repo's), then
        ``extra``."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["PATH"] = SEARCH_PATH
        env["SLURM_CONF"] = str(self.conf_path)
        if extra:
            env.update(extra)
        return env

    def command(self, *argv: str, timeout: float = COMMAND_TIMEOUT_S, check: bool = True) -> str:
        """Runs a slurm client command against this cluster and returns its stdout."""
        try:
            result = subprocess.run(
                list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired as error:
            raise SlurmClusterError(f"`{' '.join(argv)}` did not finish within {timeout} s") from error
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"`{' '.join(argv)}` failed (exit {result.returncode}): {result.stderr.strip()}"
            )
        return result.stdout

    def sbatch_args(self, nodes: int = 1, gpus_per_node: int | None = None, time: str = "30") -> list[str]:
        """sbatch options that fit the templates' ``#SBATCH`` requests onto this one small node.

        ``time`` (minutes) must outlast every template's ``--signal=TERM@<lead seconds>``: with a
        limit shorter than the lead, SLURM signals the job steps at its first periodic check, some
        seconds into the job (a 5-minute limit under the M6 template's 600 s lead cancelled its
        preflight or its ranks whenever they ran past that check)."""
        args = [f"--partition={self.partition}", f"--nodes={nodes}", f"--time={time}", "--mem=0"]
        if gpus_per_node is not None:
            args += [
                f"--gpus-per-node={gpus_per_node}",
                f"--ntasks-per-node={gpus_per_node}",
                "--cpus-per-task=1",
            ]
        return args

    # ----- jobs -------------------------------------------------------------------------------

    def submit(
        self,
        script: str | os.PathLike,
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        sbatch_args: Sequence[str] = (),
    ) -> str:
        """``sbatch`` the script with ``args``; returns the job id. The job inherits this process's
        environment plus ``env`` (sbatch's default ``--export=ALL``) and runs in ``cwd`` (default:
        the cluster's job dir). Its stdout+stderr go to ``jobs/<script name>-<id>.out``."""
        self.job_dir.mkdir(exist_ok=True)
        output_pattern = self.job_dir / f"{Path(script).name}-%j.out"
        argv = [
            "sbatch",
            "--parsable",
            f"--output={output_pattern}",
            f"--chdir={cwd if cwd is not None else self.job_dir}",
            *sbatch_args,
            str(script),
            *args,
        ]
        try:
            result = subprocess.run(argv, env=self.env(env), capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired as error:
            raise SlurmClusterError(f"sbatch did not return within 30 s: {argv}") from error
        if result.returncode != 0:
            raise SlurmClusterError(
                f"sbatch failed (exit {result.returncode}): {result.stderr.strip()}\nargv: {argv}"
            )
        job_id = result.stdout.strip().split(";")[0]
        self._outputs[job_id] = Path(str(output_pattern).replace("%j", job_id))
        return job_id

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (``{}`` once the record is gone). Jobs stay listed for
        ``MinJobAge`` (1 h here) after they end, so this also answers for finished jobs."""
        argv = ["scontrol", "show", "job", "--oneliner", job_id]
        result = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=30)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return {}
            raise SlurmClusterError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def state(self, job_id: str) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED`` ...)."""
        info = self.job_info(job_id)
        if info:
            return info["JobState"]
        return self._state_from_jobcomp(job_id)

    def _state_from_jobcomp(self, job_id: str) -> str:
        """Fallback for jobs already purged from slurmctld: the jobcomp/filetxt record."""
        path = self.log_dir / "jobcomp.log"
        if path.exists():
            for line in path.read_text().splitlines():
                if f"JobId={job_id} " in line:
                    return re.search(r"JobState=(\S+)", line).group(1)
        return "UNKNOWN"

    def wait(self, job_id: str, timeout: float = 120, poll_s: float = 0.5) -> str:
        """Polls until the job ends; returns its final state. On timeout the job is cancelled and
        ``TimeoutError`` says what state it was in, with the tail of its output."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            state = info["JobState"] if info else self._state_from_jobcomp(job_id)
            if state in TERMINAL_JOB_STATES:
                return state
            if time.monotonic() > deadline:
                self.command("scancel", job_id, check=False)
                raise TimeoutError(
                    f"job {job_id} still {state} (reason: {info.get('Reason', '?')}) after {timeout} s "
                    f"(cancelled)\n"
                    f"--- output ---\n{self.output(job_id)[-3000:]}\n{self.log_tails()}"
                )
            time.sleep(poll_s)

    def output(self, job_id: str) -> str:
        """The job's stdout+stderr so far (empty before it starts)."""
        path = self._outputs.get(job_id)
        if path is None or not path.exists():
            return ""
        return path.read_text(errors="replace")

    def run(self, script: str | os.PathLike, *args: str, timeout: float = 120, **submit_options):
        """``submit`` then ``wait``: returns ``(job_id, state, output)``."""
        job_id = self.submit(script, *args, **submit_options)
        state = self.wait(job_id, timeout=timeout)
        return job_id, state, self.output(job_id)

    def cancel(self, job_id: str, signal_name: str | None = None, *, scope: str = "steps") -> None:
        """``scancel``. Without ``signal_name`` the job is cancelled. With it the job is only
        signalled: ``scope="steps"`` every process of every job step but not the batch shell (what
        ``sbatch --signal=SIG@T`` and a pre-emption do), ``"batch"`` only the batch shell (like
        ``--signal=B:SIG@T``), ``"full"`` the batch shell, its children (srun) and every step."""
        argv = ["scancel"]
        if signal_name:
            argv.append(f"--signal={signal_name}")
            flags = {"steps": [], "batch": ["--batch"], "full": ["--full"]}
            if scope not in flags:
                raise ValueError(f"scope must be one of {sorted(flags)}, got {scope!r}")
            argv += flags[scope]
        self.command(*argv, job_id)

    def log_tails(self) -> str:
        return "\n".join(f"--- {path.name} ---\n{_tail(path)}" for path in sorted(self.log_dir.glob("*.log")))

    # ----- bring-up ---------------------------------------------------------------------------

    def _start(self) -> None:
        for directory in (self.conf_dir, self.state_dir, self.spool_dir, self.log_dir, self.job_dir):
            directory.mkdir(parents=True, exist_ok=True)
        self._start_munged()
        self._write_config()
        common = ["-D", "-f", str(self.conf_path)]
        self._spawn("slurmctld", [_which("slurmctld"), *common, "-c", "-i"])
        self._wait_for(
            lambda: self._responds(["scontrol", "ping"], "is UP"), "slurmctld to answer `scontrol ping`"
        )
        self._spawn("slurmd", [_which("slurmd"), *common])
        self._wait_for(self._node_idle, f"node {self.node_name} to become idle")

    def _start_munged(self) -> None:
        self.munge_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.munge_dir, 0o700)
        socket_path = self.munge_dir / "munge.socket"
        if len(str(socket_path)) > UNIX_SOCKET_PATH_MAX:
            self._short_socket_dir = tempfile.mkdtemp(prefix="munge-")
            socket_path = Path(self._short_socket_dir) / "munge.socket"
        self.munge_socket = socket_path
        key = self.munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        argv = [
            _which("munged"),
            "--foreground",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={self.munge_dir / 'munged.pid'}",
            f"--seed-file={self.munge_dir / 'munged.seed'}",
            f"--log-file={self.log_dir / 'munged.log'}",
            "--num-threads=2",
            "--force",
        ]
        self._spawn("munged", argv)
        self._wait_for(socket_path.exists, f"munged socket {socket_path}")

    def _write_config(self) -> None:
        ctld_port, slurmd_port = free_port(), free_port()
        while slurmd_port == ctld_port:
            slurmd_port = free_port()
        gres = f" Gres=gpu:{self.gpus_per_node}" if self.gpus_per_node else ""
        lines = [
            "# Written by tests/helpers/slurm_cluster.py: a single-node test cluster on loopback.",
            "ClusterName=moetrain-test",
            f"SlurmctldHost={self.node_name}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={self.state_dir}",
            f"SlurmdSpoolDir={self.spool_dir}",
            f"SlurmctldPidFile={self.state_dir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.spool_dir / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.log_dir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.log_dir / 'slurmd.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # No cgroups: processes are tracked through /proc, tasks are not confined.
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",
            f"JobCompLoc={self.log_dir / 'jobcomp.log'}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            # Start a batch job as soon as the node is free (SLURM may delay it by up to 3 s).
            "SchedulerParameters=batch_sched_delay=0",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            # Trust the node description below rather than the probed hardware (lets a test
            # describe more CPUs than the machine has, and GPUs it does not have).
            "SlurmdParameters=config_overrides",
            "MinJobAge=3600",
            "KillWait=5",
            "InactiveLimit=0",
            "Waittime=0",
            "SlurmdTimeout=60",
            "SlurmctldTimeout=60",
            *(["GresTypes=gpu"] if self.gpus_per_node else []),
            f"NodeName={self.node_name} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={self.real_memory_mib}{gres} State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node_name} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf_path.write_text("\n".join(lines) + "\n")
        # Fake GPUs so jobs can ask --gpus-per-node like the templates do. slurmd drops a GPU
        # without a device file, and rejects a File that is not a character device, so each GPU
        # is a symlink to /dev/null (nothing confines devices here: TaskPlugin=task/none).
        gres_conf = ""
        if self.gpus_per_node:
            self.fake_gpu_dir.mkdir(exist_ok=True)
            for index in range(self.gpus_per_node):
                link = self.fake_gpu_dir / f"gpu{index}"
                if not link.is_symlink():
                    link.symlink_to("/dev/null")
            files = f"{self.fake_gpu_dir}/gpu[0-{self.gpus_per_node - 1}]"
            gres_conf = f"NodeName={self.node_name} Name=gpu File={files}\n"
        (self.conf_dir / "gres.conf").write_text(gres_conf)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.log_dir / f"{name}.stdout", "wb")  # noqa: SIM115 - closed with the process
        try:
            self._processes[name] = subprocess.Popen(
                argv,
                env=self.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_terminate_with_parent,
            )
        finally:
            log.close()

    def _check_daemons_alive(self) -> None:
        for name, process in self._processes.items():
            if process.poll() is not None:
                raise SlurmClusterError(
                    f"{name} exited with {process.returncode}\n"
                    f"--- {name}.stdout ---\n{_tail(self.log_dir / f'{name}.stdout')}\n{self.log_tails()}"
                )

    def _wait_for(self, ready, what: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self._check_daemons_alive()
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"timed out after {timeout} s waiting for {what}\n{self.log_tails()}")
            time.sleep(0.25)

    def _responds(self, argv: list[str], expected: str) -> bool:
        try:
            result = subprocess.run(argv, env=self.env(), capture_output=True, text=True, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0 and expected in result.stdout

    def _node_idle(self) -> bool:
        out = self.command("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        state = states.get(self.node_name, "")
        if state.startswith(("drain", "down", "fail", "inval")) and not state.endswith("*"):
            reason = self.command("scontrol", "show", "node", self.node_name, check=False)
            raise SlurmClusterError(f"node {self.node_name} is {state}:\n{reason}\n{self.log_tails()}")
        return state == "idle"

    # ----- tear-down --------------------------------------------------------------------------

    def _stop(self) -> None:
        """Cancels jobs, stops the daemons (TERM, then KILL), then kills any leftover process of
        this cluster: those whose environment holds our ``SLURM_CONF`` (slurmstepd, job tasks)."""
        if "slurmctld" in self._processes and self._processes["slurmctld"].poll() is None:
            with contextlib.suppress(SlurmClusterError, OSError, subprocess.SubprocessError):
                self.command("scancel", "--full", f"--partition={self.partition}", timeout=10, check=False)
                deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
                while (
                    time.monotonic() < deadline
                    and self.command(
                        "squeue", "--noheader", "--states=RUNNING,COMPLETING,PENDING", timeout=10, check=False
                    ).strip()
                ):
                    time.sleep(0.25)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self._processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=SHUTDOWN_TIMEOUT_S)
        for pid in self._leftover_pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if self._short_socket_dir:
            shutil.rmtree(self._short_socket_dir, ignore_errors=True)

    def _leftover_pids(self) -> list[int]:
        marker = f"SLURM_CONF={self.conf_path}".encode() + b"\0"
        own = os.getpid()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == own:
                continue
            try:
                environ = (entry / "environ").read_bytes()
            except OSError:
                continue
            if marker in environ:
                pids.append(int(entry.name))
        return pids


@contextlib.contextmanager
def local_slurm_cluster(
    tmp_path: str | os.PathLike,
    *,
    cpus: int | None = None,
    gpus_per_node: int = 2,
    real_memory_mib: int | None = None,
    partition: str = "debug",
) -> Iterator[LocalSlurmCluster]:
    """A running single-node cluster under ``tmp_path`` (see the module docstring).

    ``cpus`` defaults to ``os.cpu_count()``; ``gpus_per_node`` fake GPUs (gres without device
    files) let jobs ask ``--gpus-per-node`` like the templates do (0: a CPU-only cluster, where
    such a request is refused); ``partition`` names the one partition. Raises ``SlurmUnavailable``
    when SLURM cannot be installed, ``SlurmClusterError`` when it does not come up."""
    ensure_slurm_installed()
    cluster = LocalSlurmCluster(
        Path(tmp_path),
        cpus=cpus or os.cpu_count() or 1,
        gpus_per_node=gpus_per_node,
        real_memory_mib=real_memory_mib or _real_memory_mib(),
        partition=partition,
    )
    try:
        cluster._start()
        yield cluster
    finally:
        cluster._stop()


@contextlib.contextmanager
def slurm_cluster_or_skip(tmp_path: str | os.PathLike, **options) -> Iterator[LocalSlurmCluster]:
    """``local_slurm_cluster`` for pytest fixtures: ``SlurmUnavailable`` becomes a skip."""
    import pytest

    try:
        ensure_slurm_installed()
    except SlurmUnavailable as error:
        pytest.skip(f"no SLURM: {error}")
    with local_slurm_cluster(tmp_path, **options) as cluster:
        yield cluster
