"""marscli's command line: thin typer commands over the stage modules (stages/).

Every command parses options, builds its stage's config from them once (options.py), calls one
function of its stage and maps `MarsError` to one stderr line and an exit code (2 bad input, 1
runtime failure). The options are checked by the stage, not here. Nothing heavy is imported
here: `marscli --help` must not load torch or transformers. No `from __future__ import
annotations` here: typer would then `eval` every option's annotation string at each start
(~30 ms of every stage's start-up, bench/bench_advantages.py).
"""

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from marscli import options as opt
from marscli.agent.runner import MAX_TOKENS
from marscli.errors import BadInput, MarsError, check_range, os_error
from marscli.secrets import redact  # torch-free: an error may echo a URL with a password

app = typer.Typer(
    name="marscli",
    help="SenseNova-MARS as composable stages: rollout | reward | advantages, then update.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: typer 0.29's rich panels print a value (`--json <bool>`, even
    # `--help <bool>`) after every flag, as if flags took one
    rich_markup_mode=None,
)
index_app = typer.Typer(help="Build search indexes (text: SQLite FTS5; images: perceptual hashes).",
                        no_args_is_help=True, rich_markup_mode=None)
app.add_typer(index_app, name="index")


class ArgumentOrCommand(TyperGroup):
    """A group whose callback is a command of its own, with an argument: `eval BENCH [OPTIONS]`
    runs the callback (options before or after BENCH), `eval summarize|rescore ...` the
    subcommand (a first word naming a subcommand is never read as BENCH)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] in self.commands:
            # stop at the subcommand's name: the callback's argument gets a copy of it, and
            # everything from the name on is the subcommand's
            ctx.allow_interspersed_args, ctx.allow_extra_args = False, True
            return super().parse_args(ctx, [args[0], *args])
        # parsed as a command: options anywhere, and a word after BENCH is an extra argument
        ctx.allow_interspersed_args, ctx.allow_extra_args = True, False
        return super().parse_args(ctx, args)

    def get_params(self, ctx: typer.Context) -> list[Any]:
        """A subcommand's usage line names the group without the callback's argument."""
        params = super().get_params(ctx)
        return params if ctx.command is self else [p for p in params
                                                   if p.param_type_name != "argument"]


eval_app = typer.Typer(cls=ArgumentOrCommand, rich_markup_mode=None,
                       subcommand_metavar="| summarize|rescore RESULTS.jsonl [OPTIONS]")
app.add_typer(eval_app, name="eval")


def fail(err: MarsError) -> None:
    """Print `error: ...` on one line and exit with the error's code."""
    msg = redact(" ".join(str(err).split("\n")))
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(err.exit_code)


def main() -> None:
    try:
        app()
    except MarsError as e:  # raised outside a command body (option callbacks)
        if os.environ.get("MARSCLI_DEBUG"):
            raise
        print(f"error: {redact(str(e))}", file=sys.stderr)
        sys.exit(e.exit_code)
    except OSError as e:  # a full disk or a read-only folder met outside a guard
        err = os_error(e)
        if err is None or os.environ.get("MARSCLI_DEBUG"):
            raise
        print(f"error: {redact(str(err))}", file=sys.stderr)
        sys.exit(err.exit_code)


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """`with guard():` around a command body maps MarsError to one stderr line and its exit
    code (`MARSCLI_DEBUG=1`: the traceback instead). Each command is one stage, with its own
    memory of the inputs it read (`provenance.stage_inputs`: its outputs never clobber them)."""
    from marscli.records.provenance import stage_inputs

    try:
        with stage_inputs():
            yield
    except MarsError as e:
        if os.environ.get("MARSCLI_DEBUG"):
            raise
        fail(e)
    except OSError as e:
        err = os_error(e)
        if err is None or os.environ.get("MARSCLI_DEBUG"):
            raise
        fail(err)


# ---------------------------------------------------------------------------------- commands


@app.command()
def env() -> None:
    """Print versions of Python, torch, transformers, vLLM, DeepSpeed and CUDA (for bug reports)."""
    from marscli.stages.env import describe

    for k, v in describe().items():
        print(f"{k}: {v}")


