"""K3Tokenizer: byte-level BPE with the K3 reserved-token block (docs/spec_text.md#tokenizer), trained or
loaded.

Layout. Ids ``0 .. base-1`` are ordinary BPE tokens; the last 256 ids ``base .. base+255`` are the
reserved block, ``base = vocab_size - 256``. Offsets inside the block mirror the released tokenizer,
where ``base = 163584`` (163,584 tiktoken ranks) and ``vocab_size = 163840``:

    +0 [BOS]   +1 [EOS]   +2 <|end_of_msg|> (eos_id, the stop token)   +3 <|open|>  +4 <|close|>  +5 <|sep|>
    +6 [start_header_id]  +7 [end_header_id]  +9 [EOT]  +18..+21 <|media_begin|> <|media_content|>
    <|media_end|> <|media_pad|>   +65 <osagent_mode>   +254 [UNK]   +255 [PAD]

Other slots are ``<|reserved_token_ID|>`` (ID = the absolute id). All reserved tokens are "special"
(dropped by ``decode(skip_special=True)``) except the XTML markers ``<|open|> <|close|> <|sep|>``.

Forgery: ordinary text never encodes to a reserved id (`K3Tokenizer.encode`). Pre-tokenisation: Kimi
K2's split (`PRE_TOKENIZER_PATTERN`, commented there).

Backends. A trained tokenizer uses HF ``tokenizers`` (byte-level BPE). :meth:`K3Tokenizer.save` writes
``tokenizer.json`` (HF), ``tiktoken.model`` (the release's base64-token/rank lines, ranks = ids) and
``tokenizer_config.json`` (the release's ``added_tokens_decoder`` layout plus the chat template,
``k3/chat_template.jinja``). ``K3Tokenizer.from_dir`` reads ``tokenizer.json`` when present, else the
official ``tiktoken.model`` through the optional ``tiktoken`` package. :mod:`k3.tokenizer_export` has the
rank and GGUF views (:meth:`K3Tokenizer.gguf_vocab`).

Training and the cache of trained tokenizers are :mod:`k3.tokenizer_train`.
"""

from __future__ import annotations

import base64
import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from k3.tokenizer_export import gguf_vocab, merges_from_ranks, token_bytes, write_tiktoken_model

NUM_RESERVED = 256
MIN_VOCAB_SIZE = 256 + NUM_RESERVED  # every byte plus the reserved block
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_MAX_TRAIN_BYTES = 256 * 2**20  # the stdlib (~31 MB) trains in full
DEFAULT_MODEL_MAX_LENGTH = 1_048_576  # config.json max_position_embeddings
FORMAT_VERSION = 2  # what a cached tokenizer encodes (2: Kimi K2's split); another version is retrained
# Pre-tokenisation. Kimi K2's split (docs/spec_text.md#tokenizer gives K3 K2's regex, unverified there, §8.9;
# llama.cpp's converter assumes the same), PRE_TOKENIZER_PATTERN: Han runs; letter runs of one case shape
# (capitals then lower case, or capitals only; Han excluded, marks included) with one optional leading
# non-letter and an optional English contraction; digit groups of at most 3; punctuation runs with trailing
# newlines; newline runs; other whitespace. It is the `pat_str` that the release's
# `tokenization_kimi.py` gives tiktoken, so a trained tokenizer exported as `tiktoken.model` encodes
# identically under tiktoken, and a GGUF can declare llama.cpp's `kimi-k2` pre-tokenizer (which departs
# from the regex on combining marks, a few Han-script characters such as 々, and case changes after
# kana/Hangul; the interop docs give examples). The regex only changes how text is cut before BPE, so
# any pattern decodes losslessly; a `tokenizer.json` carries its own pattern, so tokenizers trained
# with an older split still load and encode as trained.
# the two sides of a word; `&&` intersects sets (Oniguruma, tiktoken's regex, `regex` V1): not Han
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_LEAD = r"[^\r\n\p{L}\p{N}]?"  # one optional non-letter, non-digit, non-newline before a word
PRE_TOKENIZER_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        f"{_LEAD}{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",  # "Word", "word": capitals, lower case
        f"{_LEAD}{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",  # "WORD" (and what the first leaves)
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",  # a whitespace run leaves its last space to the word after it
        r"\s+",
    ]
)
_ADDED_TOKEN_FLAGS = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)  # as released
# offset in the reserved block -> (name, special); docs/spec_text.md#tokenizer
_NAMED_RESERVED = {
    0: ("[BOS]", True),
    1: ("[EOS]", True),
    2: ("<|end_of_msg|>", True),
    3: ("<|open|>", False),
    4: ("<|close|>", False),
    5: ("<|sep|>", False),
    6: ("[start_header_id]", True),
    7: ("[end_header_id]", True),
    9: ("[EOT]", True),
    18: ("<|media_begin|>", True),
    19: ("<|media_content|>", True),
    20: ("<|media_end|>", True),
    21: ("<|media_pad|>", True),
    65: ("<osagent_mode>", True),
    254: ("[UNK]", True),
    255: ("[PAD]", True),
}


