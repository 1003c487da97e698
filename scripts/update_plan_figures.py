"""One source for the M6-1T figures: the planner's output, pasted into the files that quote it.

Runs ``moetrain plan`` on ``configs/m6_1t.yaml`` for the M6-T cluster (the command below) and
writes, between ``plan-figures:begin`` / ``plan-figures:end`` marker lines, the plan in README.md
("Plan a trillion-parameter run"), a summary in the header of configs/m6_1t.yaml and in the
comments of scripts/slurm/m6_1t_480gpu.sbatch, and "How it fits" in docs/planner.md; it also sets
the config's ``recompute_budget_mb`` to the activation budget the planner chose and every
checkpoint size quoted as "N GiB per rank (N TiB per run)" in the sbatch script and
scripts/slurm/README.md. It also writes the output of the ``moetrain plan --mixed`` commands of
MIXED_COMMANDS, each after its ``$ moetrain plan ...`` line, between ``mixed-figures:begin`` /
``mixed-figures:end`` in docs/planner.md ("Hardware-aware batch balancing"). Nothing outside the
markers and those values is touched. ``--check``
changes nothing and exits 1 naming every file that is out of date (tests/docs/test_plan_figures.py runs
it).

Usage: python scripts/update_plan_figures.py [--check]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "m6_1t.yaml"
README = ROOT / "README.md"
SBATCH = ROOT / "scripts" / "slurm" / "m6_1t_480gpu.sbatch"
SLURM_README = ROOT / "scripts" / "slurm" / "README.md"
PLANNER_DOC = ROOT / "docs" / "planner.md"
CHECKPOINT_SIZE = re.compile(r"\d+\.\d\d GiB per rank \(\d+\.\d\d TiB per run\)")
CLUSTER_ARGS = ["--cluster", "v100-32gb", "--nodes", "60", "--inter-node-gbps", "35"]
COMMAND = "moetrain plan --model configs/m6_1t.yaml " + " ".join(CLUSTER_ARGS)
MIXED_COMMANDS = [  # mixed V100 + P100 clusters: the dense M6-base, M6-100B with its experts over all 64 GPUs
    ["--model", "m6-base", "--cluster", "v100-32gb", "--nodes", "4", "--mixed", "p100-16gb:4", "--precision",
     "fp16", "--global-batch", "1024"],
    ["--model", "m6-100B", "--cluster", "v100-32gb", "--nodes", "4", "--mixed", "p100-16gb:4", "--precision",
     "fp16", "--global-batch", "1024", "--ep-size", "64", "--offload"],
]  # fmt: skip
GiB = 2**30


def run_plan(json_output: bool, extra: tuple[str, ...] = ()) -> str:
    """COMMAND's standard output (``extra``: more flags)."""
    return plan_output(["--model", str(CONFIG), *CLUSTER_ARGS, *extra, *(["--json"] if json_output else [])])


def plan_output(args: list[str]) -> str:
    """``moetrain plan ARGS``'s standard output (in this process)."""
    from moetrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *args])
    if code != 0:
        raise SystemExit(f"moetrain plan {shlex.join(args)} says the plan does not fit:\n{out.getvalue()}")
    return out.getvalue()


def mixed_block() -> list[str]:
    """docs/planner.md's fenced block of the MIXED_COMMANDS: each ``$ moetrain plan ...`` line and
    its output, a blank line between them."""
    lines = []
    for args in MIXED_COMMANDS:
        lines += ["", f"$ moetrain plan {shlex.join(args)}", *plan_output(args).rstrip("\n").splitlines()]
    return ["```", *lines[1:], "```"]


def gib(value: float) -> str:
    return f"{value / GiB:.2f}"


