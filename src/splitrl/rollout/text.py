"""From generated token ids to text: decoding a response and cutting it at a stop string
(DESIGN §5: generation stops at EOS or stop strings). Used by the generation workers and by
evaluation alike; no torch."""

from __future__ import annotations


def cut_at_stop_string(ids: list[int], decode, stop_strings: list[str]) -> int | None:
    """Number of tokens up to and including the first one whose text completes a stop string,
    or None when no stop string occurs. ``decode(ids) -> str``."""
    if not stop_strings or not any(s in decode(ids) for s in stop_strings):
        return None
    for n in range(1, len(ids) + 1):
        text = decode(ids[:n])
        if any(s in text for s in stop_strings):
            return n
    return None


def decode_response(tokenizer, ids: list[int]) -> str:
    """The text of generated ids, special tokens dropped.

    A model whose vocabulary is larger than the tokenizer's (padded embeddings, a random-init
    model) can sample ids the tokenizer has no text for: they decode as unknown (dropped when the
    tokenizer has no unknown token)."""
    n = len(tokenizer)
    unk = tokenizer.unk_token_id
    ids = [i if i < n else unk for i in ids if i < n or unk is not None]
    return tokenizer.decode(ids, skip_special_tokens=True)
