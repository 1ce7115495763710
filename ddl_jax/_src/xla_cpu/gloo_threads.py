"""gloo's transport threads lowered to ``SCHED_IDLE`` (an XLA:CPU tuning, ``tunings.py``).

A gloo TCP loop thread spins while a peer's message waits for this process to post its
receive; at normal priority it takes the core from the step when a process has one core.
At ``SCHED_IDLE`` it runs when the step waits. Found in ``/proc`` (Linux) by a daemon
thread, as XLA starts one per group of devices that a collective first runs over.
"""

import contextlib
import os
import platform
import threading
import time

# epoll_wait's system call numbers (epoll_pwait where there is no epoll_wait), and the
# maximum events and timeout (ms) gloo's TCP loop passes: `gloo::transport::tcp::Loop::run`.
_EPOLL_SYSCALLS = {"x86_64": {232, 281}, "aarch64": {22}}
_GLOO_LOOP_EPOLL = (64, 10)


def loop_threads() -> list[int]:
    """Thread ids of this process's gloo TCP loop threads now in ``epoll_wait`` (Linux).

    A thread counts when ``/proc`` shows it in ``epoll_wait`` with gloo's loop arguments
    (64 events, a 10 ms timeout). XLA starts one such thread per communicator, when a
    program first runs a collective over a new group of devices.
    """
    calls = _EPOLL_SYSCALLS.get(platform.machine(), set())
    found = []
    for tid in os.listdir("/proc/self/task") if calls else ():
        try:
            with open(f"/proc/self/task/{tid}/syscall") as f:
                fields = f.read().split()
        except OSError:  # the thread ended, or /proc hides system calls
            continue
        epoll = len(fields) > 4 and fields[0].isdigit() and int(fields[0]) in calls
        if epoll and tuple(int(x, 16) for x in fields[3:5]) == _GLOO_LOOP_EPOLL:
            found.append(int(tid))
    return found


def _idle_gloo_loops(interval: float = 0.5) -> None:
    """Lowers every gloo loop thread that appears to ``SCHED_IDLE``, for ever (a daemon)."""
    done: set[int] = set()
    while True:
        for tid in set(loop_threads()) - done:
            with contextlib.suppress(OSError):  # it ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            done.add(tid)
        time.sleep(interval)


_started = threading.Event()


def start_idling() -> None:
    """Starts the daemon thread that idles gloo's loop threads (once per process; Linux)."""
    if hasattr(os, "SCHED_IDLE") and not _started.is_set():
        _started.set()
        threading.Thread(target=_idle_gloo_loops, name="ddl-idle-gloo", daemon=True).start()
