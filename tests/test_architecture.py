"""Architecture rules of issue 15: every per-format fact lives in the format's declaration, and nothing outside
the format modules tests a format's name."""
import ast, functools, inspect, json, re
from pathlib import Path
import pytest
import torch
import cquant as cq
from cquant import comfy, modules, tensor
from cquant.calibrate import search_smoothing
from cquant.formats import format_module_names

PKG = Path(cq.__file__).parent
FORMAT_MODULES = {f'{m}.py' for m in format_module_names()} | {'tensor.py', '_modidx.py'}   # found by their declarations
GENERATED = {'_modidx.py'}   # nbdev's index, written from the notebooks
# (file, top-level name assigned) -> why a format name may appear there as a string constant
QUANTOPS = {'float8_e4m3fn_rowwise', 'float8_e4m3fn_blockwise', 'int8_blockwise', 'hybrid_mxfp8'}   # ComfyUI-QuantOps' formats
ALLOWED = set()      # none: the policy modes named after a format take the name from its declaration (NVFP4.name)


def _assigned(stmt) -> set:
    "Names a top-level statement binds (assignments, defs, classes)."
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): return {stmt.name}
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else []
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def format_name_constants() -> list:
    "`file:line: name` of every string constant equal to a registered format name outside the format modules."
    names, hits = set(cq.FORMATS), []
    for p in sorted(PKG.glob('*.py')):
        if p.name in FORMAT_MODULES | GENERATED: continue
        for stmt in ast.parse(p.read_text(), str(p)).body:
            if any((p.name, n) in ALLOWED for n in _assigned(stmt)): continue
            hits += [f'{p.name}:{n.lineno}: {n.value!r}' for n in ast.walk(stmt)
                     if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names]
    return hits


def test_no_format_names_outside_format_modules():
    hits = format_name_constants()
    assert not hits, 'format names outside the format modules (ask cquant.tensor.FORMATS instead):\n' + '\n'.join(hits)


def format_importers(graph:dict) -> dict:
    "`{module: [format modules it imports]}` for the modules outside the format layer (the package re-exports aside)."
    fm = set(format_module_names())
    return {m: sorted(ts & fm) for m, ts in graph.items() if m not in fm | {'formats', '__init__'} and ts & fm}


def test_a_format_touches_only_its_own_files():
    "No module outside the format layer imports a format: the policy's choices and modes come from the declarations."
    assert format_importers(import_graph()[0]) == {}
    assert format_importers({'policy': {'fp8', 'tensor'}, 'w4a4': {'int8'}}) == {'policy': ['fp8']}   # not vacuous


def test_the_check_finds_a_name(tmp_path, monkeypatch):
    "The scanner is not vacuous: a planted name test is reported with its line."
    (tmp_path / 'planted.py').write_text("x = 1\nif x == 'nvfp4': pass\n")
    monkeypatch.setattr(f'{__name__}.PKG', tmp_path)
    assert format_name_constants() == ["planted.py:2: 'nvfp4'"]


