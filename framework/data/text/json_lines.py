"""One string field of JSON lines, decoded in the graph: TensorFlow ops on batches of lines.

There is no JSON parser among TensorFlow's ops, and a regular expression cannot tell a top-level
key from one nested in an object, so this is a small scanner written with vectorised tensor ops
over the lines' code points (no Python per line, no `py_function`): every line of a batch at
once, in one flat vector.

1. Decode UTF-8; bytes that are not UTF-8 become NUL, a problem (valid JSON has no raw NUL).
   Only the characters that shape JSON (quotes, backslashes, brackets, colons, commas) are
   scanned further, gathered with their positions into a short vector.
2. A quote or backslash is escaped when an odd run of backslashes precedes it; the unescaped
   quotes open and close strings, and the brackets outside strings give each character's depth.
3. The field is the last string at depth 1 (inside the outer object) that equals the field name
   and is followed by `:`, as `json.loads` keeps the last of repeated keys; its value must be a
   string.
4. The value's escapes are decoded: `\\" \\\\ \\/ \\b \\f \\n \\r \\t` and `\\uXXXX`, a
   surrogate pair to one character; the code points are encoded back to UTF-8.

On a valid JSON line the text is exactly `json.loads(line)[field]` encoded as UTF-8 (the tests
check it on thousands of generated lines). What is checked, each failure reported with the file
and line (`PROBLEMS`): valid UTF-8; an object whose quotes and brackets balance; the field at the
top level; a string value; valid escapes in it. Not checked, because they cannot change the field's
text: commas, colons and literals elsewhere in the line (`{"text": "a" "b": 1}` gives "a"), raw
control characters inside strings, and whether `{` closes with `}` or `]`. A lone surrogate
(`\\ud800` without its pair), which UTF-8 cannot hold, becomes U+FFFD. A key is matched as written:
one spelt with escapes (`"\\u0074ext"`) is not the field `text`.
"""

from __future__ import annotations

import functools
import json
import re

import tensorflow as tf

from framework.core.errors import BAD_DATA

PROBLEMS = (
    "",
    "not valid UTF-8",
    "not a JSON object (its braces, brackets or quotes do not balance)",
    "no top-level field {field!r}",
    "the field {field!r} is not a string",
    'a bad escape in the field {field!r} (JSON allows \\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX)',
)
OK, NOT_UTF8, NOT_OBJECT, NO_FIELD, NOT_STRING, BAD_ESCAPE = range(len(PROBLEMS))

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
_QUOTE, _BACKSLASH, _COLON = ord('"'), ord("\\"), ord(":")
# The characters the scanner looks at; NUL stands for bytes that are not UTF-8 (see decode).
_STRUCTURE = '"\\{}[]:,\0'
_SPACE = " \t\n\r"
_SIMPLE_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}
_ENVELOPE = r"(?s)[ \t\n\r]*\{.*\}[ \t\n\r]*"


def _ascii_table(characters: str, values: list[int] | None = None, default: int = 0) -> tf.Tensor:
    """A lookup table over code points 0-127 (`values`, or 1, at `characters`)."""
    table = [default] * 128
    for i, c in enumerate(characters):
        table[ord(c)] = 1 if values is None else values[i]
    return tf.constant(table, tf.int32)


def _lookup(table: tf.Tensor, codes: tf.Tensor) -> tf.Tensor:
    """`table[code]` for ASCII codes, `table[127]` (DEL, never a key of ours) for the rest."""
    return tf.gather(table, tf.clip_by_value(codes, 0, 127))


def _last_at_or_before(mask: tf.Tensor) -> tf.Tensor:
    """For each position i, the largest j <= i where `mask` is true, else -1."""
    where = tf.cast(tf.where(mask)[:, 0], tf.int32)
    return tf.gather(tf.concat([[-1], where], 0), tf.cumsum(tf.cast(mask, tf.int32)))


def _next_from(mask: tf.Tensor, start: tf.Tensor) -> tf.Tensor:
    """For each index in `start`, the smallest j >= it where `mask` is true, else len(mask)."""
    size = tf.size(mask)
    where = tf.cast(tf.where(mask)[:, 0], tf.int32)
    before = tf.concat([tf.cumsum(tf.cast(mask, tf.int32), exclusive=True), [tf.size(where)]], 0)
    return tf.gather(tf.concat([where, [size]], 0), tf.gather(before, tf.minimum(start, size)))


