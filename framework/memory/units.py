"""Byte sizes as people write them ("16GiB", "512MB", "1.5G") and as the framework prints them.

A memory budget arrives as a flag string; parsing it here, with one strict grammar and one error
message, keeps "16GB" from silently meaning something else in each tool that reads it.
"""

import decimal
import re

# IEC suffixes and bare letters are powers of 1024: accelerator memory is sized that way
# ("16G of HBM per core" means 16 GiB). SI suffixes keep their decimal meaning.
_MULTIPLIERS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
    "g": 1024**3,
    "gib": 1024**3,
    "gb": 1000**3,
    "t": 1024**4,
    "tib": 1024**4,
    "tb": 1000**4,
}

_SIZE_RE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-zA-Z]*)\s*$")

_ACCEPTED = (
    "Write a non-negative number with an optional unit, e.g. 16GiB, 512MB, 1.5G or 4096 "
    "(units: B, K/KiB, M/MiB, G/GiB, T/TiB are powers of 1024; kB, MB, GB, TB of 1000)."
)

_FORMAT_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def parse_bytes(size: str | int) -> int:
    """Returns the number of bytes a size such as "16GiB", "512MB", "1.5G" or "4096" stands for.

    Suffixes are case-insensitive. KiB/MiB/GiB/TiB and the bare letters K/M/G/T are powers of
    1024; kB/MB/GB/TB are powers of 1000; B or no suffix means bytes. A fractional result is
    rounded down to whole bytes. Non-negative integers are returned unchanged.

    Raises:
      ValueError: naming the input and the accepted forms, for a string that is not a size
        (unknown unit, empty, negative, exponent) or a negative int.
      TypeError: for anything but a string or an int (booleans included).
    """
    if isinstance(size, bool) or not isinstance(size, (str, int)):
        raise TypeError(f"A byte size is a string or an int, not {size!r}. {_ACCEPTED}")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"A byte size cannot be negative: {size}.")
        return size
    match = _SIZE_RE.match(size)
    if match is None or match.group("unit").lower() not in _MULTIPLIERS:
        raise ValueError(f"Not a byte size: {size!r}. {_ACCEPTED}")
    number = decimal.Decimal(match.group("number"))
    return int(number * _MULTIPLIERS[match.group("unit").lower()])


def format_bytes(num_bytes: int) -> str:
    """Returns a short binary-unit rendering, e.g. 1610612736 -> "1.50 GiB", 512 -> "512 B"."""
    sign = "-" if num_bytes < 0 else ""
    magnitude = abs(num_bytes)
    for unit, factor in _FORMAT_UNITS:
        if magnitude >= factor:
            return f"{sign}{magnitude / factor:.2f} {unit}"
    return f"{sign}{magnitude} B"
