"""Chat messages -> prompt text with the model's chat template (``chat_template`` in ``tokenizer_config.json``),
rendered the way ``transformers`` renders it (``PreTrainedTokenizerBase.apply_chat_template``): a sandboxed
jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and ``strftime_now``
globals, ``tojson`` that keeps non-ASCII characters, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables. The rendered text is tokenized without adding special tokens, as
transformers does for a rendered template.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """The template refused the messages (``raise_exception``) or failed to render."""


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(v) -> str:
    """A special token in tokenizer_config.json is a string or an AddedToken dict (``{"content": ...}``)."""
    return v.get("content", "") if isinstance(v, dict) else (v or "")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_model_dir(cls, model_dir: str | None) -> "ChatTemplate | None":
        """The template of ``tokenizer_config.json`` (or a ``chat_template.jinja`` beside it); None without one.
        A list of named templates (``[{"name": "default", "template": ...}]``) uses the one named default."""
        if not model_dir:
            return None
        try:
            with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            cfg = {}
        source = cfg.get("chat_template")
        if isinstance(source, list):
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if not source and os.path.exists(jinja_path):
            with open(jinja_path) as f:
                source = f.read()
        if not source:
            return None
        tokens = {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKEN_KEYS}
        try:
            return cls(source, tokens)
        except TemplateError as e:
            logger.warning("the chat template of %s does not compile (%s): chat completions are off", model_dir, e)
            return None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens, **kwargs)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
