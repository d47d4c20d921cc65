"""A character-level tokenizer for the tiny CPU demo model, built locally (no hub download)."""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict

from splitrl.config_types import UserPath

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
# Every printable ASCII character plus newline: digits, letters, punctuation (which holds
# ``> , = + - *``) and space.
CHARACTERS = string.digits + string.ascii_lowercase + string.ascii_uppercase + string.punctuation + " \n"


def build_char_tokenizer(charset: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character: 4 special ids + one per character.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, then the characters of ``charset``
    (default :data:`CHARACTERS`, 96 of them, 100 ids in all) in order. A small charset (only the
    characters a task uses) gives a random-init policy a far better first guess: with 22 ids a
    random character is right 1 time in 22 instead of 1 in 100. Encoding adds no special tokens, so ``len(ids) == len(text)``;
    decoding concatenates the characters, so ``decode(encode(text)) == text`` for text made of
    :data:`CHARACTERS`. Any other character (``"é"``, a tab) encodes to ``<unk>`` — one id per
    character still — and therefore does not round-trip; decoding with
    ``skip_special_tokens=True`` drops it. There is no chat template, so prompts go to the model
    as plain text. A literal special-token string in the text (``"<eos>"``) encodes to that
    special token's single id. It saves with ``save_pretrained(dir)`` and reloads with
    ``transformers.AutoTokenizer.from_pretrained(dir)``.
    """
    # Imported here: transformers pulls in torch, which scoring processes have no use for.
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = CHARACTERS if charset is None else charset
    if len(set(chars)) != len(chars):
        raise ValueError(f"charset {chars!r} repeats characters; give each character once")
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *chars))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Every single character (newline included) is its own pre-token, hence its own id.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
    )


class TokenizerConfig(BaseModel):
    """Which tokenizer: the built-in character tokenizer of the CPU demo, or a local HF directory.

    Attributes:
        kind: ``char`` or ``pretrained``.
        path: directory for ``pretrained`` (default: the model's ``pretrained_path``).
        charset: the characters of a ``char`` tokenizer (default: all printable ASCII); the
            model's ``vocab_size`` must be at least 4 + len(charset).
    """

    model_config = ConfigDict(extra="forbid")

    kind: Literal["char", "pretrained"] = "char"
    path: UserPath | None = None
    charset: str | None = None
