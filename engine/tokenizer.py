"""The engine's tokenizer: the Rust `tokenizers` library from tokenizer.json, chat templates rendered by
transformers' own jinja renderer, and transformers' full tokenizer only after the first step.

A cold start pays for everything on the path to the first token, and transformers' tokenizer is the costliest
optional part: `import transformers` + AutoTokenizer.from_pretrained is ~2 s of GIL-bound Python. Loaded on a
thread at start, it slowed the weight read and the first step (2-core box: 1.65 s -> 2.2-2.6 s to the first
token), and a first chat job waited for it (4.2-4.7 s). So:
- encoding and decoding are the Rust tokenizer's (transformers' fast tokenizers wrap the same object);
- apply_chat_template() calls transformers.utils.chat_template_utils.render_jinja_template (the function
  transformers' apply_chat_template calls; ~0.6 s to import, once) with the template files and the special
  tokens of tokenizer_config.json;
- transformers' tokenizer loads on a background thread once the engine has run its first step
  (start_background_load), or at once when something needs it (`hf`). When it is in, it checks both fast paths:
  a probe text must encode alike, and its chat templates and special tokens must equal ours. On a difference,
  that path switches to transformers for good, and a warning says so.
Without a tokenizer.json (slow-only tokenizers) transformers loads synchronously, as before."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from engine.loader import read_json

log = logging.getLogger("engine")

# One import of transformers at a time: its lazy module breaks when two threads import it at once (a chat
# render's renderer import racing the background tokenizer load raised ImportError in both).
_IMPORT_LOCK = threading.Lock()
PROBE = "Hello world! <s> </s> <|im_start|>user\n Grüße, 世界 😀  spaces\tand\nlines 12345"
# transformers' SpecialTokensMixin.SPECIAL_TOKENS_ATTRIBUTES: what its apply_chat_template hands the template
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# apply_chat_template's own parameters that the fast path does not implement: given one, transformers renders
_HF_ONLY_KWARGS = frozenset({"tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                             "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


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


class Tokenizer:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._hf = None
        self._hf_error: BaseException | None = None
        self._use_hf_encode = self._use_hf_chat = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        cfg = read_json(self.folder / "tokenizer_config.json")
        if (self.folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as RustTokenizer

            self.backend = RustTokenizer.from_file(str(self.folder / "tokenizer.json"))
            self.eos_token_id = self._token_id(_content(cfg.get("eos_token")))
            # as transformers 5 reads them: special_tokens_map.json is legacy, read (and overriding the config)
            # only when tokenizer_config.json has no added_tokens_decoder
            src = cfg if "added_tokens_decoder" in cfg else \
                {**cfg, **read_json(self.folder / "special_tokens_map.json")}
            self.special_tokens = {k: v for k in SPECIAL_TOKENS if (v := _content(src.get(k))) is not None}
            self.chat_template = _chat_templates(self.folder, cfg)
        else:
            self._load_hf()
            if self._hf_error is not None:
                raise self._hf_error
            self.backend = self._hf.backend_tokenizer if hasattr(self._hf, "backend_tokenizer") else None
            self.eos_token_id = self._hf.eos_token_id
            self._use_hf_encode = self._use_hf_chat = True

    def _token_id(self, tok: str | None) -> int | None:
        return self.backend.token_to_id(tok) if isinstance(tok, str) else None

    def start_background_load(self) -> None:
        """Load transformers' tokenizer on a thread, unless it is loaded or loading. The engine calls this after
        its first step, so the load never competes with the cold start's critical path."""
        with self._lock:
            if self._thread is None and self._hf is None and self._hf_error is None:
                self._thread = threading.Thread(target=self._load_hf, name="tokenizer-load", daemon=True)
                self._thread.start()

    def _load_hf(self) -> None:
        try:
            with _IMPORT_LOCK:
                from transformers import AutoTokenizer  # tokenization and chat templates only

            hf = AutoTokenizer.from_pretrained(str(self.folder))
            if getattr(self, "backend", None) is not None and not self._use_hf_encode:
                if hf(PROBE).input_ids != self.backend.encode(PROBE).ids:
                    log.warning("tokenizer.json and transformers' tokenizer disagree on a probe text: encoding "
                                "with transformers from now on")
                    self._use_hf_encode = True
                if (hf.chat_template, hf.special_tokens_map) != (self.chat_template, self.special_tokens):
                    log.warning("transformers found other chat templates or special tokens than the fast path "
                                "did: rendering chat templates with transformers' tokenizer from now on")
                    self._use_hf_chat = True
            self._hf = hf
        except BaseException as e:  # noqa: BLE001 - re-raised to whoever needs transformers' tokenizer
            self._hf_error = e

    @property
    def hf(self):
        """transformers' tokenizer; starts the load if nothing has yet, and waits for it."""
        self.start_background_load()
        if self._thread is not None:
            self._thread.join()
        if self._hf_error is not None:
            raise self._hf_error
        return self._hf

    def encode(self, text: str) -> list[int]:
        """Token ids as transformers' tokenizer(text).input_ids gives them (special tokens added as configured)."""
        if self._use_hf_encode:
            return self.hf(text).input_ids
        return self.backend.encode(text).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            documents: list[dict] | None = None, continue_final_message: bool | str = False,
                            **kwargs) -> str:
        """The prompt text, as transformers' apply_chat_template(messages, tokenize=False, ...) renders it;
        kwargs are template variables (chat_template_kwargs). A template may be a name among the model's."""
        template = None if self._use_hf_chat or _HF_ONLY_KWARGS & kwargs.keys() else \
            self._pick_template(chat_template, tools)
        if template is None:  # the slow path: transformers' tokenizer, exactly
            return self.hf.apply_chat_template(
                messages, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=False, **kwargs)
        with _IMPORT_LOCK:
            from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

        if not messages:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible")
        rendered, _ = render_jinja_template(
            conversations=[_normalize_chat_messages(messages)], tools=tools, documents=documents,
            chat_template=template, continue_final_message=continue_final_message,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens, **kwargs})
        return rendered[0]

    def _pick_template(self, chat_template: str | None, tools) -> str | None:
        """transformers' get_chat_template; None where only transformers can answer: no template (its error
        message), or a template that uses a special token tokenizer_config.json does not name (a tokenizer
        class may default it)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template in own:
                chat_template = own[chat_template]
            elif chat_template is None:
                chat_template = own.get("tool_use") if tools is not None and "tool_use" in own else \
                    own.get("default")
        elif chat_template is None:
            chat_template = own
        if chat_template is None or any(k in chat_template for k in SPECIAL_TOKENS
                                        if k not in self.special_tokens):
            return None
        return chat_template
