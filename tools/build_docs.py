#!/usr/bin/env python
"""Build the cquant documentation site offline, from the notebooks, without Quarto.

Usage (from anywhere inside the repo):

    python tools/build_docs.py            # -> _docs/index.html (nbdev's doc_path); open it from the file system
    python tools/build_docs.py --out DIR  # build somewhere else (the tests build into a temporary folder)
    python tools/build_docs.py --force    # reprocess every notebook, e.g. after library code changed

What it does:

1. nbdev's own pre-render step, the one `nbdev-proc-nbs` and `nbdev-docs` run before Quarto: refresh
   `nbs/nbdev.yml`, rebuild `_modidx.py`, write `nbs/sidebar.yml` (the page order), and process every
   notebook into `_proc/` (frontmatter cell, `show_doc` rendered for exported names, `#| hide` cells and
   exported code dropped, doc links). Quarto itself is not needed for this, so nbdev's Quarto installer
   (which calls `sudo`/`curl`) is skipped.
2. Stage `_proc/` for MkDocs, applying the nbdev/Quarto conventions that mkdocs-jupyter does not know:
   the frontmatter `title`/`description` become the page heading; `#|` directive lines are removed from
   the shown code; `echo: false` hides a cell's source, `output: false` its outputs, `include: false` the
   whole cell; `output: asis` outputs (show_doc's API docs) become page markdown, so they get anchors and
   join the table of contents; Pandoc link attributes (`[source](url){target="_blank"}`) become HTML;
   show_doc signatures show classes as `class X(Bases):` with their `__init__` (fastcore writes `def X(...)`)
   and break long lines between parameters; headings get the ids nbdev's doc links and MkDocs' TOC expect;
   links to notebooks (also as `nbs/x.ipynb`, as README.md has them) and to the hosted docs point at the
   local pages; TeX becomes MathML (`latex2mathml`); cells of checks only (`test_eq`, `assert`) are left out
   of the page (they still run under nbdev-test and pytest); execnb's float `metadata.execution` (rejected by
   nbformat) and widget state (needs a CDN) are dropped.
3. Render with MkDocs + Material + mkdocs-jupyter (config: `mkdocs.yml` at the repo root, inherited by a
   generated config that adds the pages and the nav, in nbdev's sidebar order). The site needs no network,
   opened from `file://` or served (`python -m http.server -d _docs`): search runs on a local index (under
   file:// its worker runs in an iframe, by a small shim written here), no page requests anything from the
   network (no MathJax: the math is MathML; the repository is a plain link, not Material's widget that asks
   the GitHub API), and 404.html links relative to the site root.

Notebooks are not executed to build the site: pages show the outputs saved in the committed notebooks
(plots included). The only cells that run are those nbdev's processing runs to render `show_doc` (exported
cells, `show_doc` cells and every cell containing an import), exactly as under `nbdev-docs`.
With Quarto installed, `nbdev-docs` builds nbdev's own site from the same notebooks (`nbs/_quarto.yml`).
"""
from __future__ import annotations

import argparse, json, os, re, shutil, subprocess, sys, tempfile, time
from html import escape
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BASE_CONFIG = ROOT/'mkdocs.yml'
# Files nbdev copies into _proc/ that are Quarto's business, not pages or assets of the MkDocs site
_QUARTO_ONLY = {'_quarto.yml', 'nbdev.yml', 'sidebar.yml', '_brand.yml', '_metadata.yml', '_metadata.yaml'}
_WIDGET_MIME = 'application/vnd.jupyter.widget-view+json'


def _log(msg): print(f'[build_docs] {msg}', flush=True)