def test_declared_facts_reproduce_the_old_tables():
    "The declarations give exactly what the removed side tables said (behaviour unchanged)."
    F = cq.FORMATS
    flag = lambda fact: {n for n, s in F.items() if getattr(s, fact)}
    assert flag('embedding') == {'float8_e4m3fn', 'float8_e5m2', 'int8_tensorwise'}
    assert flag('row_gather') == flag('embedding') | {'float8_e4m3fn_rowwise'}
    assert {n for n, s in F.items() if s.rows_independent({})} == {'convrot_w4a4', 'asym_w4a8_int8', 'w6a8_int8', 'awq_w4a16',
                                                                   'float8_e4m3fn_rowwise', 'mxfp8'}
    assert F['int8_tensorwise'].rows_independent({'convrot': True}) and F['int8_tensorwise'].rows_independent({'per_row': True})
    assert {n for n, s in F.items() if s.bank_is_flat({})} == {'asym_w4a8_int8', 'w6a8_int8'}
    i8 = F['int8_tensorwise']
    assert i8.bank_is_flat({'per_row': True}) and not i8.bank_is_flat({'per_row': True}, {'weight_scale': torch.ones(())})
    assert i8.bank_is_flat({}, {'weight_scale': torch.ones(2, 3, 1)})
    assert {n: s.storage.row_assembly for n, s in F.items() if s.storage.row_assembly} == {
        'asym_w4a8_int8': {'weight_codebook': 'shared', 'weight_correction': 1},
        'awq_w4a16': {'weight_scale': 1, 'weight_zeros': 1},
        'float8_e4m3fn': {'weight_scale': 'shared'}, 'float8_e5m2': {'weight_scale': 'shared'},   # a given scale: rows alone
        'nvfp4': {'weight_scale_2': 'shared'}}
    assert F['float8_e4m3fn'].rows_independent({'scale': 0.5}) and {n for n, s in F.items() if s.declares('tensor_options')} == {
        'float8_e4m3fn', 'float8_e5m2', 'nvfp4'}
    assert {n: s.storage.row_block for n, s in F.items() if s.storage.row_block != 1} == {'nvfp4': 128, 'mxfp8': 128}
    assert {n: s.activations.scale_rule.divisor for n, s in F.items() if s.activations.scale_rule} == {
        'float8_e4m3fn': 448.0, 'float8_e5m2': 57344.0, 'nvfp4': 2688}
    assert {n for n, s in F.items() if s.activations.smoothing} == {'nvfp4'}
    assert {n for n, s in F.items() if s.activations.dynamic_reason} == {'mxfp8'} | QUANTOPS
    assert {n: s.loader.unread for n, s in F.items() if s.loader.unread} == {'asym_w4a8_int8': ('weight_correction',)}
    assert {n for n, s in F.items() if not s.loader.registered} == {'svdquant_w4a4'} | QUANTOPS
    assert {s.loader.node for n, s in F.items() if n in QUANTOPS} == {'ComfyUI-QuantOps'}
    assert [l for _, s in F.items() for l, _ in s.study_variants] == ['int8_per_row', 'int8_convrot16', 'int8_convrot64', 'int8_convrot256']


def test_native_compute_follows_comfyui(monkeypatch):
    "ComfyUI's disabled formats per device, from each format's native_compute (CUDA faked: capability and torch version)."
    always = {'awq_w4a16', 'svdquant_w4a4'}    # kitchen's eager code runs them: ComfyUI disables them on no device
    every = set(cq.FORMATS) - always
    ints = {'int8_tensorwise', 'convrot_w4a4', 'asym_w4a8_int8', 'w6a8_int8'}
    cuda_only, qo_fp8 = {'int8_blockwise'}, QUANTOPS - {'int8_blockwise'}    # QuantOps' Triton kernels (FP8: sm 8.9+)
    assert modules.comfy_disabled_formats('cpu') == every - ints
    assert modules.comfy_disabled_formats('xpu') == every
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.version, 'cuda', '12.8')
    for cc, tv, off in [((8, 6), (2, 9), every - ints - cuda_only), ((8, 9), (2, 9), {'nvfp4', 'mxfp8'}),
                        ((10, 0), (2, 9), {'mxfp8'}), ((12, 0), (2, 10), set()),
                        ((8, 9), (2, 2), every - ints - cuda_only - qo_fp8)]:
        monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda d=None, cc=cc: cc)
        monkeypatch.setattr(tensor, 'torch_version', lambda tv=tv: tv)
        assert modules.comfy_disabled_formats('cuda') == off, (cc, tv)


def test_min_sm_version_matches_kitchen():
    ck = pytest.importorskip('comfy_kitchen.tensor')
    for n, s in cq.FORMATS.items():
        if s.kitchen_layout: assert s.layout.MIN_SM_VERSION == getattr(ck, s.kitchen_layout).MIN_SM_VERSION, n


def test_one_comfy_quant_check():
    "tensor.load_quantized, comfy.read_comfy_quant and the checkpoint scan share check_comfy_quant's messages."
    sd = {'m.comfy_quant': cq.encode_json(['nvfp4']), 'm.weight': torch.zeros(2, 2)}
    for f in (lambda: cq.load_quantized(sd, 'm'), lambda: comfy.read_comfy_quant(sd, 'm')):
        with pytest.raises(cq.QuantFormatError, match=r"'m\.comfy_quant': expected a JSON object, found list \['nvfp4'\]"): f()
    with pytest.raises(cq.QuantFormatError, match='expected a "format" field, found keys'): tensor.check_comfy_quant({'params': {}}, 'm.')


