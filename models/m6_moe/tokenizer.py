"""Tokenizers for M6: byte-level UTF-8 by default, a ``tokenizers`` JSON file optionally.

Byte tokenizer ids (``num_sentinels`` = 16 unless given)::

    0 .. 255                    the UTF-8 bytes (Chinese characters are 3 bytes each)
    256                         <pad>
    257                         <bos>  (first decoder input of every target)
    258                         <eos>  (last label of every target)
    259 .. 259+num_sentinels-1  <extra_id_0> ... (T5-style span-corruption sentinels)

Both tokenizers expose the same interface: ``encode(str) -> list[int]``, ``decode(ids) -> str``,
``encode_head(str, max_tokens) -> (list[int], chars)`` (the longest leading part of a text that
fits in ``max_tokens`` tokens and ends at a character boundary, encoding only about that much),
``pad_id``, ``bos_id``, ``eos_id``, ``sentinel_ids`` and ``vocab_size``.

Generation prefixes go through :func:`encode_prefix`: ``<extra_id_i>`` written in the text is
sentinel ``i`` (to ask for the spans of a span-corrupted text, as the denoise task trains), and a
text the tokenizer cannot give back unchanged is refused instead of silently altered.
"""

from __future__ import annotations

import re
from pathlib import Path

from moetrain.validation import require_int

NUM_BYTES = 256
DEFAULT_NUM_SENTINELS = 16


class ByteTokenizer:
    """UTF-8 bytes plus ``<pad>``, ``<bos>``, ``<eos>`` and ``num_sentinels`` sentinels."""

    def __init__(self, num_sentinels: int = DEFAULT_NUM_SENTINELS):
        require_int("num_sentinels", num_sentinels, 1)
        self.pad_id = NUM_BYTES
        self.bos_id = NUM_BYTES + 1
        self.eos_id = NUM_BYTES + 2
        self.sentinel_ids = tuple(range(NUM_BYTES + 3, NUM_BYTES + 3 + num_sentinels))
        self.vocab_size = NUM_BYTES + 3 + num_sentinels

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_head(self, text: str, max_tokens: int) -> tuple[list[int], int]:
        """``(tokens of text[:chars], chars)`` for the largest ``chars`` whose UTF-8 bytes number at
        most ``max_tokens``: a cut never splits a character. Only ``text[:max_tokens]`` is encoded
        (a character is at least one byte). When even the first character is longer than
        ``max_tokens`` bytes: its first ``max_tokens`` bytes and ``chars = 0``."""
        head = text[:max_tokens]
        data = head.encode("utf-8")
        if len(data) <= max_tokens:
            return list(data), len(head)
        end = max_tokens
        while end > 0 and data[end] & 0xC0 == 0x80:  # data[end] continues a character: drop it all
            end -= 1
        if end == 0:
            return list(data[:max_tokens]), 0
        return list(data[:end]), len(data[:end].decode("utf-8"))

    def decode(self, ids, skip_special: bool = True) -> str:
        """Bytes back to text; special ids are dropped (``skip_special``) or written as
        ``<pad>``/``<bos>``/``<eos>``/``<extra_id_i>``. Invalid UTF-8 (a cut multi-byte character)
        becomes U+FFFD."""
        out, run = [], bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < NUM_BYTES:
                run.append(token)
                continue
            if not skip_special:
                out.append(run.decode("utf-8", errors="replace"))
                run = bytearray()
                out.append(self._special_name(token))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def _special_name(self, token: int) -> str:
        if token == self.pad_id:
            return "<pad>"
        if token == self.bos_id:
            return "<bos>"
        if token == self.eos_id:
            return "<eos>"
        if token in self.sentinel_ids:
            return f"<extra_id_{token - self.sentinel_ids[0]}>"
        raise ValueError(
            f"token id {token} is outside the byte tokenizer's vocabulary [0, {self.vocab_size})"
        )


