"""What the model's bits per byte is compared with: general-purpose compressors on the same bytes.

`compressor_bpb` runs Python's gzip, bz2 and lzma at the settings of `gzip -9`, `bzip2 -9` and
`xz -9e` on one byte string and returns 8 * compressed size / input size for each. The trainer feeds it
`eval_set_bytes`: the validation documents concatenated in the fixed evaluation order
(k3.data.eval_set), i.e. exactly the bytes whose targets the final evaluation scores. Concatenated,
not file by file, so the compressors may use what one file says about the next (the model, whose
context ends at each document, may not): the comparison favours them. Containers' headers (gzip's 18
bytes, xz's ~60) are counted, as a file on disk would have them.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
from collections.abc import Callable

import numpy as np

from k3.data import TokenizedDocs
from k3.data.eval_set import IGNORE_INDEX, EvalSet

COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {
    "gzip -9": lambda b: gzip.compress(b, compresslevel=9, mtime=0),
    "bz2 -9": lambda b: bz2.compress(b, compresslevel=9),
    "xz -9e": lambda b: lzma.compress(b, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME),
}


def compressor_bpb(data: bytes) -> dict[str, float]:
    """{compressor name: bits per input byte} for every entry of COMPRESSORS; `data` must be non-empty."""
    if not data:
        raise ValueError("data: nothing to compress")
    return {name: 8 * len(fn(data)) / len(data) for name, fn in COMPRESSORS.items()}


def eval_set_bytes(docs: TokenizedDocs, order: np.ndarray, tokenizer, token_bytes: np.ndarray) -> bytes:
    """UTF-8 bytes of the documents of `docs` in `order`, decoded from their tokens (byte-level BPE is
    lossless); raises ValueError if they differ from the bytes the evaluation counts (`token_bytes`)."""
    texts = [tokenizer.decode(docs.doc(int(d)).tolist()).encode("utf-8") for d in order]
    data = b"".join(texts)
    counted = int(np.asarray(token_bytes)[np.asarray(docs.tokens)].sum())
    if len(data) != counted:
        raise ValueError(
            f"docs: the decoded validation text has {len(data)} bytes but its tokens stand for {counted}; "
            "the compressors would not see the scored bytes"
        )
    return data


def eval_rows_bytes(es: EvalSet, rows: int, tokenizer) -> bytes:
    """UTF-8 text of the targets of the first `rows` rows of `es` (what an evaluation bounded to them
    scores; each EOS ends a document and stands for no bytes). The cut at the last row may split a
    character whose bytes span two tokens: its decoding then differs from the counted bytes by at most
    three bytes, nothing next to the thousands a bound leaves."""
    labels = es.labels[:rows].flatten()
    ids = labels[labels != IGNORE_INDEX].tolist()
    pieces, start = [], 0
    for i, t in enumerate([*ids, tokenizer.eos_id]):
        if t == tokenizer.eos_id:
            pieces.append(tokenizer.decode(ids[start:i]).encode("utf-8"))
            start = i + 1
    return b"".join(pieces)