# ---------------------------------------------------------------------------------------------------
# 1. nbdev processing
def nbdev_process(n_workers: int | None = None) -> tuple[Path, object]:
    "Run nbdev's pre-docs step (as `nbdev-proc-nbs`/`nbdev-docs` do) and return `(_proc path, config)`"
    os.chdir(ROOT)
    import nbdev.quarto as nq
    from fastcore.parallel import defaults
    if not hasattr(nq, '_pre_docs'):  # a future nbdev without this helper: fall back to the CLI
        subprocess.run(['nbdev-proc-nbs'], check=True, cwd=ROOT)
        from nbdev.config import get_config
        cfg = get_config(ROOT)
        return cfg.config_path/'_proc', cfg
    nq._ensure_quarto = lambda: None  # Quarto renders; it is not needed to process notebooks
    # the processing workers import the package, installed or not (like nbdev-test's basepath)
    sys.path.insert(0, str(ROOT))
    os.environ['PYTHONPATH'] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get('PYTHONPATH')] if p])
    # `file_re` as `nbdev-docs` passes it: `nbdev-proc-nbs` leaves it empty, and then nbdev's sidebar
    # lists nbdev.yml, sidebar.yml and styles.css as pages.
    try: cache, cfg, _ = nq._pre_docs(n_workers=n_workers or defaults.cpus, file_re=nq._def_file_re)
    except Exception as e:
        raise SystemExit(f"\n[build_docs] nbdev could not process the notebooks: {type(e).__name__}: {e}\n"
            "  (full traceback above). nbdev's docs processing, here and in `nbdev-docs`, executes every exported\n"
            "  cell, every show_doc cell and EVERY CELL CONTAINING AN IMPORT, whatever its flags, but not the other\n"
            "  cells. A cell that imports and also uses names made by ordinary cells fails with a NameError: move\n"
            "  the import into its own cell (or the notebook's first import cell), or mark the cell `#| eval: false`.\n"
            + _import_cells_report()) from e
    return Path(cache), cfg


def _import_cells_report() -> str:
    "Name the notebook cells that nbdev's docs processing runs because they import, yet also do other work"
    import ast, warnings
    try:
        from nbdev.config import get_config
        from nbdev.doclinks import nbglob
        from nbdev.process import NBProcessor
        from nbdev.processors import _do_eval, _ast_contains
    except ImportError: return ''
    cfg, res = get_config(ROOT), []
    safe = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)  # harmless out of context
    for nb in nbglob(cfg.nbs_path, as_path=True, skip_file_re='^[_.]'):
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            cells = NBProcessor(nb, rm_directives=False).nb.cells
            for c in cells:
                if c.cell_type != 'code' or not _do_eval(c) or c.directives_.keys() & {'export', 'exports', 'exporti', 'exec_doc'}: continue
                trees = c.parsed_() or []
                if _ast_contains(trees, (ast.Import, ast.ImportFrom)) and not all(isinstance(t, safe) for t in trees):
                    first = next((l for l in c.source.splitlines() if l.strip() and not l.startswith('#|')), '')
                    res.append(f'    {nb.relative_to(cfg.nbs_path)} cell {c.get("id", c.idx_)}: {first[:80]}')
    return ('  Cells that import (anywhere in the cell) and also run code; the docs build runs each one out of context:\n'
            + '\n'.join(res)) if res else ''


# ---------------------------------------------------------------------------------------------------
# 2. staging: nbdev conventions -> plain notebooks mkdocs-jupyter renders as nbdev would
def _page_name(rel: Path, fm: dict) -> Path:
    "Page source name for notebook `rel`: nbdev's `output-file` (numbers stripped), as an .ipynb"
    from nbdev.config import nbpath2html
    out = fm.get('output-file') or nbpath2html(rel).name
    return rel.parent/Path(out).with_suffix('.ipynb')


def _fix_links(text: str, links: dict[str, str], site_url: str) -> str:
    "Point links at notebooks / at the hosted site to the offline pages"
    if site_url: text = text.replace(site_url.rstrip('/') + '/', '')
    def sub(m):
        page = links.get(m.group(2))
        return m.group(1) + page if page else m.group(0)
    # markdown `](x.ipynb`, html `href="x.ipynb`, also `x.ipynb#anchor`
    return re.sub(r'''(\]\(|href=["'])([^)"'#\s]+\.ipynb)''', sub, text)


