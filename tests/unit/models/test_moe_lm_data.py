"""The language model's corpus: a text file is memory-mapped as bytes (no int64 copy of it), its
batches are those of the former int64 corpus for the same seed, and bad files give one-line errors."""

from __future__ import annotations

import pytest
import torch

import moe_lm.data
from moe_lm.data import TextBatches, load_text_corpus, load_tiny_corpus, sample_batch

TEXT = "".join(f"line {i}: naïve café — 数据 {i * i}\n" for i in range(400))


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def old_corpus(path) -> torch.Tensor:
    """The corpus as the former implementation held it: every byte of the file as int64."""
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def old_next(corpus: torch.Tensor, batch: int, seq: int, generator: torch.Generator):
    """The former ``TextBatches.next`` on an int64 corpus, with the window start drawn from every
    window that fits (``bytes - seq`` of them; it used to leave out the last)."""
    starts = torch.randint(0, corpus.numel() - seq, (batch,), generator=generator)
    windows = corpus[starts.unsqueeze(1) + torch.arange(seq + 1)]
    return windows[:, :-1], windows[:, 1:]


def test_a_text_file_is_memory_mapped_as_bytes_not_copied_as_int64(text_file):
    size = text_file.stat().st_size
    corpus = load_text_corpus(str(text_file), 66)
    assert corpus.dtype == torch.uint8 and corpus.numel() == size
    assert corpus.untyped_storage().nbytes() == size  # the map of the file, no 8-bytes-a-byte copy
    assert torch.equal(corpus.long(), old_corpus(text_file))
    embedded = load_text_corpus("embedded", 66)
    assert embedded.dtype == torch.uint8 and torch.equal(embedded.long(), load_tiny_corpus())


def test_batches_are_those_of_the_int64_corpus_for_the_same_seed(text_file):
    """Values, order and generator use are unchanged: draws, a probe, a resume from the saved
    state and :func:`sample_batch` give the batches the int64 corpus gave."""
    corpus, expected_corpus = load_text_corpus(str(text_file), 66), old_corpus(text_file)
    batches = TextBatches(corpus, 3, 64, seed=7, rank=1)
    generator = torch.Generator().manual_seed(7 * 1_000_003 + 1)
    for _ in range(4):
        inputs, targets = batches.next()
        expected_inputs, expected_targets = old_next(expected_corpus, 3, 64, generator)
        assert inputs.dtype == targets.dtype == torch.int64
        assert torch.equal(inputs, expected_inputs) and torch.equal(targets, expected_targets)
    state = batches.state_dict()
    resumed = TextBatches(corpus, 3, 64, seed=0, rank=0)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next(), batches.next(), strict=True))
    probe = batches.probe(5, seed=11)
    expected = old_next(expected_corpus, 5, 64, torch.Generator().manual_seed(11 * 1_000_003))
    assert all(torch.equal(a, b) for a, b in zip(probe, expected, strict=True))
    inputs, targets = sample_batch(corpus, 2, 16, torch.Generator().manual_seed(3))
    starts = torch.randint(0, expected_corpus.numel() - 16, (2,), generator=torch.Generator().manual_seed(3))
    windows = torch.stack([expected_corpus[s : s + 17] for s in starts.tolist()])
    assert inputs.dtype == torch.int64
    assert torch.equal(inputs, windows[:, :-1]) and torch.equal(targets, windows[:, 1:])


def test_every_window_is_drawn_the_last_byte_included():
    """A corpus of ``seq + 3`` bytes holds 3 windows of ``seq + 1``: each is drawn, so the file's
    last byte is a target (the draw used to stop one window short of the end)."""
    corpus = torch.arange(19, dtype=torch.uint8)
    for draw in (
        lambda generator: sample_batch(corpus, 64, 16, generator),
        lambda generator: TextBatches(corpus, 64, 16, seed=int(generator.initial_seed()), rank=0).next(),
    ):
        inputs, targets = draw(torch.Generator().manual_seed(5))
        assert set(inputs[:, 0].tolist()) == {0, 1, 2}
        assert int(targets.max()) == 18
    one_window = torch.arange(17, dtype=torch.uint8)  # seq + 1 bytes: the smallest corpus
    inputs, targets = sample_batch(one_window, 2, 16, torch.Generator().manual_seed(0))
    assert inputs[0].tolist() == list(range(16)) and targets[0].tolist() == list(range(1, 17))