@dataclass(frozen=True)
class ReservedToken:
    id: int
    name: str
    special: bool  # dropped by decode(skip_special=True)


def reserved_tokens(base: int) -> list[ReservedToken]:
    """The 256 reserved tokens with ids ``base .. base+255`` (``base=163584`` gives the official ids)."""
    out = []
    for off in range(NUM_RESERVED):
        name, special = _NAMED_RESERVED.get(off, (f"<|reserved_token_{base + off}|>", True))
        out.append(ReservedToken(base + off, name, special))
    return out


def pre_tokenize(text: str, pattern: str = PRE_TOKENIZER_PATTERN) -> list[str]:
    """The pieces ``pattern`` cuts ``text`` into before BPE (HF ``tokenizers``' Oniguruma engine)."""
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    return [piece for piece, _ in split.pre_tokenize_str(text)]


class _HFBackend:
    """Ordinary ids only: an HF ``tokenizers.Tokenizer`` without added tokens."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        # the batch call releases the GIL (`encode` holds it: seconds for a megabyte, every other
        # thread of the process stopped) and skips the offsets nobody reads here; the same ids
        return self.tok.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def ranks(self) -> dict[bytes, int]:
        return {token_bytes(s): i for s, i in self.tok.get_vocab().items()}

    def merges(self) -> list[tuple[bytes, bytes]]:
        pairs = json.loads(self.tok.to_str())["model"]["merges"]  # [a, b] lists, or "a b" in old files
        return [tuple(map(token_bytes, p.split(" ") if isinstance(p, str) else p)) for p in pairs]


class _TiktokenBackend:
    """Ordinary ids only: a ``tiktoken.Encoding`` over the mergeable ranks, no special tokens."""

    def __init__(self, ranks: dict[bytes, int], pat_str: str):
        tiktoken = _import_tiktoken()
        self._ranks = ranks
        self.enc = tiktoken.Encoding("k3", pat_str=pat_str, mergeable_ranks=ranks, special_tokens={})

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode_bytes(ids).decode("utf-8", errors="replace")

    def ranks(self) -> dict[bytes, int]:
        return dict(self._ranks)

    def merges(self) -> list[tuple[bytes, bytes]]:
        return merges_from_ranks(self._ranks)


def _import_tiktoken():
    try:
        import tiktoken
    except ImportError as e:
        raise ImportError(
            "loading a tiktoken.model tokenizer needs the tiktoken package: pip install tiktoken"
        ) from e
    return tiktoken


def byte_level_bpe(model):
    """An HF ``tokenizers.Tokenizer`` over the BPE ``model``, cut by PRE_TOKENIZER_PATTERN (read when
    called) and then byte-level: what trained and GGUF-read tokenizers alike encode with."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers

    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


