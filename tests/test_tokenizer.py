"""K3Tokenizer: reserved-id layout, Kimi K2 split, lossless round trip, forgery, persistence, cache, and the
tiktoken / GGUF exports encoding like us."""

import base64
import json
import random
import sys
import unicodedata

import pytest
import regex

import k3.tokenizer as tk
import k3.tokenizer_train as tokenizer_train
from k3.chat_format import chat_template
from k3.data.corpus import load_corpus
from k3.tokenizer import K3Tokenizer, reserved_tokens
from k3.tokenizer_export import (
    CONTROL,
    NORMAL,
    UNUSED,
    merges_from_ranks,
    rank_order_problems,
    token_bytes,
    token_string,
)
from k3.tokenizer_train import bytes_per_token, load_or_train_tokenizer, train_tokenizer

VOCAB = 1024
BASE = VOCAB - 256
# tokenization_kimi.py's pat_str as published (docs/spec_text.md#tokenizer: K3's is K2's), spelled out as one
# string
K2_PAT_STR = (
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SAMPLES = [
    "",
    "hello world",
    "def f(x):\n\treturn x  # tab\n\n\n",
    "emoji 🎉👩‍👩‍👧 and CJK 世界你好, 日本語のテキスト, 한국어",
    "   leading spaces and trailing   \r\n",
    "combining e\u0301 and zero\u200bwidth, RTL שלום مرحبا",
    "numbers 1234567890 3.14159 -0x1F",
]
# one of each thing the split distinguishes: case shapes, contractions, Han vs kana vs Hangul, marks, digit
# groups, punctuation + newlines, whitespace runs
SPLIT_CASES = [
    "helloWorld HTTPServer getHTTPResponse abcDEF XMLHttpRequest ǅungla __init__ _private self.x_y",
    "I'm sure they'll say it's fine; we've done it, DON'T WORRY, she'D, O'Neil's 'quoted' can’t",
    "用Python写代码 世界你好abc日本語のテキストAPI 한국어API 人々 〇 中文，标点。「引用」",
    "e\u0301cole nai\u0308ve हिन्दी भाषा ไทย العربيّة Ελληνικά кириллица",
    "1234567 12 3.14159 0x1F 1e-9 2026-07-01 ١٢٣ ½ Ⅻ",
    "a  b   c\t\td\n\n\n  e \r\n f   \n\n  \t\n x\u00a0y\u3000z",
    "🎉👩‍👩‍👧 ok 👍🏽! <|open|> [BOS] ...\n--> !!!\n\n?!",
    "class A(B):\n    def __call__(self, *args, **kw) -> 'A':\n        return {k: v for k, v in kw.items()}",
]


def _stable(c: str) -> bool:
    """A character whose Unicode category Python's tables and the regex module agree on (the engines ship
    different Unicode versions; a recently assigned or re-categorised one may split differently)."""
    cat = unicodedata.category(c)
    return cat not in ("Cn", "Cs", "Co") and regex.fullmatch(rf"\p{{{cat}}}", c) is not None


def _random_texts(n: int, seed: int = 0) -> list[str]:
    """Mixed-script strings: half random code points of common blocks, half from a tricky alphabet."""
    rng = random.Random(seed)
    blocks = [(0x20, 0x7F), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x52F), (0x600, 0x6FF), (0x900, 0x97F),
              (0xE00, 0xE7F), (0x2000, 0x206F), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0xFF00, 0xFFEF), (0x1F300, 0x1F64F), (0x20000, 0x2A6DF)]  # fmt: skip
    pool = list("aAbBzZ'sStT \t\n\r  1234567890.,;:!?-_()[]{}\"'é\u0301中文々テストǅ한🎉")
    out = []
    while len(out) < n:
        if len(out) % 2:
            s = "".join(chr(rng.randrange(*rng.choice(blocks))) for _ in range(rng.randrange(1, 60)))
        else:
            s = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 60)))
        if all(map(_stable, s)):
            out.append(s)
    return out


def _training_texts():
    py = load_corpus(None, "train").documents[:40]
    return py + (SAMPLES + SPLIT_CASES) * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(_training_texts(), vocab_size=VOCAB)


