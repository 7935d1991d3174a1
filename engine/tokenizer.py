"""The engine's tokenizer: the Rust `tokenizers` library from tokenizer.json, and chat templates rendered by
engine/chat_template.py (jinja2, as transformers renders them). Nothing on the serving path imports transformers.

transformers' import and tokenizer load are seconds of GIL-bound Python, paid by the cold start or by whichever
requests ran then (docs/decisions.md). Its fast tokenizers wrap the same Rust object, so encoding and decoding
agree; templates see tokenizer_config.json's special tokens as transformers reads them. transformers is loaded
only where asked for (`hf`, the engine's `tokenizer` property) or where only it can answer: no tokenizer.json, a
template using a special token tokenizer_config.json does not name, or an apply_chat_template option the fast path
lacks. `compare_with_transformers` checks both paths (`python -m warmup`, and the tests, on every tokenizer)."""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path

from engine.errors import UnsupportedModelError
from engine.weights.locate import read_json

log = logging.getLogger("engine")

PROBE = "Hello world! <s> </s> <|im_start|>user\n Grüße, 世界 😀  spaces\tand\nlines 12345"
# transformers' SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES: what its apply_chat_template hands the template
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template's own parameters that the fast path does not implement: given one, transformers renders
_HF_ONLY_KWARGS = frozenset(
    {
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


def _content(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok  # {"content": "</s>", ...} in older configs


def _chat_templates(folder: Path, cfg: dict) -> str | dict | None:
    """The model's chat template(s) as transformers' from_pretrained finds them: chat_template.jinja and
    additional_chat_templates/*.jinja override tokenizer_config.json's `chat_template` (a string, or a list of
    {name, template}). One default template is a str; several are a {name: template} dict."""
    found = {}
    if (folder / "chat_template.jinja").is_file():
        found["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    for f in sorted(extra.glob("*.jinja")) if extra.is_dir() else []:
        found[f.stem] = f.read_text(encoding="utf-8")
    if found:
        return found["default"] if list(found) == ["default"] else found
    t = cfg.get("chat_template")
    return {d["name"]: d["template"] for d in t} if isinstance(t, (list, tuple)) else t


def _compile(source: str) -> None:
    from engine.chat_template import compile_template

    compile_template(source)


class Tokenizer:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._hf = None
        self._hf_lock = threading.Lock()
        cfg = read_json(self.folder / "tokenizer_config.json")
        if (self.folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as RustTokenizer

            try:
                self.backend = RustTokenizer.from_file(str(self.folder / "tokenizer.json"))
            except Exception as e:  # noqa: BLE001 - the Rust side raises a bare Exception
                why = f"{self.folder / 'tokenizer.json'} is not a readable tokenizer ({e}): cut short by an "
                raise UnsupportedModelError(why + "incomplete download or copy? Copy it again") from None
            self.eos_token_id = self._token_id(_content(cfg.get("eos_token")))
            # as transformers 5 reads them: special_tokens_map.json is legacy, read (and overriding the config)
            # only when tokenizer_config.json has no added_tokens_decoder
            src = (
                cfg if "added_tokens_decoder" in cfg else {**cfg, **read_json(self.folder / "special_tokens_map.json")}
            )
            self.special_tokens = {k: v for k in SPECIAL_TOKENS if (v := _content(src.get(k))) is not None}
            self.chat_template = _chat_templates(self.folder, cfg)
            for t in self._own_templates():
                if self._pick_template(t, None) is None:
                    log.info(
                        "the chat template uses special tokens tokenizer_config.json does not name: loading "
                        "transformers' tokenizer now to render it"
                    )
                    self.hf  # noqa: B018 - at start, so no request pays for it
                    break
        else:  # a slow-only tokenizer: transformers does everything, loaded now
            self.backend = None
            self.eos_token_id = self.hf.eos_token_id

    def warm_pieces(self) -> list:
        """Compiling the model's own chat templates (with jinja2's import, ~25 ms), as idle pieces after ready:
        a prompt job never needs them, and a chat job that comes first compiles its own (compile_template's cache)."""
        if self.backend is None:  # transformers renders them
            return []
        return [functools.partial(_compile, t) for t in self._own_templates() if self._pick_template(t, None)]

    def _own_templates(self) -> list[str]:
        own = self.chat_template.values() if isinstance(self.chat_template, dict) else [self.chat_template]
        return [t for t in own if t is not None]

    def _token_id(self, tok: str | None) -> int | None:
        return self.backend.token_to_id(tok) if isinstance(tok, str) else None

    @property
    def hf(self):
        """transformers' tokenizer, loaded on first use (this call waits for it)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer  # tokenization and chat templates only

                self._hf = AutoTokenizer.from_pretrained(str(self.folder))
            return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids as transformers' tokenizer(text, add_special_tokens=...).input_ids gives them (True: with the
        special tokens, a BOS say, that the tokenizer's post-processor adds; a chat template writes its own)."""
        if self.backend is None:
            return self.hf(text, add_special_tokens=add_special_tokens).input_ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows, added tokens included (the model's embedding may have more rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True) if self.backend is not None else len(self.hf)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        continue_final_message: bool | str = False,
        **kwargs,
    ) -> str:
        """The prompt text, as transformers' apply_chat_template(messages, tokenize=False, ...) renders it;
        kwargs are template variables (chat_template_kwargs). A template may be a name among the model's."""
        template = (
            None
            if self.backend is None or _HF_ONLY_KWARGS & kwargs.keys()
            else self._pick_template(chat_template, tools)
        )
        if template is None:  # transformers' tokenizer, exactly (and its error for a model without a template)
            return self.hf.apply_chat_template(
                messages,
                tools=tools,
                documents=documents,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        from engine.chat_template import render

        return render(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            continue_final_message=continue_final_message,
            **{**self.special_tokens, **kwargs},
        )

    def _pick_template(self, chat_template: str | None, tools) -> str | None:
        """transformers' get_chat_template; None where only transformers can answer: no template (its error
        message), or a template that uses a special token tokenizer_config.json does not name (a tokenizer
        class may default it)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template in own:
                chat_template = own[chat_template]
            elif chat_template is None:
                chat_template = own.get("tool_use") if tools is not None and "tool_use" in own else own.get("default")
        elif chat_template is None:
            chat_template = own
        if chat_template is None or any(k in chat_template for k in SPECIAL_TOKENS if k not in self.special_tokens):
            return None
        return chat_template


# Conversations `compare_with_transformers` renders through both renderers: a plain turn, and a multi-turn chat
# with a system prompt and non-ASCII text, each with and without the generation prompt.
PROBE_CHATS = (
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Grüße, 世界 😀"},
        {"role": "assistant", "content": "Hallo."},
        {"role": "user", "content": "Again?"},
    ],
)


def compare_with_transformers(tok: Tokenizer) -> list[str]:
    """Where the fast paths differ from transformers' tokenizer for this tokenizer's folder (empty: nowhere): a
    probe text's ids, the chat templates found, the special tokens, and the text each renderer makes of
    PROBE_CHATS. Loads transformers; for preparation (`python -m warmup`) and tests."""
    if tok.backend is None:
        return []  # transformers does everything already
    hf, out = tok.hf, []
    if hf(PROBE).input_ids != tok.backend.encode(PROBE).ids:
        out.append("tokenizer.json encodes a probe text differently from transformers' tokenizer")
    if hf.chat_template != tok.chat_template:
        out.append("transformers finds other chat templates than tokenizer_config.json / *.jinja give")
    if hf.special_tokens_map != tok.special_tokens:
        out.append(f"special tokens differ: transformers {hf.special_tokens_map}, ours {tok.special_tokens}")
    if hf.chat_template is not None:
        for i, msgs in enumerate(PROBE_CHATS):
            for gen in (True, False):
                theirs = _render(hf.apply_chat_template, msgs, tokenize=False, add_generation_prompt=gen)
                ours = _render(tok.apply_chat_template, msgs, add_generation_prompt=gen)
                if ours != theirs:
                    out.append(f"probe chat {i} (add_generation_prompt={gen}): ours renders {ours!r}, "
                               f"transformers {theirs!r}")  # fmt: skip
    return out


def _render(fn, *a, **kw) -> str:
    try:
        return fn(*a, **kw)
    except Exception as e:  # a template may refuse a probe (e.g. no system role): both must refuse it alike
        return f"<error {type(e).__name__}>"


def template_iterates_content(template: str) -> bool:
    """Whether a chat template loops over a message's content parts (vLLM's "openai" content format) rather than
    reading it as a string; imports jinja2 on first use only (chat_template.iterates_content)."""
    from engine.chat_template import iterates_content

    return iterates_content(template)