def _hex_digit(code: tf.Tensor) -> tf.Tensor:
    """The value of a hexadecimal digit's code point, -1 for any other character."""
    lower = tf.bitwise.bitwise_or(code, 0x20)  # 'A'-'F' -> 'a'-'f'; digits are unchanged by it
    digit = (code >= ord("0")) & (code <= ord("9"))
    letter = (lower >= ord("a")) & (lower <= ord("f"))
    return tf.where(digit, code - ord("0"), tf.where(letter, lower - ord("a") + 10, -1))


def _all_space(flat: tf.Tensor, begin: tf.Tensor, end: tf.Tensor) -> tf.Tensor:
    """Whether each gap flat[begin:end] is JSON whitespace only (gaps are short: a few)."""
    gaps = tf.gather(flat, tf.ragged.range(begin, tf.maximum(begin, end)))
    space = gaps.with_flat_values(_lookup(_ascii_table(_SPACE), gaps.flat_values) > 0)
    return tf.reduce_all(space, axis=1)


def extract_field(lines: tf.Tensor, field: str) -> tuple[tf.Tensor, tf.Tensor]:
    """(text, problem) of each line of a 1-D string tensor: the UTF-8 text of the top-level
    string `field` of each JSON line, and 0 or the index of what is wrong in `PROBLEMS` (its
    text is then empty). See the module docstring for what is checked.

    Only the characters that shape JSON (quotes, backslashes, brackets, colons, commas) are
    scanned, gathered into a short vector of their positions; the text between them is touched
    twice (decoding and copying the value out), which keeps a 2 kB document at a few vector ops.
    """
    key = tf.constant([ord(c) for c in field], tf.int32)
    # Bytes that are not UTF-8 become NUL, which valid JSON never holds raw either.
    codes = tf.strings.unicode_decode(lines, "UTF-8", errors="replace", replacement_char=0)
    flat = codes.flat_values
    count = tf.shape(lines, out_type=tf.int32)[0]
    limits = tf.cast(codes.row_limits(), tf.int32)

    # The structural characters: positions, characters, lines.
    pos = tf.cast(tf.where(_lookup(_ascii_table(_STRUCTURE), flat) > 0)[:, 0], tf.int32)
    char = tf.gather(flat, pos)
    line = tf.searchsorted(limits, pos, side="right", out_type=tf.int32)
    first_of_line = tf.searchsorted(line, tf.range(count), side="left", out_type=tf.int32)

    def per_line_any(mask):
        return tf.math.unsorted_segment_max(tf.cast(mask, tf.int32), line, count) > 0

    def from_line_start(cumulative):  # an exclusive cumulative sum, restarted on each line
        return cumulative - tf.gather(
            tf.concat([cumulative, [0]], 0), tf.gather(first_of_line, line)
        )

    def next_in_line(mask, start):  # the next structural index >= start on the same line
        found = _next_from(mask, start)
        lines_of = tf.concat([line, [-1]], 0)
        number = tf.size(line)
        same = tf.gather(lines_of, found) == tf.gather(lines_of, tf.minimum(start, number))
        return tf.where(same & (found < number), found, number)

    # A quote or backslash is escaped when an odd run of backslashes is right before it.
    backslash = tf.equal(char, _BACKSLASH)
    previous = tf.concat([[-2], pos[:-1]], 0)
    follows_backslash = tf.concat([[False], backslash[:-1]], 0) & tf.equal(previous + 1, pos)
    follows_backslash &= tf.equal(tf.concat([[-1], line[:-1]], 0), line)
    run = tf.range(tf.size(pos)) - _last_at_or_before(~follows_backslash)
    escaped = run % 2 == 1
    quote = tf.equal(char, _QUOTE) & ~escaped
    starter = backslash & ~escaped  # the backslash that begins an escape
    quotes_before = from_line_start(tf.cumsum(tf.cast(quote, tf.int32), exclusive=True))
    opening = quote & (quotes_before % 2 == 0)
    outside = (quotes_before % 2 == 0) & ~quote
    step = _lookup(_ascii_table("{}[]", [1, -1, 1, -1]), char) * tf.cast(outside, tf.int32)
    depth = from_line_start(tf.cumsum(step, exclusive=True)) + step  # after the character

    # The envelope: an object whose quotes and brackets balance.
    last = tf.math.unsorted_segment_max(tf.range(tf.size(pos)), line, count)
    is_last = tf.equal(tf.range(tf.size(pos)), tf.gather(last, line))
    not_object = (
        ~tf.strings.regex_full_match(lines, _ENVELOPE)
        | per_line_any(~is_last & (depth < 1))
        | per_line_any(is_last & tf.not_equal(depth, 0))
        | per_line_any(is_last & tf.equal(quotes_before % 2, 1))
        | per_line_any(is_last & quote)
    )
    not_utf8 = per_line_any(tf.equal(char, 0))

    # The field: a string at depth 1 spelling the key, then a colon.
    closing = next_in_line(quote, tf.range(tf.size(pos)) + 1)
    colon = next_in_line(tf.ones_like(quote), closing + 1)
    candidate = (
        opening
        & tf.equal(depth, 1)
        & tf.equal(tf.gather(tf.concat([pos, [-1]], 0), closing), pos + len(field) + 1)
        & tf.equal(tf.gather(tf.concat([char, [-1]], 0), colon), _COLON)
    )
    where = tf.cast(tf.where(candidate)[:, 0], tf.int32)
    spelt = tf.reduce_all(
        tf.equal(tf.gather(flat, tf.gather(pos, where)[:, None] + 1 + tf.range(len(field))), key),
        axis=1,
    )
    spelt &= _all_space(
        flat, tf.gather(pos, tf.gather(closing, where)) + 1, tf.gather(pos, tf.gather(colon, where))
    )
    keys = tf.boolean_mask(where, spelt)
    found = tf.math.unsorted_segment_max(keys, tf.gather(line, keys), count)  # the last key
    has_field = found >= 0
    colon_of_key = tf.gather(tf.concat([colon, [tf.size(pos)]], 0), tf.maximum(found, 0))
    value = tf.minimum(colon_of_key + 1, tf.size(pos))  # the structural character after ':'
    value_end = next_in_line(quote, value + 1)
    is_string = has_field & (value_end < tf.size(pos))
    value_pos = tf.gather(tf.concat([pos, [0]], 0), value)
    is_string &= tf.equal(tf.gather(tf.concat([char, [-1]], 0), value), _QUOTE)
    is_string &= _all_space(flat, tf.gather(tf.concat([pos, [0]], 0), colon_of_key) + 1, value_pos)
    begin = tf.where(is_string, value_pos + 1, 0)
    end = tf.where(is_string, tf.gather(tf.concat([pos, [0]], 0), value_end), 0)

    # The value's escapes: each starter becomes one code point and hides what it consumed.
    inside = (pos >= tf.gather(begin, line)) & (pos < tf.gather(end, line))
    escapes = tf.boolean_mask(pos, starter & inside)
    escape_line = tf.boolean_mask(line, starter & inside)

    def at(offset):
        return tf.gather(flat, tf.minimum(escapes + offset, tf.size(flat) - 1))

    def hex_at(offset):
        digits = [_hex_digit(at(offset + i)) for i in range(4)]
        ok = tf.reduce_all(tf.stack([d >= 0 for d in digits]), axis=0)
        return ((digits[0] * 16 + digits[1]) * 16 + digits[2]) * 16 + digits[3], ok

    simple = _lookup(
        _ascii_table("".join(_SIMPLE_ESCAPES), [ord(v) for v in _SIMPLE_ESCAPES.values()], -1),
        at(1),
    )
    unit, unit_ok = hex_at(2)
    unicode = tf.equal(at(1), ord("u")) & unit_ok & (escapes + 5 < tf.gather(end, escape_line))
    low, low_ok = hex_at(8)
    pair = (
        unicode
        & (unit >= 0xD800)
        & (unit <= 0xDBFF)
        & tf.equal(at(6), _BACKSLASH)
        & tf.equal(at(7), ord("u"))
        & low_ok
        & (low >= 0xDC00)
        & (low <= 0xDFFF)
        & (escapes + 11 < tf.gather(end, escape_line))
    )
    surrogate = (unit >= 0xD800) & (unit <= 0xDFFF)
    code = tf.where(
        pair,
        0x10000 + (unit - 0xD800) * 1024 + (low - 0xDC00),
        tf.where(unicode, tf.where(surrogate, 0xFFFD, unit), simple),
    )
    bad_escape = (
        tf.math.unsorted_segment_max(tf.cast(~unicode & (simple < 0), tf.int32), escape_line, count)
        > 0
    )
    consumed = tf.where(pair, 11, tf.where(unicode, 5, 1))

    values = tf.gather(flat, tf.ragged.range(begin, end))
    size = tf.size(values.flat_values)
    slot = tf.gather(tf.cast(values.row_starts(), tf.int32) - begin, escape_line) + escapes
    marks = tf.zeros([size + 1], tf.int32)
    marks = tf.tensor_scatter_nd_add(marks, tf.minimum(slot + 1, size)[:, None], tf.ones_like(slot))
    marks = tf.tensor_scatter_nd_add(
        marks, tf.minimum(slot + 1 + consumed, size)[:, None], -tf.ones_like(slot)
    )
    hidden = tf.cumsum(marks)[:size] > 0
    decoded = tf.tensor_scatter_nd_update(values.flat_values, slot[:, None], code)
    kept = tf.ragged.boolean_mask(
        values.with_flat_values(decoded), values.with_flat_values(~hidden)
    )
    text = tf.strings.unicode_encode(kept, "UTF-8", errors="replace")

    problem = tf.zeros([count], tf.int32)
    for mask, number in (
        (bad_escape, BAD_ESCAPE),
        (~is_string, NOT_STRING),
        (~has_field, NO_FIELD),
        (not_object, NOT_OBJECT),
        (not_utf8, NOT_UTF8),
    ):
        problem = tf.where(mask, number, problem)
    return tf.where(problem == OK, text, ""), problem


