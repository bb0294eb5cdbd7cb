"""The fit planner: measure a config's real train step under each remat policy and batch size, and
pick the fastest setting whose peak memory fits a budget.

It sits beside the binaries, not in `framework.memory`, because it builds the gin-configured
`Trainer` (library code imports neither the trainer nor gin). Its figures come from child
processes (`child.py`, started by `workers.py`): compile workers (`compile_worker.py`) that read
XLA's plan of one combination after another, in the order `schedule.py` hands them out, and a
fresh process for each combination that runs (`run_child.py`), since allocator statistics and
XLA's state belong to a process and one setting's leftovers must not count against the next;
`spec.py` holds what they are sent, `measurement.py` what they report. `sweep.py` puts them
together.
"""

from framework.planner.choose import Plan, choose
from framework.planner.measurement import Measurement
from framework.planner.report import table, verdict, write_plan
from framework.planner.spec import RunConfig
from framework.planner.sweep import ConfigError, make_plan, measure_combination, plan_target

__all__ = [
    "ConfigError",
    "Measurement",
    "Plan",
    "RunConfig",
    "choose",
    "make_plan",
    "measure_combination",
    "plan_target",
    "table",
    "verdict",
    "write_plan",
]