def _held_out() -> list[str]:
    """Text the fixture never trained on: validation stdlib files, the split cases reordered, randoms."""
    val = load_corpus(None, "val").documents[:12]
    mixed = [" ".join(reversed(s.split(" "))) for s in SPLIT_CASES]
    return val + mixed + _random_texts(300, seed=1)


def test_official_reserved_layout():
    by_id = {t.id: t for t in reserved_tokens(163584)}
    assert len(by_id) == 256 and min(by_id) == 163584 and max(by_id) == 163839
    expected = {
        163584: "[BOS]",
        163585: "[EOS]",
        163586: "<|end_of_msg|>",
        163587: "<|open|>",
        163588: "<|close|>",
        163589: "<|sep|>",
        163590: "[start_header_id]",
        163591: "[end_header_id]",
        163593: "[EOT]",
        163602: "<|media_begin|>",
        163603: "<|media_content|>",
        163604: "<|media_end|>",
        163605: "<|media_pad|>",
        163649: "<osagent_mode>",
        163838: "[UNK]",
        163839: "[PAD]",
    }
    assert {i: by_id[i].name for i in expected} == expected
    assert [i for i, t in by_id.items() if not t.special] == [163587, 163588, 163589]
    assert by_id[163592].name == "<|reserved_token_163592|>"
    assert len({t.name for t in by_id.values()}) == 256


def test_pre_tokenizer_is_kimi_k2_split(tok):
    """Our split == the `regex` module running the published K2 pattern, on the cases and 2,000 randoms."""
    assert tk.PRE_TOKENIZER_PATTERN == K2_PAT_STR and tok.pat_str == K2_PAT_STR and tok.kimi_split
    reference = regex.compile(K2_PAT_STR, regex.V1)  # V1: `&&` is set intersection, as in tiktoken
    texts = SAMPLES + SPLIT_CASES + _random_texts(2000)
    for text in texts:
        assert tok.pre_tokenize(text) == reference.findall(text), text
    assert tok.pre_tokenize("helloWorld HTTPServer") == ["hello", "World", " HTTPServer"]
    assert tok.pre_tokenize("世界abc日本語のテキスト") == ["世界", "abc", "日本語", "のテキスト"]
    assert tok.pre_tokenize("1234567 don't") == ["123", "456", "7", " don't"]


def _reference_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """Pure-Python K2 tokenization: the `regex` module's split, then rank BPE on each piece's bytes."""
    ids = []
    for piece in regex.findall(K2_PAT_STR, text, flags=regex.V1):
        parts = [bytes([b]) for b in piece.encode()]
        while len(parts) > 1:
            pair = [ranks.get(parts[i] + parts[i + 1], len(ranks)) for i in range(len(parts) - 1)]
            i = min(range(len(pair)), key=pair.__getitem__)
            if pair[i] == len(ranks):
                break
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        ids += [ranks[p] for p in parts]
    return ids


def test_encode_matches_pure_python_reference(tok):
    ranks = tok.ranks()
    for text in SAMPLES + SPLIT_CASES + _held_out():
        assert tok.encode(text) == _reference_encode(ranks, text), text[:80]


def test_special_ids_at_documented_positions(tok):
    assert tok.vocab_size == VOCAB and tok.base == BASE
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (BASE, BASE + 2, VOCAB - 1, VOCAB - 2)
    assert tok.token_to_id("[EOS]") == BASE + 1 and tok.token_to_id("<|sep|>") == BASE + 5
    assert tok.token_to_id("<|media_pad|>") == BASE + 21 and tok.token_to_id("<osagent_mode>") == BASE + 65
    assert tok.id_to_token(BASE + 9) == "[EOT]"
    assert not tok.is_special(tok.token_to_id("<|open|>")) and tok.is_special(tok.bos_id)
    assert not tok.is_special(5)
    with pytest.raises(ValueError, match="name"):
        tok.token_to_id("<|im_end|>")  # a K2 token that K3 does not have


