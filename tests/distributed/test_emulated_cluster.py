"""benchmarks/emulated_cluster.py: two network namespaces joined by a rate-limited veth pair, gloo
across them. Skipped (with the reason) unless this process can build it (root, iproute2)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT, load_script
from tests.scripts.emulated_all_to_all import exchange

pytestmark = pytest.mark.serial  # times real waits and rates: run alone (tests/README.md)

SCRIPT = ROOT / "tests" / "scripts" / "emulated_all_to_all.py"


LAUNCHER = load_script(ROOT / "benchmarks" / "emulated_cluster.py")
PROBLEM = LAUNCHER.can_emulate()


def _exchange_worker(rank, world):
    return exchange(rank, world)


@pytest.mark.slow
@pytest.mark.skipif(PROBLEM is not None, reason=f"emulated cluster unavailable: {PROBLEM}")
@pytest.mark.timeout(180)
def test_all_to_all_over_the_emulated_cluster_equals_loopback(tmp_path):
    code = LAUNCHER.run_on_emulated_cluster(
        ["-c", f"import sys, runpy; sys.path.insert(0, {str(ROOT)!r}); sys.argv = ['x', {str(tmp_path)!r}]; "
         f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"],
        ranks_per_node=2,
        rate_mbit=100,
        timeout_s=150,
    )  # fmt: skip
    assert code == 0
    loopback = run_distributed(_exchange_worker, 4)
    for rank in range(4):
        emulated = torch.load(tmp_path / f"rank{rank}.pt")
        for algorithm in ("flat", "hierarchical"):
            assert emulated[f"{algorithm}_round_trip"]
            assert torch.equal(emulated[algorithm], loopback[rank][algorithm])
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"moe{os.getpid() % 100000}n0" not in listed  # removed on the way out


@pytest.mark.skipif(PROBLEM is not None, reason=f"emulated cluster unavailable: {PROBLEM}")
def test_a_failed_setup_removes_what_it_made_and_nothing_else():
    tag = f"moedup{os.getpid() % 10000}"
    subprocess.run(["ip", "netns", "add", f"{tag}n1"], check=True)  # taken: the second namespace fails
    try:
        with pytest.raises(RuntimeError, match=f"ip netns add {tag}n1 failed"):
            LAUNCHER.EmulatedCluster(rate_mbit=100, tag=tag).__enter__()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"{tag}n0" not in listed and f"{tag}n1" in listed
    finally:
        subprocess.run(["ip", "netns", "del", f"{tag}n1"], check=False)


@pytest.mark.skipif(PROBLEM is not None, reason=f"emulated cluster unavailable: {PROBLEM}")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_launch_removes_the_namespaces(signum):
    # SIGINT at its default, as Ctrl-C in a terminal finds it: a suite started in the background
    # of a non-interactive shell inherits SIGINT ignored, and the launcher would not see it
    launcher = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "emulated_cluster.py"), "--ranks-per-node", "1", "--",
         "-c", "import time; time.sleep(120)"],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    tag = f"moe{launcher.pid % 100000}"
    name = f"{tag}n1"
    try:
        deadline = time.monotonic() + 30
        while name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout:
            assert time.monotonic() < deadline and launcher.poll() is None, "the cluster never came up"
            time.sleep(0.1)
        time.sleep(0.5)  # the ranks are starting
        launcher.send_signal(signum)
        assert launcher.wait(timeout=30) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    left = [ns for ns in (f"{tag}n0", f"{tag}n1") if ns in listed]
    for ns in left:  # a failed run's namespaces must not outlive it
        subprocess.run(["ip", "netns", "del", ns], check=False)
    assert not left


SMALL = {  # appended to each documented command (argparse keeps the last value): a quick run
    "all_to_all.py": [
        "--emulated-mbit",
        "200",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--sizes-kib",
        "16",
        "64",
        "256",
    ],
    "fit_links.py": [],
    "moe_layer_ep.py": [
        "--emulated-mbit",
        "200",
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--tokens",
        "32",
        "--chunks",
        "1",
        "2",
    ],
}


@pytest.mark.slow
@pytest.mark.skipif(PROBLEM is not None, reason=f"emulated cluster unavailable: {PROBLEM}")
@pytest.mark.timeout(600)
def test_the_documented_emulated_cluster_commands_run(tmp_path):
    doc = (ROOT / "docs" / "expert_parallel.md").read_text(encoding="utf-8")
    block = doc.split("## An emulated two-node cluster", 1)[1].split("```\n", 2)[1]
    commands = [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]
    assert [words[1] for words in commands] == [f"benchmarks/{name}" for name in SMALL]
    for words in commands:
        script = words[1].split("/")[-1]
        argv = [sys.executable, str(ROOT / words[1]), *words[2:], *SMALL[script]]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip(), script
