"""Records and the files that hold them, lowest first (a module imports only those above it):

- `provenance`: what one stage read (`Inputs`, scoped by `stage_inputs`), and file hashes.
- `locks`: one writer per output (`OutputLock` on `OUT.lock`), and whether a file is still
  being written (`live_writer`, `writer_alive`), which readers check.
- `jsonl`: records as JSONL lines: reading, following a file another stage is writing, `dumps`.
- `outputs`: outputs written whole, one writer at a time, never onto an input: atomic files
  and folders, resumable appends.
- `sidecar`: `OUT.meta.json`, a stage's last file, which records the inputs' hashes.
- `mcq`: the options of a multiple-choice question written in its text.
- `schema`: the records as dataclasses, validated where they enter a stage.
- `trackers`: a stage's metrics, also sent to TensorBoard, W&B or a JSONL file (rollout, eval
  and the trainers alike).
"""