@app.command()
def advantages(
    scored: Annotated[str, typer.Argument(
        metavar="SCORED.jsonl", help="Scored trajectory rows (JSONL; - for stdin).")],
    estimator: Annotated[str, typer.Option(
        help="Advantage estimator: bn-gspo (the paper's), grpo, dr-grpo or rloo.")] = "bn-gspo",
    minibatches: Annotated[int, typer.Option(
        help="Split whole groups into M seeded minibatches and normalise within each.")] = 1,
    filter_zero_std: Annotated[bool, typer.Option(
        "--filter-zero-std", help="Drop groups whose rewards are all equal.")] = False,
    mask_truncated: Annotated[bool, typer.Option(
        "--mask-truncated", help="Rows stopped by the turn limit or the token budget keep "
        "their reward in the group statistics but get advantage 0 and \"masked\": "
        "\"truncated\" (update trains nothing on them).")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the minibatch shuffle.")] = 0,
    output: Annotated[str, typer.Option(
        "-o", "--output", help="Output JSONL (- for stdout).")] = "-",
) -> None:
    """Add `advantage` and `group` statistics to scored rows (numpy only, no torch)."""
    with guard():
        from marscli.stages.advantages import main as advantages_main

        advantages_main(scored, output, estimator, minibatches, filter_zero_std, seed,
                        mask_truncated)


@app.command()
def reward(
    traj: Annotated[str, typer.Argument(
        metavar="TRAJ.jsonl", help="Trajectory rows (JSONL; - for stdin).")],
    judge: opt.Judge = opt.JUDGE,
    format_weight: Annotated[float, typer.Option(
        help="Format reward for a clean trajectory ending in an answer.")] = 0.5,
    max_unscored: opt.MaxUnscored = opt.MAX_UNSCORED,
    judge_timeout: opt.JudgeTimeout = opt.JUDGE_TIMEOUT,
    judge_retries: opt.JudgeRetries = opt.JUDGE_RETRIES,
    judge_concurrency: opt.JudgeConcurrency = opt.JUDGE_CONCURRENCY,
    judge_cache: opt.JudgeCache = None,
    protocol: Annotated[str, typer.Option(
        help="mars (marscli's scoring) or release (the released code's: the letter read from "
             "the last turn, A-D; the judge only for a tagged open answer).")] = "mars",
    output: Annotated[str, typer.Option(
        "-o", "--output", help="Output JSONL (- for stdout).")] = "-",
    follow: Annotated[bool, typer.Option(
        "--follow", help="Score rows as the stage writing TRAJ appends them, until its sidecar "
        "TRAJ.meta.json appears, so that judging overlaps generation (make rl does).")] = False,
) -> None:
    """Add `reward` (accuracy + format) to trajectory rows; torch-free with --judge exact."""
    with guard():
        from marscli.stages.reward import main as reward_main

        reward_main(traj, output, judge, format_weight, max_unscored,
                    opt.judge_options(locals(), check=False), protocol=protocol, follow=follow)


@app.command()
def ask(
    image: Annotated[str, typer.Argument(help="Image file (any size; the zoom tool crops it).")],
    question: Annotated[str, typer.Argument(help="The question.")],
    policy: opt.Policy = opt.DEFAULT_POLICY,
    engine: Annotated[str, typer.Option(
        help="hf (default), vllm, or replay (scripted turns from --replies).")] = "hf",
    replies: Annotated[str | None, typer.Option(
        metavar="FILE", help="--engine replay: the assistant's turns to replay through the "
        "real tools (a JSON list of strings; scripts/demo_image.py --replies writes one).")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the trajectory record to stdout (image paths absolute).")] = False,
    max_turns: opt.MaxTurns = opt.GEN.max_turns,
    max_turn_tokens: opt.MaxTurnTokens = opt.GEN.max_turn_tokens,
    max_new_tokens: Annotated[int | None, typer.Option(
        hidden=True, help="Deprecated: --max-turn-tokens.")] = None,
    temperature: opt.Temperature = 0.0,
    seed: opt.Seed = opt.GEN.seed,
    device: opt.Device = opt.GEN.device,
    crops_dir: Annotated[str | None, typer.Option(
        help="Where crops are saved (default: a new temp folder).")] = None,
    system_prompt: opt.SystemPrompt = None,
    tools_config: opt.ToolsConfig = None,
    text_search: opt.TextSearch = None,
    image_search: opt.ImageSearch = None,
) -> None:
    """Ask the agent about an image: the live trace on stderr, the answer on stdout."""
    gen = opt.generation_options({**locals(), "batch_size": 1})
    with guard():
        if max_new_tokens is not None:  # the old name of --max-turn-tokens, kept working
            check_range("--max-new-tokens", max_new_tokens, 1, MAX_TOKENS)
            gen.max_turn_tokens = max_new_tokens
        from marscli.stages.ask import main as ask_main

        ask_main(image, question, gen, crops_dir=crops_dir, replies=replies, as_json=json_out)


IndexOutput = Annotated[str, typer.Option("-o", "--output", help="Index file to write (SQLite).")]
IndexForce = Annotated[bool, typer.Option("--force", help="Replace an existing index file.")]


@index_app.command("text")
def index_text(
    corpus: Annotated[str, typer.Argument(
        metavar="CORPUS.jsonl", help="Rows {id, title, text} (or Search-R1's {id, contents}).")],
    output: IndexOutput,
    force: IndexForce = False,
) -> None:
    """Build a SQLite FTS5 (BM25) index for `--text-search local:INDEX`."""
    with guard():
        from marscli.stages import index

        index.text(corpus, output, force=force)


@index_app.command("images")
def index_images(
    source: Annotated[str, typer.Argument(
        metavar="FOLDER_OR_JSONL", help="A folder of images, or JSONL rows {path, title}.")],
    output: IndexOutput,
    force: IndexForce = False,
) -> None:
    """Build a perceptual-hash index for `--image-search local:INDEX`."""
    with guard():
        from marscli.stages import index

        index.images(source, output, force=force)


@app.command()
def search(
    query: Annotated[str | None, typer.Argument(help="Text query (omit it with --image).")] = None,
    text_search: Annotated[str | None, typer.Option(
        metavar="SPEC", help="Text backend: local:INDEX, retriever:URL or serper.")] = None,
    image: Annotated[str | None, typer.Option(
        help="Reverse-search this image file or public image URL.")] = None,
    image_search: Annotated[str, typer.Option(
        metavar="SPEC", help="Image backend: data, local:INDEX or serper-lens.")] = "data",
    row: Annotated[str | None, typer.Option(
        metavar="ROWS.jsonl[:LINE]",
        help="Prompt row for the data backend (default: line 1).")] = None,
    k: Annotated[int, typer.Option(help="Text results per query.")] = 5,
    max_chars: Annotated[int, typer.Option(help="Truncate the tool text to this.")] = 8192,
    fetch_pages: Annotated[bool, typer.Option(
        "--fetch-pages", help="serper: read the top pages, not just Google's snippets.")] = False,
    summarizer: Annotated[str | None, typer.Option(
        metavar="URL", help="OpenAI-compatible base URL that summarises the results "
                            "(key from SUMMARIZER_API_KEY or OPENAI_API_KEY).")] = None,
    summarizer_model: Annotated[str | None, typer.Option(
        help="Model name at --summarizer.")] = None,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache",
        help="Skip the result cache ($MARSCLI_CACHE_DIR or ~/.cache/marscli).")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print {ok, text, images: [{title, thumbnail}]} as JSON.")] = False,
) -> None:
    """Print what text_search_tool(QUERY) or image_search_tool() would return to the model."""
    with guard():
        from marscli.stages.search import main as search_main

        search_main(query, text_search, image, image_search, row, k, max_chars, fetch_pages,
                    summarizer, summarizer_model, no_cache, as_json=json_out)


@app.command()
def serve(
    policy: Annotated[str | None, typer.Argument(
        metavar="[POLICY]", help="Checkpoint folder to serve (none: start asleep, until POST "
                                 "/wake or /reload names one).")] = None,
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free one).")] = 8471,
    host: Annotated[str, typer.Option(
        help="Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface, "
             "for rollouts on other nodes).")] = "127.0.0.1",
    device: opt.Device = opt.GEN.device,
    tensor_parallel: opt.TensorParallel = None,
    max_batch: Annotated[int, typer.Option(help="Sequences vLLM batches at once.")] = 256,
    max_model_len: Annotated[int | None, typer.Option(
        help="Context length (default: the model's, at most 32,768).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="The share of each GPU's memory vLLM takes for weights and KV cache (GPUs only; "
             "--kv-cache-gib sets the cache instead).")] = 0.85,
    kv_cache_gib: Annotated[float | None, typer.Option(
        help="KV cache size in GiB (default on CPU: 1; on GPUs: a share of the memory).")] = None,
    sleep_mode: Annotated[bool, typer.Option(
        "--sleep-mode/--no-sleep-mode",
        help="vLLM's sleep mode where it has one (CUDA, ROCm): POST /sleep releases the GPU "
             "memory in place. Without it, and on vLLM-CPU, /sleep frees the engine and the "
             "wake builds a new one.")] = True,
    allow_dir: Annotated[list[str] | None, typer.Option(
        metavar="DIR", help="A folder whose images and checkpoints requests may name "
                            "(repeat it; default: the working folder and POLICY's parent).")
    ] = None,
    max_request_pixels: Annotated[int, typer.Option(
        help="Pixels of one request's images at most (413 beyond).")] = 100_000_000,
    max_inflight_pixels: Annotated[int, typer.Option(
        help="Pixels being decoded at once, all requests (503 + Retry-After beyond).")
    ] = 200_000_000,
    api_key_file: Annotated[str | None, typer.Option(
        metavar="FILE", help="A file (mode 600) holding a token: every request but GET /health "
                             "must send Authorization: Bearer <token> (401 otherwise); clients "
                             "read it from MARSCLI_SERVE_TOKEN_FILE.")] = None,
) -> None:
    """Keep a vLLM engine up and serve generation over HTTP, reloading weights in place
    (`POST /reload`) and sleeping between rollouts (`POST /sleep`, `/wake`); rollout and eval
    use it with --engine server:http://HOST:PORT."""
    with guard():
        from marscli.stages.serve import serve as run_server

        run_server(policy, host=host, port=port, device=device,
                   tensor_parallel=tensor_parallel or 1, max_batch=max_batch,
                   max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                   gpu_memory_utilization=gpu_memory_utilization,
                   sleep_mode=sleep_mode, allow_dir=allow_dir,
                   max_request_pixels=max_request_pixels,
                   max_inflight_pixels=max_inflight_pixels, api_key_file=api_key_file)


