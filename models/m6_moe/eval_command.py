"""``moetrain eval`` for M6: captions every image of one or more manifests with a trained
checkpoint and scores the captions against the manifests' texts (exact match, BLEU-4,
teacher-forced token accuracy; see :mod:`m6_moe.evaluate`)::

    moetrain eval --config run.yaml --checkpoint runs/x/checkpoints --manifest held.jsonl [more.jsonl]

``--to-sinks`` also sends the scores to the run's ``metrics.sinks`` (TensorBoard, Weights & Biases,
MLflow: the training run's own tracker run), at the checkpoint's step, as ``eval/<manifest>/<score>``
(:func:`eval_scalars`); never to ``metrics.jsonl``, which belongs to the training run. The sinks'
packages are checked before the checkpoint is read, and the report is printed before it is sent.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from m6_moe.command_options import (
    add_decoding_options,
    beam_options,
    check_output_file,
    positive_int,
    write_output,
)
from m6_moe.data import ManifestDataset
from m6_moe.evaluate import EVAL_STRATEGIES, caption_manifest, caption_scores
from m6_moe.generate import check_new_tokens
from m6_moe.metrics import BLEU_TOKENIZERS
from m6_moe.trained_model import load_trained_model, tokenizer_for
from moetrain.metrics import MetricsLog, RunInfo, check_sinks

log = logging.getLogger(__name__)


class EvalCommand:
    """``moetrain eval``: captions every image of one or more manifests and scores the captions
    against the manifest's texts (exact match, BLEU-4, teacher-forced token accuracy; see
    :mod:`m6_moe.evaluate`)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--manifest",
            action="extend",
            nargs="+",
            required=True,
            metavar="FILE",
            help="JSON-lines manifest(s) of {'image', 'text'} records; every text of an image is one of its "
            "references; image paths relative to the manifest or absolute",
        )
        parser.add_argument(
            "--strategy", choices=EVAL_STRATEGIES, default="greedy", help="decoding (default greedy)"
        )
        add_decoding_options(parser, "the config's data.seq_len, the longest target it trained on")
        parser.add_argument(
            "--batch-size", type=positive_int, default=16, help="images per batch (default 16)"
        )
        parser.add_argument(
            "--limit", type=positive_int, metavar="N", help="only the first N images of each manifest"
        )
        parser.add_argument(
            "--bleu-tokenize",
            choices=BLEU_TOKENIZERS,
            default="auto",
            help="sacrebleu's word splitting for BLEU-4: auto (default) is zh when a reference holds Chinese "
            "characters, else 13a",
        )
        parser.add_argument(
            "--predictions",
            metavar="FILE",
            help="also write every image's caption and references to this JSON-lines file",
        )
        parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
        parser.add_argument(
            "--to-sinks",
            action="store_true",
            help="also send the scores to the config's metrics.sinks other than jsonl (the training run's "
            "tracker run), at the checkpoint's step, as eval/<manifest>/<score>",
        )

    def run(self, args, config) -> int:
        beam = beam_options(args)
        if args.predictions:
            check_output_file("--predictions", Path(args.predictions))
        sinks = tracker_sinks(config) if args.to_sinks else []
        model_config = config.model
        tokenizer = tokenizer_for(model_config)
        max_new_tokens = args.max_new_tokens or min(config.data.seq_len, model_config.max_text_len)
        check_new_tokens(model_config, 0, max_new_tokens)  # captions have an empty prefix
        datasets = [
            ManifestDataset(
                path,
                model_config.image_size,
                model_config.image_channels,
                skip_bad_records=model_config.tasks.skip_bad_records,
                max_image_pixels=model_config.tasks.max_image_pixels,
            )
            for path in args.manifest
        ]  # every manifest is read before the model is loaded: a bad line stops at once
        model, loaded = load_trained_model(config, args.checkpoint)
        use_cache = not args.no_cache
        log.info(
            "%s decoding%s, at most %d new tokens, %s",
            args.strategy, f" ({beam['num_beams']} beams)" if beam else "", max_new_tokens,
            "key/value cache" if use_cache else "no cache (full recompute)",
        )  # fmt: skip
        results = [
            caption_manifest(
                model,
                tokenizer,
                dataset,
                strategy=args.strategy,
                **beam,
                max_new_tokens=max_new_tokens,
                batch_size=args.batch_size,
                limit=args.limit,
                use_cache=use_cache,
                progress=not args.no_progress,
            )
            for dataset in datasets
        ]
        report = {
            "checkpoint": str(loaded["path"]),
            "step": loaded["step"],
            "strategy": args.strategy,
            "max_new_tokens": max_new_tokens,
            "manifests": [
                {"manifest": r.manifest, **caption_scores([r], args.bleu_tokenize)} for r in results
            ],
        }
        report.update(beam)
        if len(results) > 1:
            report["all"] = caption_scores(results, args.bleu_tokenize)
        print(json.dumps(report, ensure_ascii=False) if args.json else format_report(report), flush=True)
        if args.predictions:
            lines = [
                json.dumps(
                    {"manifest": r.manifest, "image": image, "prediction": p, "references": refs},
                    ensure_ascii=False,
                )
                for r in results
                for image, p, refs in zip(r.images, r.predictions, r.references, strict=True)
            ]
            write_output("--predictions", Path(args.predictions), "\n".join(lines) + "\n")
        if sinks:
            send_to_sinks(config, sinks, report)
        return 0


