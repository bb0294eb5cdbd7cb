"""`python -m framework.plan`: the planner's earlier name, kept so that existing commands work.

The planner is `python -m framework.planner` (console command `framework-plan`); this alias says
so on stderr and runs it with the same flags.
"""

import sys

from framework.planner.__main__ import console_main

if __name__ == "__main__":
    print("framework.plan is the planner: running python -m framework.planner", file=sys.stderr)
    console_main()
