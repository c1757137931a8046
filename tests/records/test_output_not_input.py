"""Outputs never clobber inputs, for every command that writes (issue 55.1): an output that is
one of the command's inputs, or a folder output holding one, is refused before anything is
written — exit 2, one line, every file as it was. Inputs read other than through the records
readers count too (`provenance.note_inputs`): the corpus an index reads, the images it hashes,
`--text` files, checkpoints, system prompts, the pictures a report shows or `ask` crops
beside. Also `index` over an existing file without `--force` (issue 55.9)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image

from helpers import (
    MIXED,
    ZOOM_THEN_ANSWER,
    invoke,
    scene,
    write_bench,
    write_jsonl,
    write_prompts,
)

Case = Callable[[Path, Path], list[str]]  # (tmp_path, tiny model) → the command's arguments
REFUSED = re.compile(r"is an input of this stage|holds .*, an input of this stage|"
                     r"is the output being written")


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file and folder under `folder`, with the bytes of each file."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def one_line(err: str) -> str:
    lines = [x for x in err.strip().splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err and err.rstrip().endswith(lines[0]), err
    return lines[0]


def corpus(folder: Path) -> Path:
    return write_jsonl(folder / "corpus.jsonl", [{"id": "1", "title": "t", "text": "a fact"}])


def rollout_out(tmp: Path, tiny: Path) -> Path:
    """A rollout's trajectories (replayed), beside the picture they show."""
    p = write_prompts(tmp / "p.jsonl", ["a", "b"])
    code, _, err = invoke(["rollout", str(p), "-o", str(tmp / "t.jsonl"), "--policy", str(tiny),
                           "--engine", "replay", "-n", "1"])
    assert code == 0, err
    return tmp / "t.jsonl"


def trajectories(tmp: Path, tiny: Path) -> Path:
    from marscli.qwen.policy import load_processor

    from helpers import trajectory

    return write_jsonl(tmp / "adv.jsonl", [trajectory(tmp, load_processor(str(tiny)), 0)])


def scored(i: int) -> dict:
    return {"v": 1, "id": f"p{i // 2}#{i % 2}", "prompt_id": f"p{i // 2}", "sample": i % 2,
            "reward": {"total": float(i % 2)}}


def index_text(tmp: Path, tiny: Path) -> list[str]:
    c = corpus(tmp)
    return ["index", "text", str(c), "-o", str(c), "--force"]


def index_images(tmp: Path, tiny: Path) -> list[str]:
    (tmp / "imgs").mkdir()
    for name, colour in (("one", "red"), ("two", "blue")):
        Image.new("RGB", (40, 40), colour).save(tmp / "imgs" / f"{name}.png")
    return ["index", "images", str(tmp / "imgs"), "-o", str(tmp / "imgs" / "one.png"), "--force"]


def tiny_model(tmp: Path, tiny: Path) -> list[str]:
    (tmp / "out").mkdir()
    (tmp / "out" / "words.txt").write_text("a few words to learn\n")
    return ["tiny-model", str(tmp / "out"), "--text", str(tmp / "out" / "words.txt"), "--force"]


def rollout(tmp: Path, tiny: Path) -> list[str]:
    p = write_prompts(tmp / "p.jsonl", ["a", "b"])
    return ["rollout", str(p), "-o", str(p), "--force", "--policy", str(tiny),
            "--engine", "replay", "-n", "1"]


def reward(tmp: Path, tiny: Path) -> list[str]:
    t = rollout_out(tmp, tiny)
    return ["reward", str(t), "-o", str(t)]


def advantages(tmp: Path, tiny: Path) -> list[str]:
    s = write_jsonl(tmp / "s.jsonl", [scored(0), scored(1)])
    return ["advantages", str(s), "-o", str(s)]


def update(tmp: Path, tiny: Path) -> list[str]:
    shutil.copytree(tiny, tmp / "run" / "ckpt-0")
    adv = trajectories(tmp, tiny)
    return ["update", str(adv), "--policy", str(tmp / "run" / "ckpt-0"), "--out",
            str(tmp / "run"), "--force"]


