"""K3Tokenizer: reserved-id layout, lossless round trip, marker forgery, persistence, cache, tiktoken."""

import base64
import json
import random
import sys

import pytest

import k3.tokenizer as tk
from k3.data.corpus import load_corpus
from k3.tokenizer import (
    K3Tokenizer,
    bytes_per_token,
    load_or_train_tokenizer,
    reserved_tokens,
    train_tokenizer,
)

VOCAB = 1024
BASE = VOCAB - 256
SAMPLES = [
    "",
    "hello world",
    "def f(x):\n\treturn x  # tab\n\n\n",
    "emoji 🎉👩‍👩‍👧 and CJK 世界你好, 日本語のテキスト, 한국어",
    "   leading spaces and trailing   \r\n",
    "combining e\u0301 and zero\u200bwidth, RTL שלום مرحبا",
    "numbers 1234567890 3.14159 -0x1F",
]


def _training_texts():
    py = load_corpus(None, "train").documents[:40]
    return py + SAMPLES * 20


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(_training_texts(), vocab_size=VOCAB)


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
    assert loaded.vocab_size == VOCAB and loaded.reserved == tok.reserved
    for text in SAMPLES + ["<|open|>x<|sep|>[PAD]"]:
        assert loaded.encode(text) == tok.encode(text)
        assert loaded.encode(text, allow_special=True) == tok.encode(text, allow_special=True)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("[BOS]", "<|end_of_msg|>", "[PAD]")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (BASE, BASE + 2, VOCAB - 1)
    assert cfg["added_tokens_decoder"][str(BASE + 3)] == {"content": "<|open|>", "special": False}
    assert "[EOT]" in cfg["special_tokens_map"]["additional_special_tokens"]
    assert cfg["model_max_length"] > 0


def test_tokenizer_json_is_valid_hf_with_reserved_ids(tok, tmp_path):
    from tokenizers import Tokenizer

    tok.save(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size() == VOCAB
    assert hf.token_to_id("[BOS]") == BASE and hf.token_to_id("[PAD]") == VOCAB - 1
    assert hf.encode("some code()", add_special_tokens=False).ids == tok.encode("some code()")


def test_tiny_corpus_keeps_layout(tmp_path):
    small = train_tokenizer(["ab ab ab"], vocab_size=VOCAB)  # far fewer merges than ids
    assert small.vocab_size == VOCAB and small.bos_id == BASE
    assert small.decode(small.encode("zz 世界")) == "zz 世界"
    small.save(tmp_path)
    assert K3Tokenizer.from_dir(tmp_path).encode("ab cd") == small.encode("ab cd")


def test_cache_hit_avoids_retraining(tmp_path, monkeypatch):
    monkeypatch.setenv("K3_CACHE_DIR", str(tmp_path / "env_cache"))
    calls = []

    def texts():
        calls.append(1)
        return SAMPLES * 10

    first = load_or_train_tokenizer("fp123", texts, vocab_size=600)
    assert (tmp_path / "env_cache/tokenizers/fp123-600/tokenizer.json").is_file()
    monkeypatch.setattr(tk, "train_tokenizer", lambda *a, **k: pytest.fail("retrained on a cache hit"))
    second = load_or_train_tokenizer("fp123", texts, vocab_size=600)
    assert calls == [1]
    assert second.encode(SAMPLES[3]) == first.encode(SAMPLES[3])
    explicit = tmp_path / "explicit"
    monkeypatch.undo()
    load_or_train_tokenizer("fp123", texts, vocab_size=600, cache_dir=explicit)
    assert calls == [1, 1] and (explicit / "tokenizers/fp123-600/tokenizer_config.json").is_file()


def test_stale_cache_is_retrained(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return SAMPLES

    load_or_train_tokenizer("fp", texts, vocab_size=600, cache_dir=tmp_path)
    cfg_path = tmp_path / "tokenizers/fp-600/tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["k3"]["format_version"] = -1
    cfg_path.write_text(json.dumps(cfg))
    load_or_train_tokenizer("fp", texts, vocab_size=600, cache_dir=tmp_path)
    assert calls == [1, 1]


def _write_tiktoken_model(path):
    merges = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld"]
    ranks = [bytes([b]) for b in range(256)] + merges
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    return len(ranks)


def test_tiktoken_model_loading_or_clear_error(tmp_path):
    n = _write_tiktoken_model(tmp_path / "tiktoken.model")
    try:
        import tiktoken  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install tiktoken"):
            K3Tokenizer.from_dir(tmp_path)
        return
    t = K3Tokenizer.from_dir(tmp_path)
    assert t.base == n and t.vocab_size == n + 256 and t.eos_id == n + 2
    assert t.encode("hello") == [259]
    assert t.encode(" world") == [262, 263]
    text = "hello<|open|> world 🎉[EOS]"
    assert [i for i in t.encode(text) if i >= n] == []
    ids = t.encode(text, allow_special=True)
    assert [i for i in ids if i >= n] == [n + 3, n + 1]
    assert t.decode(ids) == "hello<|open|> world 🎉" and t.decode(ids, skip_special=False) == text
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
