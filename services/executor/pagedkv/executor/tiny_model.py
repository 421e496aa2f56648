"""A random tiny Hugging Face model with a byte-level tokenizer, made offline.

`make_tiny_model` writes a directory that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load like any hub checkpoint, so tests can compare the engine
with ``transformers`` ``generate`` token for token, and demos can serve text,
with nothing downloaded.

Token ids (the tokenizer knows ``NUM_TOKENIZER_TOKENS`` of them):

* ``0..255``: the bytes, id ``b`` is byte ``b`` (GPT-2 byte-level alphabet);
* ``BOS_TOKEN_ID`` 256 ``<bos>``, ``EOS_TOKEN_ID`` 257 ``<eos>``,
  ``PAD_TOKEN_ID`` 258 ``<pad>``;
* the vocabulary is exactly these 259 ids, so every generated token decodes
  to text.

Encoding adds no special tokens (callers prepend ``<bos>`` if they want it), so
decoding an encoding gives the text back exactly; text that spells a special
token, like ``"<eos>"``, encodes to that token, as usual in transformers. One
exception: for ``qwen2``, ``AutoTokenizer`` loads transformers'
``Qwen2Tokenizer`` whatever ``tokenizer_config.json`` says, which rebuilds the
pipeline with an NFC normalizer (and Qwen's split regex, harmless without
merges), so text not in NFC comes back normalized;
``tokenizers.Tokenizer.from_file`` stays exact.

The tokenizer config carries a small chat template (``CHAT_TEMPLATES``): a
Llama-3-style one (the default) or a Qwen2-style one, their markers spelled
as plain text (``<|eot_id|>`` is ten byte tokens here), so the tiny models
chat like real ones and tests can compare a rendered conversation with
transformers' ``apply_chat_template``.

Weights are float32, drawn from ``initializer_range`` 0.2: at the usual 0.02 a
tiny random model repeats one token forever, and a comparison against such
output hides bugs. llama and mistral have the same parameters, so one seed
gives both the same weights: they agree until mistral's sliding window drops a
key (transformers lets query position ``q`` see keys ``k`` with
``q - k < MISTRAL_SLIDING_WINDOW``, so from position 24 on).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

if TYPE_CHECKING:
    from tokenizers import Tokenizer

Arch = Literal["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma2", "gemma3"]
ARCHS: tuple[Arch, ...] = get_args(Arch)

NUM_BYTE_TOKENS = 256
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<bos>", "<eos>", "<pad>"
BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID = 256, 257, 258
NUM_TOKENIZER_TOKENS = 259
VOCAB_SIZE = NUM_TOKENIZER_TOKENS

HIDDEN_SIZE = 64
INTERMEDIATE_SIZE = 128
NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
MAX_POSITION_EMBEDDINGS = 1024
INITIALIZER_RANGE = 0.2
MISTRAL_SLIDING_WINDOW = 24
# gemma2 and gemma3: a sliding-window layer, then a full-attention one (two KV
# cache groups), the window as short as mistral's.
GEMMA_SLIDING_WINDOW = 24
GEMMA_LAYER_TYPES = ("sliding_attention", "full_attention")
DEFAULT_NUM_LAYERS = 2

ChatTemplateName = Literal["llama3", "qwen2", "none"]
CHAT_TEMPLATE_NAMES: tuple[ChatTemplateName, ...] = get_args(ChatTemplateName)
DEFAULT_CHAT_TEMPLATE: ChatTemplateName = "llama3"

LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ message['content'] | trim }}"
    "{{ '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
"""Llama 3's layout: the BOS, each message as a role header, the trimmed
content and an end marker, then the assistant's header when asked for."""

QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
"""Qwen2's layout: ChatML turns, with a default system message when the
conversation does not start with one."""

CHAT_TEMPLATES: dict[ChatTemplateName, str | None] = {
    "llama3": LLAMA3_CHAT_TEMPLATE,
    "qwen2": QWEN2_CHAT_TEMPLATE,
    "none": None,
}


