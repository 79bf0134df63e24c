"""k3 sft: the assistant-only mask, training ids == serving ids, per-conversation packing, bad lines,
resumable packing, and a short run that lowers the held-out assistant loss (k3-nano, seconds)."""

import json

import numpy as np
import pytest
import torch

from k3.chat_format import ChatOptions, encode_chat
from k3.data.chats import PackedChats, read_chats, render_conversation

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "doc",
            "description": "doc line",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
        },
    }
]
CALL = {"id": "c1", "type": "function", "function": {"name": "doc", "arguments": '{"name": "a.b"}'}}


def _conv(q: str = "What does a.b do?", fact: str = "Frob the widget.") -> dict:
    return {
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": q},
            {"role": "assistant", "content": "", "reasoning_content": "I call doc.", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": fact},
            {"role": "assistant", "content": f"a.b: {fact}", "reasoning_content": "Quote it."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Polite."},
        ],
    }


@pytest.fixture(scope="module")
def tok():
    from k3.tokenizer_train import train_tokenizer

    text = json.dumps(_conv()) + " the widget frob doc call argument message response think tools " * 20
    return train_tokenizer([text], vocab_size=1024)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2], strict=True))


def test_mask_is_exactly_the_assistant_turns(tok):
    [(ids, mask)] = render_conversation(tok, _conv())
    spans = [tok.decode(ids[a:b].tolist(), skip_special=False) for a, b in _runs(mask)]
    call = (
        '<|open|>tools<|sep|><|open|>call tool="doc" index="1"<|sep|><|open|>argument key="name" '
        'type="string"<|sep|>a.b<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>'
    )
    end = "<|close|>message<|sep|><|end_of_msg|>"
    assert spans == [
        "I call doc.<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|>" + call + end,
        "Quote it.<|close|>think<|sep|><|open|>response<|sep|>a.b: Frob the widget.<|close|>response<|sep|>"
        + end,
        "Polite.<|close|>think<|sep|><|open|>response<|sep|>You are welcome.<|close|>response<|sep|>" + end,
    ]
    context = tok.decode(ids[~mask].tolist(), skip_special=False)
    for text in ("Be brief.", "What does a.b do?", "Frob the widget.", "Thanks.", '"name":"doc"'):
        assert text in context
    assert context.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_training_ids_equal_serving_ids(tok):
    conv = _conv()
    [(ids, mask)] = render_conversation(tok, conv)
    turns = [i for i, m in enumerate(conv["messages"]) if m["role"] == "assistant"]
    for (start, _), i in zip(_runs(mask), turns, strict=True):  # the server's prompt, then the turn
        served = encode_chat(tok, conv["messages"][:i], conv["tools"])
        assert ids[:start].tolist() == served
    # earlier thinking rendered empty: one document per turn, each exactly the server's request
    opts = ChatOptions(preserve_thinking=False)
    docs = render_conversation(tok, conv, opts)
    assert len(docs) == len(turns)
    for (ids, mask), i in zip(docs, turns, strict=True):
        [(start, stop)] = _runs(mask)
        assert stop == len(ids)
        assert ids[:start].tolist() == encode_chat(tok, conv["messages"][:i], conv["tools"], opts)
    assert "Polite." not in tok.decode(docs[-1][0].tolist(), skip_special=False).split("Thanks.")[0]


def test_packing_isolates_conversations(tok):
    from k3.config import preset
    from k3.data.chats import ChatSet
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM

    docs = [render_conversation(tok, _conv(f"What does a.b{k} do?", "x" * k))[0] for k in range(1, 6)]
    chats = ChatSet([d[0] for d in docs], [d[1] for d in docs], list(range(5)))
    seq = max(len(d[0]) for d in docs) * 2 + 3
    batch = next(PackedChats(chats, seq, 2, pad_id=tok.eos_id, shuffle=False))
    cfg = preset("k3-nano").replace(dtype="float32")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    init_weights(model, 0.5, cfg.num_hidden_layers, seed=0)
    with torch.no_grad():
        packed = model(batch["input_ids"], cu_seqlens=batch["cu_seqlens"], doc_ids=batch["doc_ids"]).logits
    found = 0
    for r in range(2):
        for d in batch["doc_ids"][r].unique():
            where = torch.nonzero(batch["doc_ids"][r] == d).flatten()
            lo, hi = int(where[0]), int(where[-1]) + 1
            ids = batch["input_ids"][r, lo:hi]
            k = next(
                (k for k, x in enumerate(chats.ids) if len(x) == hi - lo and (x == ids.numpy()).all()), None
            )
            if k is None:  # the row's padding
                assert (batch["labels"][r, lo:hi] == -100).all()
                continue
            found += 1
            with torch.no_grad():
                alone = model(ids[None]).logits[0]
            torch.testing.assert_close(packed[r, lo:hi], alone, rtol=1e-4, atol=1e-4)
            labels = batch["labels"][r, lo:hi]
            assert labels[-1] == -100  # nothing across the boundary
            m = torch.from_numpy(chats.mask[k])
            assert torch.equal(labels[:-1] != -100, m[1:])
            assert torch.equal(labels[:-1][m[1:]], ids[1:][m[1:]])
    assert found >= 3


