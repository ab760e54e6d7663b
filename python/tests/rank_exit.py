"""How a data-parallel test worker ends (dp_worker.py, dp_state_dict_worker.py,
dp_failure_worker.py)."""
import os
import sys


def run_then_exit(main):
    """Runs main(), then leaves without the interpreter's own exit: torch's gloo worker threads
    may still free the work object of a finished collective while the interpreter finalizes,
    which takes the GIL from a dying thread and aborts the process (pytorch/pytorch#179291, seen
    with torch 2.13 about once in ten runs). Everything of the rank is closed and written by
    then. An exception in main() propagates (the interpreter's exit reports it)."""
    main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
