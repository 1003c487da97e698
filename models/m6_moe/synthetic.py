"""The embedded default dataset: coloured shapes with Chinese and English captions, no downloads.

Each image shows one shape (circle, square, triangle, diamond) in one of six colours at one of
five positions (left, right, top, bottom, center) on a grey-scale background, with a random size
and a small random offset. Every image gets two manifest records, one caption per language::

    {"image": "train/00012.png", "text": "a red circle on the left", "lang": "en", ...}
    {"image": "train/00012.png", "text": "左边有一个红色的圆形", "lang": "zh", ...}

(records also carry ``colour``, ``shape``, ``position``; the loader reads only ``image`` and
``text``). :func:`write_synthetic_dataset` writes ``train/``, ``heldout/``, ``train.jsonl``,
``heldout.jsonl`` and ``meta.json``; the output is a pure function of the arguments (``seed``
included). :func:`ensure_synthetic_dataset` creates it race-free (temporary directory, then an
atomic rename).

Held-out metric: :func:`caption_accuracy`, the share of images whose generated caption equals
one of its true captions (any language) after whitespace normalisation; the floor to beat is
:func:`most_frequent_caption_accuracy`, always answering the training split's most frequent
caption.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from m6_moe.optional import pillow
from moetrain.progress import ProgressBar
from moetrain.validation import require_int

# name -> (Chinese, RGB)
COLOURS = {
    "red": ("红色", (220, 40, 40)),
    "green": ("绿色", (40, 170, 60)),
    "blue": ("蓝色", (40, 80, 220)),
    "yellow": ("黄色", (235, 205, 30)),
    "purple": ("紫色", (150, 60, 190)),
    "orange": ("橙色", (245, 135, 25)),
}
SHAPES = {"circle": "圆形", "square": "正方形", "triangle": "三角形", "diamond": "菱形"}
# name -> (English phrase, Chinese, centre as a fraction of the side (x, y))
POSITIONS = {
    "left": ("on the left", "左边", (0.25, 0.5)),
    "right": ("on the right", "右边", (0.75, 0.5)),
    "top": ("at the top", "上边", (0.5, 0.25)),
    "bottom": ("at the bottom", "下边", (0.5, 0.75)),
    "center": ("in the center", "中间", (0.5, 0.5)),
}
BACKGROUNDS = ((255, 255, 255), (230, 230, 230), (190, 190, 190), (60, 60, 60), (0, 0, 0))
FORMAT_VERSION = 1


@dataclass(frozen=True)
class CaptionFacts:
    colour: str
    shape: str
    position: str
    language: str  # "en" or "zh"


def english_caption(colour: str, shape: str, position: str) -> str:
    article = "an" if colour[0] in "aeiou" else "a"
    return f"{article} {colour} {shape} {POSITIONS[position][0]}"


def chinese_caption(colour: str, shape: str, position: str) -> str:
    return f"{POSITIONS[position][1]}有一个{COLOURS[colour][0]}的{SHAPES[shape]}"


_PARSE = {}
for _c in COLOURS:
    for _s in SHAPES:
        for _p in POSITIONS:
            _PARSE[english_caption(_c, _s, _p)] = CaptionFacts(_c, _s, _p, "en")
            _PARSE[chinese_caption(_c, _s, _p)] = CaptionFacts(_c, _s, _p, "zh")


def normalize_caption(text: str) -> str:
    """Whitespace runs become one space; leading and trailing whitespace is removed."""
    return " ".join(text.split())


def parse_caption(text: str) -> CaptionFacts | None:
    """The colour, shape, position and language a caption states, or None if it is not one of the
    dataset's caption forms."""
    return _PARSE.get(normalize_caption(text))


def draw_shape(size: int, colour: str, shape: str, position: str, rng: random.Random):
    """A ``size`` x ``size`` RGB Pillow image of one shape; radius ``U(0.12, 0.18) * size``,
    centre offset ``U(-0.05, 0.05) * size`` per axis, background drawn from ``BACKGROUNDS``."""
    pil = pillow()
    image = pil.Image.new("RGB", (size, size), BACKGROUNDS[rng.randrange(len(BACKGROUNDS))])
    draw = pil.ImageDraw.Draw(image)
    fx, fy = POSITIONS[position][2]
    cx = (fx + rng.uniform(-0.05, 0.05)) * size
    cy = (fy + rng.uniform(-0.05, 0.05)) * size
    r = rng.uniform(0.12, 0.18) * size
    fill = COLOURS[colour][1]
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=fill)
    elif shape == "diamond":
        draw.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=fill)
    else:
        raise ValueError(f"shape must be one of {', '.join(map(repr, SHAPES))}, got {shape!r}")
    return image


def _write_split(
    directory: Path, split: str, count: int, size: int, rng: random.Random, bar: ProgressBar | None, done: int
) -> int:
    """Writes ``count`` images of ``split`` and its manifest; ``bar`` counts images over both
    splits (``done`` before this one). Returns the images written so far."""
    (directory / split).mkdir()
    lines = []
    for index in range(count):
        colour = rng.choice(list(COLOURS))
        shape = rng.choice(list(SHAPES))
        position = rng.choice(list(POSITIONS))
        relative = f"{split}/{index:05d}.png"
        draw_shape(size, colour, shape, position, rng).save(directory / relative, format="PNG")
        facts = {"colour": colour, "shape": shape, "position": position}
        lines.append(
            {"image": relative, "text": english_caption(colour, shape, position), "lang": "en", **facts}
        )
        lines.append(
            {"image": relative, "text": chinese_caption(colour, shape, position), "lang": "zh", **facts}
        )
        done += 1
        if bar is not None:
            bar.update(done, split=split)
    with open(directory / f"{split}.jsonl", "w", encoding="utf-8") as file:
        for line in lines:
            file.write(json.dumps(line, ensure_ascii=False) + "\n")
    return done