def problem_text(problem: int, field: str) -> str:
    """What `extract_field`'s problem number means, for the field `field`."""
    return PROBLEMS[problem].format(field=field)


def read_field(path: tf.Tensor, field: str, batch: int = 64) -> tf.data.Dataset:
    """The `field` of each non-blank line of the JSON lines file `path`, decoded in the graph;
    a line with a problem stops the pipeline with an InvalidArgumentError naming `path:line`."""
    decode = functools.partial(decode_field, field=field)
    batches = raw_lines(path).batch(batch)
    return batches.map(decode, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()


def raw_lines(path: tf.Tensor) -> tf.data.Dataset:
    """(path, line number, line) of each non-blank line of `path`, undecoded: cheap to read past,
    and decoded later by `decode_field`, which names path:line in its errors."""
    lines = tf.data.TextLineDataset(path).enumerate(1)
    lines = lines.filter(lambda number, line: ~tf.strings.regex_full_match(line, r"\s*"))
    return lines.map(lambda number, line: (path, number, line))


def decode_field(paths: tf.Tensor, numbers: tf.Tensor, lines: tf.Tensor, field: str) -> tf.Tensor:
    """The `field` of a batch of `raw_lines`; a line with a problem stops the pipeline with an
    InvalidArgumentError naming its path:line."""
    messages = tf.constant([problem_text(p, field) for p in range(len(PROBLEMS))])
    texts, problems = extract_field(lines, field)
    bad = problems > 0
    worst = tf.argmax(tf.cast(bad, tf.int32))
    where = tf.strings.join(
        [
            BAD_DATA,
            paths[worst],
            ":",
            tf.strings.as_string(numbers[worst]),
            ": ",
            tf.gather(messages, problems[worst]),
        ]
    )
    check = tf.debugging.Assert(~tf.reduce_any(bad), [where])
    with tf.control_dependencies([check]):
        return tf.identity(texts)


def check_against_json(paths: list[str], field: str, lines: int = 8, files: int = 8) -> None:
    """Decodes the first `lines` non-blank lines of the first `files` files with Python's
    `json` and with `extract_field`, and raises ValueError naming file:line where a line is not
    a JSON object with a string `field`, or where the two disagree: at set-up, before training."""
    for path in paths[:files]:
        sample = []
        with tf.io.gfile.GFile(path, "rb") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    sample.append((number, line.rstrip(b"\n")))
                if len(sample) == lines:
                    break
        if not sample:
            continue
        texts, problems = extract_field(tf.constant([line for _, line in sample]), field)
        for (number, line), text, problem in zip(sample, texts.numpy(), problems.numpy()):
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{where}: not a JSON line ({error})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(
                    f"{where}: not a JSON object with a string field {field!r} (set json_field "
                    f"to the field holding the text; this line has {_keys(record)})"
                )
            if problem:
                raise ValueError(f"{where}: {problem_text(problem, field)}")
            if text != expected_text(record[field]):
                raise ValueError(
                    f"{where}: the in-graph JSON decoding of {field!r} differs from Python's "
                    "json; please report this line"
                )


def expected_text(value: str) -> bytes:
    """What `extract_field` gives for a decoded JSON string: UTF-8, lone surrogates as U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", value).encode("utf-8")


def _keys(record: object) -> str:
    if isinstance(record, dict):
        return f"fields {sorted(record)[:10]}"
    return f"a JSON {type(record).__name__}, not an object"
