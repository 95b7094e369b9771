"""The test suite's cost as issue 36 states it: wall time and the peak memory of the whole process tree (pytest, its
xdist workers and every process a test starts), sampled from /proc (Linux), two ways: the summed RSS, which
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


def _rss_kib(pid:int) -> int:
    try:
        with open(f'/proc/{pid}/status') as f: return next((int(l.split()[1]) for l in f if l.startswith('VmRSS:')), 0)
    except OSError: return 0


def _pss_kib(pid:int) -> int:
    "Process `pid`'s PSS (KiB): `smaps_rollup` walks its page tables, about 30 ms for a 2 GB process."
    try:
        with open(f'/proc/{pid}/smaps_rollup') as f: return next((int(l.split()[1]) for l in f if l.startswith('Pss:')), 0)
    except OSError: return 0


def tree_mib(root:int, of) -> int:
    "The sum of `of(pid)` (KiB) over `root` and all its descendants, in MiB."
    kids, todo, total = _children(), [root], 0
    while todo:
        p = todo.pop(); total += of(p); todo += kids.get(p, [])
    return total // 1024


def main(cmd:list, every:float=0.5, pss_every:int=10) -> int:
    "Run `cmd`: summed RSS every `every` s, summed PSS every `pss_every` samples (reading it costs the run CPU time)."
    t0, rss, pss, i = time.time(), 0, 0, 0
    p = subprocess.Popen(cmd)
    while p.poll() is None:
        rss = max(rss, tree_mib(p.pid, _rss_kib))
        if i % pss_every == 0: pss = max(pss, tree_mib(p.pid, _pss_kib))
        i += 1; time.sleep(every)
    print(f"{' '.join(cmd)}: exit {p.returncode}, {time.time() - t0:.0f} s wall, peak memory of the process tree "
          f"{pss / 1024:.2f} GiB PSS (sampled every {every * pss_every:g} s; summed RSS {rss / 1024:.2f} GiB), "
          f"{os.cpu_count()} CPUs")
    return p.returncode


if __name__ == '__main__': sys.exit(main(sys.argv[1:] or ['pytest', '-q', 'tests']))
