"""Recipe files (issue 21): YAML / TOML compiled to the one Policy, errors naming file:line: key, the nothing-matched
warning, round trips (policy and plan recipes), the CLI (`cquant recipe`, `plan --recipe`, `quantize --recipe`) and the
recipe recorded in the output's metadata."""
import json, warnings
import pytest
import torch
import cquant as cq
from cquant.checkpoint import read_header
from cquant.cli import main
from cquant.jobs import quantize_checkpoint
from cquant.models import dit_state_dict
from cquant.policy import PRESETS, Policy, PolicyWarning, krea2_names, rule_matches
from cquant.recipe import RecipeError, plan_policy, plan_recipe, preset_example, read_recipe

SD = dit_state_dict(0)
SHAPES = {k[:-len('.weight')]: tuple(v.shape) for k, v in SD.items() if k.endswith('.weight') and v.ndim == 2}

EVERY_KIND = """\
mode: int4_mixed
preset: none
ratio: 0.25
selection: structural
rounding: nearest
convrot_groupsize: 256
int4_sensitive: [attn.proj]
keep_float: [final_layer]
exclude: ['*.adaLN_modulation.*', 're:^t_embed\\.mlp\\.0$']
fallback: int8
rules:
  - {match: 'blocks.*.attn.qkv', format: w4a8, options: {group_size: 16}}
  - {match: 're:mlp\\.fc[12]$', format: int8_tensorwise, options: {per_row: true}}
  - {contains: moe.experts, format: float}
  - {match: patch_embed, format: convrot_w4a4}
  - {match: 'blocks.3.*', format: fp8}
"""

EVERY_KIND_TOML = """\
mode = "int4_mixed"
preset = "none"
ratio = 0.25
selection = "structural"
rounding = "nearest"
convrot_groupsize = 256
int4_sensitive = ["attn.proj"]
keep_float = ["final_layer"]
exclude = ["*.adaLN_modulation.*", 're:^t_embed\\.mlp\\.0$']
fallback = "int8"
[[rules]]
match = "blocks.*.attn.qkv"
format = "w4a8"
options = {group_size = 16}
[[rules]]
match = 're:mlp\\.fc[12]$'
format = "int8_tensorwise"
options = {per_row = true}
[[rules]]
contains = "moe.experts"
format = "float"
[[rules]]
match = "patch_embed"
format = "convrot_w4a4"
[[rules]]
match = "blocks.3.*"
format = "fp8"
"""


def decisions(plan) -> dict: return {n: (d.format, d.options, d.rounding) for n, d in plan.items()}


