"""Time and memory of learning a vocabulary from a large corpus, within the sample's bounds.

    python benchmarks/vocab_sample.py --size_mb=500 --out=benchmarks/results/vocab_sample.md
    python benchmarks/vocab_sample.py --quick      # smoke test: 0.2 MB

Writes a corpus of JSON lines files (C4's layout: {"text", "timestamp", "url"}) into a temporary
directory: documents of 100 to 700 words drawn from a Zipf law (exponent 1.1) over a lexicon of
300 000 made-up words, with punctuation and capitals, so that the sample's distinct words grow as
they do in real text. Then, in a fresh process, learns the vocabulary of a `TextCorpus` over it
with the default bounds (`vocab_documents`, `vocab_sample_bytes`, `vocab_words`) and reports the
wall time, the process's peak resident memory beyond what it held before learning (TensorFlow
loaded), and the sample's documents, bytes and distinct words. The corpus is deleted afterwards.
The generated text is not English: compare runs with one another, not with a real corpus.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from reporting import REPO_DIR
from synthetic_text import write_corpus


def learn(directory: str, vocab_size: int) -> dict:
    """Learns the vocabulary of the corpus in `directory` in this process; returns the numbers."""
    import tensorflow as tf
    from reporting import machine

    from framework.data import text

    vocab_path = os.path.join(directory, "vocab.txt")
    corpus = text.TextCorpus(
        files=os.path.join(directory, "part-*.jsonl"),
        json_field="text",
        vocab_path=vocab_path,
        vocab_size=vocab_size,
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    vocab = corpus.vocab()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sample = corpus.sample().map(lambda d: (tf.strings.length(d), tf.size(tf.strings.split(d))))
    documents = sample_bytes = words = 0
    for length, count in sample.as_numpy_iterator():
        documents, sample_bytes, words = (
            documents + 1,
            sample_bytes + int(length),
            words + int(count),
        )
    distinct = len(
        set(
            word
            for batch in corpus.sample()
            .batch(1024)
            .map(lambda b: tf.strings.split(b).flat_values)
            .as_numpy_iterator()
            for word in batch
        )
    )
    return {
        "seconds": seconds,
        "peak_mib": (peak - before) / 1024,
        "rss_before_mib": before / 1024,
        "tokens": len(vocab),
        "documents": documents,
        "sample_mb": sample_bytes / 1e6,
        "words": words,
        "distinct": distinct,
        "vocab_documents": corpus.vocab_documents,
        "vocab_sample_bytes": corpus.vocab_sample_bytes,
        "vocab_words": corpus.vocab_words,
        "vocab_size": vocab_size,
        "machine": machine(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size_mb", type=float, default=500.0, help="corpus size to write")
    parser.add_argument("--files", type=int, default=64, help="files the corpus is spread over")
    parser.add_argument("--vocab_size", type=int, default=32_000, help="tokens to learn")
    parser.add_argument(
        "--quick", action="store_true", help="a 0.2 MB corpus in 2 files, 1000 tokens"
    )
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--learn", help=argparse.SUPPRESS)  # the child process: learn only
    args = parser.parse_args()
    if args.learn:
        print(json.dumps(learn(args.learn, args.vocab_size)))
        return 0
    size_mb, files = (0.2, 2) if args.quick else (args.size_mb, args.files)
    vocab_size = 1000 if args.quick else args.vocab_size
    directory = tempfile.mkdtemp(prefix="vocab_sample_")
    try:
        start = time.perf_counter()
        written = write_corpus(directory, size_mb, files)
        generated = time.perf_counter() - start
        child = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                f"--learn={directory}",
                f"--vocab_size={vocab_size}",
            ],
            env={**os.environ, "PYTHONPATH": REPO_DIR, "TF_CPP_MIN_LOG_LEVEL": "2"},
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode:
            print(child.stderr[-4000:], file=sys.stderr)
            return child.returncode
        result = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    command = " ".join(["python", "benchmarks/vocab_sample.py", *sys.argv[1:]])
    load = os.getloadavg()[0]
    report = "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"Machine: {result['machine']}",
            "",
            f"Date: {datetime.datetime.now():%Y-%m-%d %H:%M}, load average {load:.2f}",
            "",
            "| | |",
            "|---|---|",
            f"| corpus | {round(written / 1e6, 1):g} MB of JSON lines in {files} files "
            f"(written in {generated:.0f} s) |",
            f"| bounds | vocab_documents = {result['vocab_documents']:,}, vocab_sample_bytes = "
            f"{result['vocab_sample_bytes'] / 2**20:.0f} MiB, vocab_words = "
            f"{result['vocab_words']:,} |",
            f"| sample | {result['documents']:,} documents, {result['sample_mb']:.1f} MB of text, "
            f"{result['words']:,} words, {result['distinct']:,} distinct |",
            f"| vocabulary | {result['tokens']:,} tokens (vocab_size {result['vocab_size']:,}) |",
            f"| time to learn | {result['seconds']:.1f} s (reading, JSON decoding, counting, "
            "WordPiece learning) |",
            f"| peak memory | +{result['peak_mib']:.0f} MiB resident over the "
            f"{result['rss_before_mib']:.0f} MiB held before learning |",
            "",
        ]
    )
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
