"""engine/tokenizer.py: the Rust tokenizer and the jinja2 chat renderer used from the start must encode and render
exactly as transformers does; `python -m warmup` reports where they disagree (compare_with_transformers). The
engine itself does not switch to transformers."""

from __future__ import annotations

import pytest

from engine.tokenizer import PROBE, Tokenizer, compare_with_transformers

pytestmark = pytest.mark.slow  # the real SmolLM2's tokenizer against transformers' chat templates

TEXTS = [
    PROBE,
    "The capital of France is",
    "  leading spaces and trailing  ",
    "<|im_start|>system\nHi<|im_end|>",
    "def f(x):\n\treturn x ** 2  # ünïcödé",
    "",
]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_encodes_like_transformers(which, tiny_llama, smollm2_path):
    from transformers import AutoTokenizer

    folder = tiny_llama if which == "tiny" else smollm2_path
    tok, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert tok.encode(text) == hf(text).input_ids, text
    assert tok.eos_token_id == hf.eos_token_id
    ids = hf(PROBE).input_ids
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert compare_with_transformers(tok) == []


def test_compare_with_transformers_names_a_disagreement(tiny_llama):
    tok = Tokenizer(tiny_llama)

    class Wrong:  # a tokenizer.json that encodes otherwise than transformers
        def encode(self, text):
            return type("E", (), {"ids": [1, 2, 3]})()

    tok.backend = Wrong()
    tok.special_tokens = {**tok.special_tokens, "bos_token": "<wrong>"}
    diffs = compare_with_transformers(tok)
    assert len(diffs) == 2 and "probe text" in diffs[0] and "special tokens" in diffs[1], diffs


def test_compare_with_transformers_renders_the_probe_chats(smollm2_path):
    """The template check renders: a renderer that drops one character is caught on every probe chat."""
    tok = Tokenizer(smollm2_path)
    assert compare_with_transformers(tok) == []
    right = tok.apply_chat_template
    tok.apply_chat_template = lambda msgs, **kw: right(msgs, **kw)[:-1]
    diffs = compare_with_transformers(tok)
    assert len(diffs) == 4 and all("renders" in d for d in diffs), diffs


# ---- chat templates: transformers' renderer without transformers' tokenizer -------------------------------
CHATS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Grüße, 世界 😀"},
        {"role": "assistant", "content": "Hallo."},
        {"role": "user", "content": "Again?"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
MULTI = {  # chat_template.jinja + additional_chat_templates/tool_use.jinja, both using the special tokens
    "default": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}",
    "tool_use": "{{ bos_token }}TOOLS {{ tools | tojson }}\n{% for m in messages %}{{ m.role }}: {{ m.content }}\n"
    "{% endfor %}{{ greeting | default('') }}",
}


def _hf_render(hf, messages, **kw):
    return hf.apply_chat_template(messages, tokenize=False, **kw)


def test_chat_template_renders_like_transformers_without_loading_it(smollm2_path):
    from transformers import AutoTokenizer

    tok, hf = Tokenizer(smollm2_path), AutoTokenizer.from_pretrained(str(smollm2_path))
    custom = "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{{ extra }}"
    for msgs in CHATS:
        for kw in (
            {"add_generation_prompt": True},
            {"add_generation_prompt": False},
            {"add_generation_prompt": False, "continue_final_message": True},
            {"add_generation_prompt": True, "chat_template": custom, "extra": "!"},
        ):
            assert tok.apply_chat_template(msgs, **kw) == _hf_render(hf, msgs, **kw), (msgs, kw)
    assert tok._hf is None  # the fast path never touched transformers' tokenizer
    with pytest.raises(ValueError, match="empty conversation"):
        tok.apply_chat_template([])


def test_named_templates_tools_and_special_tokens(tiny_llama, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "multi"
    shutil.copytree(tiny_llama, folder)
    (folder / "chat_template.jinja").write_text(MULTI["default"])
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(MULTI["tool_use"])
    tok, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert tok.chat_template == hf.chat_template == MULTI and tok.special_tokens == hf.special_tokens_map
    msgs = CHATS[1]
    for kw in (
        {},
        {"tools": TOOLS},
        {"chat_template": "tool_use", "tools": TOOLS, "greeting": "hey"},
        {"chat_template": "default", "add_generation_prompt": False},
    ):
        ours = tok.apply_chat_template(msgs, **{"add_generation_prompt": True, **kw})
        assert ours == _hf_render(hf, msgs, **{"add_generation_prompt": True, **kw}), kw
    assert "<s>" in ours and tok._hf is None


def test_chat_falls_back_to_transformers_where_it_must(tiny_llama, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "sep"
    shutil.copytree(tiny_llama, folder)
    (folder / "chat_template.jinja").write_text("{{ sep_token }}{% for m in messages %}{{ m.content }}{% endfor %}")
    tok, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    # sep_token is not in tokenizer_config.json: a tokenizer class could default it, so transformers renders
    assert tok.apply_chat_template(CHATS[0]) == _hf_render(hf, CHATS[0], add_generation_prompt=True)
    assert tok._hf is not None
    # apply_chat_template options the fast path does not implement also go to transformers
    assert Tokenizer(folder).apply_chat_template(CHATS[0], return_dict=False) == _hf_render(
        hf, CHATS[0], add_generation_prompt=True, return_dict=False
    )
    with pytest.raises(ValueError, match="chat_template"):  # transformers' own error for a model without one
        Tokenizer(tiny_llama).apply_chat_template(CHATS[0])


@pytest.mark.parametrize("case", ["legacy-map-overrides", "decoder-ignores-map"])
def test_special_tokens_come_from_where_transformers_reads_them(case, smollm2_path, tmp_path):
    """transformers 5 reads special_tokens_map.json (overriding tokenizer_config.json) only when the config has no
    added_tokens_decoder. The fast path must render the same tokens before transformers is ever loaded."""
    import json
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / case
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(smollm2_path / f, folder / f)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}[{{ unk_token }}]"
    )
    if case == "decoder-ignores-map":
        cfg["added_tokens_decoder"] = {
            "0": {
                "content": "<|endoftext|>",
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        }
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "unk_token": "<|im_start|>"})
    )
    tok, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert tok.special_tokens == hf.special_tokens_map
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=False) == _hf_render(
        hf, CHATS[0], add_generation_prompt=False
    )
    assert tok._hf is None