def test_plan_entry_is_the_one_normaliser():
    pe = modules.plan_entry
    assert pe(None) == (None, {}, False, 'float')
    assert pe(('int8_tensorwise', {'per_row': True})) == ('int8_tensorwise', {'per_row': True}, False, 'int8_tensorwise')
    assert pe({'format': 'int8_tensorwise', 'convrot': True, 'full_precision_matrix_mult': True})[:3] == \
        ('int8_tensorwise', {'convrot': True}, True)
    with pytest.raises(cq.QuantFormatError, match='layer_sqnr: plan entry'): pe('fp8', 'layer_sqnr')


def test_smoothing_search_needs_a_declared_format():
    w, x = torch.randn(32, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="'float8_e4m3fn' declares no smoothing search"): search_smoothing(w, x, fmt='float8_e4m3fn')


# ---- Issue 15, second rule: imports run one way, each layer only downwards ----
# Layers, lowest first. A module may import modules of its own layer or of a lower one (and no cycle), never a higher one;
# the package itself (`import cquant`, i.e. `__init__`) is above every layer.
LAYERS = (
    ('core', {'_version', 'plain', 'runtime', 'numerics', 'tensor'}),
    ('formats', {*format_module_names(), 'formats'}),
    ('attention methods', {'sol_attention', 'int8_attention'}),
    ('comfy vocabulary', {'comfy', 'attention_config'}),
    ('checkpoint and modules', {'gguf', 'checkpoint', 'attention', 'modules'}),
    ('models', {'models', 'minilm'}),
    ('validation', {'validate'}),
    ('calibration and policy', {'calibrate', 'record', 'policy', 'recipe', 'rounding'}),
    ('plots', {'plots'}),
    ('jobs', {'jobs', 'lora'}),
    ('on top', {'explore', 'explorer', 'quality', 'evaluate', 'attention_explore', 'compare'}),
    ('cli', {'cli'}),          # a command runs whatever it needs, the comparison of every format included
    ('package', {'__init__'}),
)
RANK = {m: i for i, (_, ms) in enumerate(LAYERS) for m in ms}
# (file, imported cquant module) allowed inside a function: the Triton fast paths, enabled only where triton and CUDA are
FUNCTION_LEVEL_OK = {('__init__', 'kernels.dispatch'),
                     ('cli', '__init__')}     # main, once the arguments parse: the whole API, as `import cquant as cq` gives it
# modules whose function-level imports are their design (still held to the layers): the CLI imports what a command runs
# when it runs, so --help, --version and usage errors answer without torch (issue 42)
DEFERRING = {'cli'}


def _targets(node, here:str) -> list:
    "The cquant modules (dotted, relative to the package; '__init__' for the package) that an import statement names."
    if isinstance(node, ast.Import):
        return [a.name.partition('.')[2] or '__init__' for a in node.names if a.name.split('.')[0] == 'cquant']
    if node.level == 0 and (node.module or '').split('.')[0] != 'cquant': return []
    base = node.module if node.level else node.module.partition('.')[2]
    if base: return [base]
    return [a.name for a in node.names] if (node.level or node.module == 'cquant') else []


@functools.lru_cache(maxsize=None)
def import_graph(pkg:Path=None) -> tuple:
    """({module: {modules it imports at module level}}, ['file:line: imported'] for imports inside functions) of pkg/*.py
    (parsed once per folder: three tests read it)."""
    graph, inner = {}, []
    for p in sorted((pkg or PKG).glob('*.py')):
        if p.name == '_modidx.py': continue
        tree, here = ast.parse(p.read_text(), str(p)), p.stem
        in_fn = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                 for n in ast.walk(f) if n is not f}
        graph[here] = set()
        for n in ast.walk(tree):
            if not isinstance(n, (ast.Import, ast.ImportFrom)): continue
            for t in _targets(n, here):
                if id(n) in in_fn and (here, t) in FUNCTION_LEVEL_OK: continue
                if id(n) in in_fn and here not in DEFERRING: inner.append(f'{p.name}:{n.lineno}: {t}')
                else: graph[here].add(t.split('.')[0])
    return graph, inner


