"""bench/rerun_all.py (issue 37): one script reruns every figure bench/README.md quotes, and says what it cannot."""
import importlib.util, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location('rerun_all', ROOT / 'bench' / 'rerun_all.py')
rerun_all = importlib.util.module_from_spec(spec); spec.loader.exec_module(rerun_all)


def test_every_quoted_command_runs_or_says_why_not():
    cmds = rerun_all.commands()
    assert len(cmds) >= 20 and len(set(cmds)) == len(cmds)
    for c in cmds:
        why = rerun_all.skip_reason(c)
        if why is None and 'bench/' in c:                           # a runnable command names a script that exists
            script = c.split('python ', 1)[1].split()[0]
            assert (ROOT / script).is_file(), c
    assert rerun_all.skip_reason('OMP_NUM_THREADS=1 python bench/ab_sqnr.py NEW OLD NEW OLD') == 'needs two files to compare'
    assert rerun_all.skip_reason('python bench/bench_quantize.py --only nvfp4') is None
    assert rerun_all.skip_reason('python bench/rerun_all.py') == 'this script'      # the README quotes it too


def test_a_figure_added_to_the_readme_is_rerun(tmp_path):
    readme = tmp_path / 'README.md'
    readme.write_text("A figure (`python bench/bench_quantize.py --only nvfp4`), again (`python bench/bench_quantize.py  --only nvfp4`)\n"
                      "and a note in backticks that is not a command (`cq.quantize`).\n")
    assert rerun_all.commands(readme) == ['python bench/bench_quantize.py --only nvfp4']


def test_list_runs_nothing():
    r = subprocess.run([sys.executable, str(ROOT / 'bench' / 'rerun_all.py'), '--list', '--only', 'bench_lora'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.splitlines() == ['run\tpython bench/bench_lora.py quality', 'run\tpython bench/bench_lora.py cost']
