"""A generated web-text corpus for the text benchmarks: JSON lines of made-up words drawn from a
Zipf law over a large lexicon, as big as asked, the same for a seed; nothing is downloaded."""

from __future__ import annotations

import json
import os

import numpy as np

LEXICON = 300_000


def write_corpus(directory: str, size_mb: float, files: int, seed: int = 0) -> int:
    """Writes about `size_mb` MB of JSON lines over `files` files; returns the bytes written."""
    rng = np.random.default_rng(seed)
    syllables = [c + v for c in "bcdfghklmnprstvz" for v in "aeiouy"] + ["str", "ing", "tion"]
    parts = rng.choice(syllables, (LEXICON, 4))
    lengths = rng.integers(1, 5, LEXICON)
    lexicon = np.array(["".join(word[:n]) for word, n in zip(parts, lengths)])
    weights = 1.0 / np.arange(1, LEXICON + 1) ** 1.1
    cdf = np.cumsum(weights / weights.sum())
    budget, written = size_mb * 1e6 / files, 0
    for index in range(files):
        path = os.path.join(directory, f"part-{index:05d}.jsonl")
        size = 0
        with open(path, "w", encoding="utf-8") as f:
            while size < budget:
                count = int(rng.integers(100, 700))
                words = lexicon[np.searchsorted(cdf, rng.random(count))]
                ends = rng.random(count) < 0.07
                words = np.where(ends, np.char.add(words, "."), words)
                text = " ".join(words).capitalize()
                line = json.dumps(
                    {
                        "text": text,
                        "timestamp": "2019-04-25T12:57:54Z",
                        "url": f"https://example.org/{index}/{size}",
                    }
                )
                f.write(line + "\n")
                size += len(line) + 1
        written += size
    return written
