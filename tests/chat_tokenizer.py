"""A character-level tokenizer with a tiny chat template, for chat-formatted benchmark prompts on
the tiny models (ids < 128; no download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiny_models import CharTokenizer, noisy_copy, tiny_model

__all__ = ["ChatCharTokenizer", "save_tiny_chat_pair"]


class ChatCharTokenizer(CharTokenizer):
    """:class:`CharTokenizer` plus ``apply_chat_template``: ``<u>content</u><a>`` as characters,
    returned as a dict like transformers' BatchEncoding (``as_list=True``: a plain list)."""

    chat_template = "<u>{content}</u><a>"
    eos_token_id = None

    def __init__(self, as_list: bool = False) -> None:
        self.as_list = as_list

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                            tokenize: bool = True) -> Any:
        text = "".join(f"<u>{m['content']}</u>" for m in messages) + ("<a>" if add_generation_prompt else "")
        if not tokenize:
            return text
        ids = self(text)["input_ids"]
        return ids if self.as_list else {"input_ids": ids, "attention_mask": [1] * len(ids)}


def save_tiny_chat_pair(folder: Path) -> tuple[Path, Path]:
    """A tiny llama target with a character-level fast tokenizer that has a chat template
    (``folder/target``) and a noisy copy as its drafter (``folder/draft``), saved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    target = tiny_model("llama", seed=0)
    target.save_pretrained(folder / "target")
    noisy_copy(target, 0.05, seed=1).save_pretrained(folder / "draft")
    tokenizer = Tokenizer(models.WordLevel({chr(i): i for i in range(128)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.decoder = decoders.Fuse()  # characters back without spaces between them
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?")
    fast.chat_template = ("{% for m in messages %}<u>{{ m['content'] }}</u>{% endfor %}"
                          "{% if add_generation_prompt %}<a>{% endif %}")
    fast.save_pretrained(folder / "target")
    return folder / "target", folder / "draft"
