"""Byte sizes: the forms a --memory_budget flag accepts, and the ones it must refuse clearly."""

import pytest

from framework.memory import format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * 1024**3),
        ("16gib", 16 * 1024**3),
        ("512MB", 512 * 1000**2),
        ("1.5G", 1536 * 1024**2),
        ("4096", 4096),
        (" 2 kB ", 2000),
        (".5K", 512),
        ("1T", 1024**4),
        ("10B", 10),
        ("1.7B", 1),
        (123, 123),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "abc", "-1G", "16 GiBs", "1e9", "nan", "inf", "1.2.3M"]
)
def test_parse_bytes_rejects_bad_strings(text):
    with pytest.raises(ValueError, match="Not a byte size.*e.g. 16GiB"):
        parse_bytes(text)


def test_parse_bytes_rejects_negative_int():
    with pytest.raises(ValueError, match="negative"):
        parse_bytes(-5)


@pytest.mark.parametrize("value", [True, 1.5, None])
def test_parse_bytes_rejects_other_types(value):
    with pytest.raises(TypeError, match="string or an int"):
        parse_bytes(value)


def test_format_bytes():
    assert format_bytes(1536 * 1024**2) == "1.50 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 1024) == "3.00 KiB"
    assert format_bytes(parse_bytes("16GiB")) == "16.00 GiB"
