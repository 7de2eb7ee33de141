"""The tokenizer files of a Hugging Face model repository, written from a k2lab ``Tokenizer`` (no transformers
needed to write them).

* ``tokenizer.json``: the byte-level BPE itself (``tokenizers.Tokenizer.to_str``), read by ``tokenizers``
  and by transformers' fast tokenizers;
* ``tokenizer_config.json``: ``tokenizer_class`` ``PreTrainedTokenizerFast`` (transformers 4 and 5 load it
  with ``AutoTokenizer``), ``bos_token`` / ``eos_token`` / ``pad_token`` our ``<|bos|>`` / ``<|eos|>`` /
  ``<|pad|>`` and ``unk_token`` null (a byte-level BPE never needs one: any text encodes), every special token
  in ``added_tokens_decoder`` (id -> content and flags, as in ``tokenizer.json``) and the chat and media
  tokens as ``additional_special_tokens`` (transformers 5 reads them as its ``extra_special_tokens``; a
  list under that name would break transformers 4, which expects a dict there), the ``chat_template`` and
  ``clean_up_tokenization_spaces`` false (decoding gives back the exact text);
* ``special_tokens_map.json``: the same roles, for older readers;
* ``chat_template.jinja``: the template again as its own file, as transformers 5 saves it.

Without ``unk_token`` set explicitly transformers would add ``<unk>`` (and ``<s>`` / ``</s>`` without
bos/eos) past the vocabulary, which llama.cpp's converter rejects (issue 23).
"""

from __future__ import annotations

import json
from typing import Any

from k2lab.data.tokenizer import Tokenizer
from k2lab.errors import K2LabError

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "SPECIAL_TOKENS_MAP_FILE",
    "TOKENIZER_CONFIG_FILE",
    "TOKENIZER_FILE",
    "tokenizer_files",
]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _dump(data: Any) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def special_token_roles(tokenizer: Tokenizer) -> dict[str, str | None]:
    """``bos_token`` / ``eos_token`` / ``pad_token`` / ``unk_token`` -> token string (None when absent)."""
    backend = tokenizer.backend

    def content(token_id: int | None) -> str | None:
        return None if token_id is None else backend.id_to_token(token_id)

    return {
        "bos_token": content(tokenizer.bos_id),
        "eos_token": content(tokenizer.eos_id),
        "pad_token": content(tokenizer.pad_id),
        "unk_token": None,
    }


def added_tokens_decoder(tokenizer: Tokenizer) -> dict[str, dict[str, Any]]:
    """``{"id": {"content", "lstrip", "normalized", "rstrip", "single_word", "special"}}`` for every added token."""
    added = tokenizer.backend.get_added_tokens_decoder()
    return {
        str(index): {
            "content": token.content,
            "lstrip": token.lstrip,
            "normalized": token.normalized,
            "rstrip": token.rstrip,
            "single_word": token.single_word,
            "special": token.special,
        }
        for index, token in sorted(added.items())
    }


def tokenizer_files(tokenizer: Tokenizer, chat_template: str, model_max_length: int) -> dict[str, str]:
    """File name -> text of the four tokenizer files (see the module docstring).

    Raises ``K2LabError`` when the tokenizer's model is not byte-level BPE (the only kind k2lab trains,
    whose files transformers reads without a tokenizer class of its own)."""
    model_type = json.loads(tokenizer.backend.to_str()).get("model", {}).get("type")
    if model_type != "BPE":
        raise K2LabError(f"the tokenizer's model is {model_type!r}; the export writes BPE tokenizers only")
    roles = special_token_roles(tokenizer)
    role_tokens = {value for value in roles.values() if value is not None}
    extra = [token for token in tokenizer.special_tokens if token not in role_tokens]
    config = {
        "added_tokens_decoder": added_tokens_decoder(tokenizer),
        **roles,
        "additional_special_tokens": extra,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {key: value for key, value in roles.items() if value is not None}
    return {
        TOKENIZER_FILE: tokenizer.backend.to_str(),
        TOKENIZER_CONFIG_FILE: _dump(config),
        SPECIAL_TOKENS_MAP_FILE: _dump({**special_map, "additional_special_tokens": extra}),
        CHAT_TEMPLATE_FILE: chat_template,
    }