FEATURES = (  # what Hub templates use from transformers' environment
    "{%- set ns = namespace(n=0, last='') -%}{%- for m in messages -%}{%- if m.role == 'system' -%}{%- continue -%}"
    "{%- endif -%}{%- set ns.n = ns.n + 1 -%}{%- set ns.last = m.role -%}"
    "{%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{%- else %}{{ m.role }}: {{ m.content | tojson }}{% endif %}{% if ns.n > 9 %}{% break %}{% endif %}\n"
    "{%- endfor %}{{ ns.n }}|{{ ns.last }}|{{ dict(a=1) | tojson }}|{{ tools | tojson(indent=1) }}"
    "{% if messages[-1].reasoning_content is defined %}|R:{{ messages[-1].reasoning_content }}{% endif %}"
    "{% if add_generation_prompt %}\nassistant:{% endif %}"
)


def test_chat_template_features_render_like_transformers(smollm2_path):
    import jinja2
    from transformers import AutoTokenizer

    tok, hf = Tokenizer(smollm2_path), AutoTokenizer.from_pretrained(str(smollm2_path))
    chats = CHATS + [
        [{"role": "user", "content": '<b>&</b> "q" é'}, {"role": "assistant", "content": None, "thinking": "hmm"}]
    ]
    for msgs in chats:
        for kw in ({"add_generation_prompt": True, "tools": TOOLS}, {"add_generation_prompt": False}):
            assert tok.apply_chat_template(msgs, chat_template=FEATURES, **kw) == _hf_render(
                hf, msgs, chat_template=FEATURES, **kw
            ), (msgs, kw)
    date = "{{ strftime_now('%Y-%m-%d') }}"
    assert tok.apply_chat_template(CHATS[0], chat_template=date) == _hf_render(hf, CHATS[0], chat_template=date)
    with pytest.raises(jinja2.TemplateError, match="no system role"):
        tok.apply_chat_template(CHATS[0], chat_template="{{ raise_exception('no system role') }}")
    for escape in (
        "{{ ''.__class__.__mro__ }}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{{ messages.append(1) }}",
    ):  # the sandbox holds, as in transformers
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(CHATS[0], chat_template=escape)
    assert tok._hf is None


def test_the_engine_never_imports_transformers(smollm2_path):
    """A fresh process: an engine start, a chat render and a generation leave transformers unimported (its import
    holds the GIL for ~0.5 s, its tokenizer's load for ~2 s more: requests running then would stall)."""
    import subprocess
    import sys

    code = f"""
import sys
from engine import LLM, SamplingParams
llm = LLM(model={str(smollm2_path)!r}, dtype="float32", log_stats_interval=0)
prompt = llm.engine.tok.apply_chat_template([{{"role": "user", "content": "hi"}}])
out = llm.generate([prompt, "Hi"], SamplingParams(max_tokens=3))
assert "transformers" not in sys.modules, "transformers was imported"
assert llm.tokenizer.decode(out[1].outputs[0].token_ids) == out[1].outputs[0].text  # loaded when asked for
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_chat_templates_compile_after_ready_not_at_start(tiny_llama, tmp_path):
    """Opening a tokenizer neither imports jinja2 nor compiles (a prompt job never needs them); its warm pieces,
    which the engine runs after ready, compile each template its fast path renders, so a chat job finds them in
    compile_template's cache. A fresh process, for the imports."""
    import shutil
    import subprocess
    import sys

    folder = tmp_path / "multi"
    shutil.copytree(tiny_llama, folder)
    (folder / "chat_template.jinja").write_text(MULTI["default"])
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(MULTI["tool_use"])
    code = f"""
import sys
from engine.tokenizer import Tokenizer
tok = Tokenizer({str(folder)!r})
assert "jinja2" not in sys.modules, "opening the tokenizer imported jinja2"
pieces = tok.warm_pieces()
assert len(pieces) == 2, pieces
for piece in pieces:
    piece()
from engine.chat_template import compile_template
assert compile_template.cache_info().currsize == 2
tok.apply_chat_template([{{"role": "user", "content": "hi"}}], add_generation_prompt=True)
assert compile_template.cache_info().misses == 2, compile_template.cache_info()  # the render compiled nothing
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