@app.command("serve-ctl")
def serve_ctl(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server, http://HOST:PORT.")],
    action: Annotated[str, typer.Argument(
        metavar="ACTION", help="sleep (GPU memory back), wake, or health.")],
    policy: Annotated[str | None, typer.Option(
        help="wake: the checkpoint to wake with (default: the one the server holds).")] = None,
    level: Annotated[int | None, typer.Option(
        help="sleep: 1 keeps the weights in host memory, 2 drops them (default 1).")] = None,
    timeout: Annotated[float, typer.Option(
        help="Seconds in all, retries included (a connect waits at most 10 s).")] = 600.0,
    retries: Annotated[int, typer.Option(
        help="Retries while the server does not answer (a refused connect is not retried).")] = 8,
    if_awake: Annotated[bool, typer.Option(
        "--if-awake", help="sleep: a server asleep already is left as it is (its health "
                           "printed, exit 0) instead of refused.")] = False,
) -> None:
    """Sleep or wake a `marscli serve` (or ask its health); its reply as one JSON line."""
    with guard():
        from marscli.stages.serve_ctl import serve_ctl as run_ctl

        run_ctl(url, action, policy=policy, level=level, timeout=timeout, retries=retries,
                if_awake=if_awake)


@app.command("tiny-model")
def tiny_model(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Checkpoint folder to create.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    text: Annotated[list[str] | None, typer.Option(
        metavar="FILE", help="Extra tokenizer training text (text or JSONL: string values); "
                             "repeatable. Pass the task's corpus and prompts.")] = None,
    size: Annotated[str | None, typer.Option(
        help="tiny (about 1 M parameters with --vocab tiny), small (demo) or micro (the "
             "default with --vocab qwen: text hidden 64).")] = None,
    vocab: Annotated[str, typer.Option(
        help="tiny (a small BPE trained here) or qwen (the real Qwen3-VL vocabulary and chat "
             "template; needs the qwen extra).")] = "tiny",
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT.")] = False,
    min_pixels: Annotated[int, typer.Option(
        help="Processor floor: images are upscaled to at least this many pixels.")] = 65_536,
    max_pixels: Annotated[int, typer.Option(
        help="Processor cap: 200,704 (448x448) gives at most 196 image tokens.")] = 200_704,
    init_std: Annotated[float, typer.Option(
        help="Standard deviation of the random weights (Qwen3-VL's initializer_range). "
             "0.08 left the seeing plateau 3x sooner than 0.02 (docs/demo.md).")] = 0.02,
) -> None:
    """Build a random Qwen3-VL checkpoint (HF format, tokenizer, processor) for tests and demos."""
    with guard():
        from marscli.stages.tiny_model import main as tiny_main

        tiny_main(out, seed=seed, text_files=text or [], size=size, force=force,
                  min_pixels=min_pixels, max_pixels=max_pixels, vocab=vocab, init_std=init_std)


