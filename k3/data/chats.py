"""Conversations for supervised fine-tuning: the OpenAI fine-tuning JSONL, rendered and masked.

Reading. One conversation per line: `{"messages": [...], "tools": [...]}` (tools optional), messages with
the roles system / user / assistant (`content`, `reasoning_content`, `tool_calls`) / tool
(`tool_call_id`, `content`). A line that is not a JSON object, has an unknown role, has no assistant turn,
a tool result that answers no call of the assistant turn before it, or renders longer than the context,
raises ValueError naming its line number and the fault; with `skip_bad` it is skipped and counted.

Rendering. A conversation is rendered with `k3.chat_format.render` + `encode_segments`, the functions
the server renders a request with, and the same default options (thinking on, effort "max"). For the
assistant turn at message i the server's prompt is `render(messages[:i], add_generation_prompt=True)`;
the turn is trained on exactly that prompt (context) followed by what the model generates: its thinking,
the response, the tool calls and the `<|end_of_msg|>` marker (supervised, mask True). The tool
declarations, system notes, user and tool messages and the generation prompt are never supervised.

Documents. With preserved thinking (the default: every earlier assistant turn keeps its
`reasoning_content`, as K3 was trained) each turn's prompt + turn is a prefix of the whole conversation,
so a conversation is one document with several supervised spans. With `preserve_thinking=False` the
server shows only the latest assistant turn's thinking and renders earlier ones empty, so a turn's
prompt is no prefix of the whole rendering; each assistant turn is then its own document, rendered as
the server would render that request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from k3.chat_format import OPEN, ChatOptions, encode_segments, render

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ChatSet:
    """Rendered conversations: `ids[k]` int32 [L_k] and `mask[k]` bool [L_k] (True = supervised token),
    `lines[k]` the JSONL line number; `skipped` lists (line, reason) left out with skip_bad."""

    ids: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(x) for x in self.ids))

    @property
    def num_supervised(self) -> int:
        return int(sum(int(m.sum()) for m in self.mask))


def check_conversation(conv) -> None:
    """ValueError naming what is wrong with one conversation object (structure only)."""
    if not isinstance(conv, dict):
        raise ValueError("not a JSON object")
    msgs, tools = conv.get("messages"), conv.get("tools")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError('"messages" must be a non-empty list')
    if tools is not None and not isinstance(tools, list):
        raise ValueError('"tools" must be a list')
    ids: set[str] = set()
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ROLES:
            raise ValueError(f"messages[{i}]: unknown role {role!r} (one of {', '.join(ROLES)})")
        if role == "assistant":
            ids = {str(c.get("id")) for c in m.get("tool_calls") or () if isinstance(c, dict)}
        elif role == "tool" and str(m.get("tool_call_id")) not in ids:
            raise ValueError(
                f"messages[{i}]: tool result {m.get('tool_call_id')!r} answers no call of the assistant turn "
                "before it"
            )
        elif role in ("user", "system"):
            ids = set()
    if msgs[0]["role"] == "assistant":
        raise ValueError("messages[0]: an assistant turn needs a message before it")
    if not any(m["role"] == "assistant" for m in msgs):
        raise ValueError("no assistant message to train on")


def _encode(tokenizer, segs: list, cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Segments -> (ids int32, mask bool); the mask is True over segments [cuts[2k], cuts[2k+1])."""
    pieces = [encode_segments(tokenizer, [s]) for s in segs]
    starts = np.cumsum([0] + [len(x) for x in pieces])
    mask = np.zeros(int(starts[-1]), dtype=bool)
    for lo, hi in zip(cuts[::2], cuts[1::2], strict=True):
        mask[starts[lo] : starts[hi]] = True
    ids = np.fromiter((t for x in pieces for t in x), dtype=np.int32, count=int(starts[-1]))
    return ids, mask


_ASSISTANT_OPEN = [(OPEN, True), ("message", False), (" role", False), ('="', False), ("assistant", False)]


def _last_assistant_start(segs: list) -> int:
    """Index of the segment opening the last assistant message (markers cannot be forged by text)."""
    n = len(_ASSISTANT_OPEN)
    return max(j for j in range(len(segs) - n + 1) if segs[j : j + n] == _ASSISTANT_OPEN)


def render_conversation(
    tokenizer, conv: dict, options: ChatOptions | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One conversation -> documents [(ids int32 [L], mask bool [L])] (see the module doc).

    Each assistant turn i is trained on exactly what the server renders: the prompt
    `render(messages[:i], add_generation_prompt=True)` as context, then the turn's own segments after
    the generation prompt (supervised). When every turn's sequence is a prefix of the whole
    conversation's (preserved thinking), that is one document; otherwise (earlier thinking rendered
    empty, so a turn's prompt shows its predecessor's thinking that the whole rendering hides) each turn
    is its own document."""
    opts = options or ChatOptions()
    msgs, tools = conv["messages"], conv.get("tools") or None
    full = render(msgs, tools, opts, add_generation_prompt=False)
    turns = []  # (segments of the turn's sequence, index where its supervised part starts)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(msgs[:i], tools, opts, add_generation_prompt=True)
        before = render(msgs[:i], tools, opts, add_generation_prompt=False)
        upto = render(msgs[: i + 1], tools, opts, add_generation_prompt=False)
        turn = upto[_last_assistant_start(upto) :]
        opening = prompt[len(before) :]  # the generation prompt
        if prompt[: len(before)] != before or turn[: len(opening)] != opening:
            raise ValueError(f"messages[{i}]: the turn does not continue its generation prompt")
        turns.append((prompt + turn[len(opening) :], len(prompt)))
    if all(full[: len(seq)] == seq for seq, _ in turns):
        cuts = [c for seq, lo in turns for c in (lo, len(seq))]
        return [_encode(tokenizer, full[: cuts[-1]], cuts)]
    return [_encode(tokenizer, seq, [lo, len(seq)]) for seq, lo in turns]


def read_chats(
    path: str | Path,
    tokenizer,
    max_len: int,
    options: ChatOptions | None = None,
    skip_bad: bool = False,
) -> ChatSet:
    """Read, check, render and mask every line of the JSONL at `path` (see the module doc)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"data: {path} is not a file")
    out = ChatSet()
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                try:
                    conv = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"bad JSON ({e.msg} at column {e.colno})") from None
                check_conversation(conv)
                docs = render_conversation(tokenizer, conv, options)
                longest = max(len(ids) for ids, _ in docs)
                if longest > max_len:
                    raise ValueError(f"renders to {longest} tokens, longer than the context ({max_len})")
            except ValueError as e:
                if not skip_bad:
                    raise ValueError(f"data: {path} line {n}: {e}") from None
                out.skipped.append((n, str(e)))
                continue
            for ids, mask in docs:
                out.ids.append(ids)
                out.mask.append(mask)
                out.lines.append(n)
    if not out.ids:
        raise ValueError(f"data: {path} holds no usable conversation ({len(out.skipped)} skipped)")
    return out


