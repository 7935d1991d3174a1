"""The engine's tokenizer: the Rust `tokenizers` library from tokenizer.json at start, transformers in the
background.

`import transformers` + AutoTokenizer.from_pretrained cost ~1.5 s of a cold start, and the first token needs
neither: encoding and decoding are the Rust tokenizer's (transformers' fast tokenizers wrap the same object).
transformers loads on a background thread for what only it does (chat templates, special-token metadata).
Once loaded, it encodes a probe text; if the two ever disagree (a tokenizer_config.json flag that transformers
applies on top of tokenizer.json), encoding switches to transformers for good, and a warning says so. Without a
tokenizer.json (slow-only tokenizers) transformers loads synchronously, as before."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from engine.loader import read_json

log = logging.getLogger("engine")

PROBE = "Hello world! <s> </s> <|im_start|>user\n Grüße, 世界 😀  spaces\tand\nlines 12345"


class Tokenizer:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._hf = None
        self._hf_error: BaseException | None = None
        self._use_hf_encode = False
        cfg = read_json(self.folder / "tokenizer_config.json")
        if (self.folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer as RustTokenizer

            self.backend = RustTokenizer.from_file(str(self.folder / "tokenizer.json"))
            self.eos_token_id = self._token_id(cfg.get("eos_token"))
            self._thread = threading.Thread(target=self._load_hf, name="tokenizer-load", daemon=True)
            self._thread.start()
        else:
            self._thread = None
            self._load_hf()
            if self._hf_error is not None:
                raise self._hf_error
            self.backend = self._hf.backend_tokenizer if hasattr(self._hf, "backend_tokenizer") else None
            self.eos_token_id = self._hf.eos_token_id
            self._use_hf_encode = True

    def _token_id(self, tok) -> int | None:
        if isinstance(tok, dict):  # {"content": "</s>", ...} in older configs
            tok = tok.get("content")
        return self.backend.token_to_id(tok) if isinstance(tok, str) else None

    def _load_hf(self) -> None:
        try:
            from transformers import AutoTokenizer  # tokenization and chat templates only

            hf = AutoTokenizer.from_pretrained(str(self.folder))
            if getattr(self, "backend", None) is not None and hf(PROBE).input_ids != self.backend.encode(PROBE).ids:
                log.warning("tokenizer.json and transformers' tokenizer disagree on a probe text: encoding with "
                            "transformers from now on")
                self._use_hf_encode = True
            self._hf = hf
        except BaseException as e:  # noqa: BLE001 - re-raised to whoever needs transformers' tokenizer
            self._hf_error = e

    @property
    def hf(self):
        """transformers' tokenizer (chat templates); waits for the background load."""
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
