"""The stored chunk format: every way a value can be wrong is refused with its reason."""

from __future__ import annotations

import pytest

from tandem.kvcache.tiers.chunk import (
    ChunkError,
    ChunkHeader,
    chunk_key,
    decode_chunk,
    encode_chunk,
)

LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "block_size": 4, "head_dim": 8, "dtype": "float32"}
HEADER = ChunkHeader("Llama/float32/abc", LAYOUT, (2, 2, 1, 2, 4, 8), 2, tuple(range(8)))
PAYLOAD = bytes(range(256)) * 2


def test_round_trip() -> None:
    assert bytes(decode_chunk(encode_chunk(HEADER, PAYLOAD), HEADER)) == PAYLOAD
    assert chunk_key(0xABC, 16) == "0000000000000abc-16b-r0of1"


@pytest.mark.parametrize(("mutate", "reason"), [
    (lambda v: v[:-1], "checksum"),
    (lambda v: v[:10], "truncated"),
    (lambda v: b"XXXX" + v[4:], "magic"),
    (lambda v: v[:40] + bytes([v[40] ^ 1]) + v[41:], "checksum"),
    (lambda v: v[:-20] + bytes([v[-20] ^ 0xFF]) + v[-19:], "checksum"),
])
def test_damaged_values_are_refused(mutate, reason: str) -> None:
    with pytest.raises(ChunkError) as error:
        decode_chunk(mutate(encode_chunk(HEADER, PAYLOAD)), HEADER)
    assert error.value.reason == reason


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("fingerprint", "Llama/float32/other-revision", "foreign"),
    ("layout", {**LAYOUT, "num_kv_heads": 2}, "layout"),
    ("layout", {**LAYOUT, "dtype": "int64"}, "layout"),  # not a cache's rows
    ("layout", {**LAYOUT, "num_planes": 2}, "layout"),  # a field this reader's layout lacks
    ("shape", (2, 2, 1, 2, 4, 4), "layout"),
    ("token_ids", tuple(range(1, 9)), "tokens"),
    ("rank", 1, "layout"),
])
def test_values_written_for_something_else_are_refused(field: str, value, reason: str) -> None:
    from dataclasses import replace

    with pytest.raises(ChunkError) as error:
        decode_chunk(encode_chunk(replace(HEADER, **{field: value}), PAYLOAD), HEADER)
    assert error.value.reason == reason


def test_the_writer_s_codec_travels_in_the_header_and_any_name_is_read() -> None:
    """A reader takes the codec the chunk names, whatever its own (it decodes into its cache);
    an older chunk without the field is raw."""
    from dataclasses import replace

    from tandem.kvcache.tiers.chunk import read_chunk

    written = replace(HEADER, codec="int4")
    header, payload = read_chunk(encode_chunk(written, PAYLOAD), HEADER)
    assert header.codec == "int4" and bytes(payload) == PAYLOAD
    header, _ = read_chunk(encode_chunk(HEADER, PAYLOAD), written)
    assert header.codec == "raw"


@pytest.mark.parametrize("codec", ["", "INT8", "int8; rm -rf", "x" * 17])
def test_a_codec_name_no_writer_could_have_written_is_refused(codec: str) -> None:
    from dataclasses import replace

    with pytest.raises(ChunkError) as error:
        decode_chunk(encode_chunk(replace(HEADER, codec=codec), PAYLOAD), HEADER)
    assert error.value.reason == "header"


def test_rows_of_another_cache_dtype_are_read_at_their_own_shape() -> None:
    """A chunk an int8-cache worker wrote (uint8 rows: 8 values and a 4-byte scale) reaches an
    fp32 reader as it is; the codec turns its rows into the reader's. Its shape must be the
    one its own layout gives."""
    from dataclasses import replace

    from tandem.kvcache.tiers.chunk import read_chunk

    int8 = replace(HEADER, layout={**LAYOUT, "dtype": "uint8"}, shape=(2, 2, 1, 2, 4, 12))
    header, payload = read_chunk(encode_chunk(int8, PAYLOAD), HEADER)
    assert header.layout["dtype"] == "uint8" and bytes(payload) == PAYLOAD
    with pytest.raises(ChunkError) as error:
        decode_chunk(encode_chunk(replace(int8, shape=HEADER.shape), PAYLOAD), HEADER)
    assert error.value.reason == "layout"
