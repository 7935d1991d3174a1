"""engine/tokenizer.py: the Rust tokenizer used from the start must encode exactly as transformers does, and
the engine switches to transformers if they ever disagree."""
from __future__ import annotations

import pytest

from engine.tokenizer import PROBE, Tokenizer

TEXTS = [PROBE, "The capital of France is", "  leading spaces and trailing  ", "<|im_start|>system\nHi<|im_end|>",
         "def f(x):\n\treturn x ** 2  # ünïcödé", ""]


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
    assert tok.hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) if which == "smollm2" \
        else tok.hf is not None
    assert not tok._use_hf_encode


def test_switches_to_transformers_on_disagreement(tiny_llama):
    tok = Tokenizer(tiny_llama)
    want = tok.hf(PROBE).input_ids

    class Wrong:  # a backend that disagrees with transformers
        def encode(self, text):
            return type("E", (), {"ids": [1, 2, 3]})()

    tok.backend = Wrong()
    tok._load_hf()  # what the background thread does
    assert tok._use_hf_encode and tok.encode(PROBE) == want


# ---- chat templates: transformers' renderer without transformers' tokenizer -------------------------------
CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Grüße, 世界 😀"},
     {"role": "assistant", "content": "Hallo."}, {"role": "user", "content": "Again?"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
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
        for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                   {"add_generation_prompt": False, "continue_final_message": True},
                   {"add_generation_prompt": True, "chat_template": custom, "extra": "!"}):
            assert tok.apply_chat_template(msgs, **kw) == _hf_render(hf, msgs, **kw), (msgs, kw)
    assert tok._hf is None and tok._thread is None  # the fast path never touched transformers' tokenizer
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
    for kw in ({}, {"tools": TOOLS}, {"chat_template": "tool_use", "tools": TOOLS, "greeting": "hey"},
               {"chat_template": "default", "add_generation_prompt": False}):
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
    assert Tokenizer(folder).apply_chat_template(CHATS[0], return_dict=False) == \
        _hf_render(hf, CHATS[0], add_generation_prompt=True, return_dict=False)
    with pytest.raises(ValueError, match="chat_template"):  # transformers' own error for a model without one
        Tokenizer(tiny_llama).apply_chat_template(CHATS[0])


def test_chat_switches_to_transformers_when_templates_or_tokens_disagree(smollm2_path):
    tok = Tokenizer(smollm2_path)
    tok.special_tokens = {**tok.special_tokens, "bos_token": "<wrong>"}
    tok._load_hf()  # what the background thread does
    assert tok._use_hf_chat and not tok._use_hf_encode
    assert tok.apply_chat_template(CHATS[0]) == _hf_render(tok.hf, CHATS[0], add_generation_prompt=True)


def test_engine_loads_transformers_only_after_its_first_step(smollm2_path):
    from engine import LLM, SamplingParams

    llm = LLM(model=str(smollm2_path), dtype="bfloat16", log_stats_interval=0)
    tok = llm.engine.tok
    assert tok._thread is None and tok._hf is None  # nothing competes with the cold start
    llm.generate("Hi", SamplingParams(max_tokens=1))
    assert tok._thread is not None
    assert llm.tokenizer is tok.hf and tok._hf is not None
    assert not tok._use_hf_chat and not tok._use_hf_encode  # its checks agreed with both fast paths


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
    cfg["chat_template"] = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}[{{ unk_token }}]"
    if case == "decoder-ignores-map":
        cfg["added_tokens_decoder"] = {"0": {"content": "<|endoftext|>", "lstrip": False, "normalized": False,
                                             "rstrip": False, "single_word": False, "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "unk_token": "<|im_start|>"}))
    tok, hf = Tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert tok.special_tokens == hf.special_tokens_map
    assert tok.apply_chat_template(CHATS[0], add_generation_prompt=False) == \
        _hf_render(hf, CHATS[0], add_generation_prompt=False)
    assert tok._hf is None


def test_a_chat_render_racing_the_background_load(smollm2_path):
    """Cold start with a chat job and a prompt job at once: the render's first import of transformers and the
    tokenizer load that the first step starts run together. Both must work (a fresh process: transformers must
    not be imported yet)."""
    import subprocess
    import sys

    code = f"""
import threading
from engine import LLM, SamplingParams
llm = LLM(model={str(smollm2_path)!r}, dtype="float32", log_stats_interval=0)
tok, errors = llm.engine.tok, []
def chat():
    try:
        tok.apply_chat_template([{{"role": "user", "content": "hi"}}])
    except Exception as e:
        errors.append(repr(e))
t = threading.Thread(target=chat)
t.start()
llm.generate("Hi", SamplingParams(max_tokens=1))
t.join()
tok._thread.join()
assert not errors and tok._hf_error is None, (errors, tok._hf_error)
print("ok", llm.tokenizer is not None)
"""
    for _ in range(2):  # the race hit 3 runs in 4 before the import lock
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip().endswith("ok True"), r.stderr[-2000:]
