"""Caption tokenizer: open_clip's CLIP BPE (the vocabulary ships inside the open_clip wheel, works offline)."""

from __future__ import annotations

import torch
from open_clip.tokenizer import SimpleTokenizer

TEXT_VOCABULARIES = ("full", "shapes")


class TextTokenizer:
    """Turns captions into fixed-length rows of CLIP BPE ids for the DALL-E text block.

    Each row is the caption's BPE ids followed by CLIP's end-of-text id, then 0-padding up to
    `text_seq_len`. Captions that are too long are cut, and the last kept position is end-of-text.
    No start-of-text id: the model prepends its own <bos>. Pads are 0 (which is also the id of "!" in
    CLIP's vocabulary; the model treats every 0 as padding, so a "!" is simply dropped).

    Args:
        text_seq_len: number of text positions per row (ids per caption, including end-of-text).
    """

    vocab_size = 49408

    def __init__(self, text_seq_len: int = 32):
        if text_seq_len < 2:
            raise ValueError(f"text_seq_len must be >= 2 (one token plus end-of-text), got {text_seq_len}")
        self.text_seq_len = text_seq_len
        self.bpe = SimpleTokenizer()
        self.eot_id = self.bpe.eot_token_id
        self.sot_id = self.bpe.sot_token_id
        assert len(self.bpe.encoder) == self.vocab_size

    def encode(self, caption: str) -> list[int]:
        """BPE ids of one caption, cut to text_seq_len - 1, then end-of-text."""
        return self.bpe.encode(caption)[: self.text_seq_len - 1] + [self.eot_id]

    def __call__(self, captions: list[str] | str) -> torch.Tensor:
        """LongTensor [len(captions), text_seq_len] of ids, 0-padded."""
        if isinstance(captions, str):
            captions = [captions]
        ids = torch.zeros(len(captions), self.text_seq_len, dtype=torch.long)
        for row, caption in enumerate(captions):
            tokens = self.encode(caption)
            ids[row, : len(tokens)] = torch.tensor(tokens)
        return ids

    def decode(self, ids: torch.Tensor | list[int]) -> str:
        """Caption text of one row of ids (stops at end-of-text, ignores pads and start-of-text)."""
        ids = torch.as_tensor(ids).tolist()
        kept = []
        for token in ids:
            if token == self.eot_id:
                break
            if token != 0 and token != self.sot_id:
                kept.append(token)
        return self.bpe.decode(kept).strip()


def shapes_token_ids() -> tuple[int, ...]:
    """The CLIP BPE ids of every caption of the embedded shapes data (its words and end-of-text), sorted: the
    compact text vocabulary of `DALLEConfig.text_token_ids` for the tiny recipe. BPE splits text into words
    before merging, so a word has the same ids alone as inside a caption."""
    from recipes.shapes import caption_words

    tokenizer = TextTokenizer(text_seq_len=2)
    ids = {token for word in caption_words() for token in tokenizer.bpe.encode(word)}
    return tuple(sorted(ids | {tokenizer.eot_id}))


def text_token_ids(vocabulary: str) -> tuple[int, ...] | None:
    """`DALLEConfig.text_token_ids` of a named text vocabulary: "full" (None: every CLIP BPE id has a row) or
    "shapes" (`shapes_token_ids`)."""
    if vocabulary not in TEXT_VOCABULARIES:
        raise ValueError(f"unknown text vocabulary {vocabulary!r}; use one of {TEXT_VOCABULARIES}")
    return shapes_token_ids() if vocabulary == "shapes" else None
