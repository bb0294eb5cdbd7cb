"""`python -m framework.planner.child SPEC_JSON`: a planner's child process. The spec
(`spec.WorkerSpec`) says which: `Measure.RUN` measures one combination (`run_child.py`) and
prints its JSON line; `Measure.COMPILE` serves a compile worker (`compile_worker.py`) on
stdin and stdout until stdin ends."""

from __future__ import annotations

import json
import os
import sys

from framework.planner.compile_worker import serve_compiled
from framework.planner.run_child import measure
from framework.planner.spec import Measure, WorkerSpec


def main() -> None:
    spec = WorkerSpec.from_json(json.loads(sys.argv[1]))
    if spec.measure == Measure.COMPILE:
        # The protocol keeps stdout's pipe to itself: anything else written there (TensorFlow,
        # a model that prints) goes to stderr instead.
        protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w")
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        for line in serve_compiled(spec, sys.stdin):
            protocol.write(json.dumps(line) + "\n")
            protocol.flush()
        return
    result = measure(spec)
    print(json.dumps(result.to_json()), flush=True)


if __name__ == "__main__":
    main()
