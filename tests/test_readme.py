"""README.md as a newcomer uses it: every Python snippet runs when pasted into a fresh interpreter, and the
test command installs exactly what `.ci/run` installs."""
import subprocess, sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT/'README.md').read_text(encoding='utf-8')


def _blocks(lang):
    "The fenced blocks of README.md whose info string is `lang` ('' for the notebook's code cells)."
    blocks, cur, info = [], None, None
    for line in README.splitlines():
        if line.startswith('```'):
            if cur is None: cur, info = [], line[3:].strip()
            else:
                if info == lang: blocks.append('\n'.join(cur))
                cur = None
        elif cur is not None: cur.append(line)
    return blocks


@pytest.mark.long
def test_python_snippets_run_as_pasted(tmp_path):
    "The code blocks (rendered from the index notebook's cells) run in order in a fresh process, imports included."
    code = _blocks('')      # outputs are indented blocks, not fenced ones
    assert code, 'no code blocks found in README.md'
    script = '\n'.join(code)
    assert 'import cquant as cq' in script and 'import torch' in script
    r = subprocess.run([sys.executable, '-c', script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def _norm(cmd): return ' '.join(t for t in cmd.split() if t != '-q')


def test_ci_installs_what_the_readme_test_command_installs():
    "Each step of the README's test command (after the venv) is a command of .ci/run, and pytest ends both."
    sh = _blocks('sh')[0].strip().splitlines()
    test_cmd = next(l for l in sh if 'pytest' in l)
    steps = [s.strip() for s in test_cmd.split('&&')]
    assert steps[0].startswith('python3 -m venv .venv') and steps[1] == '. .venv/bin/activate'
    ci = (ROOT/'.ci'/'run').read_text(encoding='utf-8')
    ci_cmds = [_norm(l) for l in ci.splitlines()]
    for s in steps[2:-1]:
        assert any(c.endswith(_norm(s)) for c in ci_cmds), f'README step not in .ci/run: {s}'
    assert steps[-1] == 'pytest -q tests' and ci.rstrip().splitlines()[-1] == 'pytest -q tests'