def cycles(graph:dict) -> list:
    "Every import cycle, as a path a -> ... -> a (one per cycle found by depth-first search)."
    found, state = [], {}
    def visit(m, path):
        state[m] = 'open'
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 'open': found.append(' -> '.join(path[path.index(t):] + [t]))
            elif t not in state: visit(t, path + [t])
        state[m] = 'done'
    for m in sorted(graph):
        if m not in state: visit(m, [m])
    return found


def upward(graph:dict) -> list:
    "`a -> b (layer of a < layer of b)` for every import of a higher layer, and modules missing from LAYERS."
    bad = [f'{m}: not in LAYERS' for m in sorted(set(graph) | {t for ts in graph.values() for t in ts}) if m not in RANK]
    name = lambda m: LAYERS[RANK[m]][0]
    return bad + [f'{m} -> {t} ({name(m)} imports {name(t)})' for m, ts in sorted(graph.items()) for t in sorted(ts)
                  if m in RANK and t in RANK and RANK[t] > RANK[m]]


def test_layers_name_every_module():
    assert set(import_graph()[0]) == set(RANK), set(import_graph()[0]) ^ set(RANK)


def test_no_import_cycles():
    found = cycles(import_graph()[0])
    assert not found, 'import cycles:\n' + '\n'.join(found)


def test_imports_only_go_down():
    bad = upward(import_graph()[0])
    assert not bad, 'imports of a higher layer:\n' + '\n'.join(bad)


def test_no_function_level_imports_of_cquant():
    "A function importing a cquant module hides a dependency (and often a cycle); only the optional kernels may."
    inner = import_graph()[1]
    assert not inner, 'cquant imports inside functions (import at module level, or move the code down a layer):\n' + '\n'.join(inner)


def test_the_import_checks_find_violations(tmp_path):
    "The checks are not vacuous: a planted cycle, an upward import and a function-level import are reported."
    (tmp_path / 'tensor.py').write_text('from .checkpoint import load_file\n')                   # core -> checkpoint
    (tmp_path / 'checkpoint.py').write_text('import torch\nfrom cquant.tensor import FORMATS\n'
                                            'def f():\n    from cquant import policy\n')
    (tmp_path / 'fp8.py').write_text('from . import int8, tensor\nimport cquant\n')
    (tmp_path / 'int8.py').write_text('from .fp8 import x\n')
    g, inner = import_graph(tmp_path)
    assert g == {'checkpoint': {'tensor'}, 'fp8': {'int8', 'tensor', '__init__'}, 'int8': {'fp8'}, 'tensor': {'checkpoint'}}
    assert cycles(g) == ['checkpoint -> tensor -> checkpoint', 'fp8 -> int8 -> fp8']
    assert upward(g) == ['fp8 -> __init__ (formats imports package)', 'tensor -> checkpoint (core imports checkpoint and modules)']
    assert inner == ['checkpoint.py:4: policy']