def _pandoc_link_attrs(md: str) -> str:
    "`[text](url){target=\"_blank\" .cls}` (Pandoc link attributes, e.g. show_doc's source links) as an HTML <a>"
    def sub(m):
        text, url, attrs = m.groups()
        kv = re.findall(r'([\w-]+)=("[^"]*"|\S+)', attrs)
        cls = re.findall(r'(?:^|\s)\.([\w-]+)', attrs)
        ids = re.findall(r'(?:^|\s)#([\w.-]+)', attrs)
        extra = ''.join(f' {k}="{escape(v.strip(chr(34)))}"' for k, v in kv)
        extra += f' class="{" ".join(cls)}"' if cls else ''
        extra += f' id="{ids[0]}"' if ids else ''
        return f'<a href="{escape(url)}"{extra}>{text}</a>'
    return re.sub(r'\[([^\]]*)\]\(([^)\s]*)\)\{([^}]*)\}', sub, md)


_MATH_RE = re.compile(
    r'(?P<fence>^[ ]{0,3}(?P<f>`{3,}|~{3,})[^\n]*\n.*?^[ ]{0,3}(?P=f)[ \t]*$)'   # fenced code: leave alone
    r'|(?P<code>(?P<bt>`+)[^`].*?(?P=bt))'                                    # inline code: leave alone
    r'|\$\$(?P<dtex>.+?)\$\$'                                                  # $$display$$
    r'|(?<![\\$\w])\$(?=[^\s$])(?P<itex>(?:[^$\n]|\n(?![ \t]*\n))+?)(?<=[^\s\\])\$(?!\d)',   # $inline$ (within a paragraph)
    re.S | re.M)


def _tex_to_mathml(md: str) -> str:
    """TeX math (`$...$`, `$$...$$`, a span may break a line) as MathML, which browsers render with no script and
    no network (`latex2mathml`, a docs dependency). TeX it cannot convert stays as written, and tests/test_docs.py
    fails on it."""
    try: from latex2mathml.converter import convert
    except ImportError: return md
    def sub(m):
        tex, display = (m.group('dtex'), 'block') if m.group('dtex') is not None else (m.group('itex'), 'inline')
        if tex is None: return m.group(0)
        try: return convert(' '.join(tex.split()), display=display)
        except Exception: return m.group(0)
    return _MATH_RE.sub(sub, md)


_CHECK_NAMES = re.compile(r'test_\w+|test$')   # fastcore.test's checks (test_eq, test_fail, test_close, ...)


def _checks_only(src: str) -> bool:
    """A cell of checks only (`test_eq(...)`, `assert ...`, loops and `with` blocks of them): it runs under nbdev-test
    and the tests, and is not shown on the page"""
    import ast
    try: body = ast.parse(src).body
    except SyntaxError: return False
    def check(st) -> bool:
        if isinstance(st, ast.Assert): return True
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Name):
            return bool(_CHECK_NAMES.fullmatch(st.value.func.id))
        if isinstance(st, (ast.For, ast.With)): return all(map(check, st.body))
        return False
    return bool(body) and all(map(check, body))


