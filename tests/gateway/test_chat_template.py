"""Chat templates from the model directory, rendered as transformers renders them.

The tiny models carry a Llama-3-style or a Qwen2-style template; every
conversation here renders to exactly the text transformers'
``apply_chat_template(..., tokenize=False)`` gives for the same directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is first imported

from pagedkv.executor.tiny_model import (
    LLAMA3_CHAT_TEMPLATE,
    QWEN2_CHAT_TEMPLATE,
    make_tiny_model,
)
from pagedkv.gateway.chat_template import ChatTemplate, ChatTemplateError

SYSTEM = {"role": "system", "content": "You answer in one word."}
USER = {"role": "user", "content": "  What is the capital of France?\n"}
ASSISTANT = {"role": "assistant", "content": "Paris."}
USER_2 = {"role": "user", "content": "And of Spain? ünïcödé 😀 <eos>"}
CONVERSATIONS = {
    "one user message": [USER],
    "system first": [SYSTEM, USER],
    "multi-turn": [USER, ASSISTANT, USER_2],
    "multi-turn with system": [SYSTEM, USER, ASSISTANT, USER_2],
    "ends with the assistant": [SYSTEM, USER, ASSISTANT],
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama with the llama3 template, a tiny qwen2 with the qwen2 one,
    and a tiny llama without a template."""
    root = tmp_path_factory.mktemp("chat")
    dirs = {"llama3": root / "llama3", "qwen2": root / "qwen2", "none": root / "none"}
    make_tiny_model(dirs["llama3"], "llama", chat_template="llama3")
    make_tiny_model(dirs["qwen2"], "qwen2", chat_template="qwen2")
    make_tiny_model(dirs["none"], "llama", chat_template="none")
    return dirs


def _hf_render(model_dir: Path, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert isinstance(text, str)
    return text


def _template(model_dir: Path) -> ChatTemplate:
    template = ChatTemplate.from_model_dir(model_dir)
    assert template is not None
    return template


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_rendering_equals_transformers_apply_chat_template(
    model_dirs: dict[str, Path], name: str, conversation: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    ours = _template(model_dirs[name]).render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _hf_render(model_dirs[name], messages, add_generation_prompt)


def test_the_tiny_templates_render_the_expected_layouts(model_dirs: dict[str, Path]) -> None:
    llama3 = _template(model_dirs["llama3"]).render([SYSTEM, USER])
    assert llama3 == (
        "<bos><|start_header_id|>system<|end_header_id|>\n\nYou answer in one word.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    qwen2 = _template(model_dirs["qwen2"]).render([USER], add_generation_prompt=False)
    assert qwen2 == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n  What is the capital of France?\n<|im_end|>\n"
    )


def test_make_tiny_model_writes_the_template_into_tokenizer_config(
    model_dirs: dict[str, Path],
) -> None:
    for name, source in (("llama3", LLAMA3_CHAT_TEMPLATE), ("qwen2", QWEN2_CHAT_TEMPLATE)):
        config = json.loads((model_dirs[name] / "tokenizer_config.json").read_text())
        assert config["chat_template"] == source
        assert not (model_dirs[name] / "chat_template.jinja").exists()
    config = json.loads((model_dirs["none"] / "tokenizer_config.json").read_text())
    assert "chat_template" not in config


@pytest.mark.parametrize("name", ["llama3", "qwen2"])
def test_text_part_lists_render_as_their_joined_text(
    model_dirs: dict[str, Path], name: str
) -> None:
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the capital?"}]
    messages = [SYSTEM, {"role": "user", "content": parts}]
    joined = [SYSTEM, {"role": "user", "content": "What is\nthe capital?"}]
    ours = _template(model_dirs[name]).render(messages)
    assert ours == _hf_render(model_dirs[name], joined, True)


def test_non_text_parts_are_refused_naming_the_part(model_dirs: dict[str, Path]) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "see"}, image]}]
    with pytest.raises(ChatTemplateError, match="only text content parts") as info:
        _template(model_dirs["llama3"]).render(messages)
    assert info.value.param == "messages[1].content[1].type"