@app.command()
def rollout(
    prompts: Annotated[str, typer.Argument(
        metavar="PROMPTS.jsonl", help="Prompt rows (marscli or MARS form; - for stdin).")],
    output: Annotated[str, typer.Option(
        "-o", "--output", help="Trajectory JSONL, appended to and resumed (with the settings "
        "it was written with: OUT.settings.json); crops go to OUT.media/ beside it. - streams "
        "records to stdout as they finish, with no resume, crops in ./rollout.media/ and "
        "absolute image paths.")],
    policy: opt.Policy = None,
    n: Annotated[int, typer.Option(
        "-n", help="Samples per prompt (G, at most 1024); ids PROMPTID#k.")] = 8,
    engine: opt.Engine = opt.GEN.engine,
    shard: opt.Shard = None,
    temperature: opt.Temperature = opt.GEN.temperature,
    top_p: opt.TopP = opt.GEN.top_p,
    top_k: opt.TopK = opt.GEN.top_k,
    presence_penalty: opt.PresencePenalty = opt.GEN.presence_penalty,
    max_turns: opt.MaxTurns = opt.GEN.max_turns,
    max_response_tokens: opt.MaxResponseTokens = opt.GEN.max_response_tokens,
    max_prompt_tokens: opt.MaxPromptTokens = None,
    max_turn_tokens: opt.MaxTurnTokens = opt.GEN.max_turn_tokens,
    batch_size: opt.BatchSize = opt.GEN.batch_size,
    max_inflight: opt.MaxInflight = None,
    lockstep: opt.Lockstep = False,
    seed: opt.Seed = opt.GEN.seed,
    text_search: opt.TextSearch = None,
    image_search: opt.ImageSearch = None,
    system_prompt: opt.SystemPrompt = None,
    tools_config: opt.ToolsConfig = None,
    device: opt.Device = opt.GEN.device,
    base_url: opt.BaseUrl = None,
    model: opt.Model = None,
    api_key_env: opt.ApiKeyEnv = None,
    tokenize_with: opt.TokenizeWith = None,
    timeout: opt.Timeout = None,
    retries: opt.Retries = None,
    concurrency: opt.Concurrency = None,
    tensor_parallel: opt.TensorParallel = None,
    image_dir: opt.ImageDir = None,
    search_timeout: opt.SearchTimeout = opt.GEN.search_timeout,
    search_retries: opt.SearchRetries = opt.GEN.search_retries,
    media_dir: Annotated[str | None, typer.Option(
        metavar="DIR", help="Where crops and thumbnails go (default: OUT.media/, or "
                            "./rollout.media/ with -o -).")] = None,
    max_tool_failure_rate: opt.MaxToolFailureRate = opt.MAX_TOOL_FAILURE_RATE,
    force: opt.Force = False,
    track: opt.Track = None,
) -> None:
    """Sample N trajectories per prompt with the agent; resumable, shardable."""
    gen = opt.generation_options(locals())
    with guard():
        from marscli.agent.runner import parse_shard
        from marscli.stages.rollout import run_rollout
        run_rollout(prompts, output, gen, n=n, shard=parse_shard(shard), image_dir=image_dir,
                    force=force, media=media_dir, track=track,
                    max_tool_failure_rate=max_tool_failure_rate)


@app.command()
def preflight(
    text_search: opt.TextSearch = None,
    image_search: opt.ImageSearch = None,
    judge: Annotated[str | None, typer.Option(
        metavar="SPEC", help="The judge reward uses: exact, or openai:MODEL@URL (asked for one "
                             "token).")] = None,
    search_timeout: opt.SearchTimeout = opt.GEN.search_timeout,
    search_retries: opt.SearchRetries = 0,
    judge_timeout: opt.JudgeTimeout = opt.JUDGE_TIMEOUT,
) -> None:
    """Check that each search and judge endpoint answers from here (one request each); make rl
    runs it first, where the stages run. Exit 1 naming those that failed."""
    with guard():
        from marscli.stages.preflight import run_preflight
        run_preflight(text_search, image_search, judge, timeout=search_timeout,
                      retries=search_retries, judge_timeout=judge_timeout)


@app.command("toy-world")
def toy_world(
    out: Annotated[str, typer.Argument(metavar="OUT", help="World folder to create.")],
    entities: Annotated[int, typer.Option(
        help="Made-up companies (5..96), each with a logo.")] = 24,
    seed: Annotated[int, typer.Option(help="Seed of everything (same seed, same bytes).")] = 0,
    train: Annotated[int, typer.Option(help="Prompt rows in train.jsonl.")] = 240,
    test: Annotated[int, typer.Option(help="Prompt rows in test.jsonl (new scenes).")] = 60,
    sft: Annotated[int, typer.Option(help="Rows with scripted expert replies in sft.jsonl.")] = 120,
    size: Annotated[int, typer.Option(help="Scene side in pixels.")] = 1024,
    grid: Annotated[int, typer.Option(
        help="Logos sit in one cell of a GRID x GRID layout; the expert zooms on that cell.")] = 8,
    zoom_cells: Annotated[int, typer.Option(
        help="The expert's zoom box spans this many cells per side (a block aligned to "
             "multiples of it, holding the logo's cell): 2 on a 4x4 grid zooms on a "
             "quadrant.")] = 1,
    kinds: Annotated[str, typer.Option(
        help="Question kinds, comma-separated: perception, knowledge, both."
    )] = "perception,knowledge,both",
    perceive: Annotated[int, typer.Option(
        help="Scenes of perception pre-training in perceive.jsonl (two message rows each: "
             "read the logo's crop, give the logo's box), for a random model to learn to see "
             "before the cold start; with --zoom-cells 2 or more also perceive-zoomed.jsonl "
             "(where the logo is in the crop).")] = 0,
    clutter: Annotated[float, typer.Option(
        help="Amount of muted clutter in the scenes, as a multiple of the default (0: the "
             "background gradient alone).")] = 1.0,
    direct: Annotated[float, typer.Option(
        help="Share of the cold-start (sft) rows of each kind and attribute whose expert "
             "answers without a tool, blind (some logo's value, another company's fact): a "
             "teacher that under-uses the tools, for RL to learn when to use them.")] = 0.0,
    avoid_seeds: Annotated[str, typer.Option(
        help="Seeds of worlds (of --avoid-entities entities) whose logos this world must not "
             "reuse, comma-separated: a pre-training world disjoint from the demo's.")] = "",
    avoid_entities: Annotated[int | None, typer.Option(
        help="Entities of the --avoid-seeds worlds (default: --entities).")] = None,
    avoid_by: Annotated[str, typer.Option(
        help="What of the --avoid-seeds worlds' logos is not reused: 'pair' (their shape and "
             "colour together) or 'logo' (the whole logo: shape, colour, plate and letter; "
             "their pairs appear with other letters or plates).")] = "pair",
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT.")] = False,
) -> None:
    """Write a synthetic MARS-like world (logos, scenes, corpus, prompts, expert replies)."""
    with guard():
        from marscli.stages.toy_world import main as toy_main

        toy_main(out, entities=entities, seed=seed, train=train, test=test, sft=sft, size=size,
                 grid=grid, kinds=kinds, zoom_cells=zoom_cells, perceive=perceive,
                 clutter=clutter, direct=direct, avoid_seeds=avoid_seeds,
                 avoid_entities=avoid_entities, avoid_by=avoid_by, force=force)