class JSONTokenizer:
    """A Hugging Face ``tokenizers`` JSON file (needs the optional ``tokenizers`` package).

    The file's vocabulary must hold the special tokens named by ``pad_token``, ``bos_token``,
    ``eos_token`` and ``sentinel_format.format(i)`` for ``i < num_sentinels``."""

    def __init__(
        self,
        path: str | Path,
        pad_token: str = "<pad>",
        bos_token: str = "<bos>",
        eos_token: str = "<eos>",
        sentinel_format: str = "<extra_id_{}>",
        num_sentinels: int = DEFAULT_NUM_SENTINELS,
    ):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError(
                f"tokenizer file {path} needs the 'tokenizers' package (pip install tokenizers); "
                "use tokenizer 'bytes' for the built-in byte-level tokenizer"
            ) from None
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"tokenizer file {self.path} does not exist")
        self._tokenizer = Tokenizer.from_file(str(self.path))

        def token_id(token: str) -> int:
            found = self._tokenizer.token_to_id(token)
            if found is None:
                raise ValueError(f"tokenizer file {self.path} has no special token {token!r}")
            return found

        self.pad_id = token_id(pad_token)
        self.bos_id = token_id(bos_token)
        self.eos_id = token_id(eos_token)
        self.sentinel_ids = tuple(token_id(sentinel_format.format(i)) for i in range(num_sentinels))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self._special = {self.pad_id, self.bos_id, self.eos_id, *self.sentinel_ids}

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_head(self, text: str, max_tokens: int) -> tuple[list[int], int]:
        """``(tokens of text[:chars], chars)`` for the largest ``chars`` whose tokens number at most
        ``max_tokens`` (found by bisection, taking the token count to grow with ``chars``). Encodes
        heads of ``4 * max_tokens`` characters, doubled until one holds more than ``max_tokens``
        tokens, so a long text costs about its kept part. When even the first character is more
        than ``max_tokens`` tokens: the first ``max_tokens`` of them and ``chars = 0``."""
        size = min(len(text), 4 * max_tokens)
        while len(tokens := self.encode(text[:size])) <= max_tokens:
            if size == len(text):
                return tokens, size
            size = min(len(text), 2 * size)
        low, high = 0, size  # text[:low] fits (the empty text does), text[:high] does not
        while high - low > 1:
            middle = (low + high) // 2
            if len(self.encode(text[:middle])) <= max_tokens:
                low = middle
            else:
                high = middle
        if low == 0:
            return self.encode(text[:1])[:max_tokens], 0
        return self.encode(text[:low]), low

    def decode(self, ids, skip_special: bool = True) -> str:
        ids = [int(t) for t in ids]
        if skip_special:
            ids = [t for t in ids if t not in self._special]
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(spec: str):
    """``"bytes"`` -> :class:`ByteTokenizer`; a path ending in ``.json`` -> :class:`JSONTokenizer`."""
    if spec == "bytes":
        return ByteTokenizer()
    if isinstance(spec, str) and spec.endswith(".json"):
        return JSONTokenizer(spec)
    raise ValueError(f"tokenizer must be 'bytes' or the path of a tokenizers .json file, got {spec!r}")


_SENTINEL_NAME = re.compile(r"<extra_id_(\d+)>")


def encode_prefix(tokenizer, text: str) -> list[int]:
    """Token ids of a generation prefix: ``text`` encoded by ``tokenizer``, except that each
    ``<extra_id_i>`` in it becomes the tokenizer's sentinel ``i``. Raises a one-line
    ``ValueError`` when the ids do not represent ``text`` faithfully, i.e. when decoding them
    (special tokens written out) does not give back ``text`` exactly: characters the tokenizer
    maps to an unknown token, normalises (case, accents, spacing) or cannot encode (a lone
    surrogate from a non-UTF-8 command line), or a sentinel number the tokenizer does not have."""
    if not isinstance(text, str):
        raise ValueError(f"prefix must be a string, got {type(text).__name__}")
    ids: list[int] = []
    start = 0
    try:
        for match in _SENTINEL_NAME.finditer(text):
            ids += tokenizer.encode(text[start : match.start()])
            digits = match.group(1)  # bounded: int() refuses over 4300 digits, naming no prefix
            number = int(digits) if len(digits) <= 9 else len(tokenizer.sentinel_ids)
            if number >= len(tokenizer.sentinel_ids):
                raise ValueError(
                    f"prefix {text!r}: {match.group(0)} is not a sentinel of the tokenizer (it has "
                    f"<extra_id_0> to <extra_id_{len(tokenizer.sentinel_ids) - 1}>)"
                )
            ids.append(tokenizer.sentinel_ids[number])
            start = match.end()
        ids += tokenizer.encode(text[start:])
    except UnicodeEncodeError as error:
        raise ValueError(
            f"prefix {text!r} is not valid Unicode text (character {error.start} cannot be encoded as "
            "UTF-8; was the command line written in another encoding?)"
        ) from None
    decoded = tokenizer.decode(ids, skip_special=False)
    if decoded != text:
        raise ValueError(
            f"prefix {text!r}: the tokenizer cannot represent it faithfully (its {len(ids)} tokens decode "
            f"to {decoded!r}); write it as the tokenizer's training text does"
        )
    return ids
