"""Models named by a Hugging Face id are found in the local cache, never downloaded.

A fake cache laid out as huggingface_hub lays one out
(``models--org--name/refs/main`` and ``snapshots/<commit>/``) holds a tiny
model; every part that takes a model reads it through the id.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.common.model_source import (
    ModelNotFound,
    cached_snapshot,
    hub_cache_dir,
    is_hub_id,
    resolve_model,
)

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "tiny-org/tiny-llama"


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the cache tests look up: a config, a word-level tokenizer of two
    words and a chat template (quick to make; no weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = tmp_path_factory.mktemp("files") / "model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    tokenizer = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "<unk>": 2}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "chat_template": "{{ bos_token }}{{ messages[0].content }}"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama (with its chat template), made once."""
    directory = tmp_path_factory.mktemp("tiny") / "llama"
    pagedkv = Path(sys.executable).parent / "pagedkv"
    subprocess.run(
        [str(pagedkv), "make-tiny-model", str(directory), "--arch", "llama"],
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    return directory


def cache_model(cache: Path, repo_id: str, files: Path, commit: str = COMMIT) -> Path:
    """Lays ``files`` out as ``repo_id`` at revision main in the hub cache ``cache``."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(files, snapshot)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty hub cache named by HF_HUB_CACHE (the other variables unset)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    for name in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_directory_is_its_own_model(tmp_path: Path) -> None:
    assert resolve_model(str(tmp_path)) == tmp_path


def test_a_cached_id_is_the_snapshot_that_refs_main_names(
    hub_cache: Path, model_files: Path
) -> None:
    snapshot = cache_model(hub_cache, REPO_ID, model_files)
    assert resolve_model(REPO_ID) == snapshot
    assert (resolve_model(REPO_ID) / "config.json").is_file()


def test_the_cache_is_hf_hub_cache_else_hf_home_hub_else_xdg_else_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert hub_cache_dir() == tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hub_cache_dir() == tmp_path / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hub_cache_dir() == tmp_path / "hub"


def test_the_cache_is_where_huggingface_hub_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same directory as huggingface_hub's constants, in a fresh process."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    code = "from huggingface_hub import constants; print(constants.HF_HUB_CACHE)"
    theirs = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(theirs) == hub_cache_dir()


def test_an_id_found_through_hf_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_files: Path
) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    snapshot = cache_model(tmp_path / "hf-home" / "hub", "solo-name", model_files)
    assert resolve_model("solo-name") == snapshot


def test_an_uncached_id_says_where_it_was_looked_for(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFound) as info:
        resolve_model("org/absent")
    assert str(info.value) == (
        f"not a directory and not in the Hugging Face cache at {hub_cache} "
        "(models are not downloaded at run time; set HF_HUB_CACHE or HF_HOME)"
    )


def test_a_cached_id_whose_ref_names_no_snapshot_is_not_cached(
    hub_cache: Path, model_files: Path
) -> None:
    cache_model(hub_cache, REPO_ID, model_files)
    ref = hub_cache / "models--tiny-org--tiny-llama" / "refs" / "main"
    ref.write_text("f" * 40)
    assert cached_snapshot(REPO_ID) is None
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache"):
        resolve_model(REPO_ID)


def test_paths_that_are_no_id_are_no_such_directory(hub_cache: Path, tmp_path: Path) -> None:
    for name in ("/no/such/dir", "./relative", "a/b/c", "org/-bad", "org--x/y", "a..b"):
        assert not is_hub_id(name)
        with pytest.raises(ModelNotFound, match=r"^no such directory$"):
            resolve_model(name)
    (tmp_path / "file").write_text("")
    with pytest.raises(ModelNotFound, match=r"^not a directory$"):
        resolve_model(str(tmp_path / "file"))
    assert all(is_hub_id(n) for n in ("gpt2", "Qwen/Qwen2.5-0.5B-Instruct", "a_b/c.d-e"))


def test_the_tokenizer_and_chat_template_load_from_an_id(
    hub_cache: Path, model_files: Path
) -> None:
    from pagedkv.common.text import TextTokenizer
    from pagedkv.gateway.chat_template import ChatTemplate

    cache_model(hub_cache, REPO_ID, model_files)
    tokenizer = TextTokenizer.from_model_dir(REPO_ID)
    assert tokenizer is not None
    assert tokenizer.encode("world hello") == [1, 0]
    assert TextTokenizer.from_model_dir("org/absent") is None
    template = ChatTemplate.from_model_dir(resolve_model(REPO_ID))
    assert template is not None
    assert template.render([{"role": "user", "content": "hi"}]) == "<s>hi"


def test_scheduler_and_router_refuse_an_uncached_model_in_one_line(
    hub_cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pagedkv.common.cli import main

    for command in ("scheduler", "router"):
        argv = [command, "--model", "org/absent", "--redis-url", "redis://127.0.0.1:1/0"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err == (
            f"pagedkv {command}: --model org/absent: not a directory and not in the Hugging "
            f"Face cache at {hub_cache} (models are not downloaded at run time; set "
            "HF_HUB_CACHE or HF_HOME)\n"
        )


@pytest.mark.slow  # a tiny model made, an executor, a scheduler and a gateway started: ~20 s
def test_serve_of_a_cached_id_generates_text_over_grpc_and_http(
    hub_cache: Path, tiny_model: Path
) -> None:
    """``pagedkv serve org/name --http-port``: the executor loads the
    snapshot, the scheduler encodes text with its tokenizer, the gateway
    renders chats with its template."""
    import httpx

    from pagedkv.client import Client
    from pagedkv.common.text import TextTokenizer
    from pagedkv.gateway.chat_template import ChatTemplate
    from tests.gateway.stack import ServeWithGateway

    snapshot = cache_model(hub_cache, REPO_ID, tiny_model)
    with ServeWithGateway(REPO_ID, num_blocks=32) as stack:  # type: ignore[arg-type]
        assert f"model {REPO_ID}" in stack.ready_line
        with Client(stack.target, timeout=60) as client:
            completion = client.generate_text("Hello", max_tokens=4, temperature=0)
        assert completion.usage.prompt_tokens == 5
        assert len(completion.token_ids[0]) == 4
        messages = [{"role": "user", "content": "Hi"}]
        body = {"model": REPO_ID, "messages": messages, "max_tokens": 4, "temperature": 0}
        response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    template = ChatTemplate.from_model_dir(snapshot)
    tokenizer = TextTokenizer.from_model_dir(snapshot)
    assert template is not None and tokenizer is not None
    prompt_ids = tokenizer.encode(template.render(messages))
    assert prompt_ids[0] == 256  # the template's bos_token, one token
    assert response.json()["usage"]["prompt_tokens"] == len(prompt_ids)