@app.command()
def update(
    adv: Annotated[str, typer.Argument(
        metavar="ADV.jsonl", help="Trajectory rows with `advantage` (and optional `minibatch`).")],
    policy: opt.PolicyIn,
    out: opt.OutCkpt,
    loss: Annotated[str, typer.Option(help="Policy loss: gspo (the paper's) or grpo.")] = "gspo",
    agg: Annotated[str | None, typer.Option(
        help="token-mean or seq-mean-token-mean (default: the loss's own: gspo "
             "seq-mean-token-mean, grpo token-mean).")] = None,
    clip_low: Annotated[float, typer.Option(help="Ratio clip below: 1 - clip_low.")] = 0.2,
    clip_high: Annotated[float, typer.Option(help="Ratio clip above: 1 + clip_high.")] = 0.28,
    lr: Annotated[float, typer.Option(help="AdamW learning rate.")] = 1e-6,
    lr_schedule: Annotated[str, typer.Option(help="constant, cosine or linear.")] = "constant",
    warmup_steps: Annotated[int, typer.Option(help="Linear warm-up steps.")] = 0,
    adam_beta1: opt.AdamBeta1 = 0.9,
    adam_beta2: opt.AdamBeta2 = 0.999,
    adam_eps: opt.AdamEps = 1e-8,
    weight_decay: opt.WeightDecay = 0.0,
    grad_clip: opt.GradClip = 1.0,
    kl: Annotated[float, typer.Option(help="k3 KL coefficient to --ref (0: no reference).")] = 0.0,
    ref: Annotated[str | None, typer.Option(help="Reference checkpoint for --kl.")] = None,
    epochs: Annotated[int, typer.Option(help="Passes over the minibatches.")] = 1,
    old_logp: Annotated[str, typer.Option(
        help="π_old: recompute (a forward of --policy) or engine (the rollout's log-probs, "
             "verl's bypass mode; rows without them exit 2).")] = "recompute",
    rollout_is: Annotated[str | None, typer.Option(
        metavar="MODE", help="Rollout correction, weight π_old/π_engine per token: off, "
        "token-truncate, token-mask, sequence-truncate or sequence-mask (default: "
        "token-truncate with --old-logp recompute, off with engine).")] = None,
    rollout_is_cap: Annotated[float, typer.Option(
        help="C: truncate modes cap the weight at C, mask modes drop tokens (sequences) "
             "above it.")] = 2.0,
    rollout_is_floor: Annotated[float, typer.Option(
        help="F: truncate modes raise the weight to F, mask modes drop tokens (sequences) "
             "below it.")] = 0.0,
    micro_batch_tokens: Annotated[int, typer.Option(
        help="Token budget of a micro-batch (longest sequence x count; a longer sequence "
             "trains alone).")] = 32768,
    deepspeed: opt.DeepSpeed = None,
    gradient_checkpointing: opt.GradientCheckpointing = False,
    logp_chunk: opt.LogpChunk = None,
    freeze_vision: opt.FreezeVision = False,
    seed: Annotated[int, typer.Option()] = 0,
    metrics: opt.Metrics = None,
    device: opt.TrainDevice = "auto",
    save_dtype: opt.SaveDtype = "auto",
    state_dir: opt.StateDir = None,
    keep_optimizer: Annotated[bool, typer.Option(
        "--keep-optimizer", help="Carry AdamW's state across iterations: load it from "
        "POLICY/train_state/ when present, write it to OUT/train_state/ (DeepSpeed: one file "
        "per rank, loaded on any number of ranks and ZeRO stage).")] = False,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing OUT.")] = False,
    track: opt.Track = None,
) -> None:
    """Policy-gradient update (BN-GSPO / GRPO) of a checkpoint. Data-parallel / ZeRO: launch
    with `torchrun --nproc_per_node N -m marscli update ...`, `deepspeed --no_local_rank
    --module marscli update ...` or `srun`."""
    params = locals()
    with guard():
        from marscli.stages.update import UpdateConfig, run_update

        run_update(adv, policy, out, opt.config(UpdateConfig, params))


@app.command("inspect")
def inspect_cmd(
    traj: Annotated[str, typer.Argument(
        metavar="TRAJ.jsonl",
        help="Trajectory rows: rollout, reward or advantages output (- for stdin).")],
    ids: Annotated[list[str] | None, typer.Option(
        "--id", metavar="ID", help="Only this trajectory id; repeatable.")] = None,
    where: Annotated[list[str] | None, typer.Option(
        metavar="EXPR", help="FIELD OP VALUE filter, dotted paths, OP in == != >= <= > <, e.g. "
                             "reward.accuracy==0, turns>3, tool_calls.image_zoom_in_tool>=1; "
                             "repeatable (ANDed); a missing field never matches.")] = None,
    limit: Annotated[int | None, typer.Option(help="Stop after N matches.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json",
        help="Print the matching records as JSONL (pipe them to another stage).")] = False,
    ids_out: Annotated[bool, typer.Option(
        "--ids", help="Print the matching ids, one a line.")] = False,
) -> None:
    """Show trajectories turn by turn: thinking, tool calls, observations, answer, reward."""
    with guard():
        from marscli.stages.inspect import main as inspect_main

        inspect_main(traj, ids=ids, where=where, limit=limit, as_json=json_out, as_ids=ids_out)


@app.command()
def plot(
    source: Annotated[str, typer.Argument(
        metavar="METRICS_OR_RUN", help="A run folder (RUN/iter-K/...) or a metrics JSONL.")],
    output: Annotated[str, typer.Option(
        "-o", "--output", help="PNG file to write (- for stdout).")],
    title: Annotated[str | None, typer.Option(
        help="Figure title (default: the run's name).")] = None,
) -> None:
    """Plot per-iteration curves of a run (or each metric of a metrics JSONL) to a PNG."""
    with guard():
        from marscli.stages.plot import main as plot_main

        plot_main(source, output, title)


@app.command()
def report(
    source: Annotated[str, typer.Argument(
        metavar="RUN_OR_TRAJ", help="A run folder (RUN/iter-K/...) or one trajectory JSONL.")],
    output: Annotated[str, typer.Option(
        "-o", "--output", help="HTML file to write (- for stdout).")],
    max_trajectories: Annotated[int, typer.Option(
        help="Trajectories shown at most, split evenly over the iterations.")] = 200,
    image_px: Annotated[int, typer.Option(
        help="Embedded images are downscaled to this many pixels on their longer side.")] = 512,
    title: Annotated[str | None, typer.Option(help="Page title (default: the run's name).")] = None,
) -> None:
    """Write one self-contained HTML page: curves, iteration table, filterable trajectories."""
    with guard():
        from marscli.stages.report import main as report_main

        report_main(source, output, max_trajectories, image_px, title)