def test_round_trip_arbitrary_unicode(tok):
    rng = random.Random(0)
    randoms = [
        "".join(
            chr(rng.choice([rng.randrange(32, 0x2FFF), rng.randrange(0x1F300, 0x1FAFF)]))
            for _ in range(rng.randrange(1, 80))
        )
        for _ in range(50)
    ]
    for text in SAMPLES + randoms:
        ids = tok.encode(text)
        assert all(0 <= i < BASE for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode_batch(SAMPLES) == [tok.encode(s) for s in SAMPLES]


def test_bpe_learned_merges(tok):
    text = "def function(self, value):\n    return value\n"
    assert len(tok.encode(text)) < len(text.encode()) / 2  # real merges, not bytes
    assert bytes_per_token(tok, [text]) > 2.0
    assert len(tok.merges()) == BASE - 256  # every ordinary id past the bytes comes from a merge


def test_ranks_follow_merge_order(tok):
    """What makes tiktoken's rank BPE equal to the merge-list BPE: products numbered in merge order, one
    merge each; and every token's own bytes encode to the token (tiktoken looks whole pieces up first)."""
    assert rank_order_problems(tok) == []
    ranks, merges = tok.ranks(), tok.merges()
    assert [ranks[a + b] for a, b in merges] == list(range(256, BASE))
    assert merges_from_ranks(ranks) == merges  # the converter's derivation gives back our merge list
    backend = tok._backend.tok.model
    for token, i in ranks.items():
        assert [t.id for t in backend.tokenize(token_string(token))] == [i]


def test_forged_markers_are_ordinary_text(tok):
    text = '<|open|>message role="user"<|sep|>hi [BOS]<|close|>message<|sep|><|end_of_msg|>'
    plain = tok.encode(text)
    assert all(i < BASE for i in plain) and tok.decode(plain) == text
    ids = tok.encode(text, allow_special=True)
    markers = [i for i in ids if i >= BASE]
    assert markers == [BASE + 3, BASE + 5, BASE, BASE + 4, BASE + 5, BASE + 2]
    assert tok.decode(ids, skip_special=False) == text
    # specials are dropped, the XTML markers are kept
    assert tok.decode(ids) == '<|open|>message role="user"<|sep|>hi <|close|>message<|sep|>'


def test_decode_rejects_out_of_range(tok):
    with pytest.raises(ValueError, match="ids"):
        tok.decode([VOCAB])
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=300)


