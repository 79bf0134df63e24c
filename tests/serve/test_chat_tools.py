"""`k3 chat`'s tool loop (calls run, results shown and sent back) and its warning for a model that was
never fine-tuned on conversations."""

import asyncio
from types import SimpleNamespace

from k3.serve import chat


def test_tool_loop_runs_calls_and_sends_results(monkeypatch, capsys):
    replies = [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "find", "arguments": '{"name": "dedent"}'},
                }
            ],
        },
        {"role": "assistant", "content": "dedent is defined in textwrap.", "reasoning_content": "q"},
    ]
    seen = []

    async def fake_turn(aengine, messages, args):
        seen.append(list(messages))
        return replies[len(seen) - 1]

    monkeypatch.setattr(chat, "_turn", fake_turn)
    messages = [{"role": "user", "content": "Which module defines dedent?"}]
    asyncio.run(chat._answer(None, messages, SimpleNamespace(tools="stdlib")))
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "textwrap"}
    assert seen[1][-1]["content"] == "textwrap"  # the second generation saw the result
    assert "find" in capsys.readouterr().out


def test_warns_on_a_checkpoint_never_fine_tuned(tmp_path):
    (tmp_path / "run" / "checkpoints" / "step-00000010").mkdir(parents=True)
    assert not chat.trained_on_chats(str(tmp_path / "run"))
    (tmp_path / "run" / "sft_config.json").write_text("{}")
    assert chat.trained_on_chats(str(tmp_path / "run"))
    assert chat.trained_on_chats(str(tmp_path / "run" / "checkpoints" / "step-00000010"))