def summary(plan: dict) -> list[str]:
    """The plan in a few sentences (the config's and the sbatch script's comments)."""
    gpu, step, host = plan["gpu_memory"], plan["step_peak"], plan["host_memory"]
    settings, recompute, reserve = plan["settings"], plan["recompute"], plan["reserve"]
    nccl = [key for key in reserve if key.startswith("nccl_")]
    staging = plan["checkpoint"]["rank_bytes"] * plan["cluster"]["gpus_per_node"]
    return [
        f"micro-batch {settings['micro_batch']} x grad_accum {settings['grad_accum']} -> "
        f"{gib(plan['gpu_total'])} GiB per GPU of {gib(plan['gpu_usable'])} usable (32 GiB less the 10% "
        "headroom):",
        f"{gib(gpu['weights'])} fp32 weights, {gib(gpu['step_peak'])} step peak at the {step['where']} "
        f"({gib(step['activations'])} activations held,",
        f"{gib(step['gradients'])} gradients, {gib(step['working'])} working; "
        f"{gib(recompute['activation_bytes'])} kept by the forward with {recompute['layers_recomputed']} "
        "layers recomputed),",
        f"{gib(gpu['reserved'])} reserved (CUDA context, NCCL for {len(nccl)} communicators, fragmentation).",
        f"Host memory per node {gib(plan['host_total'])} of {gib(plan['host_capacity'])} GiB (offloaded Adam "
        f"{gib(host['offloaded_states'])}, pinned staging {gib(host['pinned_staging'])}).",
        f"Checkpoints: {gib(plan['checkpoint']['rank_bytes'])} GiB per GPU, "
        f"{plan['checkpoint']['run_bytes'] / 2**40:.2f} TiB per run; "
        + (
            "written from a host copy in the background."
            if settings["async_checkpoint"]
            else f"written synchronously: a background write's host copy would add {gib(staging)} GiB "
            "per node."
        ),
        f"The all-to-all in {plan['time']['a2a_chunks']} chunks hides "
        f"{plan['time']['all_to_all_hidden_s']:.1f} s of its {plan['time']['all_to_all_s']:.1f} s per step "
        "behind the experts.",
        f"{plan['time']['tokens_per_step']:,} tokens per step, "
        f"~{plan['time']['tokens_per_s'] / 1e3:.0f}k tokens/s (the planner's model, not a measurement).",
    ]


def why_it_fits(plan: dict) -> list[str]:
    """README's "Why it fits" paragraph with the plan's numbers, wrapped at 100 characters."""
    step, recompute, host = plan["step_peak"], plan["recompute"], plan["host_memory"]
    per_rank = plan["checkpoint"]["rank_bytes"]
    staging = per_rank * plan["cluster"]["gpus_per_node"]
    spare = plan["gpu_usable"] - plan["gpu_total"]
    sentences = [
        "Why it fits: with ep_size 480 each GPU holds 2 of the 960 experts per layer",
        f"({plan['params']['per_rank'] / 1e9:.1f}B parameters); the Adam moments and fp32 masters go to",
        f"host memory ({gib(host['offloaded_states'])} GiB per node) and are stepped by the C++ CPU Adam.",
        f"The forward keeps {gib(recompute['activation_bytes'])} GiB of activations after recomputing",
        f"{recompute['layers_recomputed']} of 24 layers in whole or part (the exact knapsack of",
        "`auto_checkpoint`). The step's peak comes at the",
        f"{step['where']}: {gib(step['activations'])} GiB of activations still held (the rebuilt layer",
        f"included), {gib(step['gradients'])} GiB of gradients and {gib(step['working'])} GiB of working",
        "memory. The reserve counts the CUDA context, NCCL's buffers for each communicator and",
        f"fragmentation ({gib(plan['gpu_memory']['reserved'])} GiB), and {gib(spare)} GiB beyond the 10%",
        "headroom stay free. Checkpoints are written synchronously: a background write would first copy",
        f"every rank's {gib(per_rank)} GiB of state into host memory, {gib(staging)} GiB per node that the",
        "512 GiB nodes do not have beside the offloaded optimizer. The step-peak model is checked against",
        "measured peaks on the CPU",
        "([docs/planner.md](docs/planner.md#validation-against-real-runs)); time figures are a model,",
        "not a measurement.",
    ]
    return wrap(sentences, "")


def warmup_steps() -> str:
    """The config's ``optim.overlap_after_steps`` (0 when absent)."""
    found = re.search(r"^\s+overlap_after_steps: (\d+)", CONFIG.read_text(encoding="utf-8"), re.M)
    return found.group(1) if found else "0"


