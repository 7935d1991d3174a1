"""Chat templates rendered as transformers 5 renders them, with jinja2 alone.

transformers' own renderer (transformers.utils.chat_template_utils) would import transformers on the serving path
(engine/tokenizer.py says why not). The environment below is the one transformers builds in
`_cached_compile_jinja_template`: jinja2's ImmutableSandboxedEnvironment (Hub templates are untrusted code), with
trim_blocks and lstrip_blocks, loop controls, the `{% generation %}` tag (rendered as its body: we never ask for
assistant masks), a `tojson` that does not escape HTML, `raise_exception`, `strftime_now`, and a `dict` and
`namespace` that cannot reach Python internals. `render` follows transformers' `render_jinja_template` for
what the worker sends: messages with None values dropped, reasoning fields aliased, tools as JSON schemas,
documents, and continue_final_message. tests/test_tokenizer.py checks the output against transformers'
apply_chat_template on the same templates."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# names a message's reasoning is passed under; templates read the first (transformers' _REASONING_FIELDS)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without the type object's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attributes (no path to CPython internals)."""

    def __init__(*args, **kwargs):  # jinja2's signature trick, so namespace(self=...) still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute."
            )


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_TemplateDict(),
        namespace=_Namespace,
    )
    return env.from_string(source)


def render(
    source: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    continue_final_message: bool | str = False,
    **variables,
) -> str:
    """One conversation through the template `source`; `variables` are the special tokens and the request's
    template kwargs. Errors are ValueError / TypeError / jinja2's TemplateError, with transformers' messages."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ValueError("Tools should be JSON schemas (dicts).")
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = []
    for m in messages:
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, but got {m!r}.")
        m = {k: v for k, v in m.items() if v is not None}  # OpenAI's content=None: templates expect no key
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final] if field in _REASONING_FIELDS else [field]
        if not any(f in source for f in fields):
            raise ValueError(
                f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template'
            )
        if not isinstance(final, str):
            raise ValueError("continue_final_message needs the final message's text as a string")
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    text = compile_template(source).render(
        messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt, **variables
    )
    if final is not None:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the chat after "
                "applying the chat template"
            )
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


@lru_cache(maxsize=32)
def iterates_content(template: str) -> bool:
    """Whether the template loops over a message's content (vLLM's _detect_content_format: "openai" if so, then it
    gets the parts as a list; "string" otherwise). Looks for `{% for x in <...>.content %}` or
    `<...>['content']`, directly, through filters, or through a variable set from it."""
    env = jinja2.Environment(extensions=[jinja2.ext.loopcontrols])
    env.add_extension(_Generation)
    try:
        ast = env.parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # the render will report it

    def content_of(node) -> bool:
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
            node = node.node
        if isinstance(node, jinja2.nodes.Getitem):
            return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
        return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"

    aliases = {
        a.target.name
        for a in ast.find_all(jinja2.nodes.Assign)
        if isinstance(a.target, jinja2.nodes.Name) and content_of(a.node)
    }
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        while isinstance(it, (jinja2.nodes.Filter, jinja2.nodes.Test)):
            it = it.node
        if content_of(it) or (isinstance(it, jinja2.nodes.Name) and it.name in aliases):
            return True
    return False
