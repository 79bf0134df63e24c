"""`k3 train --data corpus.jsonl` with bad records: each stops the run naming its file, line and fault
(`k3: error: ...`, exit 2), or with --skip-bad is skipped and counted, and the run says what it read."""

import json

import pytest

from k3.cli import main

GOOD = [json.dumps({"text": f"def f_{i}(x):\n    return x * {i}\n"}) for i in range(300)]
BAD = {
    "not json": ("{not json", "line 101: not JSON"),
    "no text": (json.dumps({"body": "def g(): pass"}), "line 101: no 'text' field (keys: body)"),
    "text not a string": (json.dumps({"text": 1}), "line 101: 'text' is a number, not a string"),
}


def _corpus(tmp_path, *bad: str):
    lines = [*GOOD[:100], *bad, *GOOD[100:]]
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_record_stops_the_run_with_its_file_and_line(tmp_path, capsys, case):
    line, message = BAD[case]
    path = _corpus(tmp_path, line)
    run = str(tmp_path / "run")
    rc = main(["train", "--preset", "k3-nano", "--steps", "1", "--data", str(path), "--out", run])
    err = capsys.readouterr().err
    assert rc == 2 and f"k3: error: data: {path}: {message}" in err and "--skip-bad" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # stopped before training


def test_skip_bad_counts_and_the_run_reports_what_it_read(tmp_path, capsys, make_tc):
    from k3.train.trainer import Trainer

    path = _corpus(tmp_path, BAD["not json"][0], BAD["no text"][0], BAD["text not a string"][0])
    trainer = Trainer(make_tc().replace(data=str(path), skip_bad=True), progress=False)
    s = trainer.data.stats
    assert s["bad_records"] == 3 and s["train_documents"] + s["val_documents"] == 300 and s["files"] == 1
    assert s["val_documents"] == trainer.data.val.num_docs > 0
    out = capsys.readouterr().out
    assert f"corpus: {path}: 300 documents" in out and "from 1 file;" in out
    assert f"held out {s['val_documents']} documents" in out and "skipped 3 bad records (--skip-bad)" in out
    assert "data: " in out and "tokenizer and tokens built, now cached" in out
    # the cache built while skipping does not hide the bad records from a run without --skip-bad
    with pytest.raises(ValueError, match="line 101: not JSON"):
        Trainer(make_tc().replace(data=str(path)), progress=False)
    Trainer(make_tc().replace(data=str(path), skip_bad=True), progress=False)
    assert "tokenizer and tokens cached" in capsys.readouterr().out


def test_only_bad_records_is_an_error_naming_them(tmp_path):
    from k3.data import prepare_data

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": 1}) + "\n")
    with pytest.raises(ValueError, match=r"one.jsonl: line 1: 'text' is a number, not a string"):
        prepare_data(path, vocab_size=512)
    with pytest.raises(ValueError, match="no training documents in .*skipped 1 bad records"):
        prepare_data(path, vocab_size=512, skip_bad=True)
