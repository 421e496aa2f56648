"""A model's chat template, rendered the way Hugging Face renders it, without transformers.

A model directory carries its chat template (a Jinja2 program that turns a
list of messages into the prompt text the model was trained on) in
``chat_template.jinja`` or in ``tokenizer_config.json``'s ``chat_template``
(a string, or a list of ``{"name", "template"}`` of which ``"default"`` is
used); the file wins when both exist, as in transformers. ``ChatTemplate``
renders it as transformers' ``apply_chat_template(..., tokenize=False)``
does: an immutable sandboxed Jinja2 environment with ``trim_blocks`` and
``lstrip_blocks``, the loop controls extension, ``raise_exception``,
``strftime_now``, a ``tojson`` that does not escape HTML, and as variables
``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the
tokenizer's special tokens as strings (``bos_token``, ``eos_token``, ...) and
any extra keyword.

Templates are code from the model's authors: they run in the sandbox, which
refuses underscore attributes (``''.__class__``), methods that mutate, and
namespaces with underscore names. Here a refused attribute raises at once
(Jinja2 alone would render it as an empty string), and every failure of a
template is a ``ChatTemplateError``.

Messages are OpenAI-style dicts. A ``content`` given as a list of text parts
(``[{"type": "text", "text": ...}]``) is joined into one string (parts
separated by a newline) before rendering, since most templates concatenate
``message['content']`` as a string; other parts (images, audio) are refused
with a ``ChatTemplateError`` whose ``param`` names the part. Keys whose value
is None are dropped, as transformers does, so ``"content": null`` reads as
absent.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from jinja2.utils import Namespace

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens a template sees as strings (transformers'
``special_tokens_map``), when the tokenizer config names them."""