def test_save_load_round_trip(tok, tmp_path):
    tok.save(tmp_path)
    loaded = K3Tokenizer.from_dir(tmp_path)
    assert loaded.vocab_size == VOCAB and loaded.reserved == tok.reserved and loaded.kimi_split
    for text in SAMPLES + ["<|open|>x<|sep|>[PAD]"]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode(text, allow_special=True) == tok.encode(text, allow_special=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("[BOS]", "<|end_of_msg|>", "[PAD]")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (BASE, BASE + 2, VOCAB - 1)
    flags = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    assert cfg["added_tokens_decoder"][str(BASE + 3)] == {"content": "<|open|>", **flags, "special": False}
    assert len(cfg["added_tokens_decoder"]) == 256 and cfg["added_tokens_decoder"][str(BASE)]["special"]
    assert "[EOT]" in cfg["additional_special_tokens"] and "<|open|>" not in cfg["additional_special_tokens"]
    assert cfg["chat_template"] == chat_template() and cfg["model_max_length"] > 0
    assert cfg["k3"]["format_version"] == tk.FORMAT_VERSION == 2


def test_tokenizer_json_is_valid_hf_with_reserved_ids(tok, tmp_path):
    from tokenizers import Tokenizer

    tok.save(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size() == VOCAB
    assert hf.token_to_id("[BOS]") == BASE and hf.token_to_id("[PAD]") == VOCAB - 1
    for text in SPLIT_CASES:  # (HF matches reserved names as added tokens, so compare with allow_special)
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text, allow_special=True)


def test_tiktoken_package_encodes_like_us(tok, tmp_path):
    """The saved tiktoken.model under the tiktoken package (the release's loader: its ranks, the K2 pat_str,
    the reserved block as special tokens) gives our ids on held-out text, ordinary and with markers."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    tok.save(tmp_path)
    ranks = load_tiktoken_bpe(str(tmp_path / "tiktoken.model"))
    assert ranks == tok.ranks()
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    specials = {e["content"]: int(i) for i, e in cfg["added_tokens_decoder"].items()}
    enc = tiktoken.Encoding("k3", pat_str=K2_PAT_STR, mergeable_ranks=ranks, special_tokens=specials)
    texts = _held_out()
    assert enc.encode_ordinary_batch(texts) == tok.encode_batch(texts)
    assert sum(map(len, tok.encode_batch(texts))) > 30_000  # the comparison covers real text
    chat = '<|open|>message role="user"<|sep|>hi [BOS] <|media_pad|><|close|>message<|sep|><|end_of_msg|>'
    assert enc.encode(chat, allowed_special="all") == tok.encode(chat, allow_special=True)
    assert enc.encode(chat, disallowed_special=()) == tok.encode(chat)


def test_gguf_vocab(tok):
    v = tok.gguf_vocab()
    assert (v.model, v.pre) == ("gpt2", "kimi-k2") and len(v.tokens) == len(v.token_types) == VOCAB
    assert v.token_types == [NORMAL] * BASE + [CONTROL] * 256
    assert v.tokens[BASE + 3] == "<|open|>" and v.tokens[VOCAB - 1] == "[PAD]"
    ranks = tok.ranks()
    assert {token_bytes(s): i for i, s in enumerate(v.tokens[:BASE])} == ranks
    assert token_string(b" \n") == "\u0120\u010a" and token_bytes("\u0120\u010a") == b" \n"
    assert len(v.merges) == BASE - 256
    for m, (a, b) in zip(v.merges, tok.merges(), strict=True):
        left, right = m.split(" ")
        assert (token_bytes(left), token_bytes(right)) == (a, b) and token_bytes(left + right) in ranks
    assert v.special_ids == dict(bos=BASE, eos=BASE + 2, unk=VOCAB - 2, pad=VOCAB - 1)


def test_tiny_corpus_keeps_layout(tmp_path):
    small = train_tokenizer(["ab ab ab"], vocab_size=VOCAB)  # far fewer merges than ids
    assert small.vocab_size == VOCAB and small.bos_id == BASE
    assert small.decode(small.encode("zz 世界")) == "zz 世界"
    small.save(tmp_path)
    assert K3Tokenizer.from_dir(tmp_path).encode("ab cd") == small.encode("ab cd")
    v = small.gguf_vocab()
    n_merges = len(small.merges())
    assert 0 < n_merges == len(v.merges) and rank_order_problems(small) == []
    assert v.token_types[: 256 + n_merges] == [NORMAL] * (256 + n_merges)
    assert v.token_types[256 + n_merges : BASE] == [UNUSED] * (BASE - 256 - n_merges)
    assert v.tokens[BASE - 1] == f"<|unused_{BASE - 1}|>"
    ranks = K3Tokenizer.from_dir(tmp_path).ranks()  # the unused fillers round-trip through tiktoken.model
    assert ranks == small.ranks() and len(ranks) == BASE


def test_no_merges_refused_only_when_there_is_room():
    with pytest.raises(ValueError, match="no BPE merge"):
        train_tokenizer(["a", "b", "c"], vocab_size=VOCAB)  # one-byte pieces only
    assert train_tokenizer(["a b c"], vocab_size=512).merges() == []  # 256 bytes + 256 reserved: no room


def test_old_split_still_loads_but_is_not_exported_as_kimi(tmp_path, monkeypatch):
    """A tokenizer.json trained with another regex keeps encoding with it; gguf_vocab refuses it."""
    old = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s+"
    monkeypatch.setattr(tk, "PRE_TOKENIZER_PATTERN", old)
    trained = train_tokenizer(SPLIT_CASES * 5, vocab_size=VOCAB)
    monkeypatch.undo()
    trained.save(tmp_path)
    loaded = K3Tokenizer.from_dir(tmp_path)
    assert loaded.pat_str == old and not loaded.kimi_split
    assert loaded.pre_tokenize("helloWorld") == ["helloWorld"]
    assert loaded.encode(SPLIT_CASES[0]) == trained.encode(SPLIT_CASES[0])
    with pytest.raises(ValueError, match="kimi-k2"):
        loaded.gguf_vocab()


def test_cache_hit_avoids_retraining(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "env_cache"))
    calls = []

    def texts():
        calls.append(1)
        return SAMPLES * 10

    first = load_or_train_tokenizer("fp123", texts, vocab_size=600)
    assert (tmp_path / "env_cache/tokenizers/fp123-600/tokenizer.json").is_file()
    assert (tmp_path / "env_cache/tokenizers/fp123-600/tiktoken.model").is_file()
    monkeypatch.setattr(
        tokenizer_train, "train_tokenizer", lambda *a, **k: pytest.fail("retrained on a cache hit")
    )
    second = load_or_train_tokenizer("fp123", texts, vocab_size=600)
    assert calls == [1]
    assert second.encode(SAMPLES[3]) == first.encode(SAMPLES[3])
    explicit = tmp_path / "explicit"
    monkeypatch.undo()
    load_or_train_tokenizer("fp123", texts, vocab_size=600, cache_dir=explicit)
    assert calls == [1, 1] and (explicit / "tokenizers/fp123-600/tokenizer_config.json").is_file()


@pytest.mark.parametrize("version", [-1, 1])  # 1: the cl100k-style split, which must not be reused
def test_stale_cache_is_retrained(tmp_path, version):
    calls = []

    def texts():
        calls.append(1)
        return SAMPLES

    load_or_train_tokenizer("fp", texts, vocab_size=600, cache_dir=tmp_path)
    cfg_path = tmp_path / "tokenizers/fp-600/tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["k3"]["format_version"] = version
    cfg_path.write_text(json.dumps(cfg))
    tok = load_or_train_tokenizer("fp", texts, vocab_size=600, cache_dir=tmp_path)
    assert calls == [1, 1] and tok.kimi_split
    assert json.loads(cfg_path.read_text())["k3"]["format_version"] == tk.FORMAT_VERSION


def _write_tiktoken_model(path):
    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld"]
    ranks = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return len(ranks)


def test_tiktoken_model_loading_or_clear_error(tmp_path):
    n = _write_tiktoken_model(tmp_path / "tiktoken.model")
    t = K3Tokenizer.from_dir(tmp_path)
    assert t.base == n and t.vocab_size == n + 256 and t.eos_id == n + 2 and t.kimi_split
    assert t.encode("hello") == [259]
    assert t.encode(" world") == [262, 263]
    text = "hello<|open|> world 🎉[EOS]"
    assert [i for i in t.encode(text) if i >= n] == []
    ids = t.encode(text, allow_special=True)
    assert [i for i in ids if i >= n] == [n + 3, n + 1]
    assert t.decode(ids) == "hello<|open|> world 🎉" and t.decode(ids, skip_special=False) == text
    assert t.merges() == [(b"h", b"e"), (b"l", b"l"), (b"he", b"ll"), (b"hell", b"o"), (b" ", b"w"),
                          (b"o", b"r"), (b" w", b"or"), (b"l", b"d")]  # fmt: skip
    v = t.gguf_vocab()
    assert v.merges[:3] == ["h e", "l l", "he ll"] and v.tokens[260] == "\u0120w"
    t.save(tmp_path / "copy")
    assert K3Tokenizer.from_dir(tmp_path / "copy").encode(text, allow_special=True) == ids


def test_tiktoken_missing_package_error(tmp_path, monkeypatch):
    _write_tiktoken_model(tmp_path / "tiktoken.model")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    with pytest.raises(ImportError, match="pip install tiktoken"):
        K3Tokenizer.from_dir(tmp_path)


def test_from_dir_errors(tmp_path):
    with pytest.raises(ValueError, match="neither"):
        K3Tokenizer.from_dir(tmp_path)
    (tmp_path / "tiktoken.model").write_text("!!notbase64 x\n")
    with pytest.raises(ValueError, match="tiktoken.model:1"):
        K3Tokenizer.from_dir(tmp_path)
