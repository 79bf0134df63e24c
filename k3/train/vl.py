"""Train a tiny K3 VL model on the synthetic image-text task (or a `--data` folder) and measure held-out
QA accuracy by greedy generation. A self-contained loop (AdamW, warmup-cosine from k3.optim.schedule,
Quantile-Balancing router updates); `k3 train --task vision` runs it with the k3 train flags mapped.

    python -m k3.train.vl --preset k3-tiny-vl --steps 1500 --out runs/tiny-vl
    k3 train --task vision --preset k3-tiny-vl --steps 1500 --batch-size 32 --out runs/tiny-vl

Each sample is a chat turn in the XTML format with thinking off (`k3.chat_format`): the user message is
`<|kimi_image_placeholder|>{question}` (expanded to the media tokens, docs/spec_vision.md#placement), and the
loss is on the assistant's response (`{answer}<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>`),
so the trained checkpoint answers through the same chat rendering the server uses. A fraction of samples ask
for the caption instead (`describe the image.`), trained but not scored.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time

import torch

from k3.chat_format import CLOSE, ChatOptions, render
from k3.model.moe import update_router_biases
from k3.model.multimodal import K3VLForCausalLM, init_vl_weights
from k3.model.transformer import IGNORE_INDEX
from k3.optim.schedule import warmup_cosine
from k3.tokenizer import K3Tokenizer
from k3.tokenizer_train import train_tokenizer
from k3.vision import synthetic
from k3.vision.config import IMAGE_PLACEHOLDER, K3VLConfig, vl_preset
from k3.vision.media import encode_segments_with_images
from k3.vision.preprocess import ImageInput, batch_images, preprocess_image

CAPTION_QUESTION = "describe the image."
CHAT = ChatOptions(thinking=False)


@dataclasses.dataclass
class Encoded:
    ids: list[int]
    prompt_len: int  # ids[:prompt_len] is the generation prompt
    image: ImageInput


def user_message(question: str) -> dict:
    return {"role": "user", "content": f"{IMAGE_PLACEHOLDER}{question}"}


def encode_example(tok: K3Tokenizer, config: K3VLConfig, question: str, answer: str | None, image) -> Encoded:
    """Chat-format ids of one image question (+ the assistant answer when given)."""
    img = preprocess_image(image, config.media)
    slot = [(img.orig_size, img.num_tokens)]
    prompt = encode_segments_with_images(tok, render([user_message(question)], options=CHAT), slot)
    if answer is None:
        return Encoded(prompt, len(prompt), img)
    msgs = [user_message(question), {"role": "assistant", "content": answer}]
    full = encode_segments_with_images(tok, render(msgs, options=CHAT, add_generation_prompt=False), slot)
    assert full[: len(prompt)] == prompt, "the generation prompt must prefix the rendered answer"
    return Encoded(full, len(prompt), img)


def collate(batch: list[Encoded], pad_id: int) -> dict:
    """Right-padded input_ids / labels [B, T] (loss on the answer only) + packed images."""
    T = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), T), IGNORE_INDEX, dtype=torch.long)
    for b, e in enumerate(batch):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        labels[b, e.prompt_len - 1 : len(e.ids) - 1] = torch.tensor(e.ids[e.prompt_len :])
    pixels, grid = batch_images([e.image for e in batch])
    return {"input_ids": ids, "labels": labels, "pixel_values": pixels, "grid_thw": grid}


def task_texts(n: int = 2000) -> list[str]:
    """Text the tokenizer is trained on: chat markup words, questions, answers, captions, sizes."""
    out = [CAPTION_QUESTION, 'message role="user"', 'message role="assistant"', "response", "image 100x100"]
    for i in range(n):
        ex = synthetic.example("train", 0, i)
        out += [ex.question, ex.answer, ex.caption, f"image {ex.image.width}x{ex.image.height}"]
    return out


class Sampler:
    """Training examples: the synthetic stream (endless) or a `--data` folder (cycled)."""

    def __init__(
        self,
        seed: int,
        data: str | None,
        caption_frac: float,
        skip: int = 0,
        kinds: tuple[str, ...] = synthetic.KINDS,
        max_shapes: int = 3,
    ):
        self.rng = random.Random(seed + skip)
        self.seed, self.caption_frac, self.i = seed, caption_frac, skip
        self.kinds, self.max_shapes = kinds, max_shapes
        self.rows = None
        if data:
            from k3.vision.data import load_folder

            self.rows = list(load_folder(data, "train"))
            if not self.rows:
                raise ValueError(f"--data {data}: no training rows")

    def next(self) -> synthetic.Example:
        if self.rows is not None:
            ex = self.rows[self.i % len(self.rows)]
        else:
            ex = synthetic.example("train", self.seed, self.i, self.kinds, self.max_shapes)
        self.i += 1
        if ex.caption and ex.kind != "caption" and self.rng.random() < self.caption_frac:
            return synthetic.Example(ex.image, ex.caption, CAPTION_QUESTION, ex.caption, "caption")
        return ex


@torch.no_grad()
def answer(model: K3VLForCausalLM, tok: K3Tokenizer, enc: Encoded, max_new_tokens: int = 12) -> str:
    """Greedy answer to one encoded prompt (uncached: the prompts are short), up to the closing marker."""
    pixels, grid = batch_images([enc.image])
    img = model.image_embeddings(pixels, grid)
    ids = list(enc.ids)
    stop = {tok.token_to_id(CLOSE), tok.eos_id}
    out: list[int] = []
    for _ in range(max_new_tokens):
        x = torch.tensor([ids])
        e = model.language_model.model.embed_tokens(x)
        e = e.masked_scatter((x == model.pad_id)[..., None], img)
        nxt = int(model.language_model(inputs_embeds=e).logits[0, -1].argmax())
        if nxt in stop:
            break
        out.append(nxt)
        ids.append(nxt)
    return tok.decode(out).strip()


def evaluate(model, tok, config, examples: list[synthetic.Example]) -> dict:
    """Exact-match accuracy of greedy answers, overall and per question kind."""
    model.eval()
    right: dict[str, list[int]] = {}
    for ex in examples:
        pred = answer(model, tok, encode_example(tok, config, ex.question, None, ex.image))
        right.setdefault(ex.kind, []).append(int(pred == ex.answer))
    model.train()
    per_kind = {k: sum(v) / len(v) for k, v in sorted(right.items())}
    total = sum(sum(v) for v in right.values()) / sum(len(v) for v in right.values())
    return {"accuracy": total, "per_kind": per_kind, "n": len(examples)}


def build_config(args) -> K3VLConfig:
    """The VL preset, with `--lm-layers` / `--tower-width` applied when given (size ablations)."""
    config = vl_preset(args.preset)
    if args.lm_layers:
        config = dataclasses.replace(config, text=config.text.with_layers(args.lm_layers))
    if args.tower_width:
        config = dataclasses.replace(config, vision=config.vision.with_width(args.tower_width))
    return config


def heldout_examples(args) -> list[synthetic.Example]:
    if args.data:
        from k3.vision.data import load_folder

        return list(load_folder(args.data, "heldout"))[: args.eval_n]
    kinds = tuple(dict.fromkeys(args.kinds))  # a kind repeated in --kinds trains more, evaluates once
    return synthetic.examples("heldout", args.seed, args.eval_n, kinds=kinds, max_shapes=args.max_shapes)


def train(args, on_step=None) -> dict:
    """Train as `args` says (see `parse_args`); returns the final held-out evaluation.

    on_step(step, model, batch, out): called after each backward, before clipping and the optimizer step
    (gradients in place; batch is `collate`'s dict, out the model output) -- for probes that log more."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    if args.init:  # continue from a checkpoint of this loop (its weights and tokenizer)
        from k3.checkpoint.vl import load_vl_checkpoint

        model, tok = load_vl_checkpoint(args.init), K3Tokenizer.from_dir(args.init)
        config = model.config
    else:
        config = build_config(args)
        tok = train_tokenizer(task_texts(), vocab_size=config.text.vocab_size)
        model = K3VLForCausalLM(config)
        init_vl_weights(model, seed=args.seed, projector_norm_init=args.projector_norm_init)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.wd)
    sampler = Sampler(args.seed, args.data, args.caption_frac, args.skip, args.kinds, args.max_shapes)
    heldout = heldout_examples(args)
    log, t0 = [], time.time()
    print(f"{args.preset}: {n_params:,} parameters; {args.steps} steps x {args.batch}", flush=True)
    for step in range(args.steps):
        lr = args.lr * warmup_cosine(step, args.steps, min(args.warmup, args.steps), min_ratio=0.05)
        for g in opt.param_groups:
            g["lr"] = lr
        rows = []
        for _ in range(args.batch):
            ex = sampler.next()
            rows.append(encode_example(tok, config, ex.question, ex.answer, ex.image))
        batch = collate(rows, tok.pad_id)
        out = model(**batch)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if on_step is not None:
            on_step(step, model, batch, out)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        update_router_biases(model)
        if step % args.log_every == 0 or step == args.steps - 1:
            rec = {"step": step, "loss": round(loss.item(), 4), "lr": lr, "s": round(time.time() - t0, 1)}
            if args.eval_every and step and step % args.eval_every == 0:
                rec["heldout"] = evaluate(model, tok, config, heldout[: args.eval_n // 4])["accuracy"]
            print(json.dumps(rec), flush=True)
            log.append(rec)
        if args.out and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            _save(model, tok, args.out, {"step": step + 1, "of": args.steps, "partial": True})
    result = evaluate(model, tok, config, heldout)
    result |= {"preset": args.preset, "steps": args.steps, "batch": args.batch, "train_s": time.time() - t0,
               "init": args.init, "skip": args.skip, "lr": args.lr,
               "projector_norm_init": args.projector_norm_init, "kinds": list(args.kinds),
               "max_shapes": args.max_shapes, "lm_layers": config.text.num_hidden_layers,
               "tower_width": config.vision.vt_hidden_size}  # fmt: skip
    print(json.dumps(result), flush=True)
    if args.out:
        _save(model, tok, args.out, result)
    return result


def _save(model: K3VLForCausalLM, tok: K3Tokenizer, out_dir: str, record: dict) -> None:
    """Write the checkpoint (weights + tokenizer) and `record` beside it: the held-out evaluation at the
    end, or {"step", "of", "partial"} for a mid-run save, so a stopped run keeps its last save."""
    from k3.checkpoint.vl import save_vl_checkpoint

    out = save_vl_checkpoint(model, out_dir, tok)
    (out / "heldout_eval.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved {out}" + (f" at step {record['step']}" if record.get("partial") else ""), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="k3-tiny-vl")
    p.add_argument(
        "--data", default=None, help="a folder of images + data.jsonl (default: the synthetic task)"
    )
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--caption-frac", type=float, default=0.15)
    p.add_argument(
        "--projector-norm-init",
        type=float,
        default=0.1,
        help="initial mm_projector.post_norm weight: the image tokens' starting RMS (text embeddings: 0.02)",
    )
    p.add_argument(
        "--kinds",
        default=",".join(synthetic.KINDS),
        help="comma-separated question kinds of the synthetic task to train and evaluate on; a kind "
        "named twice is drawn twice as often in training (held-out evaluation weighs kinds equally)",
    )
    p.add_argument(
        "--max-shapes", type=int, default=3, help="most shapes in a colour scene (1..3; 1: one colour)"
    )
    p.add_argument(
        "--lm-layers", type=int, default=None, help="text layers (3:1 KDA:MLA; default: the preset's)"
    )
    p.add_argument("--tower-width", type=int, default=None, help="vision tower width (default: the preset's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-n", type=int, default=400)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", default=None, help="checkpoint directory to write")
    p.add_argument(
        "--save-every", type=int, default=0, help="also save to --out every N steps (0: only at the end)"
    )
    p.add_argument(
        "--init", default=None, help="start from this checkpoint (weights + tokenizer) of this loop"
    )
    p.add_argument("--skip", type=int, default=0, help="start the training stream at this example index")
    args = p.parse_args(argv)
    if args.save_every < 0:
        p.error(f"--save-every must be 0 or a positive number of steps, got {args.save_every}")
    if args.steps <= 0 or args.batch <= 0 or not math.isfinite(args.lr) or args.lr <= 0:
        p.error("--steps, --batch and --lr must be positive")
    if not (math.isfinite(args.projector_norm_init) and args.projector_norm_init > 0):
        p.error(f"--projector-norm-init must be a positive number, got {args.projector_norm_init}")
    for flag in ("lm_layers", "tower_width"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
    if (args.lm_layers or args.tower_width) and args.init:
        p.error("--lm-layers / --tower-width size a new model; --init continues a checkpoint as it is")
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    try:
        synthetic.check_kinds(args.kinds, args.max_shapes)
    except ValueError as e:
        p.error(f"--kinds / --max-shapes: {e}")
    return args


# `k3 train --task vision`: the k3 train flags this loop understands -> its own flags
_FROM_TRAIN_CLI = {"preset": "--preset", "data": "--data", "steps": "--steps", "batch_size": "--batch",
                   "lr": "--lr", "weight_decay": "--wd", "warmup_steps": "--warmup", "seed": "--seed",
                   "threads": "--threads", "eval_every": "--eval-every", "log_every": "--log-every",
                   "out": "--out", "save_every": "--save-every"}  # fmt: skip


def run_from_train_cli(args: argparse.Namespace) -> int:
    """`k3 train --task vision [--preset k3-tiny-vl] ...`: this loop with the k3 train flags mapped;
    a k3 train flag it has no meaning for raises ValueError naming it."""
    ignore = {"task", "_command", "_parser", "preset"}
    unused = [
        k
        for k, v in vars(args).items()
        if k not in ignore and k not in _FROM_TRAIN_CLI and v not in (None, False)
    ]
    if unused:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(unused))
        raise ValueError(
            f"--task vision does not take {flags} (it takes {', '.join(_FROM_TRAIN_CLI.values())})"
        )
    argv = ["--preset", args.preset or "k3-tiny-vl"]
    for key, flag in _FROM_TRAIN_CLI.items():
        if key != "preset" and getattr(args, key, None) is not None:
            argv += [flag, str(getattr(args, key))]
    result = train(parse_args(argv))
    return 0 if math.isfinite(result["accuracy"]) else 1


def main(argv=None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