TEXT_PART_SEPARATOR = "\n"
"""What joins the text parts of one message's content."""

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning comes under; like transformers, a message
with one of them gets the first two too (templates read one or the other)."""


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or a template that fails.

    ``param`` names the offending part of the request, as an OpenAI error's
    ``param`` does (``"messages[1].content[0]"``), or is None when the
    template itself refused (``raise_exception``) or failed.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ChatTemplate:
    """One compiled chat template and the special tokens it is rendered with.

    Immutable and safe to share between requests and threads (a render
    builds its own context). Compiling is cached per template text.
    """

    __slots__ = ("_template", "source", "special_tokens")

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        """Compiles ``source``; ``special_tokens`` maps names such as
        ``bos_token`` to the strings the template sees. Raises
        ``ChatTemplateError`` when the source does not compile."""
        self.source = source
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"the chat template does not compile: {exc.message} (line {exc.lineno})"
            ) from None

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The chat template of the model directory ``path``; None when it has none.

        Reads ``chat_template.jinja``, else ``tokenizer_config.json``'s
        ``chat_template``, and the special tokens from
        ``tokenizer_config.json`` (a string or an ``AddedToken`` dict with
        ``content``; ``special_tokens_map.json`` fills the names it lacks).
        Raises ``ChatTemplateError`` for a template that does not compile, or
        a list of templates without a ``"default"`` one.
        """
        directory = Path(path)
        config = _read_json(directory / TOKENIZER_CONFIG_FILE)
        jinja_file = directory / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            source: Any = jinja_file.read_text(encoding="utf-8")
        else:
            source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ChatTemplateError(
                    f"{directory / TOKENIZER_CONFIG_FILE}: chat_template lists "
                    f"{sorted(map(str, named))} but no 'default' template"
                )
            source = named["default"]
        if not isinstance(source, str) or not source:
            return None
        tokens = _special_tokens(_read_json(directory / SPECIAL_TOKENS_MAP_FILE))
        tokens.update(_special_tokens(config))
        return cls(source, tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """The prompt text of ``messages``.

        ``add_generation_prompt`` ends it with what starts the assistant's
        reply. ``extra`` become template variables too (``tools``,
        ``documents`` default to None; an extra named like a special token
        replaces it; ``messages`` and ``add_generation_prompt`` are the
        arguments, whatever ``extra`` holds). Inputs are copied as plain JSON data first; the
        caller's objects are never changed. Raises ``ChatTemplateError``.
        """
        variables: dict[str, Any] = {"tools": None, "documents": None}
        variables.update(self.special_tokens)
        for name, value in extra.items():
            variables[name] = _plain(value, name)
        variables["messages"] = [_message(m, i) for i, m in enumerate(messages)]
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(variables)
        except _TemplateRaised as exc:
            raise ChatTemplateError(str(exc)) from None
        except jinja2.exceptions.SecurityError as exc:
            raise ChatTemplateError(f"the chat template did something unsafe: {exc}") from None
        except Exception as exc:  # any failure of the template's own code
            raise ChatTemplateError(
                f"the chat template failed: {type(exc).__name__}: {exc}"
            ) from None


# --- messages as plain data ------------------------------------------------------------


def _message(message: Any, index: int) -> dict[str, Any]:
    """A copy of one message as plain data: keys with None values dropped,
    text parts joined, reasoning under each name templates read."""
    param = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ChatTemplateError("a message must be an object", param)
    plain = {str(k): _plain(v, f"{param}.{k}") for k, v in message.items() if v is not None}
    content = plain.get("content")
    if isinstance(content, list):
        plain["content"] = _joined_text(content, f"{param}.content")
    elif content is not None and not isinstance(content, str):
        raise ChatTemplateError("content must be a string or a list of parts", f"{param}.content")
    reasoning = next((plain[k] for k in REASONING_FIELDS if k in plain), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


def _joined_text(parts: list[Any], param: str) -> str:
    """The text of a content given as parts; only text parts are accepted."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise ChatTemplateError("a content part must be an object", f"{param}[{j}]")
        kind = part.get("type")
        if kind != "text":
            raise ChatTemplateError(
                f"only text content parts are supported, not {kind!r}", f"{param}[{j}].type"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError("a text part needs a string text", f"{param}[{j}].text")
        texts.append(text)
    return TEXT_PART_SEPARATOR.join(texts)


def _plain(value: Any, param: str) -> Any:
    """``value`` rebuilt from JSON types only (str, int, float, bool, None,
    lists, dicts with string keys), so a template can reach no other
    object's methods; tuples become lists."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    for kind in (str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{param}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{param}[{i}]") for i, v in enumerate(value)]
    raise ChatTemplateError(f"not JSON data: a {type(value).__name__}", param)


# --- the tokenizer config --------------------------------------------------------------


def _read_json(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``; empty when the file does not exist."""
    if not file.is_file():
        return {}
    data = json.loads(file.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens ``config`` gives, as strings (an
    ``AddedToken`` is saved as a dict whose ``content`` is the string)."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


# --- the sandbox -----------------------------------------------------------------------


class _TemplateRaised(jinja2.TemplateError):
    """What the template's ``raise_exception(message)`` raises."""


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, where an unsafe attribute raises at once.

    Jinja2's sandbox returns an undefined value for it, which renders as an
    empty string; a template that reaches for ``__class__`` is refused here.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )


class _SafeNamespace(Namespace):
    """``namespace(...)`` whose attribute names may not start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        Namespace.__setitem__(self, name, value)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks the
    assistant's tokens with it (for training masks); it renders its body."""

    tags = {"generation"}  # noqa: RUF012 - as jinja2.ext.Extension declares it

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace attribute may not be named {name!r}")


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON as ``json.dumps`` writes it (Jinja2's own filter escapes HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _make_dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    """``dict(...)`` for templates, without the ``dict`` type itself."""
    return dict(*args, **kwargs)


@functools.cache
def _sandbox() -> _Sandbox:
    """The one environment every template compiles in (it holds no state
    that a render changes)."""
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    env.globals["dict"] = _make_dict
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _sandbox().from_string(source)
