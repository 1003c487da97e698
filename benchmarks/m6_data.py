"""The M6 data pipeline at corpus scale: manifest memory per rank, and loading in worker processes.

``index`` mode: a generated manifest of ``--records`` image-text records (10M by default, ~1 GB,
written to a temporary directory; records point at 64 small PNGs) is indexed (time, bytes per
record on disk). Then fresh processes, one per measurement, report their resident memory
(``/proc/self/status``: VmRSS = RssAnon, the process's private memory, + RssFile, its mapped file
pages: here the libraries' code, since the index is read with ``pread``, not mapped):

- ``new``: open the dataset from its cached index, build the sampler and draw ``--batches``
  micro-batches of 16 (images decoded, 0 workers), for the full manifest and for its first 10k
  records (``--records`` is at least 10k): the difference between the two is what the corpus size
  costs a rank. RSS resolves only ~0.3 MiB, so two finer figures follow (see ``HEAP_CHILD``): the
  Python heap the pipeline's objects hold (tracemalloc, exact) and the RSS per pipeline of
  ``--opens`` kept open;
- ``old``: the in-memory way this replaced (every record parsed into a Python object, its text
  tokenized, the task pools as lists: the code of ``ManifestDataset._read`` and ``TaskSampler``
  before the index, copied below), on the first 100k and 500k records (at most ``--records``); its
  cost per record is extrapolated linearly to ``--records`` (the two counts show it is linear).

``workers`` mode: the M6 tiny preset trains (AdamW, micro-batch 16, ``seq_len`` 40) on a manifest
of 2,000 records over 200 JPEGs of 256-512 px (decoded and resized to the model's 32 px), once
loading in the training process (``num_workers: 0``) and once with ``--workers`` loader workers,
the cases alternating within each of ``--rounds`` rounds; per case the median step time
(``next()`` + forward + backward + optimizer step) and the time spent waiting in ``next()``.
Thread policies: ``default`` (each case with the run's default threads,
:func:`moetrain.cpus.default_threads`) and ``same`` (both cases with 1 torch thread). Ratio: step
time with 0 workers / with N workers (of the medians, and per round).

Usage:
    python benchmarks/m6_data.py index [--records 10000000] [--batches 200] [--opens 50] [--json PATH]
        [--dir DIR]
    python benchmarks/m6_data.py workers [--workers 1] [--steps 30] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cli import existing_directory, int_in, output_path, positive_int, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMALL_RECORDS = 10_000  # the small manifest: the first records of the full one
OLD_RECORDS = (100_000, 500_000)  # the in-memory way's manifests, each at most --records
COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
SHAPES = ["circle", "square", "triangle", "diamond", "star", "cross", "ring", "arrow"]


def machine() -> dict:
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------ index
def write_manifest(directory: Path, records: int) -> Path:
    """``records`` lines of ~110 bytes over 64 small PNGs in ``directory/images``."""
    from PIL import Image

    (directory / "images").mkdir(parents=True, exist_ok=True)
    for i in range(64):
        Image.new("RGB", (16, 16), COLOURS[i % 8]).save(directory / "images" / f"{i:05d}.png")
    path = directory / "train.jsonl"
    with open(path, "w", encoding="utf-8") as file:
        for start in range(0, records, 100_000):
            lines = [
                f'{{"image": "images/{i % 64:05d}.png", "text": "photo {i}: a {COLOURS[i % 8]} '
                f"{SHAPES[i // 8 % 8]} next to a {COLOURS[i // 64 % 8]} {SHAPES[i // 512 % 8]}, "
                f'caption {i * 7919 % 1_000_003}"}}\n'
                for i in range(start, min(records, start + 100_000))
            ]
            file.writelines(lines)
    return path


def head_manifest(source: Path, records: int, directory: Path) -> Path:
    """The first ``records`` lines of ``source`` as a manifest in ``directory`` (same images)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "images").symlink_to(source.parent / "images")
    path = directory / "train.jsonl"
    with open(source, "rb") as file, open(path, "wb") as out:
        for _ in range(records):
            out.write(file.readline())
    return path