def sft(tmp: Path, tiny: Path) -> list[str]:
    data = trajectories(tmp, tiny)
    (tmp / "out").mkdir()
    (tmp / "out" / "system.txt").write_text("You are a careful visual agent.\n")
    return ["sft", str(data), "--policy", str(tiny), "--out", str(tmp / "out"), "--system-prompt",
            str(tmp / "out" / "system.txt"), "--force", "--epochs", "1"]


def eval_(tmp: Path, tiny: Path) -> list[str]:
    b = write_bench(tmp / "b.jsonl", MIXED[:2])
    return ["eval", str(b), "-o", str(b), "--force", "--policy", str(tiny), "--engine", "replay"]


def merge(tmp: Path, tiny: Path) -> list[str]:
    a = write_jsonl(tmp / "a.jsonl", [scored(0), scored(1)])
    return ["merge", str(a), str(a), "--allow-partial"]


def plot(tmp: Path, tiny: Path) -> list[str]:
    m = write_jsonl(tmp / "metrics.jsonl", [{"step": i, "loss": 1.0 / (i + 1)} for i in range(3)])
    return ["plot", str(m), "-o", str(m)]


def ask(tmp: Path, tiny: Path) -> list[str]:
    """The first crop of `ask` is `ask#0-1.png` in --crops-dir: here, the picture asked about."""
    img = scene(tmp / "ask#0-1.png")
    (tmp / "replies.json").write_text(json.dumps(ZOOM_THEN_ANSWER))
    return ["ask", str(img), "What colour?", "--policy", str(tiny), "--engine", "replay",
            "--replies", str(tmp / "replies.json"), "--crops-dir", str(tmp)]


def report(tmp: Path, tiny: Path) -> list[str]:
    t = rollout_out(tmp, tiny)
    return ["report", str(t), "-o", str(tmp / "scene.png")]


# One case a writing command; toy-world reads no file (its output cannot be an input); serve,
# search and state write no output a user names that a stage also reads.
CASES: dict[str, Case] = {
    "index text": index_text, "index images": index_images, "tiny-model": tiny_model,
    "rollout": rollout, "reward": reward, "advantages": advantages, "update": update,
    "sft": sft, "eval": eval_, "merge": merge, "plot": plot, "report": report, "ask": ask,
}


@pytest.mark.parametrize("command", list(CASES))
def test_an_output_that_is_an_input_is_refused_and_nothing_changes(command, tmp_path,
                                                                    tiny_model):
    args = CASES[command](tmp_path, tiny_model)
    before = snapshot(tmp_path)
    code, _, err = invoke(args)
    assert code == 2 and REFUSED.search(one_line(err)), err
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["text", "images"])
def test_index_over_an_existing_file_needs_force(kind, tmp_path):
    if kind == "text":
        source = corpus(tmp_path)
    else:
        source = tmp_path / "imgs"
        source.mkdir()
        Image.new("RGB", (40, 40), "red").save(source / "one.png")
    out = tmp_path / "index.sqlite"
    assert invoke(["index", kind, str(source), "-o", str(out)])[0] == 0
    before = snapshot(tmp_path)
    code, _, err = invoke(["index", kind, str(source), "-o", str(out)])
    assert code == 2 and "already exists — pass --force" in one_line(err), err
    assert snapshot(tmp_path) == before
    code, _, err = invoke(["index", kind, str(source), "-o", str(out), "--force"])
    assert code == 0, err


def test_index_onto_a_folder_is_one_line(tmp_path):
    c = corpus(tmp_path)
    (tmp_path / "idx").mkdir()
    before = snapshot(tmp_path)
    code, _, err = invoke(["index", "text", str(c), "-o", str(tmp_path / "idx"), "--force"])
    assert code == 2 and "is a folder" in one_line(err), err
    assert snapshot(tmp_path) == before