SCORES = ("exact_match", "bleu4", "token_accuracy")


def sink_names(manifests: list[str]) -> list[str]:
    """A distinct name per manifest label (a path or a pattern) for sink keys: its file name
    without the extension, with as many parent directories as tell it apart from the others
    (``en/test.jsonl``, ``zh/test.jsonl`` -> ``en/test``, ``zh/test``); names still alike (the
    same manifest twice, ``a.json`` and ``a.jsonl``) get ``-2``, ``-3``, ... in order. ``all`` is
    reserved for the aggregate: a manifest named so gets a parent directory, else ``all-2``."""
    parts = []
    for label in manifests:
        path = Path(label)
        directories = path.parent.relative_to(path.anchor).parts if path.anchor else path.parent.parts
        parts.append([*directories, path.stem])
    depth = [1] * len(parts)
    while True:
        names = ["/".join(p[-d:]) for p, d in zip(parts, depth, strict=True)]
        counts = Counter(names)
        longer = [
            i
            for i, name in enumerate(names)
            if (name == "all" or counts[name] > 1) and depth[i] < len(parts[i])
        ]
        if not longer:
            break
        for i in longer:
            depth[i] += 1
    taken = {"all"} | {name for name in names if counts[name] == 1}
    unique = []
    for name in names:
        candidate, number = name, 1
        if counts[name] > 1 or name == "all":
            while candidate in taken:
                number += 1
                candidate = f"{name}-{number}"
            taken.add(candidate)
        unique.append(candidate)
    return unique


def eval_scalars(report: dict) -> dict[str, float]:
    """``{"eval/<manifest>/<score>": value}`` for exact match, BLEU-4 and token accuracy of each
    manifest (``<manifest>``: :func:`sink_names`, e.g. its file name without the extension), and
    ``eval/all/<score>`` over all of them when there are several."""
    labels = [m["manifest"] for m in report["manifests"]]
    groups = list(zip(sink_names(labels), report["manifests"], strict=True))
    if "all" in report:
        groups.append(("all", report["all"]))
    return {
        f"eval/{name}/{key}": float(scores[key]) for name, scores in groups for key in SCORES if key in scores
    }


def tracker_sinks(config) -> list[str]:
    """The sinks ``--to-sinks`` sends to: ``metrics.sinks`` but ``jsonl``, their packages imported
    now (a one-line ``ImportError`` naming ``--to-sinks`` and ``metrics.sinks`` when one is
    missing); an empty list, with a warning, when there is none."""
    names = [name for name in config.metrics.sinks if name != "jsonl"]
    if not names:
        log.warning("--to-sinks: metrics.sinks names no sink but jsonl; the scores are only printed")
    try:
        check_sinks(names)
    except ImportError as error:
        raise ImportError(f"--to-sinks: {error}") from None
    return names


def send_to_sinks(config, names: list[str], report: dict) -> None:
    """The scores to the sinks ``names`` (:func:`tracker_sinks`), logged at the checkpoint's step
    and as summary."""
    out_dir = Path(config.out_dir)
    run = RunInfo(
        out_dir, report["step"], json.loads(json.dumps(asdict(config))), 0,
        config.metrics.project or out_dir.resolve().name,
    )  # fmt: skip
    sinks = MetricsLog(names, run)
    try:
        scores = eval_scalars(report)
        sinks.log(report["step"], scores)
        sinks.summary(scores)
    finally:
        sinks.finish()


def format_report(report: dict) -> str:
    """The text form of ``moetrain eval``'s report: one block per manifest (and ``all``)."""
    blocks = [_format_scores(entry["manifest"], entry) for entry in report["manifests"]]
    if "all" in report:
        blocks.append(_format_scores(f"all {len(report['manifests'])} manifests", report["all"]))
    return "\n".join(blocks)


def _format_scores(title: str, scores: dict) -> str:
    notes = [
        f"{scores[name]} {label}"
        for name, label in (
            ("skipped_images", "bad image(s) skipped"),
            ("text_only_records", "text-only record(s) left out"),
            ("truncated_references", "reference(s) cut to the model's max_text_len for token accuracy"),
        )
        if scores[name]
    ]
    hits = round(scores["exact_match"] * scores["images"])
    lines = [
        f"{title}: {scores['images']} images, {scores['references']} references"
        + (f" ({'; '.join(notes)})" if notes else ""),
        f"  exact match     {scores['exact_match']:7.2%}  ({hits} of {scores['images']} images)",
        f"  BLEU-4          {scores['bleu4']:7.2f}  (sacrebleu {scores['bleu_signature']})",
        f"  token accuracy  {scores['token_accuracy']:7.2%}  (of {scores['tokens']} reference tokens, "
        "teacher-forced)",
    ]
    return "\n".join(lines)