MEMORY = """
def memory():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields
"""

NEW_CHILD = (
    MEMORY
    + """
import gc, json, sys, time
import torch
from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset
from m6_moe.loader import M6Batches
from m6_moe.tasks import TaskSampler
from m6_moe.tokenizer import ByteTokenizer
torch.set_num_threads(1)
gc.collect()
before = memory()
started = time.perf_counter()
dataset = ManifestDataset(sys.argv[1], image_size=32)
sampler = TaskSampler(dataset, ByteTokenizer(), M6TaskConfig(), seq_len=40)
opened = time.perf_counter() - started
batches = M6Batches(sampler, 16, num_patches=16)
started = time.perf_counter()
for _ in range(int(sys.argv[2])):
    batches.next()
drawn = time.perf_counter() - started
gc.collect()
after = memory()
print(json.dumps({"records": len(dataset), "before": before, "after": after, "open_s": opened,
                  "draw_s": drawn, "samples": 16 * int(sys.argv[2])}))
"""
)

# RSS moves by whole pages and with the allocator's pools (±0.3 MiB between two fresh processes),
# coarser than the target for 10M records (records / 100 = 100 KB). Two finer measurements: the
# Python heap (objects and numpy arrays) the pipeline's objects hold, exact to the byte with
# tracemalloc (what stays allocated after drawing and is freed with the pipeline; one warm-up
# pipeline first takes the one-time costs: imports, decoder plugins); and the RSS of ``opens``
# more pipelines kept open at once, each after one batch, divided by ``opens``.
HEAP_CHILD = (
    MEMORY
    + """
import gc, json, sys, tracemalloc
import torch
from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset
from m6_moe.loader import M6Batches
from m6_moe.tasks import TaskSampler
from m6_moe.tokenizer import ByteTokenizer
torch.set_num_threads(1)
manifest, drawn, opens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def open_and_draw(batches):
    dataset = ManifestDataset(manifest, image_size=32)
    sampler = TaskSampler(dataset, ByteTokenizer(), M6TaskConfig(), seq_len=40)
    pipeline = M6Batches(sampler, 16, num_patches=16)
    for _ in range(batches):
        pipeline.next()
    return pipeline

open_and_draw(2)
gc.collect()
tracemalloc.start()
pipeline = open_and_draw(drawn)
gc.collect()
with_pipeline = tracemalloc.get_traced_memory()[0]
records = len(pipeline.sampler.dataset)
del pipeline
gc.collect()
without = tracemalloc.get_traced_memory()[0]
tracemalloc.stop()
gc.collect()
before = memory()
kept = [open_and_draw(1) for _ in range(opens)]
gc.collect()
after = memory()
print(json.dumps({"records": records, "heap_held": with_pipeline - without, "opens": opens,
                  "rss_per_open": (after["VmRSS"] - before["VmRSS"]) / opens}))
"""
)

OLD_CHILD = (
    MEMORY
    + '''
import gc, json, sys, time
from dataclasses import dataclass
from pathlib import Path
from m6_moe.tokenizer import ByteTokenizer

@dataclass(frozen=True)
class Record:
    text: str
    image: Path | None
    line: int

def old_in_memory(manifest, tokenizer):
    """ManifestDataset._read / _parse and TaskSampler.__init__ before the index (git 17929f3),
    without the error paths (the generated manifest has no bad line)."""
    raw_lines = manifest.read_bytes().split(b"\\n")
    records = []
    for number, raw in enumerate(raw_lines, start=1):
        line = raw.decode("utf-8")
        if not line.strip():
            continue
        data = json.loads(line)
        text, image = data.get("text"), data.get("image")
        path = None
        if image is not None:
            path = Path(image) if Path(image).is_absolute() else manifest.parent / image
        records.append(Record(text, path, number))
    del raw_lines
    tokens = [tokenizer.encode(r.text) for r in records]
    with_image = [i for i, r in enumerate(records) if r.image is not None]
    pools = {
        "caption": with_image,
        "denoise": list(range(len(records))),
        "image_text": [i for i in with_image if len(records[i].text) >= 2],
    }
    return records, tokens, pools

gc.collect()
before = memory()
started = time.perf_counter()
kept = old_in_memory(Path(sys.argv[1]), ByteTokenizer())
seconds = time.perf_counter() - started
gc.collect()
after = memory()
print(json.dumps({"records": len(kept[0]), "before": before, "after": after, "seconds": seconds}))
'''
)


