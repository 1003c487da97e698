"""The M6 data pipeline at corpus scale: manifest index and its cache, many manifests, the epoch
permutation, sharding between ranks and loader workers, exact resume (also at another world
size), bad records found by workers, and the engine's use of it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from m6_moe.config import M6TaskConfig
from m6_moe.data import ManifestDataset, resolve_manifests
from m6_moe.loader import M6Batches, rank_positions
from m6_moe.manifest_index import ManifestIndex, cache_roots, ensure_index
from m6_moe.shuffle import EpochPermutation
from m6_moe.tasks import TaskSampler
from m6_moe.tokenizer import ByteTokenizer
from moetrain.registry import DataShard
from tests.helpers.dist_utils import run_distributed
from tests.helpers.paths import ROOT

TOKENIZER = ByteTokenizer()
COLOURS = ["red", "green", "blue", "white", "black", "grey"]


def write_corpus(directory: Path, records: int, name: str = "train.jsonl", extra_lines=()) -> Path:
    """``records`` image-text records over 6 small PNGs in ``directory/images`` (relative paths),
    then ``extra_lines`` (raw bytes)."""
    (directory / "images").mkdir(parents=True, exist_ok=True)
    for colour in COLOURS:
        if not (directory / "images" / f"{colour}.png").exists():
            Image.new("RGB", (12, 10), colour).save(directory / "images" / f"{colour}.png")
    lines = [
        json.dumps(
            {"image": f"images/{COLOURS[i % 6]}.png", "text": f"record {i} is {COLOURS[i % 6]}"}
        ).encode()
        for i in range(records)
    ]
    path = directory / name
    path.write_bytes(b"\n".join([*lines, *extra_lines]) + b"\n")
    return path


def sampler_for(manifests, seed: int = 0, skip: bool = False, **task_options) -> TaskSampler:
    dataset = ManifestDataset(manifests, image_size=8, skip_bad_records=skip, max_image_pixels=10_000)
    return TaskSampler(dataset, TOKENIZER, M6TaskConfig(**task_options), seq_len=24, seed=seed)


def record_number(sampler: TaskSampler, record: int) -> int:
    """The ``i`` of ``"record i is ..."``: which manifest record a sample came from."""
    return int(sampler.dataset.record(record).text.split()[1])


# ----------------------------------------------------------------------------- permutation
@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_epoch_permutation_is_a_bijection_that_depends_on_its_key(n):
    order = EpochPermutation(n, key=11)(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    assert EpochPermutation(n, key=11)(5 % n) == order[5 % n]  # one element alone: the same
    if n >= 7:
        assert not np.array_equal(order, EpochPermutation(n, key=12)(np.arange(n)))
        assert not np.array_equal(order, np.arange(n))
    with pytest.raises(IndexError):
        EpochPermutation(n, key=1)(n)


# ----------------------------------------------------------------------------------- index
def test_index_is_cached_and_rebuilt_when_the_manifest_changes(tmp_path, caplog):
    manifest = write_corpus(tmp_path, 5)
    with caplog.at_level(logging.INFO, logger="moetrain.m6_moe.manifest_index"):
        first = ensure_index(manifest)
        assert ensure_index(manifest) == first  # cached: built once
    assert sum("indexed" in r.getMessage() for r in caplog.records) == 1
    index = ManifestIndex(manifest, first)
    assert (index.records, index.image_records, index.bad_lines) == (5, 5, 0)
    assert (
        index.array("offsets").dtype == np.uint64
        and index.array("offsets")[1] == len(manifest.read_bytes().split(b"\n")[0]) + 1
    )
    assert json.loads(index.read(4))["text"] == "record 4 is black"
    with open(manifest, "ab") as file:  # appended to: a new key, a new index, the old one kept
        file.write(json.dumps({"text": "text only"}).encode() + b"\n")
    second = ensure_index(manifest)
    assert second != first and first.exists() and second.parent == first.parent
    assert ManifestIndex(manifest, second).records == 6
    left = sorted(p.name for p in second.parent.iterdir())
    assert left == sorted([first.name, second.name])  # both kept (a running job may use the old one)
    dataset = ManifestDataset(manifest, image_size=8)
    assert len(dataset) == 6 and dataset.record(5).image is None and dataset.record(5).line == 6


def test_concurrent_builders_leave_one_index_and_a_progress_bar(tmp_path, progress_log):
    stream = progress_log()
    manifest = write_corpus(tmp_path, 50)
    with ThreadPoolExecutor(3) as pool:
        found = list(pool.map(lambda _: ensure_index(manifest, progress=True), range(3)))
    assert len(set(found)) == 1 and [p.name for p in found[0].parent.iterdir()] == [found[0].name]
    assert "indexing train.jsonl (MB)" in stream.getvalue()


def test_index_goes_to_the_fallback_directory_when_the_manifest_directory_is_not_writable(tmp_path, caplog):
    manifest = write_corpus(tmp_path / "corpus", 4)
    beside, _ = cache_roots(manifest)
    beside.write_text("a file where the index directory would go")  # mkdir fails, as on a read-only disk
    with caplog.at_level(logging.WARNING, logger="moetrain.m6_moe.manifest_index"):
        directory = ensure_index(manifest, fallback_dir=tmp_path / "cache")
    assert directory.is_relative_to(tmp_path / "cache") and ManifestIndex(manifest, directory).records == 4
    assert any("is not writable: its index is cached in" in r.getMessage() for r in caplog.records)
    assert ensure_index(manifest, fallback_dir=tmp_path / "cache") == directory  # found there next time


def test_the_index_command_builds_and_reports(tmp_path):
    manifest = write_corpus(tmp_path, 3, extra_lines=[b"{bad json"])
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'models'}"}
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "m6_moe.index_command", str(manifest)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr  # runpy's, when the package imports the module run
    assert f"{manifest}: 3 records (3 with an image), 1 bad lines; index " in done.stdout
    assert f"indexed {manifest}: 3 records" in done.stderr  # the build's log line, on stderr
    assert ensure_index(manifest) == Path(done.stdout.split("; index ")[1].strip())
    missing = subprocess.run(
        [sys.executable, "-m", "m6_moe.index_command", str(tmp_path / "nope.jsonl")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "nope.jsonl cannot be read" in missing.stderr


def test_many_manifests_and_glob_patterns_form_one_dataset(tmp_path):
    first = write_corpus(tmp_path / "a", 3)
    write_corpus(tmp_path / "b", 2, name="part-0.jsonl", extra_lines=[b'{"image": "x.png"}'])
    write_corpus(tmp_path / "b", 4, name="part-1.jsonl")
    dataset = ManifestDataset(
        [first, str(tmp_path / "b" / "part-*.jsonl")], image_size=8, skip_bad_records=True
    )
    assert [m.name for m in dataset.manifests] == ["train.jsonl", "part-0.jsonl", "part-1.jsonl"]
    assert len(dataset) == 9 and dataset.skipped_records == 1
    assert "part-0.jsonl:3: record has no text" in dataset.skip_summary()
    assert dataset.record(4).image == tmp_path / "b" / "images" / "green.png"  # relative to its manifest
    assert dataset.where(5) == f"{tmp_path / 'b' / 'part-1.jsonl'}:1"
    texts = ["record 2 is blue", "record 0 is red", "record 1 is green", "record 0 is red"]
    assert [r.text for r in dataset.records[2:6]] == texts
    assert dataset.load_image(8).shape == (3, 8, 8)
    with pytest.raises(ValueError, match=r"part-0\.jsonl:3: record has no text"):
        ManifestDataset([first, tmp_path / "b" / "part-0.jsonl"], image_size=8)
    with pytest.raises(ValueError, match="data.source pattern .* matches no file"):
        ManifestDataset(str(tmp_path / "c" / "*.jsonl"), image_size=8)
    with pytest.raises(ValueError, match="data.source must name at least one manifest"):
        ManifestDataset([], image_size=8)
    sampler = TaskSampler(dataset, TOKENIZER, M6TaskConfig(), seq_len=24)
    assert sorted(sampler.record_at(0, i) for i in range(9)) == list(range(9))


def test_a_file_whose_name_holds_glob_characters_is_taken_as_given(tmp_path):
    """``caps[2024].jsonl`` exists: it is that file, not the pattern ``caps[2024].jsonl`` (which
    matches ``caps2.jsonl`` ... and not itself); an entry that is no file is still a pattern."""
    bracketed = write_corpus(tmp_path, 3, name="caps[2024].jsonl")
    starred = write_corpus(tmp_path, 2, name="all*.jsonl")
    plain = write_corpus(tmp_path, 4, name="caps2.jsonl")
    assert resolve_manifests(str(bracketed)) == [bracketed]
    assert resolve_manifests([bracketed, str(starred)]) == [bracketed, starred]
    assert resolve_manifests(str(tmp_path / "caps[0-9].jsonl")) == [plain]  # no such file: a pattern
    dataset = ManifestDataset(str(bracketed), image_size=8)
    assert dataset.manifests == [bracketed] and len(dataset) == 3
    with pytest.raises(ValueError, match=r"data.source pattern .*caps\[0-1\]\.jsonl' matches no file"):
        resolve_manifests(str(tmp_path / "caps[0-1].jsonl"))


# ------------------------------------------------------------------------- stream and epochs
def test_rank_and_worker_slices_are_disjoint_and_cover_the_stream():
    """4 ranks with unequal micro-batches, 3 workers each: every position once, in order of steps."""
    batches, start, steps, workers = (3, 1, 2, 2), 17, 12, 3
    seen = {}
    for rank in range(4):
        for worker in range(workers):
            for step in range(worker, steps, workers):  # worker w makes steps w, w + W, ...
                for position in rank_positions(start, batches, rank, step):
                    assert position not in seen
                    seen[position] = (rank, worker, step)
    assert sorted(seen) == list(range(start, start + steps * sum(batches)))
    assert [seen[p][0] for p in range(start, start + 8)] == [0, 0, 0, 1, 2, 2, 3, 3]


def test_epochs_are_counted_and_each_sees_every_record_once(tmp_path):
    sampler = sampler_for(write_corpus(tmp_path, 10))
    batches = M6Batches(sampler, 4, num_patches=4)
    records = []
    for _ in range(10):  # 40 samples: 4 epochs of 10
        batches.next()
        records += batches.last_report["records"]
    assert (batches.epoch, batches.offset, batches.position) == (4, 0, 40)
    epochs = [records[e * 10 : (e + 1) * 10] for e in range(4)]
    assert all(sorted(epoch) == list(range(10)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 4  # a new order every epoch
    assert sum(batches.task_counts.values()) == 40 and batches.batches_drawn == 10


def test_exact_resume_from_a_json_round_tripped_state(tmp_path):
    manifest = write_corpus(tmp_path, 13)
    uninterrupted = M6Batches(sampler_for(manifest, seed=3), 5, num_patches=4)
    expected = [uninterrupted.next() for _ in range(6)]
    first = M6Batches(sampler_for(manifest, seed=3), 5, num_patches=4)
    for _ in range(2):
        first.next()
    state = json.loads(json.dumps(first.state_dict()))  # plain values only, as in a checkpoint
    assert state["epoch"] == 0 and state["offset"] == 10
    resumed = M6Batches(sampler_for(manifest, seed=3), 5, num_patches=4)
    resumed.load_state_dict(state)
    _, probe_labels = resumed.probe(3, seed=123)  # a separate stream: the position does not move
    assert torch.equal(resumed.probe(3, seed=123)[1], probe_labels) and resumed.position == 10
    for inputs_want, labels_want in expected[2:]:
        inputs, labels = resumed.next()
        assert torch.equal(labels, labels_want) and all(
            torch.equal(inputs[k], inputs_want[k]) for k in inputs
        )
    assert resumed.batches_drawn == uninterrupted.batches_drawn == 6
    assert resumed.task_counts == uninterrupted.task_counts
    other_seed = M6Batches(sampler_for(manifest, seed=4), 5, num_patches=4)
    assert not torch.equal(other_seed.next()[1], expected[0][1])


def test_workers_make_the_same_batches_and_report_bad_records(tmp_path):
    """2 loader workers alternate micro-steps and give exactly the in-process batches; the bad
    images they find (missing, oversized) and the bad manifest lines are counted in the training
    process; in strict mode a worker's bad record is a one-line ValueError."""
    Image.new("L", (200, 100)).save(tmp_path / "huge.png")  # 20,000 pixels > max_image_pixels
    extra = [
        json.dumps({"image": "missing.png", "text": "a missing image"}).encode(),
        json.dumps({"image": "huge.png", "text": "an oversized image"}).encode(),
        b'{"image": "images/red.png", "text": "caf\xe9"}',  # not UTF-8
    ]
    manifest = write_corpus(tmp_path, 8, extra_lines=extra)
    options = {"denoise_weight": 0, "image_text_weight": 0}  # captions: every draw loads an image
    in_process = M6Batches(sampler_for(manifest, skip=True, **options), 3, num_patches=4)
    in_workers = M6Batches(sampler_for(manifest, skip=True, **options), 3, num_patches=4, num_workers=2)
    for step in range(8):  # 24 samples: 2.4 epochs of 10 records
        _, want = in_process.next()
        _, got = in_workers.next()
        assert torch.equal(got, want) and in_workers.last_report["worker"] == step % 2
        assert in_workers.last_report["records"] == in_process.last_report["records"]
    in_workers.close()
    assert in_workers.skipped_records == in_process.skipped_records == 3  # 1 line + 2 images
    summary = in_workers.skip_summary(max_reasons=3)
    assert "line is not UTF-8" in summary and "missing.png does not exist" in summary
    assert "more than tasks.max_image_pixels = 10,000" in summary
    strict = M6Batches(sampler_for(write_corpus(tmp_path / "s", 2, extra_lines=extra[:1]), **options), 3,
                       num_patches=4, num_workers=1)  # fmt: skip
    with pytest.raises(ValueError, match=r"train\.jsonl:3: image .*missing\.png does not exist") as error:
        for _ in range(4):
            strict.next()
    assert "\n" not in str(error.value)


