"""The embedded stdlib task and `k3 eval-agent`: tools, split, scoring, and the whole loop through a
real `k3 serve` on 127.0.0.1 with the openai SDK (a random-init k3-nano; seconds)."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from k3.agent import stdlib_task as task
from k3.agent import stdlib_tools as st
from k3.agent.evaluate import run_conversation


def test_tools_answer_from_inspect():
    import inspect
    import textwrap

    assert st.signature("textwrap.indent") == str(inspect.signature(textwrap.indent))
    assert st.doc("textwrap.dedent") == inspect.getdoc(textwrap.dedent).split("\n")[0]
    assert st.find("dedent") == "textwrap"
    assert st.call_tool("find", '{"name": "dedent"}') == "textwrap"
    for bad in (
        st.signature("antigravity.fly"),
        st.signature("os.system"),
        st.doc("textwrap._x"),
        st.call_tool("find", "{oops"),
        st.call_tool("rm", "{}"),
    ):
        assert bad.startswith("error:")


def test_heldout_modules_never_in_training_data():
    held = set(task.split_modules("heldout"))
    assert held and not held & set(task.split_modules("train"))
    train_text = json.dumps(task.conversations(400, "train", seed=0))
    names = {e[0] for m in held for e in task.entries(m)}
    assert names and not [n for n in names if n in train_text]
    assert task.conversations(5, "heldout", 1) == task.conversations(5, "heldout", 1)


class _Client:
    """An openai-client stand-in that answers like a model; `policy(messages) -> (content, calls)`."""

    def __init__(self, policy):
        self.policy = policy
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, model, messages, tools, **kw):
        content, calls = self.policy(messages)
        tcs = [
            SimpleNamespace(id=f"call_{i}", function=SimpleNamespace(name=n, arguments=a))
            for i, (n, a) in enumerate(calls)
        ]
        msg = SimpleNamespace(content=content, tool_calls=tcs or None, reasoning_content="r", model_extra={})
        return SimpleNamespace(choices=[SimpleNamespace(message=msg)])


def _reference_policy(ref):
    """Answers exactly as the reference conversation does (calls, then the answer from the results)."""
    assistant = [m for m in ref["messages"] if m["role"] == "assistant"]

    def policy(messages):
        m = assistant[sum(x["role"] == "assistant" for x in messages)]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or ()]
        return m["content"], calls

    return policy


def test_scoring_perfect_and_wrong():
    for ref in task.conversations(12, "heldout", seed=2):
        rec = run_conversation(_Client(_reference_policy(ref)), "m", ref, 64, 4, {})
        assert rec["correct"] and rec["valid_json"] == rec["right_call"] == rec["call_turns"] > 0
        wrong = run_conversation(
            _Client(lambda msgs: ("", [("doc", '{"name": "textwrap.dedent"}')])), "m", ref, 64, 3, {}
        )
        assert (
            not wrong["correct"] and wrong["right_call"] == 0 and wrong["valid_json"] == wrong["call_turns"]
        )
        bad = run_conversation(_Client(lambda msgs: ("", [("doc", "{name")])), "m", ref, 64, 2, {})
        assert bad["valid_json"] == 0 and bad["requests"][0] == 2


def test_eval_agent_end_to_end(tmp_path):
    import torch

    from k3.checkpoint.io import save_checkpoint
    from k3.config import preset
    from k3.model.init import init_weights
    from k3.model.transformer import K3ForCausalLM
    from k3.tokenizer_train import train_tokenizer

    cfg = preset("k3-nano").replace(dtype="float32")
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg)
    init_weights(model, 0.02, cfg.num_hidden_layers, seed=0)
    d = save_checkpoint(model, cfg, tmp_path / "nano")
    train_tokenizer([json.dumps(task.conversations(30, "train"))], vocab_size=cfg.vocab_size).save(d)
    out = tmp_path / "scores.json"
    cmd = [
        sys.executable,
        "-m",
        "k3.cli",
        "eval-agent",
        str(d),
        "--conversations",
        "2",
        "--max-tokens",
        "8",
        "--max-requests",
        "2",
        "--json",
        str(out),
        "--lifetime",
        "120",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["conversations"] == 2 and res["call_turns"] >= 2
    assert all(0 <= res[k] <= 1 for k in ("valid_json", "right_call", "correct"))
    assert len(res["transcripts"]) == 2 and res["transcripts"][0]["messages"][0]["role"] == "user"
    assert "valid tool-call JSON" in r.stdout


@pytest.mark.parametrize("n", [0, -1])
def test_eval_agent_refuses_bad_counts(n):
    from k3.agent.evaluate import evaluate_agent

    with pytest.raises(ValueError, match="conversations"):
        evaluate_agent("http://127.0.0.1:9", conversations=n)


def test_a_refused_request_fails_the_conversation_not_the_run():
    def policy(messages):
        raise RuntimeError("400: the prompt is longer than the context")

    ref = task.conversations(1, "heldout", seed=0)[0]
    rec = run_conversation(_Client(policy), "m", ref, 64, 3, {})
    assert not rec["correct"] and rec["errors"] and rec["requests"] == [1]


def test_made_up_names_do_not_exist_and_are_reported():
    import random

    rng = random.Random(0)
    mods = task.split_modules("train")
    for _ in range(50):
        name = task.made_up(rng, mods)
        mod, bare = name.split(".", 1)
        assert st.signature(name).startswith("error:") and st.find(bare).startswith("error:")
        assert mod in mods or mod not in st.MODULES  # a training module or an invented one
    convs = [task.conversation(rng, mods, task.MADE_UP) for _ in range(300)]
    made = [c for c in convs if c["messages"][2]["content"].startswith("error:")]
    assert task.MADE_UP - 0.12 < len(made) / len(convs) < task.MADE_UP + 0.12
    assert all(c["messages"][2]["content"] in c["messages"][-1]["content"] for c in made)
    held = task.conversations(50, "heldout")
    assert not any(c["messages"][2]["content"].startswith("error:") for c in held)


def test_training_conversations_chain_questions_with_unique_call_ids():
    from k3.data.chats import check_conversation

    convs = task.conversations(200, "train", seed=2)
    questions = [sum(m["role"] == "user" for m in c["messages"]) for c in convs]
    assert min(questions) == 1 and max(questions) > task.TRAIN_QUESTIONS  # follow-ups add user turns
    for c in convs:
        check_conversation(c)  # every tool result answers a call of the assistant turn before it
        ids = [t["id"] for m in c["messages"] for t in m.get("tool_calls") or ()]
        assert ids == [f"call_{i}" for i in range(1, len(ids) + 1)]
    held = task.conversations(50, "heldout")
    assert all(sum(m["role"] == "user" for m in c["messages"]) <= 2 for c in held)