def test_none_values_are_dropped_as_transformers_does(model_dirs: dict[str, Path]) -> None:
    template = _template(model_dirs["llama3"])
    with_none = [USER, {"role": "assistant", "content": None}]
    assert template.render(with_none) == _hf_render(model_dirs["llama3"], with_none, True)


def test_raise_exception_in_a_template_is_a_chat_template_error(
    model_dirs: dict[str, Path],
) -> None:
    messages = [USER, {"role": "tool", "content": "42"}]
    with pytest.raises(
        ChatTemplateError, match=r"^roles are system, user and assistant, not tool$"
    ):
        _template(model_dirs["llama3"]).render(messages)
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="not tool"):  # transformers refuses it too
        _hf_render(model_dirs["llama3"], messages, True)


def test_a_directory_without_a_template_has_none(model_dirs: dict[str, Path]) -> None:
    assert ChatTemplate.from_model_dir(model_dirs["none"]) is None


def test_chat_template_jinja_takes_effect_over_tokenizer_config(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dirs["llama3"] / name).read_bytes())
    source = "{% for m in messages %}[{{ m.role }}|{{ eos_token }}]{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(source)
    ours = _template(tmp_path).render([SYSTEM, USER], add_generation_prompt=False)
    assert ours == "[system|<eos>][user|<eos>]"
    assert ours == _hf_render(tmp_path, [SYSTEM, USER], False)


BOS_CONTENT_EOS = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"


def test_special_tokens_may_be_added_token_dicts_and_templates_a_named_list(
    tmp_path: Path,
) -> None:
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {
                "name": "default",
                "template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}",
            },
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert _template(tmp_path).render([USER]) == "<s>  What is the capital of France?\n</s>"
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="no 'default' template"):
        ChatTemplate.from_model_dir(tmp_path)


def test_extra_variables_and_tojson_render_as_transformers_does(
    model_dirs: dict[str, Path],
) -> None:
    source = (
        "{% if tools is not none %}{{ tools | tojson }}{% endif %}"
        "{% for m in messages %}{{ m | tojson(indent=2) }}{% endfor %}"
        "{% if enable_thinking is defined %}{{ enable_thinking }}{% endif %}"
    )
    template = ChatTemplate(source)
    tools = [{"type": "function", "function": {"name": "f", "description": "<é & ü>"}}]
    messages = [{"role": "user", "content": "<b>ünï</b>"}]
    ours = template.render(messages, tools=tools, enable_thinking=False)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama3"])
    theirs = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=source, tokenize=False, enable_thinking=False
    )
    assert ours == theirs
    assert template.render(messages) == json.dumps(messages[0], indent=2, ensure_ascii=False)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__ }}",
        "{{ ''.__class__.__mro__ }}",
        "{{ messages['__class__'] }}",
        "{{ raise_exception.__globals__ }}",
        "{% set ns = namespace(__init__=1) %}",
        "{{ messages.append(1) }}",
    ],
)
def test_the_sandbox_refuses_reaching_into_python(source: str) -> None:
    with pytest.raises(ChatTemplateError, match=r"unsafe|may not be named"):
        ChatTemplate(source).render([USER])


def test_a_template_that_fails_or_does_not_compile_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 / 0 }}").render([USER])
    with pytest.raises(ChatTemplateError, match="content must be a string") as info:
        ChatTemplate("").render([USER, {"role": "user", "content": 3}])
    assert info.value.param == "messages[1].content"


def test_loop_controls_strftime_and_generation_tags_are_available() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}"
        "{{ strftime_now('%Y') | length }}"
    )
    assert ChatTemplate(source).render([USER, ASSISTANT]) == "user4"


def test_rendering_leaves_the_callers_messages_unchanged(model_dirs: dict[str, Path]) -> None:
    parts = [{"type": "text", "text": "hi"}]
    messages = [{"role": "user", "content": parts, "name": None}]
    _template(model_dirs["qwen2"]).render(messages)
    assert messages == [{"role": "user", "content": parts, "name": None}]


def test_extra_variables_cannot_replace_the_messages(model_dirs: dict[str, Path]) -> None:
    template = _template(model_dirs["qwen2"])
    extra = {"messages": [ASSISTANT], "bos_token": "<B>"}
    assert template.render([USER], **extra) == template.render([USER])
