"""Rerun every figure of bench/README.md: each command it quotes (in backticks), once, in the order it quotes them.

The README is the one list: a figure added there with its command is rerun here. Commands that need something
this tree does not hold (an older checkout, files named NEW/OLD, a placeholder) are listed as skipped with the
reason, and so are `farm-bench` commands where that tool is not installed. Each run's output goes to
bench/out/rerun-<time>/NN-<script>.log, headed by the command, the commit and the machine.

    python bench/rerun_all.py --list              # what would run, and what is skipped and why
    python bench/rerun_all.py                     # all of it (hours: the checkpoint and record studies dominate)
    python bench/rerun_all.py --only quantize     # the commands matching a regex
"""
import argparse, datetime, os, platform, re, shutil, subprocess, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = re.compile(r'`((?:[A-Z_]+=\S+ )*(?:python bench/|farm-bench )[^`]*)`')
NEEDS = (('<', 'a placeholder'), ('[CMD', 'a placeholder'), ('...', 'elided arguments'), (' NEW OLD', 'two files to compare'),
         ('/path/', 'an older checkout'), ('/tmp/oldtree', 'an older checkout'))


def commands(readme:Path=ROOT / 'bench' / 'README.md') -> list:
    "Each distinct command the README quotes, whitespace normalised, in order of first quote."
    out = []
    for c in COMMAND.findall(readme.read_text(encoding='utf-8')):
        c = ' '.join(c.split())
        if c not in out: out.append(c)
    return out


def skip_reason(cmd:str) -> str | None:
    "Why `cmd` cannot run as quoted, or None."
    if 'bench/rerun_all.py' in cmd: return 'this script'
    why = next((w for s, w in NEEDS if s in cmd), None)
    if why: return f'needs {why}'
    if cmd.startswith('farm-bench') and shutil.which('farm-bench') is None: return 'farm-bench is not installed'
    return None


def machine() -> str:
    "One line: CPUs, CPU model, memory, Python and torch versions."
    model = next((l.split(':', 1)[1].strip() for l in Path('/proc/cpuinfo').read_text().splitlines()
                  if l.startswith('model name')), platform.processor()) if Path('/proc/cpuinfo').exists() else platform.processor()
    mem = next((l.split()[1] for l in Path('/proc/meminfo').read_text().splitlines() if l.startswith('MemTotal')), '?') \
        if Path('/proc/meminfo').exists() else '?'
    try: import torch; tv = torch.__version__
    except ImportError: tv = 'none'
    return f"{os.cpu_count()} CPUs ({model}), {int(mem) // 2**20 if mem != '?' else '?'} GiB, Python {platform.python_version()}, torch {tv}"


def commit() -> str:
    r = subprocess.run(['git', 'describe', '--always', '--dirty'], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or 'unknown'


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--list', action='store_true', help='print what would run and what is skipped, run nothing')
    ap.add_argument('--only', metavar='REGEX', help='only the commands this regex finds')
    ap.add_argument('--timeout', type=float, default=3 * 3600, help='seconds per command (default: 3 hours)')
    args = ap.parse_args(argv)
    todo = [c for c in commands() if args.only is None or re.search(args.only, c)]
    if args.list:
        for c in todo: print(f"{'skip: ' + skip_reason(c) if skip_reason(c) else 'run'}\t{c}")
        return 0
    out = ROOT / 'bench' / 'out' / f"rerun-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True)
    head, rows = f"commit {commit()}; {machine()}", []
    print(head)
    for i, c in enumerate(todo, 1):
        if (why := skip_reason(c)): rows.append((c, f'skipped ({why})', 0.0, '')); continue
        script = re.search(r'(bench/\w+|farm-bench)', c)[1].split('/')[-1]
        log = out / f'{i:02d}-{script}.log'
        t0 = time.perf_counter()
        with open(log, 'w') as f:
            f.write(f"$ {c}\n{head}\n\n"); f.flush()
            try: rc = subprocess.run(['bash', '-c', c], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired: rc = 'timeout'
        rows.append((c, f'exit {rc}', time.perf_counter() - t0, str(log.relative_to(ROOT))))
        print(f"{rows[-1][1]:>10} {rows[-1][2]:8.1f} s  {c}", flush=True)
    failed = [r for r in rows if r[1] not in ('exit 0',) and not r[1].startswith('skipped')]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} done or skipped; logs in {out.relative_to(ROOT)}")
    for c, status, _, _ in rows:
        if status.startswith('skipped'): print(f"  {status}: {c}")
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