def test_packed_chats_resume(tok):
    from k3.data.chats import ChatSet

    docs = [render_conversation(tok, _conv(f"q{k}?"))[0] for k in range(7)]
    chats = ChatSet([d[0] for d in docs], [d[1] for d in docs], list(range(7)))
    a = PackedChats(chats, 1200, 2, tok.eos_id, seed=3)
    for _ in range(5):
        next(a)
    b = PackedChats(chats, 1200, 2, tok.eos_id, seed=0)
    b.load_state_dict(a.state_dict())
    for _ in range(4):
        x, y = next(a), next(b)
        assert all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize(
    "line, fault",
    [
        ("{not json", "bad JSON"),
        (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}), "unknown role 'robot'"),
        (
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "tool", "tool_call_id": "zz", "content": "1"},
                    ]
                }
            ),
            "answers no call",
        ),
        (json.dumps(_conv("?" + "long words here " * 400)), "longer than the context"),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant message"),
    ],
)
def test_bad_lines_name_their_line(tok, tmp_path, line, fault):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(_conv()) + "\n" + line + "\n" + json.dumps(_conv()) + "\n")
    with pytest.raises(ValueError, match=f"line 2: .*{fault}"):
        read_chats(path, tok, 1500)
    chats = read_chats(path, tok, 1500, skip_bad=True)
    assert len(chats) == 2 and chats.lines == [1, 3] and [n for n, _ in chats.skipped] == [2]


def _sft_setup(tok, tmp_path, **changes):
    from k3.checkpoint import save_checkpoint
    from k3.config import preset
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM
    from k3.train.config import TrainConfig
    from k3.train.sft import SFT_DEFAULTS, SFTOptions

    cfg = preset("k3-nano").replace(dtype="float32")
    model = K3ForCausalLM(cfg)
    init_weights(model, 0.02, cfg.num_hidden_layers, seed=0)
    init = save_checkpoint(model, cfg, tmp_path / "init")
    tok.save(init)
    data = tmp_path / "chats.jsonl"
    data.write_text(
        "".join(json.dumps(_conv(f"What does a.b{k} do?", f"Frob {k}.")) + "\n" for k in range(12))
    )
    base = dict(
        preset=str(init / "config.json"),
        data=str(data),
        steps=12,
        minutes=None,
        seq_len=1200,
        batch_size=2,
        lr=0.01,
        adamw_lr=0.01,
        warmup_steps=2,
        eval_every=0,
        save_every=0,
        threads=1,
        out=str(tmp_path / "sft"),
    )
    tc = TrainConfig(**SFT_DEFAULTS).replace(**{**base, **changes})
    return tc, SFTOptions(init=str(init), data=str(data), val_data=str(data))


def test_short_sft_run_lowers_assistant_loss(tok, tmp_path):
    from k3.train.sft import SFTTrainer

    tc, sft = _sft_setup(tok, tmp_path)
    summary = SFTTrainer(tc, sft, progress=False, quiet=True).run(measure_peak=False)
    assert summary["qat"] == ["qat-mx"] and summary["steps"] == 12
    assert summary["val_loss"] < summary["first_val_loss"] - 0.5
    assert (tmp_path / "sft" / "model.safetensors").exists() and (
        tmp_path / "sft" / "tokenizer.json"
    ).exists()


def test_sft_resume_is_bit_exact(tok, tmp_path):
    from k3.train.checkpointing import read_trainer_state, step_dirs
    from k3.train.metrics import read_metrics
    from k3.train.sft import SFTOptions, SFTTrainer
    from k3.train.trainer import resume_config

    tc, sft = _sft_setup(tok, tmp_path, steps=6, save_every=3, keep=3)
    SFTTrainer(tc, sft, progress=False, quiet=True).run(measure_peak=False)
    half = [d for d in step_dirs(tmp_path / "sft") if d.name.endswith("00000003")][0]
    saved = SFTOptions(**read_trainer_state(half)["sft"])  # what `k3 sft --resume` rebuilds
    assert saved == sft
    SFTTrainer(
        resume_config(half, out=str(tmp_path / "resumed")), saved, resume=half, progress=False, quiet=True
    ).run(measure_peak=False)

    def losses(d):
        return {r["step"]: r["loss"] for r in read_metrics(d / "metrics.jsonl") if r["kind"] == "train"}

    a, b = losses(tmp_path / "sft"), losses(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6] and [a[s] for s in (4, 5, 6)] == [b[s] for s in (4, 5, 6)]


def test_evaluation_batches_hold_each_document_once(tok):
    from k3.data.chats import ChatSet
    from k3.train.sft import _val_batches

    docs = [render_conversation(tok, _conv(f"q{k}?", "y" * k))[0] for k in range(9)]
    chats = ChatSet([d[0] for d in docs], [d[1] for d in docs], list(range(9)))
    batches = _val_batches(chats, 1300, 2, tok.eos_id)
    supervised = sum(int((b["labels"] != -100).sum()) for b in batches)
    assert supervised == sum(int(m[1:].sum()) for m in chats.mask)
    starts = sum(int(((b["labels"] != -100).long().diff(dim=1) == 1).sum()) for b in batches)
    assert starts == 3 * 9  # three assistant spans per conversation, none twice