def how_it_fits(plan: dict, exact: dict) -> list[str]:
    """docs/planner.md's "How it fits" bullets and "What limits it" with the plan's numbers
    (``exact``: the same plan with ``--optim-overlap none``)."""
    params, host, step, time = plan["params"], plan["host_memory"], plan["step_peak"], plan["time"]
    reserve, cluster, checkpoint = plan["reserve"], plan["cluster"], plan["checkpoint"]
    ep, per_node, rank_bytes = plan["settings"]["ep_size"], cluster["gpus_per_node"], checkpoint["rank_bytes"]
    states = gib(params["per_rank"] * 12)
    nccl = [key.removeprefix("nccl_").replace("_", " ") for key in reserve if key.startswith("nccl_")]
    context_and_nccl = sum(value for key, value in reserve.items() if key != "fragmentation")
    used, flat = next(t for t in plan["traffic"] if t["name"] == "all_to_all"), plan["all_to_all_alternative"]
    messages = [t["intra_messages"] + t["inter_messages"] for t in (flat, used)]
    bullets = [
        [
            f"- **Experts spread over all {plan['world_size']} GPUs** (`ep_size {ep}`):",
            f"{params['experts_per_rank_per_layer']} experts per layer per GPU,",
            f"{params['expert_per_rank'] / 1e9:.2f}B expert + {params['dense'] / 1e9:.3f}B dense",
            "parameters per GPU; no expert is replicated, so there is no expert gradient all-reduce.",
        ],
        [
            "- **Optimizer states offloaded**: fp32 master + two moments are 12 bytes/parameter,",
            f"{states} GiB per GPU, which cannot sit next to the rest; on the host they take",
            f"{per_node} x {states} = {gib(host['offloaded_states'])} GiB per node.",
        ],
        [
            f"- **Recompute**: `auto` recomputes {plan['recompute']['layers_recomputed']} layers whole or",
            f"their FFNs; the peak comes at the {step['where']}, when the fp32 gradients (the dominant",
            f"term: {gib(step['gradients'])} of {gib(plan['gradient_bytes'])} GiB) have nearly all arrived.",
        ],
        [
            f"- **Reserve**: {len(nccl)} NCCL communicators ({', '.join(nccl)}; no expert-data-parallel",
            f"group at ep_size {ep}) and the CUDA context take {gib(context_and_nccl)} GiB, plus",
            f"{gib(reserve['fragmentation'])} GiB for fragmentation. The V100 NCCL figures are",
            "assumptions scaled from H100 measurements (`moetrain/planner/reserve.py`), not measured",
            "on V100.",
        ],
        [
            "- **Checkpoints**: 16 bytes per parameter (fp32 weights, fp32 master, two moments),",
            f"{gib(rank_bytes)} GiB per GPU and {checkpoint['run_bytes'] / 2**40:.2f} TiB per run.",
            f"Written in the background, every rank would first copy its {gib(rank_bytes)} GiB into host",
            f"memory: {gib(rank_bytes * per_node)} GiB per node beside the",
            f"{gib(plan['host_total'])} GiB the offloaded optimizer, its staging and the host reserve",
            f"already take, more than the {gib(plan['host_capacity'])} GiB of a DGX-1 class node, so",
            "the config writes checkpoints synchronously (`async_checkpoint: false`).",
        ],
        [
            "- **Hierarchical all-to-all**: the same bytes cross nodes either way, in",
            f"{messages[0] / messages[1]:.1f}x fewer messages than the flat algorithm.",
        ],
        [
            f"- **Chunked all-to-all** (`a2a_chunks: {plan['settings']['a2a_chunks']}`): the link is the",
            f"bottleneck, so the model picks {time['a2a_chunks']} chunks, which hide",
            f"{time['all_to_all_hidden_s']:.1f} s of the {time['all_to_all_s']:.1f} s all-to-all per step",
            "behind the experts; more chunks pay the messages' latencies again and hide less of the",
            "weight-gradient pass.",
        ],
    ]
    adam = (
        f"CPU Adam over {per_node} x {params['per_rank'] / 1e9:.2f}B parameters at "
        f"{cluster['host_memory_bandwidth'] / 1e9:.0f} GB/s of host memory bandwidth"
    )
    if plan["settings"]["optim_overlap"] == "delayed":
        optimizer = [
            f"once its hidden part is taken off. {adam} ({time['optimizer_s']:.1f} s) runs behind the next",
            "step's forward and backward (`optim.overlap: delayed`, after",
            f"{warmup_steps()} exact steps); only the copy of the new weights back to the GPUs",
            f"stays in the step ({time['optimizer_exposed_s']:.2f} s),",
            f"so the step is {time['step_s']:.1f} s instead of {exact['time']['step_s']:.1f} s with",
            "`overlap: none`, at the price of one-step-stale weights and",
            f"{gib(host['pinned_staging'])} GiB of pinned staging per node.",
        ]
    else:
        optimizer = [
            f"once its hidden part is taken off; {adam} is the next term ({time['optimizer_s']:.1f} s)."
        ]
    limits = [
        f"What limits it: the network. A node's {per_node} GPUs share",
        f"{cluster['inter_node_bandwidth'] / 1e9:.2f} GB/s between nodes, and the all-to-all takes",
        f"{time['all_to_all_s'] - time['all_to_all_hidden_s']:.1f} s of the {time['step_s']:.1f} s step",
        *optimizer,
        "`--recommend` prefers fp16 weights (`param_dtype: fp16` with the offloaded optimizer, which",
        "keeps the fp32 masters on the host; tested on CPU), with which larger micro-batches fit.",
    ]
    lines = []
    for bullet in bullets:
        first, *rest = wrap(bullet, "")
        lines += [first, *(f"  {line}" for line in wrap(rest, "", 98))] if rest else [first]
    return [*lines, "", *wrap(limits, "")]