def _prepare_indexes_worker(rank, world, manifests):
    """Builds this rank's share of the indexes (rank 0 slowly), then lists every manifest's index
    directory as this rank sees it right after the barrier."""
    import time

    import m6_moe

    built, build = [], m6_moe.ensure_index

    def recording(manifest, fallback_dir=None):
        built.append(Path(manifest).name)
        if rank == 0:
            time.sleep(1.0)  # the other rank must wait for it at the barrier
        return build(manifest, fallback_dir)

    m6_moe.ensure_index = recording
    m6_moe.prepare_manifest_indexes([Path(m) for m in manifests], rank, world)
    present = {Path(m).name: sorted(p.name for p in cache_roots(Path(m))[0].glob("*")) for m in manifests}
    return built, present


@pytest.mark.slow
def test_prepare_manifest_indexes_splits_the_builds_between_ranks_and_waits_for_all(tmp_path):
    manifests = [write_corpus(tmp_path / f"shard{i}", 3 + i, name=f"part-{i}.jsonl") for i in range(3)]
    missing = tmp_path / "missing.jsonl"  # unreadable: left for the dataset to report on every rank
    names = [str(m) for m in [*manifests, missing]]
    (built0, present0), (built1, present1) = run_distributed(_prepare_indexes_worker, 2, names)
    assert built0 == ["part-0.jsonl", "part-2.jsonl"] and built1 == ["part-1.jsonl", "missing.jsonl"]
    for present in (present0, present1):  # after the barrier every index exists, on both ranks
        assert all(len(present[m.name]) == 1 for m in manifests) and present["missing.jsonl"] == []
    for manifest, records in zip(manifests, (3, 4, 5), strict=True):
        assert ManifestIndex(manifest, ensure_index(manifest)).records == records