def quiet(f, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', PolicyWarning)
        return f(*a, **k)


@pytest.fixture
def recipe_file(tmp_path):
    p = tmp_path / 'every.yaml'
    p.write_text(EVERY_KIND)
    return p


def test_every_rule_kind(recipe_file):
    p = Policy.from_recipe(recipe_file)
    assert [o[0] for o in p.overrides] == ['glob:*.adaLN_modulation.*', 're:^t_embed\\.mlp\\.0$', 'glob:blocks.*.attn.qkv',
                                           're:mlp\\.fc[12]$', 'moe.experts', 'glob:patch_embed', 'glob:blocks.3.*']
    assert p.overrides[2][1:] == ('asym_w4a8_int8', (('group_size', 16),))           # the alias w4a8 resolved
    assert (p.int4_mixed_ratio, p.keep_float, p.int4_sensitive, p.fallback) == (0.25, ('final_layer',), ('attn.proj',), 'int8')
    assert p.origins[0] == f'{recipe_file}:9: exclude[0]' and p.origins[6] == f'{recipe_file}:16: rules[4]'
    plan = p.plan(SHAPES)
    t = lambda n: (plan[n].format, plan[n].tier)
    assert t('blocks.0.adaLN_modulation.1') == (None, 'override') and t('t_embed.mlp.0') == (None, 'override')
    assert t('t_embed.mlp.2')[1] != 'override'                                        # the regex is anchored
    assert plan['blocks.3.attn.qkv'].format == 'asym_w4a8_int8'                       # first match wins over blocks.3.*
    assert plan['blocks.3.attn.proj'].format == 'float8_e4m3fn' and plan['blocks.2.attn.proj'].tier != 'override'
    assert (plan['blocks.1.mlp.fc2'].format, plan['blocks.1.mlp.fc2'].options) == ('int8_tensorwise', {'per_row': True})
    assert {t(n) for n in SHAPES if 'moe.experts' in n} == {(None, 'override')}
    assert t('final_layer.linear') == (None, 'keep_float') and t('final_layer.adaLN_modulation.1') == (None, 'override')
    assert t('patch_embed') == ('int8_tensorwise', 'fallback')
    assert plan['patch_embed'].reason.startswith("override 'glob:patch_embed': convrot_w4a4 does not fit: weight: K=16")
    assert plan['patch_embed'].reason.endswith('; fallback int8: INT8')


def test_fallback_explicit_in_the_plan():
    "Without a fallback a rejected rule fails the plan (as before); keep_float and int8 take the layer, saying why."
    rule = "preset: none\nrules:\n  - {match: patch_embed, format: convrot_w4a4}\n"
    with pytest.raises(cq.QuantFormatError, match="asks for convrot_w4a4 on 'patch_embed'.*a fallback keep_float or int8"):
        Policy.from_recipe(rule).plan(SHAPES)
    kf = Policy.from_recipe(rule + 'fallback: keep_float\n').plan(SHAPES)['patch_embed']
    assert (kf.format, kf.tier) == (None, 'fallback') and 'K=16 (K % 64 = 16)' in kf.reason and kf.reason.endswith('; fallback keep_float')
    i8 = Policy.from_recipe(rule + 'fallback: int8\n').plan(SHAPES)['patch_embed']
    assert (i8.format, i8.options, i8.tier) == ('int8_tensorwise', {'per_row': True}, 'fallback')


def test_yaml_and_toml_compile_to_the_same_policy(recipe_file, tmp_path):
    t = tmp_path / 'every.toml'
    t.write_text(EVERY_KIND_TOML)
    assert Policy.from_recipe(t) == Policy.from_recipe(recipe_file) == Policy.from_recipe(EVERY_KIND)
    assert Policy.from_recipe(t).origins[2] == f'{t}: rules[0]'                       # tomllib gives no lines


@pytest.mark.parametrize('text, message', [
    ("mode: int8\nratoi: 0.2\n", "{f}:2: ratoi: unknown key (did you mean 'ratio'?)"),
    ("rules:\n  - {match: x, format: nvfp5}\n", "{f}:2: rules[0].format: unknown format 'nvfp5' (did you mean 'nvfp4'?)"),
    ("rules:\n  - match: x\n    format: w4a8\n    options: {group_size: '16'}\n",
     "{f}:4: rules[0].options.group_size: expected int, found str '16'"),
    ("rules:\n  - match: x\n    format: int8\n    options:\n      per_row: 1\n",
     "{f}:5: rules[0].options.per_row: expected bool, found int 1"),
    ("rules:\n  - {match: x, format: w4a8, options: {groupsize: 16}}\n",
     "{f}:2: rules[0].options.groupsize: not an option of asym_w4a8_int8 (did you mean 'group_size'"),
    ("rules:\n  - {match: 're:blocks.(', format: float}\n", "{f}:2: rules[0].match: invalid regular expression 'blocks.('"),
    ("exclude: [a, 're:[']\n", "{f}:1: exclude[1]: invalid regular expression '['"),
    ("rules:\n  - {match: x, fromat: float}\n", "{f}:2: rules[0].fromat: unknown rule key (did you mean 'format'?)"),
    ("rules:\n  - {contains: x, format: float, options: {per_row: true}}\n",
     "{f}:2: rules[0].options: options {{'per_row': True}} given to a rule that keeps layers float"),
    ("rules:\n  - {format: float}\n", "{f}:2: rules[0]: expected one of match (a glob, or re:REGEX) and contains"),
    ("mode: int8\n\nfallback: fp8\n", "{f}:3: fallback: expected None or one of ['keep_float', 'int8'], found 'fp8'"),
    ("mode: int9\n", "{f}:1: mode: expected one of ['fp8', 'nvfp4'"),
    ("keep_float: ['']\n", "{f}:1: keep_float: expected non-empty strings"),
    ("mode: int8\nmode: fp8\n", "{f}:2: mode: duplicate key"),
    ("mode: int8\nrules: [\n", "{f}:3: invalid YAML: expected the node content"),
    ("- mode\n", "{f}:1: recipe: expected a mapping of recipe keys, found list"),
])
def test_errors_name_file_line_key(tmp_path, text, message):
    f = tmp_path / 'r.yaml'
    f.write_text(text)
    with pytest.raises(RecipeError) as e: Policy.from_recipe(f)
    assert str(e.value).startswith(message.format(f=f)), str(e.value)


def test_toml_and_path_errors(tmp_path):
    t = tmp_path / 'r.toml'
    t.write_text('[[rules]]\nmatch = "x"\nformat = "int4"\noptions = {linear_dtype = 4}\n')
    assert read_recipe(t) == ({'rules': [{'match': 'x', 'format': 'int4', 'options': {'linear_dtype': 4}}]}, {}, str(t))
    with pytest.raises(RecipeError, match=r"r\.toml: rules\[0\]\.options\.linear_dtype: expected str, found int 4"):
        Policy.from_recipe(t)
    t.write_text('mode = \n')
    with pytest.raises(RecipeError, match=r"r\.toml: invalid TOML: .*line 1"): Policy.from_recipe(t)
    with pytest.raises(RecipeError, match=r"r\.json: expected a recipe file ending in \.yaml, \.yml, \.toml"):
        Policy.from_recipe(tmp_path / 'r.json')
    with pytest.raises(RecipeError, match=r"missing\.yaml: no such recipe file"): Policy.from_recipe(tmp_path / 'missing.yaml')
    data, lines, name = read_recipe('mode: fp8\nrules: []\n')
    assert (data, lines[('rules',)], name) == ({'mode': 'fp8', 'rules': []}, 2, '<recipe>')


def test_rule_matching_nothing_warns_with_its_line(tmp_path):
    f = tmp_path / 'r.yml'
    f.write_text("preset: none\nexclude: [nothing.here]\nrules:\n  - {match: 'blocks.*.attn.qkv', format: float}\n"
                 "  - {contains: qvk, format: float}\n")
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        Policy.from_recipe(f).plan(SHAPES)
    assert [str(w.message) for w in ws if w.category is PolicyWarning] == [
        f"{f}:2: exclude[0]: override 'glob:nothing.here' matches no layer (of {len(SHAPES)})",
        f"{f}:5: rules[1]: override 'qvk' matches no layer (of {len(SHAPES)})"]


@pytest.mark.parametrize('policy', [
    Policy(),
    Policy.from_recipe(EVERY_KIND),
    Policy('svdquant', 'krea2', 0.5, ('a',), ('b', 'c'), 'measured', [('x', None), ('glob:y.*', 'w6a8_int8', {'group_size': 32})],
           'auto', 'mse', 16, 'keep_float'),
    Policy('w4a8', 'hidream', rounding='gptq', overrides=[("re:^it's: \"quoted\" #x$", 'float8_e5m2')]),
])
def test_policy_round_trip(policy):
    text = policy.to_recipe()
    assert Policy.from_recipe(text) == policy
    assert Policy.from_recipe(Policy.from_recipe(text).to_recipe()).to_recipe() == text


def test_plan_recipe_dit():
    "The recipe of a plan gives every layer of the DiT state dict the same decision when planned again."
    plan = quiet(Policy().plan, SD)                           # auto: the conservative union, with an INT8 budget
    text = plan.to_recipe()
    assert text == plan_recipe(plan) and 'The plan this recipe writes: mode int4_mixed, preset auto' in text
    assert "  - {match: blocks.*.attn.qkv, format: convrot_w4a4, options: {convrot_groupsize: 256}}" in text.splitlines()
    again = Policy.from_recipe(text)
    assert again.preset == 'auto-conservative'                # the resolved preset: no detection warning the second time
    with warnings.catch_warnings():
        warnings.simplefilter('error', PolicyWarning)          # and no rule that matches nothing
        replanned = again.plan(SD)
    assert decisions(replanned) == decisions(plan)
    assert all(d.tier == 'override' for n, d in replanned.items() if plan[n].tier != 'ineligible')
    budget = [n for n in plan.selected() if n.startswith('blocks.')]
    assert budget and all(f"  - {{match: {n}, format: int8_tensorwise" in text for n in budget)   # exceptions: own rules
    assert quiet(Policy(rounding='mse').plan, SD).to_recipe().count('rounding: mse') == 1


@pytest.mark.parametrize('name', list(PRESETS))
def test_plan_recipe_of_each_preset(name):
    ex = preset_example(name)
    plan = Policy(preset=name).plan(ex)
    assert decisions(Policy.from_recipe(plan.to_recipe()).plan(ex)) == decisions(plan)


def test_plan_recipe_preset_named_state_dict():
    "A state dict with Qwen's names: auto-detected, its weight-only layers AWQ W4A16; the recipe replans the same."
    sd = {f'{n}.weight': torch.zeros(s, dtype=torch.bfloat16) for n, s in preset_example('qwen').items()}
    sd['blocks.0.norm.weight'] = torch.ones(256, dtype=torch.bfloat16)                   # ineligible: no rule
    plan = Policy('int4_full').plan(sd)
    assert plan.preset == 'qwen' and plan['blocks.2.img_mod'].format == 'awq_w4a16'
    assert plan['time_text_embed.linear'].tier == 'keep_float' and plan['blocks.0.norm'].tier == 'ineligible'
    p = plan_policy(plan)
    assert 'glob:blocks.*.img_mod' in [o[0] for o in p.overrides] and not any(rule_matches(o[0], 'blocks.0.norm') for o in p.overrides)
    assert decisions(Policy.from_recipe(plan.to_recipe()).plan(sd)) == decisions(plan)


def test_plan_recipe_auto_detected_krea2():
    shapes = {n: (3072, 3072) for n in krea2_names(4)} | {'first.proj': (3072, 256), 'txtfusion.0': (3072, 4096)}
    plan = Policy('w4a8').plan(shapes)
    assert plan.preset == 'krea2'
    p = plan_policy(plan)
    assert p.preset == 'krea2' and decisions(p.plan(shapes)) == decisions(plan)


def test_plan_recipe_glob_crossing_dots():
    "`blocks.*.x` also matches `blocks.0.y.x`: those layers get rules of their own, and the dead glob is dropped."
    shapes = {'blocks.0.x': (64, 256), 'blocks.1.x': (64, 256), 'blocks.0.y.x': (64, 384), 'blocks.1.y.x': (64, 384)}
    plan = Policy('int4_full', 'none').plan(shapes)
    assert {d.label for d in plan.values()} == {'W4A4', 'INT8'}
    p = plan_policy(plan)
    assert [o[0] for o in p.overrides] == ['glob:blocks.0.y.x', 'glob:blocks.1.y.x', 'glob:blocks.*.x']
    with warnings.catch_warnings():
        warnings.simplefilter('error', PolicyWarning)
        assert decisions(p.plan(shapes)) == decisions(plan)


def cli(capsys, *argv) -> tuple:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope='module')
def src(tmp_path_factory):
    p = tmp_path_factory.mktemp('recipe') / 'dit.safetensors'
    cq.save_file(dit_state_dict(1, torch.bfloat16, depth=1), p)
    return p


