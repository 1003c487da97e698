"""The wire precision's name, given to the public comm API directly (not through ParallelConfig,
which checks it), is checked there too: one line naming the allowed values, not a KeyError."""

from __future__ import annotations

import pytest
import torch

from moetrain.comm.compression import decode_rows, encode_rows, wire_row_bytes


@pytest.mark.parametrize("name", ["float16", "fp8", "BF16"])
def test_an_unknown_wire_is_named_with_the_allowed_ones(name):
    expected = f"comm_dtype must be one of None, 'bf16', 'fp16', got {name!r}"
    for call in (
        lambda: encode_rows(torch.randn(2, 3), name),
        lambda: decode_rows(torch.randn(2, 3), name, torch.float32),
        lambda: wire_row_bytes(3, torch.float32, name),
    ):
        with pytest.raises(ValueError) as error:
            call()
        assert str(error.value) == expected


def test_the_known_wires_still_round_trip():
    rows = torch.tensor([[1.5, -2.0, 3.25]])
    for name in (None, "bf16", "fp16"):
        torch.testing.assert_close(decode_rows(encode_rows(rows, name), name, torch.float32), rows)
