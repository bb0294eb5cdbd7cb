"""`planner.spec`: what a child process is sent survives the trip as JSON, and a mode reads as
the word `--measure` takes."""

import json

from framework.planner import Measurement
from framework.planner.schedule import Job
from framework.planner.spec import Combination, Measure, RunConfig, WorkerSpec

CONFIG = RunConfig(["quickstart.gin"], ["Trainer.train_steps = 4"], ["configs"])


def through_json(data: dict) -> dict:
    return json.loads(json.dumps(data))


def test_a_worker_spec_comes_back_from_json_as_it_was_sent():
    run = WorkerSpec(CONFIG, Measure.RUN, Combination("dots_saveable", 32, "optimizer"), steps=5)
    compile_worker = WorkerSpec(CONFIG, Measure.COMPILE, target="v5e")
    for spec in (run, compile_worker):
        assert WorkerSpec.from_json(through_json(spec.to_json())) == spec


def test_a_compile_workers_job_line_is_the_combination_alone():
    job = Job("budget:0.5", 64, search=True, shard_state="gradients")
    line = through_json(job.combination.to_json())
    assert line == {"policy": "budget:0.5", "batch_size": 64, "shard_state": "gradients"}
    assert Combination.from_json(line) == Combination("budget:0.5", 64, "gradients")


def test_a_mode_is_its_word():
    assert [str(m) for m in Measure] == ["auto", "run", "compile"]
    assert Measure.COMPILE == "compile" and json.dumps(Measure.RUN) == '"run"'
    measured = Measurement("none", 8, measure="compile")
    assert measured.measure is Measure.COMPILE
    assert through_json(measured.to_json())["measure"] == "compile"
    assert Measurement.from_json(through_json(measured.to_json())) == measured