def run_child(code: str, *args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "models")])}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"measurement failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def delta(result: dict, key: str) -> int:
    return result["after"][key] - result["before"][key]


def run_index(args) -> dict:
    from m6_moe.manifest_index import ManifestIndex, ensure_index

    base = Path(tempfile.mkdtemp(prefix="m6_data_bench_", dir=args.dir))
    try:
        started = time.perf_counter()
        manifest = write_manifest(base / "full", args.records)
        generate_s = time.perf_counter() - started
        started = time.perf_counter()
        directory = ensure_index(manifest, progress=True)
        index_s = time.perf_counter() - started
        index_bytes = sum(p.stat().st_size for p in directory.iterdir())
        assert ManifestIndex(manifest, directory).records == args.records
        manifest_bytes = manifest.stat().st_size
        small = head_manifest(manifest, SMALL_RECORDS, base / "small")
        new_full = run_child(NEW_CHILD, manifest, args.batches)
        new_small = run_child(NEW_CHILD, small, args.batches)
        heap_full = run_child(HEAP_CHILD, manifest, args.batches, args.opens)
        heap_small = run_child(HEAP_CHILD, small, args.batches, args.opens)
        counts = sorted({min(n, args.records) for n in OLD_RECORDS})
        olds = {n: run_child(OLD_CHILD, head_manifest(manifest, n, base / f"old_{n}")) for n in counts}
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    old_per_record = {n: delta(r, "VmRSS") / r["records"] for n, r in olds.items()}
    largest = max(olds)
    per_record = old_per_record[largest]
    return {
        "records": args.records,
        "manifest_bytes": manifest_bytes,
        "generate_s": generate_s,
        "index_s": index_s,
        "index_bytes_per_record": index_bytes / args.records,
        "new": {
            "full": new_full,
            "small": new_small,
            "anon_delta_full": delta(new_full, "RssAnon"),
            "anon_delta_small": delta(new_small, "RssAnon"),
            "file_delta_full": delta(new_full, "RssFile"),
            "rss_delta_full": delta(new_full, "VmRSS"),
            "rss_delta_small": delta(new_small, "VmRSS"),
            "heap_full": heap_full,
            "heap_small": heap_small,
        },
        "old": {
            str(n): {"rss_delta": delta(r, "VmRSS"), "per_record": old_per_record[n], "seconds": r["seconds"]}
            for n, r in olds.items()
        },
        "old_extrapolated_rss": per_record * args.records,
        "old_extrapolated_s": olds[largest]["seconds"] * args.records / olds[largest]["records"],
    }