def _meta(seed: int, num_train: int, num_heldout: int, size: int) -> dict:
    return {"format_version": FORMAT_VERSION, "seed": seed, "num_train": num_train,
            "num_heldout": num_heldout, "image_size": size}  # fmt: skip


def write_synthetic_dataset(
    directory: str | Path,
    seed: int = 0,
    num_train: int = 2000,
    num_heldout: int = 200,
    size: int = 64,
    progress: bool = True,
) -> Path:
    """Writes the dataset into ``directory`` (created; must not exist or be empty): ``num_train``
    training and ``num_heldout`` held-out images of ``size`` pixels, two records each.
    ``progress``: a :class:`~moetrain.progress.ProgressBar` over the images, logged (ten lines
    in a log file; a few thousand 64-pixel images per second on one core)."""
    for name, value, minimum in (
        ("num_train", num_train, 1),
        ("num_heldout", num_heldout, 1),
        ("size", size, 8),
    ):
        require_int(name, value, minimum)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(directory.iterdir()):
        raise ValueError(f"synthetic dataset directory {directory} is not empty")
    rng = random.Random(seed)
    total = num_train + num_heldout
    bar = ProgressBar(total, "synthetic dataset", log_every=max(1, total // 10)) if progress else None
    done = _write_split(directory, "train", num_train, size, rng, bar, 0)
    _write_split(directory, "heldout", num_heldout, size, rng, bar, done)
    if bar is not None:
        bar.close()
    (directory / "meta.json").write_text(json.dumps(_meta(seed, num_train, num_heldout, size), indent=1))
    return directory


def ensure_synthetic_dataset(
    directory: str | Path,
    seed: int = 0,
    num_train: int = 2000,
    num_heldout: int = 200,
    size: int = 64,
    progress: bool = True,
) -> Path:
    """Returns ``directory`` holding the dataset with these parameters, writing it first when it
    does not exist. Safe when several processes call it at once: each writes into its own
    temporary sibling directory and renames it into place; the first rename wins and the others
    discard their copy (the content is identical). An existing dataset written with other
    parameters raises ``ValueError`` (delete it or use another directory). ``progress``: as for
    :func:`write_synthetic_dataset`, shown only when this call writes."""
    directory = Path(directory)
    wanted = _meta(seed, num_train, num_heldout, size)
    if not directory.exists():
        directory.parent.mkdir(parents=True, exist_ok=True)
        temporary = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            write_synthetic_dataset(temporary, seed, num_train, num_heldout, size, progress)
            try:
                os.rename(temporary, directory)
            except OSError:
                if not (directory / "meta.json").exists():  # not lost to a concurrent writer
                    raise
        finally:
            if temporary.exists():
                shutil.rmtree(temporary)
    meta_path = directory / "meta.json"
    try:
        found = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        raise ValueError(
            f"{directory} exists but holds no synthetic dataset ({meta_path} is missing or unreadable)"
        ) from None
    if found != wanted:
        raise ValueError(f"{directory} holds a synthetic dataset written with {found}, not {wanted}")
    return directory


def captions_by_image(manifest: str | Path) -> dict[str, list[str]]:
    """Image path (as written in the manifest) -> its captions, in manifest order."""
    grouped: dict[str, list[str]] = {}
    with open(manifest, encoding="utf-8") as file:
        for line in file:
            if line.strip():
                record = json.loads(line)
                grouped.setdefault(record["image"], []).append(record["text"])
    return grouped


def caption_accuracy(predictions: list[str], references: list[list[str]]) -> float:
    """Share of predictions equal (after :func:`normalize_caption`) to one of their references."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"predictions ({len(predictions)}) and references ({len(references)}) must be equally long "
            "and non-empty"
        )
    hits = sum(
        normalize_caption(p) in {normalize_caption(r) for r in refs}
        for p, refs in zip(predictions, references, strict=True)
    )
    return hits / len(predictions)


def attribute_accuracy(predictions: list[str], references: list[list[str]]) -> dict[str, float]:
    """Per attribute (``colour``, ``shape``, ``position``): the share of predictions that parse
    (:func:`parse_caption`) and state the same value as the first reference. A diagnostic of
    what the model has learned; the metric is :func:`caption_accuracy`."""
    if len(predictions) != len(references) or not predictions:
        raise ValueError(
            f"predictions ({len(predictions)}) and references ({len(references)}) must be equally long "
            "and non-empty"
        )
    hits = dict.fromkeys(("colour", "shape", "position"), 0)
    for prediction, refs in zip(predictions, references, strict=True):
        got, want = parse_caption(prediction), parse_caption(refs[0])
        if got is None or want is None:
            continue
        for name in hits:
            hits[name] += getattr(got, name) == getattr(want, name)
    return {name: count / len(predictions) for name, count in hits.items()}


def most_frequent_caption(captions: list[str]) -> str:
    """The most frequent caption after normalisation (ties: the first seen)."""
    if not captions:
        raise ValueError("captions must not be empty")
    return Counter(normalize_caption(c) for c in captions).most_common(1)[0][0]


def most_frequent_caption_accuracy(train_captions: list[str], references: list[list[str]]) -> float:
    """Accuracy of always predicting the training split's most frequent caption."""
    guess = most_frequent_caption(train_captions)
    return caption_accuracy([guess] * len(references), references)
