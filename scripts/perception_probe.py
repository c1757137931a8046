#!/usr/bin/env python3
"""Does a policy see? Held-out accuracy of the two skills a toy-world agent needs (issue 19).

usage: scripts/perception_probe.py WORLD POLICY [--out DIR] [--limit N]

On the world's test scenes (never trained on), in the message format of the perception
pre-training rows (toy/perceive.py), greedy:
- grounding: the whole scene and "Where is the logo?" → the expert's zoom box, exactly;
- reading: the zoom tool's crop of the expert's box and the row's question → the gold word.
A policy that has not learned to see answers every scene alike (one box, one word per question),
which the most common answers printed beside each accuracy show at once. The agent's accuracy
is roughly where it looks (grounding) times what it reads there (reading), so this names which
of the two a recipe has to buy. Runs `marscli eval --mode direct` on rows written to DIR
(default: POLICY-probe); prints a table and writes DIR/probe.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from PIL import Image

from marscli.toy.perceive import SYSTEM, WHERE, crop_of


def probe_rows(world: Path, out: Path, limit: int | None) -> dict[str, list[dict]]:
    """Grounding and reading rows of the world's test split (crops written under `out`)."""
    rows = [json.loads(x) for x in (world / "test.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("category") == "perception"][:limit]
    (out / "crops").mkdir(parents=True, exist_ok=True)
    ground, read = [], []
    for r in rows:
        box, scene = r["toy"]["zoom_box"], (world / r["image"]).resolve()
        ground.append({"v": 1, "id": f"{r['id']}-ground", "image": str(scene),
                       "question": WHERE, "answer": [json.dumps(box)], "category": "ground"})
        crop = out / "crops" / f"{r['id']}.png"
        with Image.open(scene) as im:
            crop_of(im.convert("RGB"), box).save(crop)
        read.append({"v": 1, "id": f"{r['id']}-read", "image": str(crop.resolve()),
                     "question": r["question"], "answer": r["answer"],
                     "category": r["toy"]["attribute"]})
    return {"grounding": ground, "reading": read}


def reply(record: dict) -> str:
    """The model's whole reply: the probe's answers are bare words or boxes, not <answer>."""
    return "".join(s.get("text", "") for s in record["segments"] if s["role"] == "model").strip()


def score(records: list[dict]) -> dict:
    by_cat: dict[str, list[bool]] = defaultdict(list)
    for r in records:
        by_cat[r.get("category") or "-"].append(reply(r).lower() == r["answer_gt"][0].lower())
    flat = [x for v in by_cat.values() for x in v]
    return {"accuracy": round(100 * sum(flat) / len(flat), 1) if flat else None,
            "items": len(flat),
            "by_category": {c: round(100 * sum(v) / len(v), 1) for c, v in sorted(by_cat.items())},
            "most_common": Counter(reply(r) for r in records).most_common(3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("world", type=Path)
    ap.add_argument("policy")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--limit", type=int, help="Test scenes at most (default: all).")
    args = ap.parse_args()
    out = args.out or Path(f"{args.policy.rstrip('/')}-probe")
    marscli = Path(sys.executable).with_name("marscli")
    (out / "system.txt").parent.mkdir(parents=True, exist_ok=True)
    (out / "system.txt").write_text(SYSTEM + "\n")
    result = {}
    for skill, rows in probe_rows(args.world, out, args.limit).items():
        bench, res = out / f"{skill}.jsonl", out / f"{skill}-results.jsonl"
        bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
        subprocess.run([str(marscli), "eval", str(bench), "--policy", args.policy, "-o", str(res),
                        "--mode", "direct", "--system-prompt", str(out / "system.txt"),
                        "--max-turn-tokens", "24", "--force"],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result[skill] = score([json.loads(x) for x in res.read_text().splitlines() if x.strip()])
        s = result[skill]
        cats = "  ".join(f"{c} {v}" for c, v in s["by_category"].items())
        print(f"{skill:10s} {s['accuracy']:5.1f}% of {s['items']}  ({cats})  most common: "
              + ", ".join(f"{a!r} x{n}" for a, n in s["most_common"]))
    (out / "probe.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