def print_index(result: dict) -> None:
    mib = 2**20
    new, old = result["new"], result["old"]
    records = result["records"]
    print(f"manifest: {records:,} records, {result['manifest_bytes'] / mib:,.0f} MiB "
          f"(generated in {result['generate_s']:.0f} s)")  # fmt: skip
    print(
        f"index build: {result['index_s']:.1f} s, {result['index_bytes_per_record']:.1f} bytes/record on disk"
    )
    print(f"new, per rank after opening + {new['full']['samples']} samples drawn "
          f"(open {new['full']['open_s'] * 1e3:.0f} ms):")  # fmt: skip
    for name, label in (("full", f"{records:,} records"), ("small", f"{SMALL_RECORDS:,} records")):
        run = new[name]
        print(
            f"  {label:>18}: RSS +{(run['after']['VmRSS'] - run['before']['VmRSS']) / mib:7.2f} MiB "
            f"(private +{(run['after']['RssAnon'] - run['before']['RssAnon']) / mib:6.2f} MiB, "
            f"mapped files +{(run['after']['RssFile'] - run['before']['RssFile']) / mib:6.2f} MiB)"
        )
    size_cost = new["rss_delta_full"] - new["rss_delta_small"]
    print(
        f"  what the corpus size costs a rank (full - small): RSS {size_cost / mib:+.2f} MiB = "
        f"{size_cost / records:+.4f} bytes/record (target: <= records / 100 bytes, i.e. 0.01 bytes/record); "
        "the index is read with pread, never mapped: what it reads stays in the node's page cache"
    )
    heap_cost = new["heap_full"]["heap_held"] - new["heap_small"]["heap_held"]
    print(
        f"  finer: Python heap the pipeline holds (tracemalloc, exact): {new['heap_full']['heap_held']:,} "
        f"bytes at {records:,} records, {new['heap_small']['heap_held']:,} at {SMALL_RECORDS:,}: "
        f"the corpus size costs {heap_cost:+,} bytes = {heap_cost / records:+.1e} bytes/record"
    )
    rss_cost = new["heap_full"]["rss_per_open"] - new["heap_small"]["rss_per_open"]
    print(
        f"  finer: RSS per pipeline, {new['heap_full']['opens']} kept open at once: "
        f"{new['heap_full']['rss_per_open'] / 1024:.1f} KiB at {records:,} records, "
        f"{new['heap_small']['rss_per_open'] / 1024:.1f} KiB at {SMALL_RECORDS:,}: the corpus size costs "
        f"{rss_cost / 1024:+.1f} KiB = {rss_cost / records:+.4f} bytes/record"
    )
    for n, run in old.items():
        print(f"old, in memory, {int(n):,} records: RSS +{run['rss_delta'] / mib:.1f} MiB = "
              f"{run['per_record']:.0f} bytes/record, {run['seconds']:.1f} s")  # fmt: skip
    gib = result["old_extrapolated_rss"] / 2**30
    print(f"old, extrapolated to {records:,} records: {gib:.2f} GiB per rank, "
          f"{result['old_extrapolated_s']:.0f} s per rank at start-up")  # fmt: skip


