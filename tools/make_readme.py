"""README.md from nbs/index.ipynb, the job `nbdev-readme` does with Quarto (which these machines lack).

Usage: python tools/make_readme.py [--check]   (--check: exit 1 if README.md is out of date)
Hidden cells are dropped and `#|` directives stripped; saved outputs are kept, nothing is executed.
"""
import re, sys
from pathlib import Path
import nbformat
from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parents[1]

def _directives(src): return re.findall(r'^#\|\s*(.+?)\s*$', src, re.M)

def readme_text(nb_path=ROOT/'nbs'/'index.ipynb') -> str:
    nb = nbformat.read(nb_path, as_version=4)
    keep = []
    for c in nb.cells:
        if c.cell_type == 'code':
            if any(d.split(':')[0].strip() in ('hide', 'exporti') or d.replace(' ', '') == 'echo:false' for d in _directives(c.source)): continue
            c.source = re.sub(r'^#\|.*\n?', '', c.source, flags=re.M)
        keep.append(c)
    nb.cells = keep
    body, _ = MarkdownExporter(exclude_input_prompt=True, exclude_output_prompt=True).from_notebook_node(nb)
    note = '<!-- Generated from nbs/index.ipynb by tools/make_readme.py; edit the notebook, not this file. -->\n\n'
    return note + re.sub(r'\n{3,}', '\n\n', body).strip() + '\n'

if __name__ == '__main__':
    text, out = readme_text(), ROOT/'README.md'
    if '--check' in sys.argv:
        if not out.exists() or out.read_text() != text: sys.exit('README.md is out of date: run python tools/make_readme.py')
    else: out.write_text(text)