class K3Tokenizer:
    """Ordinary BPE ids ``[0, base)`` plus the reserved block ``[base, base+256)``; see the module doc."""

    def __init__(
        self,
        backend,
        base: int,
        reserved: Sequence[ReservedToken] | None = None,
        pat_str: str = PRE_TOKENIZER_PATTERN,
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
        max_train_bytes: int | None = None,
    ):
        self._backend = backend
        self.base = base
        self.reserved = list(reserved) if reserved is not None else reserved_tokens(base)
        if [t.id for t in self.reserved] != list(range(base, base + NUM_RESERVED)):
            raise ValueError(f"reserved must hold ids {base}..{base + NUM_RESERVED - 1} in order")
        self._by_name = {t.name: t for t in self.reserved}
        names = sorted(self._by_name, key=len, reverse=True)
        self._reserved_re = re.compile("|".join(re.escape(n) for n in names))
        self.pat_str = pat_str
        self.model_max_length = model_max_length
        self.max_train_bytes = max_train_bytes  # None unless trained here

    @classmethod
    def from_hf_tokenizer(cls, tok, base: int, reserved=None, **meta) -> K3Tokenizer:
        """Over an HF ``tokenizers.Tokenizer`` holding the ordinary ids only (no added tokens)."""
        return cls(_HFBackend(tok), base, reserved, **meta)

    @property
    def vocab_size(self) -> int:
        return self.base + NUM_RESERVED

    @property
    def bos_id(self) -> int:
        return self.token_to_id("[BOS]")

    @property
    def eos_id(self) -> int:
        """``<|end_of_msg|>``: the stop token (config ``eos_token_id``) and our document separator."""
        return self.token_to_id("<|end_of_msg|>")

    @property
    def pad_id(self) -> int:
        return self.token_to_id("[PAD]")

    @property
    def unk_id(self) -> int:
        return self.token_to_id("[UNK]")

    def token_to_id(self, name: str) -> int:
        """Id of a reserved token by name, e.g. ``token_to_id("<|open|>") == base + 3``."""
        if name not in self._by_name:
            raise ValueError(f"name is not a reserved token: {name!r}")
        return self._by_name[name].id

    def id_to_token(self, token_id: int) -> str:
        """Name of a reserved id."""
        if not self.base <= token_id < self.vocab_size:
            raise ValueError(f"token_id {token_id} is not a reserved id ({self.base}..{self.vocab_size - 1})")
        return self.reserved[token_id - self.base].name

    def is_special(self, token_id: int) -> bool:
        return token_id >= self.base and self.reserved[token_id - self.base].special

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; reserved names become their ids only if ``allow_special``.

        The ordinary BPE knows nothing of reserved names, so a literal ``"<|open|>"`` in ``text`` becomes
        ordinary byte tokens. (An HF ``tokenizers``/``transformers`` tokenizer built from our
        ``tokenizer.json`` registers the reserved tokens as added tokens and so always matches them --
        use this class for untrusted text.)"""
        if not allow_special:
            return self._backend.encode(text)
        ids, pos = [], 0
        for m in self._reserved_re.finditer(text):
            ids += self._backend.encode(text[pos : m.start()]) if m.start() > pos else []
            ids.append(self._by_name[m.group()].id)
            pos = m.end()
        return ids + (self._backend.encode(text[pos:]) if pos < len(text) else [])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]`` (reserved names not matched), multi-threaded."""
        return self._backend.encode_batch(list(texts))

    def decode(
        self, ids: Iterable[int], skip_special: bool = True, reserved_text: dict[int, str] | None = None
    ) -> str:
        """Text of ``ids``; special reserved tokens are dropped if ``skip_special``, markers always kept.
        ``reserved_text`` maps reserved ids to the text they decode to instead of their names (the chat
        parser marks its markers with characters no decoded text holds, `k3.chat_parse.MARKED`)."""
        parts, run = [], []
        for i in map(int, ids):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids holds {i}, outside the vocabulary [0, {self.vocab_size})")
            if i < self.base:
                run.append(i)
                continue
            if run:
                parts.append(self._backend.decode(run))
                run = []
            if reserved_text and i in reserved_text:
                parts.append(reserved_text[i])
            elif not (skip_special and self.is_special(i)):
                parts.append(self.reserved[i - self.base].name)
        if run:
            parts.append(self._backend.decode(run))
        return "".join(parts)

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces this tokenizer's pre-tokenizer cuts ``text`` into (BPE never merges across them)."""
        if not self.pat_str:
            raise ValueError("this tokenizer's pre-tokenizer has no Split regex (pat_str is empty)")
        return pre_tokenize(text, self.pat_str)

    @property
    def kimi_split(self) -> bool:
        """True iff text is cut with Kimi K2's regex (then llama.cpp's ``kimi-k2`` pre-tokenizer applies)."""
        return self.pat_str == PRE_TOKENIZER_PATTERN

    def ranks(self) -> dict[bytes, int]:
        """Ordinary tokens as bytes -> id: tiktoken's mergeable ranks (rank = id)."""
        return self._backend.ranks()

    def merges(self) -> list[tuple[bytes, bytes]]:
        """The BPE merges in priority order, as byte pairs (one per multi-byte ordinary token)."""
        return self._backend.merges()

    def gguf_vocab(self):
        """llama.cpp's view of this vocabulary: :func:`k3.tokenizer_export.gguf_vocab`."""
        return gguf_vocab(self)

    # ---- persistence -------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` (HF backend), ``tiktoken.model`` and ``tokenizer_config.json``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if isinstance(self._backend, _HFBackend):
            (d / "tokenizer.json").write_text(self._hf_json())
        write_tiktoken_model(self, d / "tiktoken.model")
        (d / "tokenizer_config.json").write_text(json.dumps(self._config(), indent=1, ensure_ascii=False))
        return d

    def _hf_json(self) -> str:
        """The ordinary BPE with the reserved tokens in its vocab and as added tokens, at their ids."""
        data = json.loads(self._backend.tok.to_str())
        for t in self.reserved:
            data["model"]["vocab"][t.name] = t.id
            data["added_tokens"].append(
                dict(id=t.id, content=t.name, **_ADDED_TOKEN_FLAGS, special=t.special)
            )
        return json.dumps(data, ensure_ascii=False)

    def _config(self) -> dict:
        """The release's ``tokenizer_config.json`` fields (every reserved id in ``added_tokens_decoder``),
        the chat template, and k3's own metadata under ``k3``."""
        from k3.chat_format import chat_template

        backend = "tiktoken" if isinstance(self._backend, _TiktokenBackend) else "hf"
        tokens = {
            "bos_token": "[BOS]",
            "eos_token": "<|end_of_msg|>",
            "pad_token": "[PAD]",
            "unk_token": "[UNK]",
        }
        extra = [t.name for t in self.reserved if t.special and t.name not in tokens.values()]
        decoder = {
            str(t.id): {"content": t.name, **_ADDED_TOKEN_FLAGS, "special": t.special} for t in self.reserved
        }
        k3 = dict(format_version=FORMAT_VERSION, backend=backend, vocab_size=self.vocab_size, base=self.base)
        k3 |= dict(pat_str=self.pat_str, max_train_bytes=self.max_train_bytes)
        return dict(
            added_tokens_decoder=decoder,
            additional_special_tokens=extra,
            **tokens,
            bos_token_id=self.bos_id,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            add_bos_token=False,
            add_eos_token=False,
            clean_up_tokenization_spaces=False,
            model_max_length=self.model_max_length,
            tokenizer_class="PreTrainedTokenizerFast" if backend == "hf" else "TikTokenTokenizer",
            chat_template=chat_template(),
            k3=k3,
        )

    @classmethod
    def from_dir(cls, directory: str | os.PathLike) -> K3Tokenizer:
        """Load a directory written by :meth:`save`, or one holding the official ``tiktoken.model``."""
        d = Path(directory)
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        meta = {k: v for k, v in cfg.get("k3", {}).items() if k in ("pat_str", "max_train_bytes")}
        if "model_max_length" in cfg:
            meta["model_max_length"] = cfg["model_max_length"]
        if (d / "tokenizer.json").is_file():
            return _load_hf(d / "tokenizer.json", meta)
        if (d / "tiktoken.model").is_file():
            return _load_tiktoken(d / "tiktoken.model", cfg, meta)
        raise ValueError(f"directory holds neither tokenizer.json nor tiktoken.model: {str(directory)!r}")

    load = from_dir