class PackedChats:
    """Endless, deterministic, resumable batches of whole conversations packed into rows of `seq_len`.

    Each epoch takes the documents in the order `default_rng(SeedSequence([seed, epoch])).permutation`
    (or as stored, shuffle=False) and fills each row with whole documents while they fit; the rest of the
    row is padding (`pad_id`, never a target, its own segment). Every document is its own segment, so KDA
    state and MLA attention never cross a conversation (`cu_seqlens` / `doc_ids` as in
    k3.data.packing.rows_to_batch). `labels[t]` is the next token where that token is supervised and in
    the same document, else -100. State: (epoch, documents taken in it).

    A batch: input_ids, labels [B, T] long, cu_seqlens [N+1] int64, doc_ids [B, T] int64.
    """

    def __init__(
        self, chats: ChatSet, seq_len: int, batch_size: int, pad_id: int, seed: int = 0, shuffle: bool = True
    ):
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len}, {batch_size}")
        longest = max(len(x) for x in chats.ids)
        if longest > seq_len:
            raise ValueError(f"seq_len={seq_len}: a conversation renders to {longest} tokens")
        self.chats, self.seq_len, self.batch_size, self.pad_id = chats, seq_len, batch_size, pad_id
        self.seed, self.shuffle = seed, shuffle
        self._epoch, self._taken = 0, 0
        self._order_epoch, self._order = None, None
        self.single_pass = False  # True: rows end at the end of the first epoch (evaluation sets)

    @property
    def exhausted(self) -> bool:
        """Every document of the first epoch has been taken."""
        return self._epoch > 0 or self._taken == len(self.chats)

    def state_dict(self) -> dict:
        return dict(
            kind="packed_chats",
            epoch=self._epoch,
            taken=self._taken,
            seed=self.seed,
            shuffle=self.shuffle,
            num_docs=len(self.chats),
            num_tokens=self.chats.num_tokens,
        )

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "packed_chats":
            raise ValueError("state: not a PackedChats state (saved by another loader)")
        for key, have in (("num_docs", len(self.chats)), ("num_tokens", self.chats.num_tokens)):
            if state[key] != have:
                raise ValueError(f"state[{key!r}]={state[key]} does not match this data ({have})")
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self._epoch, self._taken = int(state["epoch"]), int(state["taken"])

    def __iter__(self) -> PackedChats:
        return self

    def _doc(self) -> int:
        """The next document's index, without taking it."""
        if self._taken == len(self.chats):
            self._epoch, self._taken = self._epoch + 1, 0
        if self._order_epoch != self._epoch:
            n = len(self.chats)
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, self._epoch]))
            self._order, self._order_epoch = (
                (rng.permutation(n) if self.shuffle else np.arange(n)),
                self._epoch,
            )
        return int(self._order[self._taken])

    def next_row(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids [T] int64, labels [T] int64, segment starts [T] bool) of the next row."""
        T = self.seq_len
        ids, labels = np.full(T, self.pad_id, dtype=np.int64), np.full(T, -100, dtype=np.int64)
        starts, used = np.zeros(T, dtype=bool), 0
        while not (self.single_pass and self.exhausted):
            d = self._doc()
            doc, mask = self.chats.ids[d], self.chats.mask[d]
            if used + len(doc) > T:
                break
            ids[used : used + len(doc)] = doc
            labels[used : used + len(doc) - 1] = np.where(mask[1:], doc[1:], -100)
            starts[used] = True
            used += len(doc)
            self._taken += 1
        if used < T:
            starts[used] = True  # the padding is a segment of its own
        return ids, labels, starts

    def __next__(self) -> dict:
        rows = [self.next_row() for _ in range(self.batch_size)]
        flags = np.stack([r[2] for r in rows])
        B, T = flags.shape
        flat = torch.from_numpy(flags.reshape(-1))
        cu = torch.nonzero(flat).flatten()
        return dict(
            input_ids=torch.from_numpy(np.stack([r[0] for r in rows])),
            labels=torch.from_numpy(np.stack([r[1] for r in rows])),
            cu_seqlens=torch.cat([cu, cu.new_tensor([B * T])]).to(torch.int64),
            doc_ids=(torch.cumsum(flat.long(), 0) - 1).view(B, T),
        )