# ----------------------------------------------------------------------------------- engine
def engine_config(out_dir, manifest, steps, micro_batch, **extra) -> list[str]:
    return [
        f"out_dir={out_dir}", f"data.source={manifest}", f"data.micro_batch_size={micro_batch}",
        f"steps={steps}", "checkpoint_every=2", "log_every=1", "async_checkpoint=false",
        "device=cpu", *(f"{k}={v}" for k, v in extra.items()),
    ]  # fmt: skip


def train_recording(overrides: list[str]) -> tuple[list[list[int]], list[dict]]:
    """Trains the tiny M6 preset with ``overrides``; returns the global positions of every
    micro-batch this rank drew, and the metrics."""
    from moetrain.cli import build_train_config
    from moetrain.engine import Trainer

    trainer = Trainer(build_train_config(str(ROOT / "models/m6_moe/tiny.yaml"), overrides))
    drawn, draw = [], trainer.batches.next

    def recording_next():
        result = draw()
        drawn.append(trainer.batches.last_report["positions"])
        return result

    trainer.batches.next = recording_next
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return drawn, history


def resume_worker(rank, world, overrides):
    return train_recording(overrides)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expert_parallel_ranks_draw_distinct_positions_of_one_stream(tmp_path):
    """M6 with ep_size 2 on 2 ranks: the experts are split, the data is not shared: each rank draws
    its own micro-batches, together the first positions of the one global stream, none twice."""
    manifest = write_corpus(tmp_path, 24)
    overrides = engine_config(tmp_path / "run", manifest, 2, 3, threads=1, **{"parallel.ep_size": 2})
    (rank0, _), (rank1, _) = run_distributed(resume_worker, 2, overrides)
    assert len(rank0) == len(rank1) == 2 and all(len(batch) == 3 for batch in rank0 + rank1)
    assert set(sum(rank0, [])).isdisjoint(sum(rank1, []))
    assert sorted(sum(rank0 + rank1, [])) == list(range(12))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_at_another_world_size_continues_the_stream(tmp_path):
    """Through the engine, on a 24-record epoch: 1 rank (micro-batch 4) runs steps 1-2 and
    checkpoints, 2 ranks resume for steps 3-4 (rank 1 takes rank 0's position), then 1 rank runs
    steps 5-6 after them: the positions drawn are 0..23 once each, i.e. every record of the epoch
    once, as an uninterrupted run would see them."""
    manifest = write_corpus(tmp_path, 24)
    out = tmp_path / "run"
    one, _ = train_recording(engine_config(out, manifest, 2, 4, threads=1, **{"data.num_workers": 0}))
    two = run_distributed(resume_worker, 2, engine_config(out, manifest, 4, 4, threads=1))
    (rank0, _), (rank1, _) = two
    last, history = train_recording(engine_config(out, manifest, 6, 4, threads=1, **{"data.num_workers": 1}))
    positions = [p for batch in one + rank0 + rank1 for p in batch]
    assert one == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rank0 == [[8, 9, 10, 11], [16, 17, 18, 19]] and rank1 == [[12, 13, 14, 15], [20, 21, 22, 23]]
    assert sorted(positions) == list(range(24)) and last == [[24, 25, 26, 27], [28, 29, 30, 31]]
    assert [m["step"] for m in history] == [5, 6]