def _load_hf(path: Path, meta: dict) -> K3Tokenizer:
    from tokenizers import Tokenizer

    data = json.loads(path.read_text())
    added = sorted(data.pop("added_tokens", []), key=lambda t: t["id"])
    if len(added) != NUM_RESERVED:
        raise ValueError(f"{path} must have {NUM_RESERVED} added (reserved) tokens, found {len(added)}")
    base = added[0]["id"]
    reserved = [ReservedToken(t["id"], t["content"], bool(t["special"])) for t in added]
    for t in reserved:
        data["model"]["vocab"].pop(t.name, None)
    data["added_tokens"] = []
    meta = meta | {"pat_str": _split_pattern(data.get("pre_tokenizer")) or meta.get("pat_str", "")}
    return K3Tokenizer(_HFBackend(Tokenizer.from_str(json.dumps(data))), base, reserved, **meta)


def _split_pattern(pre: dict | None) -> str | None:
    """The regex of a ``tokenizer.json`` pre-tokenizer's ``Split`` step (what really cuts the text)."""
    steps = (pre or {}).get("pretokenizers", [pre or {}])
    for step in steps:
        if step.get("type") == "Split" and "Regex" in step.get("pattern", {}):
            return step["pattern"]["Regex"]
    return None


def _load_tiktoken(path: Path, cfg: dict, meta: dict) -> K3Tokenizer:
    ranks = {}
    for n, line in enumerate(path.read_text().splitlines()):
        if line.strip():
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(
                    f"{path}:{n + 1}: expected '<base64 token> <rank>', got {line[:80]!r}"
                ) from e
    base = len(ranks)
    if sorted(ranks.values()) != list(range(base)):
        raise ValueError(f"{path}: ranks must be exactly 0..{base - 1}")
    reserved = reserved_tokens(base)
    for sid, entry in cfg.get("added_tokens_decoder", {}).items():  # official names/flags win
        if base <= int(sid) < base + NUM_RESERVED:
            reserved[int(sid) - base] = ReservedToken(
                int(sid), entry["content"], bool(entry.get("special", True))
            )
    backend = _TiktokenBackend(ranks, meta.get("pat_str", PRE_TOKENIZER_PATTERN))
    return K3Tokenizer(backend, base, reserved, **meta)
