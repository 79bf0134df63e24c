"""`k3 generate --prompt-file`: piecewise reading == tokenizing the whole text; the completion of a long
prompt streamed through small prefill chunks == the model's naive generate."""

import pytest
import torch

from k3.checkpoint.io import save_checkpoint
from k3.cli import main
from k3.infer.generate_cli import read_prompt
from k3.model.generate import generate
from k3.tokenizer_train import train_tokenizer

TEXT = (
    "def f(x):\n    return x  \n\n\n  \tclass A:\n\tpass\r\n"
    "the quick brown fox — jumps 1234 over 'the' lazy dog.\n \n.\nünïcode\n\n"
) * 6


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([TEXT * 4], vocab_size=600)


@pytest.mark.parametrize("piece", [1, 7, 40, 1 << 20])
def test_pieces_tokenize_like_the_whole_text(tmp_path, tokenizer, piece):
    f = tmp_path / "p.txt"
    f.write_text(TEXT, encoding="utf-8")
    assert read_prompt(str(f), tokenizer, piece_chars=piece) == tokenizer.encode(TEXT)


def test_ids_file_and_errors(tmp_path):
    f = tmp_path / "ids.txt"
    ids = list(range(0, 500, 7))
    f.write_text("\n".join(" ".join(map(str, ids[i : i + 5])) for i in range(0, len(ids), 5)) + "\n")
    assert read_prompt(str(f), as_ids=True, piece_chars=4) == ids
    f.write_text("1 2 x 3")
    with pytest.raises(ValueError, match="integer ids"):
        read_prompt(str(f), as_ids=True)
    f.write_bytes(b"ab\xffcd")
    with pytest.raises(ValueError, match="UTF-8"):
        read_prompt(str(f), object())
    with pytest.raises(ValueError, match="cannot read"):
        read_prompt(str(tmp_path / "missing.txt"), object())


def test_generate_long_prompt_file_equals_naive(tmp_path, nano, capsys):
    d = save_checkpoint(nano, nano.config, tmp_path / "ckpt")
    prompt = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    f = tmp_path / "prompt.ids"
    f.write_text(" ".join(map(str, prompt)))
    argv = ["generate", str(d), "--prompt-file", str(f), "--ids", "--max-tokens", "6", "--chunk", "13"]
    assert main([*argv, "--page-size", "16", "--quiet"]) == 0
    out = [int(t) for t in capsys.readouterr().out.split()]
    assert out == generate(nano, torch.tensor([prompt]), 6)[0, 60:].tolist()
    assert main(["generate", str(d), "--prompt", "hello"]) == 2  # no tokenizer: needs --ids
    assert "--ids" in capsys.readouterr().err