def defined_twice(src:str) -> list:
    """Module-level names bound more than once in `src` (functions, classes, assignments); a fastcore `@patch` function
    counts as `Class.name`, the method it adds."""
    seen = {}
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name, args = node.name, getattr(node, 'args', None)
            patched = any(isinstance(d, ast.Name) and d.id == 'patch' for d in node.decorator_list)
            if patched and args and args.args and args.args[0].annotation is not None:
                name = f'{ast.unparse(args.args[0].annotation)}.{name}'
            names = [name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
        else: continue
        for n in names: seen.setdefault(n, []).append(node.lineno)
    return sorted(f'{n} (lines {", ".join(map(str, ls))})' for n, ls in seen.items() if len(ls) > 1)


def test_no_name_defined_twice_in_a_module():
    "Issue 41: a second definition silently shadows the first (two notebook cells exporting one name)."
    bad = [f'{f.name}: {d}' for f in sorted(Path(cq.__file__).parent.rglob('*.py')) for d in defined_twice(f.read_text())]
    assert not bad, 'names bound twice at module level:\n' + '\n'.join(bad)
    planted = 'def f(x): pass\n@patch\ndef g(self:A): pass\n@patch\ndef g(self:B): pass\nX = 1\nX = {k: 1 for k in X}\ndef f(): pass\n'
    assert defined_twice(planted) == ['X (lines 6, 7)', 'f (lines 1, 8)']

# ---- Issue 41: notebooks in fastcore's rhythm, prose in short cells next to the code it explains ----
PROSE_CAP, STRETCH_CAP = 200, 250   # words in one markdown cell; in the prose between two code cells (tables included)
LANDING = {'index.ipynb'}           # the home page: a map of the other pages, prose by design (one cell cap only)


def long_prose(paths) -> list:
    "`notebook id: words` of each markdown cell over PROSE_CAP words and each stretch of prose (its first cell) over STRETCH_CAP."
    out = []
    for p in paths:
        cells, run = json.loads(p.read_text(encoding='utf-8'))['cells'], None
        for c in cells + [{'cell_type': 'code'}]:
            if c['cell_type'] != 'markdown':
                if run and run[1] > STRETCH_CAP and p.name not in LANDING: out.append(f'{p.name} {run[0]}: {run[1]} words before the next code')
                run = None; continue
            n = len(re.findall(r'\S+', ''.join(c['source'])))
            if n > PROSE_CAP: out.append(f"{p.name} {c.get('id')}: {n} words in one cell")
            run = [run[0], run[1] + n] if run else [c.get('id'), n]
    return out


def test_prose_reads():
    long = long_prose(sorted((PKG.parent/'nbs').glob('*.ipynb')))
    assert not long, f'split or move this prose to the code it explains, or show its claim in a small check cell: {long}'


def test_the_prose_check_finds_long_prose(tmp_path):
    cell = lambda n, kind='markdown': {'cell_type': kind, 'id': f'c{n}', 'metadata': {}, 'source': ['word ' * n]}
    nb = tmp_path/'x.ipynb'
    nb.write_text(json.dumps({'cells': [cell(PROSE_CAP), cell(500, 'code'), cell(PROSE_CAP + 1), cell(9), cell(41), cell(3, 'code')]}))
    assert long_prose([nb]) == [f'x.ipynb c{PROSE_CAP + 1}: {PROSE_CAP + 1} words in one cell',
                                f'x.ipynb c{PROSE_CAP + 1}: {PROSE_CAP + 51} words before the next code']
    (tmp_path/'index.ipynb').write_text(nb.read_text())
    assert long_prose([tmp_path/'index.ipynb']) == [f'index.ipynb c{PROSE_CAP + 1}: {PROSE_CAP + 1} words in one cell']

# ---- Issue 15, third rule: `import cquant as cq` shows the public API (256: room for the third wave's contract names) ----
# SPEC §2 (and the §4 names that exist so far): the contract that checks outside the project call
SPEC_NAMES = ('FORMATS', 'quantize', 'QuantizedTensor', 'encode_json', 'decode_json', 'load_quantized', 'load_file',
              'save_file', 'quantize_checkpoint', 'Policy', 'load_quantized_model')


def public_names(mod=cq) -> set:
    "The names `dir(mod)` shows a user, less the submodules."
    return {n for n in dir(mod) if not n.startswith('_') and not inspect.ismodule(getattr(mod, n))}


def test_public_api_is_small_and_complete():
    names = public_names()
    assert not [n for n in SPEC_NAMES if n not in names]
    internals = sorted(n for n in names if n.startswith(('cmd_', 'add_', 'check_')) or n.endswith('_parser'))
    assert not internals, f'CLI internals and argument checkers in cq.: {internals}'
    assert len(names) <= 256, f'{len(names)} public names: trim the modules\' __all__ (#| exporti for helpers)'


def test_every_public_name_is_documented():
    "Each public function and class carries a docstring (what `doc(cq.x)` shows)."
    bare = sorted(n for n in public_names() if callable(o := getattr(cq, n)) and (inspect.isfunction(o) or inspect.isclass(o))
                  and o.__module__.startswith('cquant') and not inspect.getdoc(o))
    assert not bare, f'public names without a docstring: {bare}'