# ---------------------------------------------------------------------------------- workers
def write_jpeg_corpus(directory: Path, images: int = 200, records: int = 2000) -> Path:
    from PIL import Image, ImageDraw

    rng = random.Random(0)
    (directory / "images").mkdir(parents=True, exist_ok=True)
    for i in range(images):
        width, height = rng.randint(256, 512), rng.randint(256, 512)
        image = Image.new("RGB", (width, height), tuple(rng.randint(0, 255) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(12):
            x0, y0 = rng.randint(0, width - 40), rng.randint(0, height - 40)
            box = (x0, y0, x0 + rng.randint(20, width // 2), y0 + rng.randint(20, height // 2))
            draw.ellipse(box, fill=tuple(rng.randint(0, 255) for _ in range(3)))
        image.save(directory / "images" / f"{i:04d}.jpg", quality=90)
    path = directory / "train.jsonl"
    with open(path, "w", encoding="utf-8") as file:
        for i in range(records):
            text = f"a {COLOURS[i % 8]} {SHAPES[i // 8 % 8]} near a {COLOURS[i // 64 % 8]} one, photo {i}"
            file.write(json.dumps({"image": f"images/{i % images:04d}.jpg", "text": text}) + "\n")
    return path


def time_steps(manifest: Path, workers: int, threads: int, steps: int, warmup: int, out_dir: Path) -> dict:
    import torch

    from m6_moe import M6Config, build_m6
    from moetrain.config import DataConfig, TrainConfig
    from moetrain.registry import DataShard

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = TrainConfig(
        model=M6Config.preset("tiny"),
        data=DataConfig(source=str(manifest), micro_batch_size=16, seq_len=40, num_workers=workers),
        out_dir=str(out_dir),
    )
    model, batches, loss_fn = build_m6(config, DataShard())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step_s, wait_s = [], []
    try:
        for step in range(warmup + steps):
            started = time.perf_counter()
            inputs, labels = batches.next()
            loaded = time.perf_counter()
            loss = loss_fn(model(**inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            if step >= warmup:
                step_s.append(time.perf_counter() - started)
                wait_s.append(loaded - started)
    finally:
        batches.close()
    return {"step_s": statistics.median(step_s), "wait_s": statistics.median(wait_s)}


def run_workers(args) -> dict:
    from moetrain.cpus import cpus_per_rank, default_threads

    cpus = cpus_per_rank(1)
    policies = {
        "default": {0: default_threads(cpus, 0), args.workers: default_threads(cpus, args.workers)},
        "same": {0: 1, args.workers: 1},
    }
    base = Path(tempfile.mkdtemp(prefix="m6_workers_bench_"))
    try:
        manifest = write_jpeg_corpus(base / "corpus")
        results = {name: {0: [], args.workers: []} for name in policies}
        for _ in range(args.rounds):
            for name, threads in policies.items():
                for workers in (0, args.workers):
                    run = time_steps(manifest, workers, threads[workers], args.steps, 5, base / "run")
                    results[name][workers].append(run)
    finally:
        import shutil

        shutil.rmtree(base, ignore_errors=True)
    summary = {}
    for name, by_workers in results.items():
        cases = {
            w: {
                "threads": policies[name][w],
                "step_ms": statistics.median(r["step_s"] for r in runs) * 1e3,
                "wait_ms": statistics.median(r["wait_s"] for r in runs) * 1e3,
            }
            for w, runs in by_workers.items()
        }
        per_round = [
            a["step_s"] / b["step_s"] for a, b in zip(by_workers[0], by_workers[args.workers], strict=True)
        ]
        summary[name] = {
            "cases": cases,
            "ratio": cases[0]["step_ms"] / cases[args.workers]["step_ms"],
            "round_ratios": per_round,
        }
    return {
        "cpus": cpus,
        "workers": args.workers,
        "steps": args.steps,
        "rounds": args.rounds,
        "policies": summary,
    }


def print_workers(result: dict) -> None:
    workers = result["workers"]
    print(
        f"M6 tiny, micro-batch 16, 200 JPEGs of 256-512 px resized to 32 px, {result['cpus']} CPUs, "
        f"median of {result['steps']} steps x {result['rounds']} rounds"
    )
    print(
        f"{'threads policy':>15} | {'workers':>7} | {'threads':>7} | {'step ms':>8} | "
        f"{'wait in next() ms':>17}"
    )
    for name, policy in result["policies"].items():
        for w, case in policy["cases"].items():
            print(
                f"{name:>15} | {w:>7} | {case['threads']:>7} | {case['step_ms']:8.1f} | "
                f"{case['wait_ms']:17.1f}"
            )
        rounds = ", ".join(f"{r:.2f}" for r in policy["round_ratios"])
        print(
            f"{name:>15}: step time with 0 workers / with {workers}: {policy['ratio']:.2f}x "
            f"(rounds: {rounds})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    index = sub.add_parser("index")
    why = f" (the small manifest is the first {SMALL_RECORDS:,})"
    index.add_argument("--records", type=int_in(SMALL_RECORDS, why=why), default=10_000_000)
    index.add_argument("--batches", type=positive_int, default=200)
    index.add_argument(
        "--opens", type=positive_int, default=50, help="pipelines kept open for the RSS per pipeline"
    )
    index.add_argument(
        "--dir",
        type=existing_directory,
        default=None,
        help="where the temporary manifest goes (default: the system's)",
    )
    index.add_argument("--json", type=output_path)
    loader = sub.add_parser("workers")
    loader.add_argument(
        "--workers", type=positive_int, default=1, help="loader workers compared with loading in-process"
    )
    loader.add_argument("--steps", type=positive_int, default=30)
    loader.add_argument("--rounds", type=positive_int, default=3)
    loader.add_argument("--json", type=output_path)
    args = parser.parse_args()
    from moetrain.logs import configure_console

    configure_console("INFO")  # the index build's progress bar and log line on stderr
    if args.mode == "index":
        result = run_index(args)
        print_index(result)
    else:
        result = run_workers(args)
        print_workers(result)
    result = {"mode": args.mode, "machine": machine(), **result}
    if args.json:
        write_json(args.json, result)


if __name__ == "__main__":
    main()