def test_short_empty_and_unreadable_files_give_the_same_one_line_errors(tmp_path):
    """The errors of the former implementation (an empty file now gets the size error too: it
    used to fail inside ``torch.frombuffer``)."""
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_bytes(b"")
    short.write_text("ten bytes.")
    for path, size in ((empty, 0), (short, 10)):
        with pytest.raises(ValueError) as error:
            load_text_corpus(str(path), 66)
        assert str(error.value) == f"data.source {path} holds {size} bytes; a sequence needs 66"
    for path, reason in ((tmp_path / "none.txt", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(ValueError) as error:
            load_text_corpus(str(path), 66)
        assert str(error.value) == f"data.source: cannot read {path}: {reason}"
    with pytest.raises(ValueError, match="data.source of moe_lm must be 'embedded' or one text file"):
        load_text_corpus(["a.txt"], 66)


@pytest.mark.parametrize(
    "data",
    [
        b"ab\xe4\xb8x" + b"y" * 80,  # a 3-byte sequence cut after 2 bytes
        "数据".encode() + b"\xff" + b"z" * 80,
        b"z" * 80 + "数".encode()[:2],  # cut by the end of the file
        b"abc\xc3",
        b"a" + "数".encode()[:2] + b"q" * 80,  # 2 bytes of a sequence carried to the next chunk
    ],
    ids=["cut-sequence", "invalid-byte", "cut-by-eof", "cut-by-eof-short", "carried-2-bytes"],
)
def test_the_first_invalid_byte_is_named_when_the_file_is_checked_in_chunks(tmp_path, monkeypatch, data):
    """The file is checked a chunk at a time (here 3 bytes, so sequences straddle chunks); the
    error names the byte that decoding the whole file names."""
    monkeypatch.setattr(moe_lm.data, "_CHECK_CHUNK_BYTES", 3)
    path = tmp_path / "bad.txt"
    path.write_bytes(data)
    with pytest.raises(UnicodeDecodeError) as whole:
        data.decode("utf-8")
    with pytest.raises(ValueError) as error:
        load_text_corpus(str(path), 4)
    assert str(error.value) == (
        f"data.source {path} is not UTF-8 text (byte {whole.value.start} is not valid UTF-8): the "
        "language model trains on text files"
    )


def test_only_the_first_bytes_of_a_large_file_are_checked(tmp_path, monkeypatch):
    """Every rank checks the file at start-up: of a corpus of many GB only its first
    ``CHECKED_PREFIX_BYTES`` (here 8), so an invalid byte after them is not looked for, one inside
    them is named, and a character cut by the end of the checked part is not judged."""
    monkeypatch.setattr(moe_lm.data, "CHECKED_PREFIX_BYTES", 8)
    monkeypatch.setattr(moe_lm.data, "_CHECK_CHUNK_BYTES", 3)
    late, early, straddling = tmp_path / "late.txt", tmp_path / "early.txt", tmp_path / "straddling.txt"
    late.write_bytes(b"a" * 20 + b"\xff" + b"b" * 20)
    early.write_bytes(b"abc\xff" + b"b" * 40)
    straddling.write_bytes(b"a" * 7 + "数".encode() + b"b" * 40)
    assert load_text_corpus(str(late), 4).numel() == 41
    assert load_text_corpus(str(straddling), 4).numel() == 50
    with pytest.raises(ValueError, match=r"is not UTF-8 text \(byte 3 is not valid UTF-8\)"):
        load_text_corpus(str(early), 4)
