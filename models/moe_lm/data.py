"""The language model's data: the embedded byte corpus (``tiny_corpus.txt`` beside this module) or a
UTF-8 text file as byte values (``uint8``; a file is memory-mapped, not read into memory), and
:class:`TextBatches`, random int64 windows of it for next-byte prediction whose position is saved in
checkpoints."""

from __future__ import annotations

import codecs
import os

import torch


def load_tiny_corpus() -> torch.Tensor:
    """The embedded demo corpus as a 1-D tensor of UTF-8 byte values (``tiny_corpus.txt`` of this
    package)."""
    from importlib.resources import files

    text = files("moe_lm").joinpath("tiny_corpus.txt").read_text(encoding="utf-8")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


# Bytes read at a time while a text file is checked to be UTF-8 (the file is never held whole).
_CHECK_CHUNK_BYTES = 1 << 20
# How much of a text file is checked: enough to tell a text file from another file given by
# mistake, while every rank reading a corpus of many GB whole at start-up (480 ranks: 480 reads of
# it from a shared file system) would not be. The model reads bytes, so a bad byte further on only
# trains as the byte it is.
CHECKED_PREFIX_BYTES = 64 << 20


def _first_invalid_utf8(source: str) -> int | None:
    """The offset of the first byte of ``source``'s first :data:`CHECKED_PREFIX_BYTES` that is not
    valid UTF-8 (a sequence cut by the end of the file included; one cut by the end of the checked
    part is not judged), or None; read in chunks of ``_CHECK_CHUNK_BYTES``. ``OSError`` when the
    file cannot be read."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(source, "rb") as file:
        while offset < CHECKED_PREFIX_BYTES:
            chunk = file.read(min(_CHECK_CHUNK_BYTES, CHECKED_PREFIX_BYTES - offset))
            pending = len(decoder.getstate()[0])  # bytes of a sequence cut by the previous chunk
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                return offset - pending + error.start
            if not chunk:
                return None
            offset += len(chunk)
    return None


def map_text_file(source: str, min_bytes: int) -> torch.Tensor:
    """A UTF-8 text file of at least ``min_bytes`` bytes as ``uint8 [file bytes]`` whose storage is
    a private memory map of the file (``MAP_PRIVATE``: pages are read on demand and shared with the
    page cache, writes never reach the file). One-line ``ValueError`` naming the file when it
    cannot be read, is not UTF-8 (its first :data:`CHECKED_PREFIX_BYTES` are checked) or is too
    short."""
    try:
        invalid = _first_invalid_utf8(source)
        size = os.path.getsize(source)
    except OSError as error:
        raise ValueError(f"data.source: cannot read {source}: {error.strerror}") from None
    if invalid is not None:
        raise ValueError(
            f"data.source {source} is not UTF-8 text (byte {invalid} is not valid UTF-8): the "
            "language model trains on text files"
        )
    if size < min_bytes:
        raise ValueError(f"data.source {source} holds {size} bytes; a sequence needs {min_bytes}")
    return torch.from_file(source, shared=False, size=size, dtype=torch.uint8)


def load_text_corpus(source: str, min_bytes: int) -> torch.Tensor:
    """``"embedded"`` or a UTF-8 text file as byte values, ``uint8 [bytes]``: a file is memory-mapped
    (:func:`map_text_file`), never copied whole; batches widen only their windows to int64.
    Errors name the file."""
    if not isinstance(source, str):
        raise ValueError(f"data.source of moe_lm must be 'embedded' or one text file, got {list(source)!r}")
    if source != "embedded":
        return map_text_file(source, min_bytes)
    corpus = load_tiny_corpus().to(torch.uint8)
    if corpus.numel() < min_bytes:
        raise ValueError(f"data.source {source} holds {corpus.numel()} bytes; a sequence needs {min_bytes}")
    return corpus


def sample_batch(corpus: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    """Random windows of ``corpus`` (byte values, any integer dtype): int64 inputs ``[B, S]`` and
    next-byte targets ``[B, S]``; the start is uniform over all ``bytes - S`` windows of ``S + 1``
    bytes."""
    starts = torch.randint(0, corpus.numel() - seq, (batch,), generator=generator)
    windows = torch.stack([corpus[s : s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


class TextBatches:
    """Random windows of a byte corpus (``uint8`` or int64 ``[bytes]``, e.g. the memory map of
    :func:`load_text_corpus`) for next-token prediction, as int64 ``[batch, seq]`` inputs and
    targets; the generator is seeded per rank (``(seed * 1000003 + rank) mod 2**64``: any int64
    seed) and its state is the
    data position saved in checkpoints."""

    def __init__(self, corpus: torch.Tensor, batch: int, seq: int, seed: int, rank: int):
        self.corpus, self.batch, self.seq = corpus, batch, seq
        self.generator = torch.Generator().manual_seed((seed * 1_000_003 + rank) % 2**64)
        self.batches_drawn = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, self.corpus.numel() - self.seq, (self.batch,), generator=self.generator)
        offsets = torch.arange(self.seq + 1)
        windows = self.corpus[starts.unsqueeze(1) + offsets].long()  # only the drawn windows widen
        self.batches_drawn += 1
        return windows[:, :-1], windows[:, 1:]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch * self.seq

    def probe(self, sequences: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of ``sequences`` from a separate stream (profiling, calibration): the data
        position is not moved."""
        return TextBatches(self.corpus, sequences, self.seq, seed, 0).next()

    def reseed(self, seed: int, rank: int, step: int) -> None:
        """A new stream for ``rank`` resuming at ``step`` when no saved position exists for it
        (the run was saved with fewer ranks)."""
        self.generator.manual_seed(((seed * 1_000_003 + rank) * 1_000_033 + step) % 2**64)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = state["batches_drawn"]
