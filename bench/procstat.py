"""What a benchmark reads about another process from ``/proc``: resident memory and CPU time.

Linux only (the benchmarks pin with ``taskset`` and already assume Linux). CPU time is
``utime + stime`` of every thread of the process, in clock ticks (10 ms on most kernels), so read
it over intervals of seconds, not milliseconds.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> int:
    """Resident set size (``VmRSS``) in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far (all its threads)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) may contain spaces and parentheses: split after the last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (threads of one name summed; the main thread is ``main``)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended between the listing and the read
            continue
        name = "main" if task.name == str(pid) else stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) * _TICK_S
    return out