def test_cli_recipe_plan_quantize(capsys, src, tmp_path):
    rc, text, _ = cli(capsys, 'recipe', src, '--mode', 'int8', '--preset', 'none')
    assert rc == 0 and text.startswith('# cquant recipe') and 'mode: int8' in text
    r = tmp_path / 'r.yaml'
    r.write_text(text.replace('mode: int8', 'mode: fp8').replace('rules:\n', "rules:\n  - {match: 'blocks.*.attn.qkv', format: nvfp4}\n"))
    rc, out, _ = cli(capsys, 'plan', src, '--recipe', r, '--json')
    plan = json.loads(out)
    assert plan['policy']['mode'] == 'fp8'                                                   # the recipe's base key
    assert plan['layers']['blocks.0.attn.proj']['format'] == 'int8_tensorwise'               # its rules first
    rc, out, _ = cli(capsys, 'plan', src, '--recipe', r, '--mode', 'int4_full', '--keep-float', 'attn', '--json')
    plan = json.loads(out)
    assert plan['policy']['mode'] == 'int4_full' and plan['policy']['keep_float'] == ['attn']   # the command line wins
    dst = tmp_path / 'q.safetensors'
    rc, out, _ = cli(capsys, 'quantize', src, dst, '--recipe', r, '--quiet', '--no-sqnr', '--json')
    assert rc == 0
    meta = read_header(dst)[1]
    recorded = Policy.from_recipe(meta['cquant_recipe'])
    assert recorded == Policy.from_recipe(r) == Policy.from_json(meta['cquant_policy'])
    q = cq.load_file(dst)
    assert cq.decode_json(q['blocks.0.attn.qkv.comfy_quant'])['format'] == 'nvfp4'
    assert cq.decode_json(q['blocks.0.attn.proj.comfy_quant']) == {'format': 'int8_tensorwise'}
    assert q['blocks.0.attn.proj.weight_scale'].numel() == 256                               # per row, as planned
    rc, _, err = cli(capsys, 'plan', src, '--recipe', r, '--policy', '{}')
    assert rc == 1 and '--policy and --recipe: give one' in err
    bad = tmp_path / 'bad.yaml'
    bad.write_text('rules:\n  - {match: x, format: nvfp5}\n')
    rc, _, err = cli(capsys, 'quantize', src, tmp_path / 'x.safetensors', '--recipe', bad, '--quiet')
    assert rc == 1 and f"{bad}:2: rules[0].format: unknown format 'nvfp5'" in err and not (tmp_path / 'x.safetensors').exists()


def test_quantize_checkpoint_records_the_recipe(src, tmp_path):
    pol = Policy.from_recipe(EVERY_KIND.replace("  - {match: patch_embed, format: convrot_w4a4}\n", ''))
    dst = tmp_path / 'q.safetensors'
    quiet(quantize_checkpoint, src, dst, pol, progress=False, measure=False)
    meta = read_header(dst)[1]
    assert Policy.from_recipe(meta['cquant_recipe']) == pol and meta['cquant_recipe'] == pol.to_recipe()