def replace_between(text: str, lines: list[str], prefix: str, where: Path, name: str = "plan-figures") -> str:
    """``text`` with the lines between the marker lines (``prefix`` + ``name:begin`` /
    ``name:end``) replaced."""
    begin, end = f"{prefix}{name}:begin", f"{prefix}{name}:end"
    pattern = re.compile(rf"(^{re.escape(begin)}[^\n]*\n)(.*?)(^{re.escape(end)}[^\n]*$)", re.S | re.M)
    if not pattern.search(text):
        raise SystemExit(f"{where}: the marker lines '{begin}' and '{end}' are missing")
    body = "".join(f"{line}\n" for line in lines)
    return pattern.sub(lambda match: match.group(1) + body + match.group(3), text, count=1)


def wrap(sentences: list[str], prefix: str, width: int = 100) -> list[str]:
    """Comment lines of at most ``width`` characters."""
    words, lines, line = " ".join(sentences).split(), [], prefix
    for word in words:
        if len(line) + 1 + len(word) > width and line != prefix:
            lines.append(line)
            line = prefix
        line = f"{line} {word}" if line != prefix else f"{prefix}{word}"
    return [*lines, line]


def expected_files() -> dict[Path, str]:
    table = run_plan(json_output=False).rstrip("\n")
    plan = json.loads(run_plan(json_output=True))
    budget_mb = math.ceil(plan["recompute"]["activation_bytes"] / 2**20)

    readme = README.read_text(encoding="utf-8")
    block = ["```", f"$ {COMMAND}", *table.splitlines()[1:], "```", "", *why_it_fits(plan)]
    readme = replace_between(readme, block, "<!-- ", README)

    config = CONFIG.read_text(encoding="utf-8")
    header = [
        "# Sized with the planner (docs/planner.md) for the engine's layout (fp32 weights, fp16",
        "# autocast):",
    ]
    header += [f"#   {COMMAND}", *wrap(summary(plan), "# ")]
    config = replace_between(config, header, "# ", CONFIG)
    config, count = re.subn(
        r"^recompute_budget_mb: \d+", f"recompute_budget_mb: {budget_mb}", config, count=1, flags=re.M
    )
    if count != 1:
        raise SystemExit(f"{CONFIG}: no 'recompute_budget_mb:' line")

    sbatch = SBATCH.read_text(encoding="utf-8")
    sbatch = replace_between(sbatch, [f"#   {COMMAND}", *wrap(summary(plan), "#   ")], "# ", SBATCH)
    checkpoint = plan["checkpoint"]
    size = f"{gib(checkpoint['rank_bytes'])} GiB per rank ({checkpoint['run_bytes'] / 2**40:.2f} TiB per run)"
    sbatch = set_checkpoint_size(sbatch, size, SBATCH)
    slurm_readme = set_checkpoint_size(SLURM_README.read_text(encoding="utf-8"), size, SLURM_README)

    doc = PLANNER_DOC.read_text(encoding="utf-8")
    exact = json.loads(run_plan(json_output=True, extra=("--optim-overlap", "none")))
    doc = replace_between(doc, how_it_fits(plan, exact), "<!-- ", PLANNER_DOC)
    doc = replace_between(doc, mixed_block(), "<!-- ", PLANNER_DOC, "mixed-figures")
    return {README: readme, CONFIG: config, SBATCH: sbatch, SLURM_README: slurm_readme, PLANNER_DOC: doc}


def set_checkpoint_size(text: str, size: str, where: Path) -> str:
    """``text`` with every "N GiB per rank (N TiB per run)" set to ``size`` (at least one)."""
    text, count = CHECKPOINT_SIZE.subn(size, text)
    if not count:
        raise SystemExit(f"{where}: no checkpoint size quoted as 'N GiB per rank (N TiB per run)'")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a file is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for path, text in expected_files().items():
        if path.read_text(encoding="utf-8") != text:
            stale.append(path)
            if not args.check:
                path.write_text(text, encoding="utf-8")
    if args.check and stale:
        names = ", ".join(str(path.relative_to(ROOT)) for path in stale)
        print(f"out of date: {names}; run python scripts/update_plan_figures.py", file=sys.stderr)
        return 1
    for path in stale:
        print(f"updated {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
