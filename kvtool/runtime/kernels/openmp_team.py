"""Torch's own OpenMP threads, for the CPU decode kernel's threaded step (`cpu_decode.py`; the compiled side is
`team_launch.py`).

Why: a decode step of a small model on a CPU is a chain of torch operations, each spread over torch's OpenMP threads;
between two of them those threads spin, waiting for the next. Work run on threads of our own then competes with them
for the cores: on the 2-core VM of RESULTS.md the kernel's threaded step on Python threads was slower than a serial
one. Run by torch's team instead, the items start on threads that are awake and waiting for exactly this, and nothing
competes (RESULTS.md, "The CPU kernel on torch's OpenMP threads").

How: torch's OpenMP runtime is looked up among the libraries the process has already loaded (GNU ``libgomp`` in its
Linux wheels, or Intel's ``libiomp5``, which exports the same entry points; never loaded here), and the addresses of
``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads`` go to the compiled caller. There is no team
off Linux, without OpenMP in torch, or in a process forked after the team was found (OpenMP's threads do not survive
a fork): `openmp_team` answers None there and the caller runs serially (or on Python threads when asked to).
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass

_LIBRARIES = ("libgomp.so.1", "libiomp5.so")  # torch's OpenMP runtimes, by the names it links them as


@dataclass
class OpenMPTeam:
    """Entry points of the OpenMP runtime torch runs on, as integer addresses for compiled code."""

    gomp_parallel: int  # void GOMP_parallel(void (*fn)(void *), void *data, unsigned num_threads, unsigned flags)
    thread_num: int  # int omp_get_thread_num(void)
    num_threads: int  # int omp_get_num_threads(void)
    runs: int = 0  # threaded steps run so far (a test asserts that a large step really took this path)


_TEAM: dict[int, OpenMPTeam | None] = {}  # process id -> its team (or None: none here)


def openmp_team() -> OpenMPTeam | None:
    """The entry points of torch's OpenMP runtime in this process, or None where there is none to use (see the
    module)."""
    pid = os.getpid()
    if pid not in _TEAM:
        forked = bool(_TEAM)  # a team was looked for in a parent process: its OpenMP threads are not here
        _TEAM.clear()
        _TEAM[pid] = None if forked else _find_team()
    return _TEAM[pid]


def _find_team() -> OpenMPTeam | None:
    if not sys.platform.startswith("linux") or os.environ.get("KVTOOL_CPU_TEAM", "1") == "0":
        return None
    import torch

    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    for name in (*_LIBRARIES, *_loaded_runtimes(os.path.dirname(torch.__file__))):
        try:  # RTLD_NOLOAD: the runtime torch already loaded, or nothing (never a second copy)
            library = ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        try:
            entry = [ctypes.cast(getattr(library, f), ctypes.c_void_p).value
                     for f in ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")]
        except AttributeError:
            continue
        return OpenMPTeam(*entry)
    return None


def _loaded_runtimes(torch_dir: str) -> list[str]:
    """Paths of the OpenMP runtimes mapped into this process, torch's own first: wheels that bundle one may rename it
    (``libgomp-<hash>.so.1``), which the names above do not find."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line and ("libgomp" in line or "libiomp" in line)}
    except OSError:
        return []
    return sorted(paths, key=lambda path: not path.startswith(torch_dir))


def team_for(work: int, minimum: int) -> tuple[OpenMPTeam | None, tuple[int, int, int], int]:
    """(team, its addresses as compiled callers take them, thread count) for a host call of ``work`` units that spreads
    over torch's own threads from ``minimum`` of them: (None, (0, 0, 0), 1) where it runs on this thread (one torch
    thread, less work, or no team). The caller counts a run on the team (``team.runs += 1``)."""
    import torch

    threads = torch.get_num_threads()
    team = openmp_team() if threads > 1 and work >= minimum else None
    if team is None:
        return None, (0, 0, 0), 1
    return team, (team.gomp_parallel, team.thread_num, team.num_threads), threads