def _map_headings(md: str, f) -> str:
    "Replace each ATX heading line of markdown `md` (outside fenced code) by `f(hashes, text)`"
    out, fence = [], None
    for line in md.split('\n'):
        m = re.match(r'\s{0,3}(`{3,}|~{3,})', line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = m.group(1) if fence is None else None
        h = None if fence or m else re.match(r'(#{1,6})\s+(.*?)\s*#*\s*$', line)
        out.append(f(h.group(1), h.group(2)) if h else line)
    return '\n'.join(out)


def _code_headings(md: str) -> str:
    "Headings with `code` (often doc-linked by nbdev) get <code>: mkdocs-jupyter drops code spans from the TOC"
    def f(hashes, t):
        t = re.sub(r'\[`([^`]+)`\]\([^)]*\)', r'`\1`', t)  # no doc link inside a heading
        return f"{hashes} " + re.sub(r'`([^`]+)`', lambda c: f'<code>{escape(c.group(1))}</code>', t)
    return _map_headings(md, f)


def _anchor_headings(cells, asis_ids) -> None:
    """Give headings the ids that links expect, in place: MkDocs' TOC numbers repeated ids (`x_1`) but the
    rendered page does not, and nbdev links methods as `#class.method` where MkDocs' id is `classmethod`"""
    from markdown.extensions.toc import slugify, unique
    seen = set()
    for c in cells:
        if c.cell_type != 'markdown': continue
        def f(hashes, t):
            text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', t)
            text = re.sub(r'<[^>]+>|[`*]', '', text)
            slug = slugify(text, '-')
            uid, extra = unique(slug, seen), []
            if uid != slug: extra.append(uid)
            name = text.strip()
            if id(c) in asis_ids and re.fullmatch(r'[\w.]+', name) and name.lower() != slug: extra.append(name.lower())
            return ''.join(f'<a id="{escape(i)}"></a>\n\n' for i in extra) + f'{hashes} {t}'
        c.source = _map_headings(c.source, f)


def _asis_markdown(cell) -> list[str]:
    "Markdown text of a `#| output: asis` cell's outputs (what Quarto would inline)"
    res = []
    for o in cell.get('outputs', []):
        if o.get('output_type') == 'stream': res.append(o.get('text', ''))
        elif 'data' in o:
            d = o['data']
            txt = d.get('text/markdown') or d.get('text/html') or d.get('text/plain') or ''
            res.append(txt if isinstance(txt, str) else ''.join(txt))
    return [t for t in res if t.strip()]


# show_doc signatures: fastcore writes every callable as `def X(...)` (classes too) in lines of up to 110 characters
_SIG_WIDTH = 80  # the widest signature line, as nbs/styles.css sizes the page's code column
_SHOW_DOC_RE = re.compile(
    r'(?:\[source\]\([^)\s]*?/blob/[^/)]+/(?P<path>[^)#\s]+)\.py#L\d+\)[^\n]*\n\n)?'  # show_doc's source link
    r'(?P<head>#{1,6} (?P<name>[\w.]+)\n\n```python\n)(?P<sig>(?:async )?def [^\n]*(?:\n(?!```)[^\n]*)*)\n```')


def _split_params(line: str) -> tuple[list[str], str]:
    "The top-level comma-separated items of a signature line, and its trailing `# comment` (or '')"
    items, cur, depth, quote, i = [], '', 0, None, 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == '\\': cur, i = cur + line[i:i+2], i + 2; continue
            if ch == quote: quote = None
        elif ch in '\'"': quote = ch
        elif ch in '([{': depth += 1
        elif ch in ')]}': depth -= 1
        elif depth == 0 and ch == '#': return [t for t in items + [cur.strip()] if t], line[i:]
        elif depth == 0 and ch == ',': items.append(cur.strip()); cur, i = '', i + 1; continue
        cur, i = cur + ch, i + 1
    return [t for t in items + [cur.strip()] if t], ''


def _wrap_params(lines: list[str], indent: str, width: int = _SIG_WIDTH) -> list[str]:
    "fastcore's parameter lines re-broken between parameters so that (comments aside) none exceeds `width`"
    params = []  # [item, comment lines]
    for line in lines:
        s = line.strip()
        if s.startswith('#') and params: params[-1][1].append(s); continue
        items, comment = _split_params(s)
        params += [[it, []] for it in items]
        if comment and params: params[-1][1].append(comment)
    out, cur = [], []
    for k, (item, comments) in enumerate(params):
        if cur and len(indent + ', '.join(cur + [item]) + ',') > width: out.append(indent + ', '.join(cur) + ','); cur = []
        cur.append(item)
        if comments or k == len(params) - 1:
            out.append(indent + ', '.join(cur) + (',' if comments else '') + ''.join(' ' + c for c in comments[:1]))
            out += [indent + c for c in comments[1:]]
            cur = []
    return out


def _resolve(path: str | None, name: str):
    "The object show_doc documented: `name` in the module of source file `path` (None if it cannot be imported)"
    if not path: return None
    import importlib
    try: obj = importlib.import_module(path.removesuffix('/__init__').replace('/', '.'))
    except Exception: return None
    for part in name.split('.'): obj = getattr(obj, part, None)
    return obj


def _signature(sig: str, obj) -> str:
    "A show_doc signature with long lines broken between parameters; a class as `class X(Bases):` + `__init__`"
    import inspect
    lines = sig.split('\n')
    first, body, last = (lines[0], lines[1:-1], lines[-1]) if len(lines) > 2 else (lines[0], [], '')
    if not inspect.isclass(obj):
        if all(len(l) <= _SIG_WIDTH for l in lines): return sig
        return '\n'.join([first] + _wrap_params(body, '    ') + [last])
    bases = ', '.join(b.__qualname__ for b in obj.__bases__ if b is not object)
    head = f'class {obj.__name__}' + (f'({bases})' if bases else '') + ':'
    if not body or [p for l in body for p in _split_params(l)[0]] in (['*args', '**kwargs'], ['*args:Any', '**kwargs:Any']):
        return head
    params = _wrap_params(['self, ' + body[0].strip()] + body[1:], ' ' * 8)
    if len(params) == 1 and '#' not in params[0] and len(one := f'    def __init__({params[0].strip()}):') <= _SIG_WIDTH:
        return f'{head}\n{one}'
    return '\n'.join([head, '    def __init__('] + params + ['    ):'])


def _show_doc_classes_and_wrap(md: str) -> str:
    "Signatures in show_doc markdown: classes as classes, long lines broken between parameters"
    def sub(m):
        sig = _signature(m.group('sig'), _resolve(m.group('path'), m.group('name')))
        return m.group(0)[:m.start('sig') - m.start(0)] + sig + '\n```'
    return _SHOW_DOC_RE.sub(sub, md)


def _stage_notebook(src: Path, dst: Path, links: dict[str, str], site_url: str) -> dict:
    "Write the nbdev-processed notebook `src` to `dst` with nbdev conventions applied; return its frontmatter"
    from fastcore.nbio import read_nb, write_nb, nb_frontmatter, mk_cell
    nb = read_nb(src)
    fm = nb_frontmatter(nb)
    cells, asis_ids = [], set()
    for c in nb.cells:
        if c.cell_type == 'raw' and c.source.strip().startswith('---'): continue  # frontmatter: becomes the heading
        c.get('metadata', {}).pop('execution', None)  # execnb's float timings fail nbformat validation
        if c.cell_type == 'markdown':
            c.source = _code_headings(_tex_to_mathml(_pandoc_link_attrs(_fix_links(c.source, links, site_url))))
        if c.cell_type == 'code':
            d = c.directives
            c.remove_directives()
            if d.get('output') == 'asis' and d.get('echo') == 'false':
                # Quarto inlines such outputs (show_doc's API docs) as page markdown: do the same, so their
                # headings get anchors (nbdev's doc links point at them) and join the table of contents
                new = [mk_cell(_code_headings(_tex_to_mathml(_pandoc_link_attrs(_fix_links(
                    _show_doc_classes_and_wrap(md), links, site_url)))), 'markdown') for md in _asis_markdown(c)]
                asis_ids.update(id(n) for n in new)
                cells += new
                continue
            tags = list(c.get('metadata', {}).get('tags', []))
            if d.get('include') == 'false': continue
            if not c.get('outputs') and _checks_only(c.source): continue
            if d.get('echo') == 'false' or not c.source.strip(): tags.append('remove_input')
            if d.get('output') == 'false': tags.append('remove_output')
            outs = []
            for o in c.get('outputs', []):
                data = o.get('data')
                if data is not None:
                    if _WIDGET_MIME in data: continue  # live widgets need a kernel; their plots are separate outputs
                    for k in ('text/markdown', 'text/html'):
                        if isinstance(data.get(k), str): data[k] = _fix_links(data[k], links, site_url)
                    if isinstance(data.get('text/markdown'), str): data['text/markdown'] = _tex_to_mathml(data['text/markdown'])
                outs.append(o)
            c.outputs = outs
            if 'remove_input' in tags and not outs: continue  # nothing left to show
            if tags: c.setdefault('metadata', {})['tags'] = tags
        cells.append(c)
    _anchor_headings(cells, asis_ids)
    title, desc = fm.get('title') or dst.stem, fm.get('description')
    desc = _tex_to_mathml(re.sub(r'`([^`]+)`', r'<code>\1</code>', escape(str(desc)))) if desc else ''   # as Quarto would
    head = f'# {title}' + (f'\n\n<p class="cq-description">{desc}</p>' if desc else '')
    nb.cells = [mk_cell(head, 'markdown')] + cells
    md = nb.setdefault('metadata', {})
    md.pop('widgets', None)  # widget state makes nbconvert pull the widget manager from a CDN
    md.setdefault('kernelspec', {'display_name': 'Python 3', 'language': 'python', 'name': 'python3'})
    md.setdefault('language_info', {'name': 'python'})
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_nb(nb, dst)
    return fm


def _nav_from_sidebar(contents, pages: dict[str, tuple[str, str]]) -> list:
    "MkDocs nav from nbdev's `sidebar.yml` contents (paths, `{section, contents}`, `{text, href}`)"
    nav = []
    for item in contents or []:
        if isinstance(item, str):
            if item in pages: nav.append({pages[item][1]: pages[item][0]})
        elif isinstance(item, dict) and 'section' in item:
            sub = _nav_from_sidebar(item.get('contents'), pages)
            href = item.get('href')
            if href in pages: sub.insert(0, {pages[href][1]: pages[href][0]})
            if sub: nav.append({str(item['section']): sub})
        elif isinstance(item, dict) and item.get('href') in pages:
            p = pages[item['href']]
            nav.append({str(item.get('text') or p[1]): p[0]})
    return nav


def stage(proc: Path, cfg, dest: Path) -> list:
    "Copy `proc` into `dest` for MkDocs; return the nav"
    nbs = sorted(p for p in proc.rglob('*.ipynb') if not any(s.startswith(('.', '_')) for s in p.relative_to(proc).parts))
    fms = {}
    from fastcore.nbio import read_nb, nb_frontmatter
    for p in nbs: fms[p] = nb_frontmatter(read_nb(p))
    names = {p: _page_name(p.relative_to(proc), fms[p]) for p in nbs}
    links, nbs_dir = {}, Path(cfg.nbs_path).resolve().relative_to(ROOT).as_posix()
    for p, n in names.items():
        rel = p.relative_to(proc)  # also as linked from the repo root (README.md): nbs/x.ipynb
        for key in {rel.as_posix(), rel.name, f'{nbs_dir}/{rel.as_posix()}'}: links[key] = n.with_suffix('.html').as_posix()
    site_url = f"{cfg.get('doc_host', '')}{cfg.get('doc_baseurl', '')}" if cfg.get('doc_host') else ''
    pages = {}
    for p in nbs:
        fm = _stage_notebook(p, dest/names[p], links, site_url)
        pages[p.relative_to(proc).as_posix()] = (names[p].as_posix(), str(fm.get('title') or names[p].stem))
    for f in proc.rglob('*'):  # images and other files the notebooks refer to; styles.css becomes extra_css
        rel = f.relative_to(proc)
        if (f.is_dir() or f.suffix in ('.ipynb', '.qmd') or f.name in _QUARTO_ONLY
                or any(s.startswith('.') for s in rel.parts)): continue
        (dest/rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest/rel)
    sidebar = proc/'sidebar.yml'
    contents = (yaml.safe_load(sidebar.read_text()) or {}).get('website', {}).get('sidebar', {}).get('contents') if sidebar.exists() else None
    nav = _nav_from_sidebar(contents, pages)
    listed = json.dumps(nav)
    nav += [{t: n} for k, (n, t) in pages.items() if json.dumps(n) not in listed]  # pages the sidebar misses
    if not nav: raise SystemExit(f'No notebooks found in {proc}')
    return nav


# ---------------------------------------------------------------------------------------------------
# 3. MkDocs, and what makes the built site work with no network
# Browsers refuse `new Worker(file://...)`, so under file:// Material's search worker runs in a hidden
# iframe of the page instead (what Material's `offline` plugin does with a shim it loads from a CDN).
_FILE_WORKER = 'assets/javascripts/cq-file-worker.js'
_FILE_WORKER_JS = r"""// Written by tools/build_docs.py. Under file://, runs a Worker's script in a hidden same-origin iframe.
if (location.protocol === "file:") window.Worker = class extends EventTarget {
  constructor(url) {
    super();
    const frame = document.createElement("iframe");
    frame.hidden = true;
    document.documentElement.appendChild(frame);
    const w = frame.contentWindow, base = new URL(url, location.href), load = src => new Promise((ok, fail) => {
      const s = w.document.createElement("script");
      s.src = new URL(src, base).href; s.onload = ok; s.onerror = () => fail(new Error(`cannot load ${s.src}`));
      w.document.head.appendChild(s);
    });
    w.postMessage = data => setTimeout(() => this.dispatchEvent(new MessageEvent("message", {data})));
    w.importScripts = (...srcs) => srcs.reduce((p, src) => p.then(() => load(src)), Promise.resolve());
    this.frame = frame;
    this.ready = load(base.href);
  }
  postMessage(data) {
    this.ready.then(() => this.frame.contentWindow.dispatchEvent(new MessageEvent("message", {data})));
  }
  terminate() { this.frame.remove(); }
};
"""


def _relative_404(html: str) -> str:
    "MkDocs writes 404.html with site-absolute links (`/x`): make them relative to the site root, where it lies"
    html = re.sub(r'((?:href|src)="|"search": ")/(?!/)', r'\1', html)  # "search": Material's search worker
    return html.replace('"base": "/"', '"base": "."').replace('__md_scope=new URL("/"', '__md_scope=new URL("."')


def _no_mathjax(html: str) -> str:
    "Without mkdocs-jupyter's MathJax (from a CDN): the TeX is MathML already, and no request leaves the page"
    return re.sub(r'<!-- Load mathjax -->.*?<!-- End of mathjax configuration -->', '', html, flags=re.S)


_FORMAT_PAGE_BOOST = 2   # Material's `search.boost` of a format's own page: searching `nvfp4` opens the NVFP4 page first


def _format_pages() -> set:
    "The pages of the notebooks that define formats (their modules, as the registry finds them): `{'nvfp4.html', ...}`"
    from nbdev.config import get_config, nbpath2html
    from nbdev.doclinks import nbglob
    from fastcore.nbio import read_nb
    sys.path.insert(0, str(ROOT))
    from cquant.formats import format_module_names
    cfg, mods, out = get_config(ROOT), set(format_module_names()), set()
    for nb in nbglob(cfg.nbs_path, as_path=True, skip_file_re='^[_.]'):
        exp = next((c.directive('default_exp') for c in read_nb(nb).cells if c.cell_type == 'code' and c.directive('default_exp')), None)
        if exp and exp.split()[0] in mods: out.add(nbpath2html(nb.relative_to(cfg.nbs_path)).as_posix())
    return out


def finish_site(out: Path) -> None:
    "Post-build fixes: the search index as a script (read under file://), format pages boosted, relative 404 links, no CDN"
    index = out/'search'/'search_index.json'
    if index.exists():
        data, boosted = json.loads(index.read_text(encoding='utf-8')), _format_pages()
        for d in data['docs']:
            d['title'] = d['title'].replace('\u00b6', '').strip()  # mkdocs-jupyter's permalink sign
            if d['location'].split('#')[0] in boosted: d['boost'] = _FORMAT_PAGE_BOOST
        index.write_text(text := json.dumps(data, ensure_ascii=False), encoding='utf-8')
        (out/'search'/'search_index.js').write_text('var __index = ' + text, encoding='utf-8')
    for page in out.glob('**/*.html'):
        html = page.read_text(encoding='utf-8')
        new = _no_mathjax(_relative_404(html) if page == out/'404.html' else html)
        if new != html: page.write_text(new, encoding='utf-8')


def build(out: Path, n_workers: int | None = None, quiet: bool = False) -> Path:
    t0 = time.time()
    proc, cfg = nbdev_process(n_workers)
    _log(f'nbdev processed notebooks into {proc.relative_to(ROOT)}/ in {time.time()-t0:.1f}s')
    t1 = time.time()
    with tempfile.TemporaryDirectory(prefix='cquant-docs-') as tmp:
        src = Path(tmp)/'pages'
        nav = stage(proc, cfg, src)
        site_cfg = {
            'INHERIT': str(BASE_CONFIG),
            'site_name': str(cfg.get('title') or cfg.get('lib_name')),
            'site_description': str(cfg.get('description', '')),
            'docs_dir': str(src), 'site_dir': str(out),
            'nav': nav,
        }
        (src/_FILE_WORKER).parent.mkdir(parents=True, exist_ok=True)
        (src/_FILE_WORKER).write_text(_FILE_WORKER_JS)
        site_cfg['extra'] = {'polyfills': [_FILE_WORKER]}  # in <head>, before Material starts its search worker
        if (src/'styles.css').exists(): site_cfg['extra_css'] = ['styles.css']
        # the repository as a footer link: `repo_url` would make every page ask the GitHub API for its stars
        if cfg.get('git_url'): site_cfg['extra']['social'] = [{'icon': 'fontawesome/brands/github', 'link': cfg.git_url}]
        cfg_file = Path(tmp)/'mkdocs.yml'
        cfg_file.write_text(yaml.safe_dump(site_cfg, sort_keys=False))
        cmd = [sys.executable, '-m', 'mkdocs', 'build', '--clean', '-f', str(cfg_file)] + (['-q'] if quiet else [])
        # NO_MKDOCS_2_WARNING: Material's end-of-life notice, printed on every build, is not about this site
        subprocess.run(cmd, check=True, cwd=tmp, env={**os.environ, 'NO_MKDOCS_2_WARNING': '1'})
    finish_site(out)
    _log(f'mkdocs rendered {len(list(out.glob("**/*.html")))} pages into {out} in {time.time()-t1:.1f}s')
    _log(f'open file://{(out/"index.html").resolve()}  (total {time.time()-t0:.1f}s)')
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--out', type=Path, default=None, help="output folder (default: nbdev's doc_path, _docs/)")
    ap.add_argument('--n-workers', type=int, default=None, help='workers for nbdev notebook processing')
    ap.add_argument('-q', '--quiet', action='store_true', help='quieter: mkdocs prints errors only')
    ap.add_argument('--force', action='store_true',
                    help="reprocess every notebook (nbdev otherwise only reprocesses notebooks newer than _proc/)")
    a = ap.parse_args(argv)
    if a.force: shutil.rmtree(ROOT/'_proc', ignore_errors=True)
    out = a.out
    if out is None:
        from nbdev.config import get_config
        out = get_config(ROOT).doc_path
    build(Path(out).resolve(), a.n_workers, a.quiet)


if __name__ == '__main__': main()
