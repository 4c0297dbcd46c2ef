import math

import pytest

from recompute_graph.units import format_bytes, parse_bytes


@pytest.mark.parametrize("text, expected", [
    ("4096", 4096), ("1.5GiB", 3 * 2**29), ("800MB", 800_000_000), ("2 kib", 2048), ("1e3", 1000),
    ("3B", 3), ("1TiB", 2**40),
])
def test_parse_bytes_accepts_decimal_and_binary_units(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "-1GB", "0", "1.5XB", "nan", "GB"])
def test_parse_bytes_rejects_bad_sizes_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


def test_format_bytes_uses_binary_units():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1023.7 * 2**20) == "1 GiB"  # not "1.02e+03 MiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3 GiB"
    assert not math.isnan(float(format_bytes(2**50).split()[0]))
