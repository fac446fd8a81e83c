"""Tokenizer and chat template from the model's own source (a GGUF file or a HF directory).

The template is rendered with jinja2 (as HF transformers does); without a template in the source,
ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``) is used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from ngram_common.tokenizer import tokenizer_from_gguf

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@dataclass
class TextCodec:
    tokenizer: Tokenizer
    chat_template: str
    eos_token_ids: tuple[int, ...]
    bos_token: str = ""
    eos_token: str = ""

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: expected {{'role': str, 'content': str}}, got {m!r}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token)


def codec_from_gguf(path: str | os.PathLike[str], reader, eos_token_ids: tuple[int, ...]) -> TextCodec:
    tok = tokenizer_from_gguf(path)
    f = reader.fields.get("tokenizer.chat_template")
    template = f.contents() if f is not None else CHATML
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    bos = reader.fields.get("tokenizer.ggml.bos_token_id")
    return TextCodec(tok, template, eos_token_ids, tokens[bos.contents()] if bos is not None else "",
                     tokens[eos_token_ids[0]] if eos_token_ids else "")


def codec_from_hf_dir(path: Path, eos_token_ids: tuple[int, ...]) -> TextCodec:
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(f"{tok_file} is missing (the model directory needs its tokenizer.json)")
    tok = Tokenizer.from_file(os.fspath(tok_file))
    conf = json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
    template = conf.get("chat_template") or CHATML
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])

    def token_str(v) -> str:
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    eos = token_str(conf.get("eos_token"))
    ids = eos_token_ids or ((tok.token_to_id(eos),) if eos and tok.token_to_id(eos) is not None else ())
    return TextCodec(tok, template, tuple(ids), token_str(conf.get("bos_token")), eos)
