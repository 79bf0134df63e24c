"""`--data DIR` for vision: a folder of images described by a jsonl file, read as synthetic `Example`s.

Layout: `DIR/data.jsonl` (or the one `*.jsonl` in DIR), one JSON object per line:

    {"image": "imgs/0001.png", "caption": "a red square."}                              caption only
    {"image": "imgs/0002.jpg", "question": "how many circles?", "answer": "3"}          question/answer
    {"image": "...", "caption": "...", "question": "...", "answer": "..."}              both

`image` is a path relative to DIR (it must stay inside DIR); images are decoded with the upload limits of
`k3.vision.image_io`. A row with a caption and no question becomes the question `CAPTION_QUESTION` with
the caption as its answer. Rows are split train/held-out by a hash of the image path (`heldout_fraction`),
so the split is stable when rows are added. Bad rows raise ValueError naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

from k3.vision.image_io import ImageError, ImageLimits, decode_image
from k3.vision.synthetic import Example

CAPTION_QUESTION = "describe the image."


def find_jsonl(root: str | Path) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"--data {root}: not a directory")
    if (root / "data.jsonl").is_file():
        return root / "data.jsonl"
    found = sorted(root.glob("*.jsonl"))
    if len(found) != 1:
        raise ValueError(f"--data {root}: expected data.jsonl or exactly one *.jsonl, found {len(found)}")
    return found[0]


def is_heldout(key: str, heldout_fraction: float) -> bool:
    """Stable split: the first 8 bytes of sha256(key) as a fraction in [0, 1)."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    return h < heldout_fraction


def _row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(row, dict) or not isinstance(row.get("image"), str):
        raise ValueError(f"{where}: each row must be an object with an 'image' path string")
    has_q = "question" in row or "answer" in row
    if has_q and not (isinstance(row.get("question"), str) and isinstance(row.get("answer"), str)):
        raise ValueError(f"{where}: 'question' and 'answer' must both be strings")
    if not has_q and not isinstance(row.get("caption"), str):
        raise ValueError(f"{where}: a row needs a 'caption' or a 'question' + 'answer'")
    return row


def load_folder(
    root: str | Path,
    split: str = "train",
    heldout_fraction: float = 0.1,
    limits: ImageLimits | None = None,
) -> Iterator[Example]:
    """Examples of one split ("train" / "heldout" / "all") of a `--data` folder, in file order."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = Path(root).resolve()
    path = find_jsonl(root)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        row = _row(line, where)
        if split != "all" and is_heldout(row["image"], heldout_fraction) != (split == "heldout"):
            continue
        file = (root / row["image"]).resolve()
        if not file.is_relative_to(root) or not file.is_file():
            raise ValueError(f"{where}: image {row['image']!r} is not a file inside {root}")
        try:
            img = decode_image(file.read_bytes(), limits or ImageLimits())
        except ImageError as e:
            raise ValueError(f"{where}: image {row['image']!r}: {e}") from None
        caption = row.get("caption", "")
        if "question" in row:
            yield Example(img, caption, row["question"], row["answer"], row.get("kind", "qa"))
        else:
            yield Example(img, caption, CAPTION_QUESTION, caption, "caption")


def write_folder(root: str | Path, items: list[Example]) -> Path:
    """Write examples as a `--data` folder (PNG files + data.jsonl); for tests and exporting the task."""
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for i, ex in enumerate(items):
        rel = f"images/{i:06d}.png"
        ex.image.save(root / rel)
        row = {
            "image": rel,
            "caption": ex.caption,
            "question": ex.question,
            "answer": ex.answer,
            "kind": ex.kind,
        }
        lines.append(json.dumps(row))
    out = root / "data.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out
