"""Records and the files that hold them, lowest first (a module imports those above it; only
`write_sidecar`, which writes through `outputs`, and `follow_rows`, which watches the writer's
lock, import one below, inside the function):

- `provenance`: what one stage read (`Inputs`, scoped by `stage_inputs`), file hashes, and the
  sidecar `OUT.meta.json` that records them.
- `jsonl`: records as JSONL lines: reading, following a file another stage is writing, `dumps`.
- `outputs`: outputs written whole, one writer at a time, never onto an input: the lock, atomic
  files and folders, resumable appends.
- `schema`: the records as dataclasses, validated where they enter a stage.
"""