@app.command()
def summary(
    runs: Annotated[list[str], typer.Argument(
        metavar="RUN...", help="Run folders of the toy world; seed s of RUN in RUN-seed<s>.")],
    iters: Annotated[int, typer.Option(help="RL iterations: checkpoints 0..ITERS.")],
    seeds: Annotated[int, typer.Option(help="RL seeds averaged: RUN, RUN-seed1, ...")] = 1,
    plot: Annotated[str | None, typer.Option(
        metavar="PNG", help="Also plot accuracy ± 95% CI per iteration to this PNG.")] = None,
) -> None:
    """The demo's table: per-iteration accuracy and tool use over RL seeds (RUN/summary.json)."""
    with guard():
        from marscli.stages.summary import main as summary_main

        summary_main(runs, iters, seeds, plot)


@eval_app.callback(invoke_without_command=True)
def eval_cmd(
    ctx: typer.Context,
    bench: Annotated[str | None, typer.Argument(
        metavar="BENCH", help="Benchmark file or folder (MARS data.jsonl folder, parquet, "
                              "JSONL + images, TSV).")] = None,
    output: Annotated[str | None, typer.Option(
        "-o", "--output", help="Results JSONL, appended to and resumed (with the settings "
        "it was written with: RESULTS.jsonl.settings.json); the summary goes to "
        "RESULTS.summary.json beside it.")] = None,
    fmt: Annotated[str, typer.Option(
        "--format", help="auto (detected from the files) or a layout's name: the loaders' "
                         "own list, in the error an unknown one gets and docs/evaluation.md.")
    ] = "auto",
    split: Annotated[str | None, typer.Option(
        help="The split to read when BENCH's files hold several (default: test); never "
             "mixed.")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="No model: load BENCH, open every image, print the normalised rows "
                        "as JSONL on stdout and a summary on stderr.")] = False,
    policy: opt.Policy = None,
    mode: Annotated[str, typer.Option(
        help="agent (the tool loop) or direct (no tools, one answer turn).")] = "agent",
    samples: Annotated[int, typer.Option(
        help="Samples per item, averaged (the paper uses 8 for V* and HR-Bench).")] = 1,
    engine: opt.Engine = opt.GEN.engine,
    judge: opt.Judge = opt.JUDGE,
    protocol: Annotated[str | None, typer.Option(
        help="mars (marscli's scoring; default), official (each benchmark's own: "
             "MMSearch token F1, HR-Bench rotations, InfoSeek ranges + split harmonic "
             "mean), release (the released code's validation scoring) or release-inference "
             "(its inference/eval.py: untagged answers go to the judge whole).")] = None,
    shard: opt.Shard = None,
    text_search: opt.TextSearch = None,
    image_search: opt.ImageSearch = None,
    max_turns: opt.MaxTurns = None,
    max_turn_tokens: opt.MaxTurnTokens = opt.GEN.max_turn_tokens,
    max_response_tokens: opt.MaxResponseTokens = opt.GEN.max_response_tokens,
    max_prompt_tokens: opt.MaxPromptTokens = None,
    temperature: opt.Temperature = 0.0,
    top_p: opt.TopP = opt.GEN.top_p,
    top_k: opt.TopK = opt.GEN.top_k,
    presence_penalty: opt.PresencePenalty = opt.GEN.presence_penalty,
    seed: opt.Seed = opt.GEN.seed,
    batch_size: opt.BatchSize = opt.GEN.batch_size,
    max_inflight: opt.MaxInflight = None,
    lockstep: opt.Lockstep = False,
    benchmark: Annotated[str | None, typer.Option(
        help="Benchmark name to record (default: inferred from the format or file name).")] = None,
    image_dir: opt.ImageDir = None,
    system_prompt: opt.SystemPrompt = None,
    tools_config: opt.ToolsConfig = None,
    device: opt.Device = opt.GEN.device,
    max_unscored: opt.MaxUnscored = opt.MAX_UNSCORED,
    max_tool_failure_rate: opt.MaxToolFailureRate = opt.MAX_TOOL_FAILURE_RATE,
    summarize: Annotated[str | None, typer.Option(
        "--summarize", "--summary-only", metavar="RESULTS.jsonl", hidden=True,
        help="Old form of `eval summarize RESULTS.jsonl`.")] = None,
    rescore: Annotated[bool, typer.Option(
        "--rescore", hidden=True,
        help="With --summarize: old form of `eval rescore RESULTS.jsonl`.")] = False,
    judge_timeout: opt.JudgeTimeout = opt.JUDGE_TIMEOUT,
    judge_retries: opt.JudgeRetries = opt.JUDGE_RETRIES,
    judge_concurrency: opt.JudgeConcurrency = opt.JUDGE_CONCURRENCY,
    judge_cache: opt.JudgeCache = None,
    base_url: opt.BaseUrl = None,
    model: opt.Model = None,
    api_key_env: opt.ApiKeyEnv = None,
    tokenize_with: opt.TokenizeWith = None,
    timeout: opt.Timeout = None,
    retries: opt.Retries = None,
    concurrency: opt.Concurrency = None,
    tensor_parallel: opt.TensorParallel = None,
    search_timeout: opt.SearchTimeout = opt.GEN.search_timeout,
    search_retries: opt.SearchRetries = opt.GEN.search_retries,
    force: opt.Force = False,
    track: opt.Track = None,
) -> None:
    """Evaluate a policy on a benchmark (agent or direct); resumable, shardable; summary
    beside the paper's numbers. `eval summarize` and `eval rescore` recompute the summary of a
    results file."""
    if ctx.invoked_subcommand is not None:
        return
    params = locals()
    gen = opt.generation_options(params)
    with guard():
        jopts = opt.judge_options(params)
        if summarize is not None:  # the old form of `eval summarize|rescore RESULTS.jsonl`
            if bench is not None:
                raise BadInput("--summarize: give the results file only, not BENCH too")
            _summarize(summarize, rescore=rescore, protocol=protocol, judge_spec=judge,
                       judge_opts=jopts, max_unscored=max_unscored,
                       max_tool_failure_rate=max_tool_failure_rate)
            return
        if bench is None:
            raise BadInput("BENCH: missing — give a benchmark file or folder (or --summarize "
                           "RESULTS.jsonl)")
        if check:
            from marscli.stages.eval_check import run_check

            run_check(bench, fmt=fmt, benchmark=benchmark, image_dir=image_dir, split=split,
                      output=output)
            return
        if output is None:
            raise BadInput("-o: missing — name the results file, e.g. -o results.jsonl")
        if rescore:
            raise BadInput("--rescore: only with --summarize RESULTS.jsonl")
        from marscli.agent.runner import parse_shard
        from marscli.stages.eval import run_eval

        run_eval(bench, output, gen, fmt=fmt, mode=mode, samples=samples, judge_spec=judge,
                 protocol=protocol or "mars", shard=parse_shard(shard), benchmark=benchmark,
                 image_dir=image_dir, max_unscored=max_unscored, split=split, judge_opts=jopts,
                 max_tool_failure_rate=max_tool_failure_rate, force=force, track=track)