def test_bad_images_found_by_workers_reach_the_metrics(tmp_path, caplog):
    extra = [json.dumps({"image": "missing.png", "text": "a missing image"}).encode()]
    manifest = write_corpus(tmp_path, 3, extra_lines=extra)
    _, history = train_recording(
        engine_config(
            tmp_path / "run", manifest, 2, 4, threads=1,
            **{"data.num_workers": 1, "model.tasks.skip_bad_records": "true", "model.tasks.denoise_weight": 0,
               "model.tasks.image_text_weight": 0},
        )
    )  # fmt: skip
    assert [m["skipped_records"] for m in history] == [1, 1]  # 4 records, every one drawn at step 1
    assert any("data (end, rank 0): 1 bad record skipped:" in r.getMessage() for r in caplog.records)


def test_data_source_lists_and_num_workers_in_the_config(tmp_path):
    from m6_moe import build_m6
    from moetrain.config import DataConfig, TrainConfig, config_from_dict

    first = write_corpus(tmp_path / "a", 3)
    write_corpus(tmp_path / "b", 2, name="part-0.jsonl")
    config = config_from_dict(
        TrainConfig,
        {
            "model": {"name": "m6_moe", "preset": "tiny"},
            "data": {
                "source": [str(first), str(tmp_path / "b" / "*.jsonl")],
                "num_workers": 0,
                "seq_len": 32,
            },
            "out_dir": str(tmp_path / "run"),
        },
    )
    assert config.data.source == (str(first), str(tmp_path / "b" / "*.jsonl"))
    _, batches, _ = build_m6(config, DataShard())
    assert len(batches.sampler.dataset) == 5 and batches.num_workers == 0
    assert DataConfig().num_workers == "auto"
    for bad, message in [
        ({"source": []}, "data.source must be 'embedded', a file path or a non-empty list"),
        ({"source": ["embedded"]}, "data.source must be 'embedded', a file path or a non-empty list"),
        ({"num_workers": -1}, "data.num_workers must be 'auto' or an integer >= 0, got -1"),
        ({"num_workers": "many"}, "data.num_workers must be 'auto' or an integer >= 0, got 'many'"),
    ]:
        with pytest.raises(ValueError, match=message):
            DataConfig(**bad)
