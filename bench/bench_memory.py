"""Peak memory on a large input: an 8000 x 6000 photo through `marscli ask` and `marscli rollout`
(with a zoom-in, so a crop is cut from the full-resolution source), beside the same commands on
a 640 x 480 image. Peak RSS is the child's own (`os.wait4` rusage, ru_maxrss), in MB.

    python bench/bench_memory.py            # builds the tiny model in a temp folder
    MARSCLI_TINY=PATH python bench/bench_memory.py

What keeps the large case bounded: the source is decoded once per prompt (its G samples share
it) and kept for crops, while the processor only ever sees a copy downscaled to its own pixel
budget (`tokens.model_image`); crops are cut from the source and resized Qwen-style."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

LARGE, BASELINE = (8000, 6000), (640, 480)
REPLIES = [
    ('<thinking>Closer.</thinking><tool_call>{"name": "image_zoom_in_tool", "arguments": '
    '{"bbox_2d": [500, 500, 1000, 1000]}}</tool_call>'),
    "<thinking>Red.</thinking><answer>red</answer>",
]


def photo(path: Path, size: tuple[int, int]) -> Path:
    """A JPEG with structure (a gradient and a red block), quick to write at any size."""
    from PIL import Image, ImageDraw

    w, h = size
    im = Image.linear_gradient("L").resize((w, h)).convert("RGB")
    ImageDraw.Draw(im).rectangle([w // 2, h // 2, w * 3 // 4, h * 3 // 4], fill=(200, 30, 30))
    im.save(path, quality=90)
    return path


def peak_rss_mb(cmd: list[str], cwd: Path) -> tuple[float, float, int, str]:
    """(peak RSS in MB, wall seconds, exit code, stderr tail) of one child process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        tail = err.read()[-2000:].decode("utf-8", "replace")
    return usage.ru_maxrss / 1024, time.perf_counter() - t0, p.returncode, tail


def measure(size: tuple[int, int], tiny: Path, work: Path) -> dict[str, tuple[float, float]]:
    """{"ask": (MB, s), "rollout": (MB, s)} for one image size; raises if a command fails."""
    work.mkdir(parents=True, exist_ok=True)
    img = photo(work / "photo.jpg", size)
    marscli = [sys.executable, "-m", "marscli"]
    (work / "p.jsonl").write_bytes(orjson.dumps(
        {"v": 1, "id": "big", "image": "photo.jpg", "question": "What colour?",
         "answer": ["red"], "replies": REPLIES}) + b"\n")
    cmds = {
        "ask": [*marscli, "ask", str(img), "What colour?", "--policy", str(tiny),
                "--max-turns", "2", "--max-turn-tokens", "8", "--crops-dir", str(work / "crops")],
        "rollout": [*marscli, "rollout", str(work / "p.jsonl"), "-o", str(work / "t.jsonl"),
                    "--policy", str(tiny), "--engine", "replay", "-n", "2"],
    }
    out = {}
    for name, cmd in cmds.items():
        mb, secs, code, err = peak_rss_mb(cmd, work)
        if code != 0:
            raise RuntimeError(f"{name} on {size[0]}x{size[1]} exited {code}:\n{err}")
        out[name] = (mb, secs)
    return out


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        tiny = Path(os.environ["MARSCLI_TINY"]) if os.environ.get("MARSCLI_TINY") else None
        if tiny is None:
            from marscli.qwen.tiny import build_tiny_model

            tiny = build_tiny_model(Path(tmp) / "tiny", seed=0)
        base = measure(BASELINE, tiny, Path(tmp) / "small")
        large = measure(LARGE, tiny, Path(tmp) / "large")
    for name in ("ask", "rollout"):
        (b_mb, b_s), (l_mb, l_s) = base[name], large[name]
        print(f"memory: {name:7s} {LARGE[0]}x{LARGE[1]} peak RSS {l_mb:,.0f} MB ({l_s:.1f} s) | "
              f"{BASELINE[0]}x{BASELINE[1]} {b_mb:,.0f} MB ({b_s:.1f} s) | "
              f"ratio {l_mb / b_mb:.2f}, +{l_mb - b_mb:,.0f} MB")


if __name__ == "__main__":
    main()