def tiny_config(arch: Arch, num_layers: int = DEFAULT_NUM_LAYERS, head_dim: int = HEAD_DIM) -> Any:
    """The transformers config of a tiny ``arch`` model (float32, GQA).

    qwen2 has its built-in qkv bias and tied embeddings and no sliding window;
    llama and mistral are untied without bias; mistral attends within a sliding
    window of ``MISTRAL_SLIDING_WINDOW`` tokens. qwen3 normalises queries and
    keys per head; phi3 has one fused qkv and one gate/up projection. gemma2
    and gemma3 (model type ``gemma3_text``) alternate a layer of sliding
    window ``GEMMA_SLIDING_WINDOW`` and a full one, with their own norms
    around each sublayer, GELU and a scaled embedding; gemma2
    soft-caps attention and final logits, gemma3 normalises queries and keys
    and gives the two layer types rotaries of different bases. With more than
    two layers the gemma layer types repeat. ``head_dim`` (all but qwen2
    and phi3, whose heads split the hidden size) defaults to 16, also for
    the gemmas (their default is 256). Only qwen2 ties its embeddings: tied, a tiny
    random gemma or qwen3 soon repeats one token.
    """
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        initializer_range=INITIALIZER_RANGE,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        dtype="float32",
    )
    if arch == "llama":
        return LlamaConfig(**common, head_dim=head_dim, tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(
            **common,
            head_dim=head_dim,
            tie_word_embeddings=False,
            sliding_window=MISTRAL_SLIDING_WINDOW,
        )
    if arch == "qwen2":
        # Qwen2Config has no head_dim: it is hidden_size // num_attention_heads.
        return Qwen2Config(
            **common, tie_word_embeddings=True, use_sliding_window=False, sliding_window=None
        )
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)
    if arch == "phi3":
        return Phi3Config(
            **common,
            tie_word_embeddings=False,
            original_max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        )
    if arch in ("gemma2", "gemma3"):
        gemma = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
        layer_types = [GEMMA_LAYER_TYPES[i % 2] for i in range(num_layers)]
        return gemma(
            **common,
            head_dim=head_dim,
            query_pre_attn_scalar=head_dim,
            tie_word_embeddings=False,
            sliding_window=GEMMA_SLIDING_WINDOW,
            layer_types=layer_types,
        )
    raise ValueError(f"unknown arch {arch!r}; expected one of {', '.join(ARCHS)}")


def byte_level_tokenizer() -> Tokenizer:
    """A tokenizer with one token per byte (id = byte value) and the specials.

    BPE without merges over the 256-character byte-level alphabet: the
    ByteLevel pre-tokenizer (no regex, no prefix space) turns every byte into
    its alphabet character, the model maps each character to its id, and the
    ByteLevel decoder maps characters back to bytes.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    assert set(byte_chars.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {byte_chars[b]: b for b in range(NUM_BYTE_TOKENS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    ids = [tokenizer.token_to_id(t) for t in specials]
    assert ids == [BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID], ids
    assert tokenizer.get_vocab_size() == NUM_TOKENIZER_TOKENS
    return tokenizer


def make_tiny_model(
    path: str | Path,
    arch: Arch,
    seed: int = 0,
    num_layers: int = DEFAULT_NUM_LAYERS,
    chat_template: ChatTemplateName = DEFAULT_CHAT_TEMPLATE,
    head_dim: int = HEAD_DIM,
) -> None:
    """Write a random tiny ``arch`` model and the byte-level tokenizer into ``path``.

    The directory (created if missing; existing files of the same name are
    overwritten) gets ``config.json``, ``generation_config.json``,
    ``model.safetensors`` (float32), ``tokenizer.json`` and
    ``tokenizer_config.json`` (with ``CHAT_TEMPLATES[chat_template]`` as its
    ``chat_template``, none for ``"none"``). Weights are drawn after
    ``torch.manual_seed(seed)``, so one seed gives byte-identical weight
    files. Reseeds torch's global RNG. ``head_dim``: see ``tiny_config``.
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, num_layers, head_dim)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.bos_token_id = BOS_TOKEN_ID
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    model.save_pretrained(out)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_level_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,  # saved as null: else Qwen2Tokenizer adds an unk "<|endoftext|>"
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    template = CHAT_TEMPLATES[chat_template]
    if template is not None:
        tokenizer.chat_template = template
    # A template goes into tokenizer_config.json, not chat_template.jinja:
    # the older place, which every loader reads.
    tokenizer.save_pretrained(out, save_jinja_files=False)
