"""Run a module under cProfile with a CPU-time clock (``time.process_time``).

cProfile's default clock is the wall clock, which charges a system call with
the time the process spent descheduled in it; on a 2-core machine shared with
llama-server and the client that hides where the agent's own CPU goes.

    python bench/cpu_profile.py OUT -m MODULE [ARGS...]
"""

from __future__ import annotations

import cProfile
import os
import runpy
import sys
import time


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "-m":
        raise SystemExit(__doc__)
    out, module = sys.argv[1], sys.argv[3]
    sys.argv = [module] + sys.argv[4:]
    sys.path[0] = os.getcwd()  # what ``python -m`` puts first, instead of this script's directory
    profile = cProfile.Profile(time.process_time)
    try:
        profile.runcall(runpy.run_module, module, run_name="__main__", alter_sys=True)
    finally:
        profile.dump_stats(out)


if __name__ == "__main__":
    main()