Results = Annotated[str, typer.Argument(metavar="RESULTS.jsonl", help="Results file of eval.")]


@eval_app.command("summarize")
def eval_summarize(
    results: Annotated[list[str], typer.Argument(
        metavar="RESULTS.jsonl | RUN | SUMMARY.json...",
        help="A results file (its summary is recomputed), or a run folder (its "
             "eval/ckpt-*.summary.json) or summaries to compare.")],
    by: Annotated[str | None, typer.Option(
        help="Pick the best checkpoint by this benchmark (default: the mean over the "
             "benchmarks every checkpoint has).")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Comparing checkpoints: the table's numbers as JSON on stdout.")] = False,
    max_unscored: opt.MaxUnscored = opt.MAX_UNSCORED,
    max_tool_failure_rate: opt.MaxToolFailureRate = opt.MAX_TOOL_FAILURE_RATE,
) -> None:
    """Recompute RESULTS.summary.json from a results file (after `marscli merge`); or, given a
    run folder or summaries, compare checkpoints: accuracy with 95% intervals per benchmark
    and the best checkpoint. No generation."""
    with guard():
        from marscli.stages.eval_summarize import summarize_or_compare

        summarize_or_compare(results, by=by, as_json=as_json, max_unscored=max_unscored,
                             max_tool_failure_rate=max_tool_failure_rate)


@eval_app.command("rescore")
def eval_rescore(
    results: Results,
    protocol: Annotated[str | None, typer.Option(
        help="Score every record under this protocol (default: each record's own).")] = None,
    judge: opt.Judge = opt.JUDGE,
    max_unscored: opt.MaxUnscored = opt.MAX_UNSCORED,
    max_tool_failure_rate: opt.MaxToolFailureRate = opt.MAX_TOOL_FAILURE_RATE,
    judge_timeout: opt.JudgeTimeout = opt.JUDGE_TIMEOUT,
    judge_retries: opt.JudgeRetries = opt.JUDGE_RETRIES,
    judge_concurrency: opt.JudgeConcurrency = opt.JUDGE_CONCURRENCY,
    judge_cache: opt.JudgeCache = None,
) -> None:
    """Re-score every record of a results file (under --protocol, with --judge), rewrite it,
    then recompute RESULTS.summary.json; no generation."""
    with guard():
        _summarize(results, rescore=True, protocol=protocol, judge_spec=judge,
                   judge_opts=opt.judge_options(locals()), max_unscored=max_unscored,
                   max_tool_failure_rate=max_tool_failure_rate, command="eval rescore")


def _summarize(results: str, **kw: Any) -> None:
    """`stages.eval_summarize.run_summarize` (imported when used)."""
    from marscli.stages.eval_summarize import run_summarize

    run_summarize(results, **kw)


@app.command()
def merge(
    output: Annotated[str, typer.Argument(help="Merged JSONL to write.")],
    shards: Annotated[list[str], typer.Argument(help="Shard files, in order.")],
    allow_partial: Annotated[bool, typer.Option(
        "--allow-partial", help="Also merge shards without their sidecar (a killed or failed "
                                "job), dropping a torn last record, and a job with shards "
                                "missing; listed in the sidecar.")
    ] = False,
) -> None:
    """Join the finished shards of a rollout or eval array job; a shard still being written or
    without its sidecar is refused, duplicate ids are refused, and so are shards of another
    job (stage, policy, seed, settings, input, shard count) or a job with a shard missing;
    sidecars (*.meta.json, *.settings.json, *.summary.json) and media folders a glob matches
    skipped."""
    with guard():
        from marscli.stages.merge import main as merge_main

        merge_main(output, shards, allow_partial)


@app.command()
def sft(
    data: Annotated[str, typer.Argument(
        metavar="DATA.jsonl", help="Trajectory rows (rollout's segments) or message rows "
                                   "({messages, images}); - for stdin.")],
    policy: opt.PolicyIn,
    out: opt.OutCkpt,
    epochs: Annotated[int, typer.Option(help="Passes over the data.")] = 3,
    lr: Annotated[float, typer.Option(help="AdamW peak learning rate.")] = 1e-5,
    warmup_ratio: Annotated[float, typer.Option(
        help="Linear warm-up over this fraction of the steps (rounded up).")] = 0.03,
    schedule: Annotated[str, typer.Option(
        help="After warm-up: cosine, constant or linear.")] = "cosine",
    min_lr_ratio: Annotated[float, typer.Option(
        help="cosine/linear floor, as a fraction of --lr.")] = 0.0,
    batch_size: Annotated[int, typer.Option(help="Sequences per optimiser step.")] = 32,
    max_tokens: Annotated[int, typer.Option(
        help="Longest sequence allowed (a longer row is a bad row; never truncated).")] = 32768,
    micro_batch_tokens: Annotated[int | None, typer.Option(
        help="Token budget of a micro-batch "
             "(longest sequence x count; default --max-tokens).")] = None,
    adam_beta1: opt.AdamBeta1 = 0.9,
    adam_beta2: opt.AdamBeta2 = 0.999,
    adam_eps: opt.AdamEps = 1e-8,
    weight_decay: opt.WeightDecay = 0.0,
    grad_clip: opt.GradClip = 1.0,
    freeze_vision: opt.FreezeVision = False,
    gradient_checkpointing: opt.GradientCheckpointing = False,
    logp_chunk: opt.LogpChunk = None,
    deepspeed: opt.DeepSpeed = None,
    system_prompt: Annotated[str | None, typer.Option(
        metavar="FILE", help="Base system prompt for message rows without a system turn "
                             "(as rollout's --system-prompt).")] = None,
    seed: Annotated[int, typer.Option(help="Shuffling and initialisation seed.")] = 0,
    save_every_epoch: Annotated[bool, typer.Option(
        "--save-every-epoch", help="Keep a resumable state in OUT.partial/ after each epoch; "
                                   "re-running the command resumes from it.")] = False,
    metrics: opt.Metrics = None,
    skip_bad: Annotated[bool, typer.Option(
        "--skip-bad", help="Skip (and count) bad rows instead of exiting 2.")] = False,
    device: opt.TrainDevice = "auto",
    save_dtype: opt.SaveDtype = "auto",
    state_dir: opt.StateDir = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing OUT (and a stale OUT.partial).")] = False,
    track: opt.Track = None,
) -> None:
    """Supervised fine-tuning (cold start) on trajectories or conversations; loss on the
    model's turns only. Data-parallel / ZeRO: launch as `update` (torchrun, deepspeed, srun)."""
    params = locals()
    with guard():
        from marscli.stages.sft import (  # validates the options before torch loads
            SftConfig,
            run_sft,
        )

        run_sft(data, policy, out, opt.config(SftConfig, params))


@app.command("state")
def state_cmd(
    action: Annotated[str, typer.Argument(
        help="check | redo-from | persist | settle | adopt | prune (docs/rl-loop.md)")],
    run: Annotated[str, typer.Argument(help="The run folder (make's RUN).")],
    k: Annotated[int, typer.Argument(metavar="K", help="The checkpoint ckpt-K (prune: up to).")],
    state_dir: Annotated[str | None, typer.Option(
        metavar="DIR", help="This run's node-local working copies (make's RUN_STATE).")] = None,
    keep: Annotated[int, typer.Option(help="prune: states of the last KEEP kept.")] = 1,
    background: Annotated[bool, typer.Option(
        "--background", help="persist: copy in a process of its own.")] = False,
    lock_fd: Annotated[int | None, typer.Option(hidden=True)] = None,
) -> None:
    """The RL loop's training state on node-local storage (make rl STATE_DIR=...): check it,
    copy it durably into the run folder, redo what a lost copy held, prune it."""
    with guard():
        from marscli.stages.state import run_state

        run_state(action, run, k, state_dir, keep, background, lock_fd)


@app.command("plan")
def plan_cmd(
    policy: Annotated[str, typer.Argument(
        metavar="POLICY_OR_CONFIG", help="A checkpoint folder (its config.json is read) or a "
        "config.json file (recipes/qwen3-vl-8b.config.json, recipes/qwen3-vl-32b.config.json).")],
    gpus_per_node: Annotated[int, typer.Option(
        help="GPUs a node: the trainer's ranks a node.")] = 8,
    nodes: Annotated[int, typer.Option(help="Nodes the trainer (update) runs on.")] = 1,
    zero: Annotated[int | None, typer.Option(
        help="ZeRO stage: 0 (update without --deepspeed: plain torch), 2 or 3 (the "
             "default).")] = None,
    deepspeed: Annotated[str | None, typer.Option(
        metavar="FILE", help="update's --deepspeed config instead of --zero: its stage, offload "
        "and bucket sizes.")] = None,
    offload_optimizer: Annotated[bool, typer.Option(
        "--offload-optimizer", help="DeepSpeed keeps the fp32 states on the host.")] = False,
    micro_batch_tokens: Annotated[int, typer.Option(
        help="update's --micro-batch-tokens (longest row x rows).")] = 32768,
    gradient_checkpointing: Annotated[bool, typer.Option(
        "--gradient-checkpointing", help="update's --gradient-checkpointing.")] = False,
    logp_chunk: opt.LogpChunk = None,
    freeze_vision: Annotated[bool, typer.Option(
        "--freeze-vision", help="update's --freeze-vision: no grads or optimiser states for "
        "the vision tower.")] = False,
    ref: Annotated[bool, typer.Option(
        "--ref", help="update scores a reference policy (--kl with --ref CKPT).")] = False,
    keep_optimizer: Annotated[bool, typer.Option(
        "--keep-optimizer", help="update's --keep-optimizer: AdamW's moments are written and "
        "read back each iteration (the disk figures).")] = False,
    disk_gbps: Annotated[float, typer.Option(
        help="A node's throughput to the run folder in GB/s, for the disk figures; the "
             "default is an assumption for a shared file system, whose clients commonly reach "
             "1-3 GB/s a node: measure yours with fio or dd.")] = 2.0,
    loss_tokens: Annotated[int | None, typer.Option(
        help="Tokens under the loss in a micro-batch, at most (default: the worst case).")] = None,
    image_tokens: Annotated[int | None, typer.Option(
        help="Image tokens in a micro-batch, at most (default: the worst case).")] = None,
    tp: Annotated[int, typer.Option(
        help="The engine's tensor parallelism (--tensor-parallel).")] = 1,
    max_model_len: Annotated[int, typer.Option(help="The engine's context length.")] = 32768,
    max_num_seqs: Annotated[int, typer.Option(
        help="Sequences the engine runs at once (rollout's --batch-size; serve's "
             "--max-batch).")] = 32,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="The engine's share of a GPU (marscli's vllm engine: 0.85).")] = 0.85,
    gpu_memory: Annotated[str, typer.Option(
        help="Memory of one GPU: 80GiB, 141GB, ...")] = "80GiB",
    colocate: Annotated[bool, typer.Option(
        "--colocate", help="The engine stays up on the trainer's GPUs during the update "
        "(make rl SERVE=1 on the same nodes).")] = False,
    sleep_level: Annotated[int, typer.Option(
        help="With --colocate: 0 the engine stays awake (marscli's serve), 1 or 2 it sleeps "
             "(vLLM's sleep mode) during the update.")] = 0,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the plan as JSON (bytes).")] = False,
    check: Annotated[bool, typer.Option(
        "--check", help="Exit 2 with the reason in one line when it does not fit (make rl's "
        "check before a launch).")] = False,
) -> None:
    """Memory per GPU of an RL iteration (update's trainer, the vLLM engine) from a
    config.json, and whether it fits: a table, or --json; --check: exit 2 when it does not."""
    params = locals()
    with guard():
        from marscli.stages.plan import run_plan

        run_plan(policy, params, zero=zero, deepspeed=deepspeed, gpu_memory=gpu_memory,
                 as_json=json_out, check=check)


if __name__ == "__main__":
    main()
