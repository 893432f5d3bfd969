"""Exec wrapper that ties a llama-server child's life to the agent's.

Run as ``python -S child_exec.py --parent PID [--cpus 0,1] -- argv...``.  It
makes the child the leader of a new process group (so the supervisor can
signal the whole group), asks the kernel to SIGKILL it when the agent dies
(``PR_SET_PDEATHSIG`` -- this covers even a SIGKILLed agent), pins it to its
cores, and then ``exec``\\ s the real binary, so the pid the agent holds is
llama-server's own.  Standard library only: it runs before anything else.
"""

import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(args: list) -> None:
    parent = None
    cpus = None
    while args and args[0] != "--":
        flag, value, args = args[0], args[1], args[2:]
        if flag == "--parent":
            parent = int(value)
        elif flag == "--cpus":
            cpus = {int(c) for c in value.split(",") if c}
        else:
            sys.exit(f"child_exec: unknown option {flag}")
    argv = args[1:]
    if not argv:
        sys.exit("child_exec: no command given")
    os.setsid()
    _set_parent_death_signal()
    # The agent may have died between fork and prctl: then nobody would
    # ever signal us, so give up now.
    if parent is not None and os.getppid() != parent:
        sys.exit(1)
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        sys.stderr.write(f"child_exec: cannot execute {argv[0]}: {e.strerror}\n")
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])
