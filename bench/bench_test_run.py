"""The test suite's cost as issue 36 states it: wall time and the peak memory of the whole process tree (pytest, its
xdist workers and every process a test starts), sampled every 0.5 s from /proc (Linux), two ways: the summed RSS, which
counts a page shared by several processes once per process (torch's libraries in every worker, Chromium's processes:
1.1 GB of RSS for 0.48 GB of PSS), and the summed PSS (`smaps_rollup`), which splits a shared page between its users:
the memory the run occupies.

    python bench/bench_test_run.py                                  # pytest -q tests (the README's test command)
    python bench/bench_test_run.py pytest -q -m "not long" tests    # the quick tier
"""
import os, subprocess, sys, time


def _children() -> dict:
    "{parent pid: [child pids]} of every process now."
    kids = {}
    for p in filter(str.isdigit, os.listdir('/proc')):
        try:
            with open(f'/proc/{p}/stat') as f: ppid = int(f.read().rsplit(')', 1)[1].split()[1])
        except (OSError, IndexError, ValueError): continue
        kids.setdefault(ppid, []).append(int(p))
    return kids


def _mem_kib(pid:int) -> tuple:
    "(RSS, PSS) of process `pid` in KiB ((0, 0) once it is gone)."
    rss = pss = 0
    try:
        with open(f'/proc/{pid}/smaps_rollup') as f:
            for l in f:
                if l.startswith('Rss:'): rss = int(l.split()[1])
                elif l.startswith('Pss:'): pss = int(l.split()[1])
    except OSError: pass
    return rss, pss


def tree_mem_mib(root:int) -> tuple:
    "The summed (RSS, PSS) in MiB of `root` and all its descendants."
    kids, todo, rss, pss = _children(), [root], 0, 0
    while todo:
        p = todo.pop(); r, s = _mem_kib(p); rss += r; pss += s; todo += kids.get(p, [])
    return rss // 1024, pss // 1024


def main(cmd:list) -> int:
    t0, rss, pss = time.time(), 0, 0
    p = subprocess.Popen(cmd)
    while p.poll() is None:
        r, s = tree_mem_mib(p.pid); rss, pss = max(rss, r), max(pss, s)
        time.sleep(0.5)
    print(f"{' '.join(cmd)}: exit {p.returncode}, {time.time() - t0:.0f} s wall, peak memory of the process tree "
          f"{pss / 1024:.2f} GiB PSS ({rss / 1024:.2f} GiB summed RSS), {os.cpu_count()} CPUs")
    return p.returncode


if __name__ == '__main__': sys.exit(main(sys.argv[1:] or ['pytest', '-q', 'tests']))
