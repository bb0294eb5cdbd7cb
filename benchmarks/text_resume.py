"""How long a resumed language-model run waits for its first batch.

    python benchmarks/text_resume.py --size_mb=200 --out=benchmarks/results/text_resume.md
    python benchmarks/text_resume.py --quick      # smoke test: 0.2 MB, 1000 tokens

A text pipeline resumes at the restored step in one of two ways (`framework/data/text/`): from
the stream position its checkpoint holds (the trainer saves one per input pipeline), reading past
the raw lines before it undecoded; or, without one, by reading its stream up to the step, the
rows before it read, tokenized, packed and dropped. This writes a corpus of JSON lines
(`synthetic_text.write_corpus`: made-up words from a Zipf law) into a temporary directory, learns
its vocabulary once, records the stream's positions in one pass, and times the first batch of
`data.text_lm` both ways at several start steps (global batch 32, sequence 128: what a resumed
run of that shape waits before its first step). The corpus is deleted afterwards.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time

from reporting import machine, write_report
from synthetic_text import write_corpus

GLOBAL_BATCH, LENGTH = 32, 128


def first_batch_seconds(corpus, start_step: int, saved=None) -> float:
    from framework.data import positions, text

    start = time.perf_counter()
    dataset = text.text_lm(
        "train",
        global_batch_size=GLOBAL_BATCH,
        start_step=start_step,
        corpus=corpus,
        stream_positions=positions.StreamPositions(saved) if saved is not None else None,
    )
    next(iter(dataset))
    return time.perf_counter() - start


def recorded_positions(corpus, steps: list[int]) -> dict:
    """Each step's saved position, as a checkpoint holds it: one pass over the stream."""
    from framework.data import positions, text

    log = positions.StreamPositions(slots=max(steps) + 1)
    dataset = text.text_lm(
        "train", global_batch_size=GLOBAL_BATCH, corpus=corpus, stream_positions=log
    )
    next(iter(dataset.skip(max(steps))))
    return {step: log.of_step(step)[None] for step in steps}


def measure(directory: str, steps: list[int], vocab_size: int) -> list[dict]:
    from framework.data import text

    corpus = text.TextCorpus(
        files=os.path.join(directory, "part-*.jsonl"),
        json_field="text",
        vocab_path=os.path.join(directory, "vocab.txt"),
        vocab_size=vocab_size,
        sequence_length=LENGTH,
        log_stats=False,
    )
    corpus.vocab()  # learned once, before any timing
    first_batch_seconds(corpus, 0)  # TensorFlow's start-up, not the pipeline's
    saved = recorded_positions(corpus, steps)
    rows = []
    for step in steps:
        tokens = step * GLOBAL_BATCH * LENGTH
        reading = first_batch_seconds(corpus, step)
        seeking = first_batch_seconds(corpus, step, saved[step])
        rows.append(
            {"start_step": step, "skipped_tokens": tokens, "read": reading, "seek": seeking}
        )
    return rows


def report(rows: list[dict], size_mb: float, command: str) -> str:
    lines = [
        "# Resuming a text run: the wait for the first batch",
        "",
        f"`{command}`; {datetime.date.today()}; {machine()}.",
        "",
        f"Corpus: {size_mb:g} MB of generated JSON lines; global batch {GLOBAL_BATCH}, "
        f"sequence {LENGTH}. Reading: the stream read up to the start step (no saved position); "
        "from the saved position: what a run resumed from its checkpoint does.",
        "",
        "| start step | tokens before it | reading up to it | from the saved position |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['start_step']} | {row['skipped_tokens']:,} | {row['read']:.2f} s "
            f"| {row['seek']:.2f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size_mb", type=float, default=200, help="corpus size to generate")
    parser.add_argument("--files", type=int, default=16, help="files the corpus is split into")
    parser.add_argument(
        "--steps", default="0,1000,4000,16000", help="start steps to time, comma-separated"
    )
    parser.add_argument(
        "--quick", action="store_true", help="0.2 MB, 1000 tokens, start steps 0 and 20"
    )
    parser.add_argument("--out", help="write the report (markdown) here too")
    args = parser.parse_args()
    size_mb, steps = (0.2, [0, 20]) if args.quick else (args.size_mb, args.steps.split(","))
    directory = tempfile.mkdtemp(prefix="text_resume-")
    try:
        write_corpus(directory, size_mb, 2 if args.quick else args.files)
        rows = measure(directory, [int(s) for s in steps], 1000 if args.quick else 8192)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    command = "python benchmarks/text_resume.py " + " ".join(sys.argv[1:])
    write_report(report(rows, size_mb, command), args.out)


if __name__ == "__main__":
    main()
