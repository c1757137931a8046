"""marscli's command line: thin typer commands over the stage modules (stages/).

A command's options are the fields of the configs it names (`cfg: UpdateConfig`), declared
once beside each config (options.py builds them); its own arguments and the few options no
config owns are in its signature. Every command calls one function of its stage, inside the
error boundary (app.py); the options are checked by the stage, not here. Nothing heavy is
imported here: `marscli --help` must not load torch or transformers. No `from __future__
import annotations` here: typer would then `eval` every option's annotation string at each
start (~30 ms of every stage's start-up).
"""

from typing import Annotated

import typer

from marscli.agent.generation import GenerationOptions, JobOptions
from marscli.app import app, command, eval_app, index_app, run
from marscli.evaluation.config import EvalConfig
from marscli.options import use
from marscli.qwen.policy import DEFAULT_POLICY
from marscli.qwen.tiny_config import TinyConfig
from marscli.rl.config import AdvantagesConfig
from marscli.scoring.judge_config import JudgeConfig
from marscli.serving.config import ControlConfig, ServeConfig
from marscli.toy.config import SummaryConfig, WorldConfig
from marscli.train.config import PlanConfig, SftConfig, StateConfig, UpdateConfig
from marscli.view.config import InspectConfig, ReportConfig

# ---------------------------------------------------------------------------------- commands

Output = Annotated[str, typer.Option("-o", "--output", help="Output JSONL (- for stdout).")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing output.")]


@command(app)
def env() -> None:
    """Print versions of Python, torch, transformers, vLLM, DeepSpeed and CUDA (for bug reports)."""
    from marscli.stages.env import describe

    for k, v in describe().items():
        print(f"{k}: {v}")


@command(app)
def advantages(
    scored: Annotated[str, typer.Argument(
        metavar="SCORED.jsonl", help="Scored trajectory rows (JSONL; - for stdin).")],
    cfg: AdvantagesConfig,
    output: Output = "-",
) -> None:
    """Add `advantage` and `group` statistics to scored rows (numpy only, no torch)."""
    from marscli.stages.advantages import main as advantages_main

    advantages_main(scored, output, **vars(cfg))


@command(app)
def reward(
    traj: Annotated[str, typer.Argument(
        metavar="TRAJ.jsonl", help="Trajectory rows (JSONL; - for stdin).")],
    judge: JudgeConfig,
    format_weight: Annotated[float, typer.Option(
        help="Format reward for a clean trajectory ending in an answer.")] = 0.5,
    protocol: Annotated[str, typer.Option(
        help="mars (marscli's scoring) or release (the released code's: the letter read from "
             "the last turn, A-D; the judge only for a tagged open answer).")] = "mars",
    output: Output = "-",
    follow: Annotated[bool, typer.Option(
        "--follow", help="Score rows as the stage writing TRAJ appends them, until its sidecar "
        "TRAJ.meta.json appears, so that judging overlaps generation (make rl does).")] = False,
) -> None:
    """Add `reward` (accuracy + format) to trajectory rows; torch-free with --judge exact."""
    from marscli.scoring.judge import judge_options
    from marscli.stages.reward import main as reward_main

    reward_main(traj, output, judge.judge, format_weight, judge.max_unscored,
                judge_options(judge, check=False), protocol=protocol, follow=follow)


@command(app)
def ask(
    image: Annotated[str, typer.Argument(help="Image file (any size; the zoom tool crops it).")],
    question: Annotated[str, typer.Argument(help="The question.")],
    gen: GenerationOptions = use(
        only=("policy", "engine", "max_turns", "max_turn_tokens", "temperature", "seed",
              "device", "system_prompt", "tools_config", "text_search", "image_search"),
        policy=DEFAULT_POLICY, temperature=0.0, fixed={"batch_size": 1},
        help={"engine": "hf (default), vllm, or replay (scripted turns from --replies)."}),
    replies: Annotated[str | None, typer.Option(
        metavar="FILE", help="--engine replay: the assistant's turns to replay through the "
        "real tools (a JSON list of strings; scripts/demo_image.py --replies writes one).")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the trajectory record to stdout (image paths absolute).")] = False,
    crops_dir: Annotated[str | None, typer.Option(
        help="Where crops are saved (default: a new temp folder).")] = None,
) -> None:
    """Ask the agent about an image: the live trace on stderr, the answer on stdout."""
    from marscli.stages.ask import main as ask_main

    ask_main(image, question, gen, crops_dir=crops_dir, replies=replies, as_json=json_out)


@command(index_app, "text")
def index_text(
    corpus: Annotated[str, typer.Argument(
        metavar="CORPUS.jsonl", help="Rows {id, title, text} (or Search-R1's {id, contents}).")],
    output: Annotated[str, typer.Option("-o", "--output", help="Index file to write (SQLite).")],
    force: Force = False,
) -> None:
    """Build a SQLite FTS5 (BM25) index for `--text-search local:INDEX`."""
    from marscli.stages import index

    index.text(corpus, output, force=force)


@command(index_app, "images")
def index_images(
    source: Annotated[str, typer.Argument(
        metavar="FOLDER_OR_JSONL", help="A folder of images, or JSONL rows {path, title}.")],
    output: Annotated[str, typer.Option("-o", "--output", help="Index file to write (SQLite).")],
    force: Force = False,
) -> None:
    """Build a perceptual-hash index for `--image-search local:INDEX`."""
    from marscli.stages import index

    index.images(source, output, force=force)


@command(app)
def search(
    query: Annotated[str | None, typer.Argument(help="Text query (omit it with --image).")] = None,
    gen: GenerationOptions = use(only=("text_search", "image_search"), image_search="data"),
    image: Annotated[str | None, typer.Option(
        help="Reverse-search this image file or public image URL.")] = None,
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
    from marscli.stages.search import main as search_main

    search_main(query, gen.text_search, image, gen.image_search, row, k, max_chars,
                fetch_pages, summarizer, summarizer_model, no_cache, as_json=json_out)


@command(app)
def serve(
    policy: Annotated[str | None, typer.Argument(
        metavar="[POLICY]", help="Checkpoint folder to serve (none: start asleep, until POST "
                                 "/wake or /reload names one).")] = None,
    cfg: ServeConfig = use(),
) -> None:
    """Keep a vLLM engine up and serve generation over HTTP, reloading weights in place
    (`POST /reload`) and sleeping between rollouts (`POST /sleep`, `/wake`); rollout and eval
    use it with --engine server:http://HOST:PORT."""
    from marscli.stages.serve import serve as run_server

    run_server(policy, **vars(cfg))


@command(app, "serve-ctl")
def serve_ctl(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server, http://HOST:PORT.")],
    action: Annotated[str, typer.Argument(
        metavar="ACTION", help="sleep (GPU memory back), wake, or health.")],
    cfg: ControlConfig,
) -> None:
    """Sleep or wake a `marscli serve` (or ask its health); its reply as one JSON line."""
    from marscli.stages.serve_ctl import serve_ctl as run_ctl

    run_ctl(url, action, **vars(cfg))


@command(app, "tiny-model")
def tiny_model(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Checkpoint folder to create.")],
    cfg: TinyConfig,
) -> None:
    """Build a random Qwen3-VL checkpoint (HF format, tokenizer, processor) for tests and demos."""
    from marscli.stages.tiny_model import main as tiny_main

    tiny_main(out, **vars(cfg))


@command(app)
def rollout(
    prompts: Annotated[str, typer.Argument(
        metavar="PROMPTS.jsonl", help="Prompt rows (marscli or MARS form; - for stdin).")],
    output: Annotated[str, typer.Option(
        "-o", "--output", help="Trajectory JSONL, appended to and resumed (with the settings "
        "it was written with: OUT.settings.json); crops go to OUT.media/ beside it. - streams "
        "records to stdout as they finish, with no resume, crops in ./rollout.media/ and "
        "absolute image paths.")],
    n: Annotated[int, typer.Option(
        "-n", help="Samples per prompt (G, at most 1024); ids PROMPTID#k.")] = 8,
    gen: GenerationOptions = use(),
    job: JobOptions = use(),
    media_dir: Annotated[str | None, typer.Option(
        metavar="DIR", help="Where crops and thumbnails go (default: OUT.media/, or "
                            "./rollout.media/ with -o -).")] = None,
) -> None:
    """Sample N trajectories per prompt with the agent; resumable, shardable."""
    from marscli.stages.rollout import run_rollout

    run_rollout(prompts, output, gen, n=n, media=media_dir, **job.stage_kwargs())


@command(app)
def preflight(
    gen: GenerationOptions = use(only=("text_search", "image_search", "search_timeout",
                                       "search_retries"), search_retries=0),
    judge: Annotated[str | None, typer.Option(
        metavar="SPEC", help="The judge reward uses: exact, or openai:MODEL@URL (asked for one "
                             "token).")] = None,
    jcfg: JudgeConfig = use(only=("judge_timeout",)),
) -> None:
    """Check that each search and judge endpoint answers from here (one request each); make rl
    runs it first, where the stages run. Exit 1 naming those that failed."""
    from marscli.stages.preflight import run_preflight

    run_preflight(gen.text_search, gen.image_search, judge, timeout=gen.search_timeout,
                  retries=gen.search_retries, judge_timeout=jcfg.judge_timeout)


@command(app, "toy-world")
def toy_world(
    out: Annotated[str, typer.Argument(metavar="OUT", help="World folder to create.")],
    cfg: WorldConfig,
) -> None:
    """Write a synthetic MARS-like world (logos, scenes, corpus, prompts, expert replies)."""
    from marscli.stages.toy_world import main as toy_main

    toy_main(out, **vars(cfg))


PolicyIn = Annotated[str, typer.Option(help="Input checkpoint (HF folder); left untouched.")]
OutCkpt = Annotated[str, typer.Option(help="Output checkpoint folder (must not exist).")]


@command(app)
def update(
    adv: Annotated[str, typer.Argument(
        metavar="ADV.jsonl", help="Trajectory rows with `advantage` (and optional `minibatch`).")],
    policy: PolicyIn,
    out: OutCkpt,
    cfg: UpdateConfig,
) -> None:
    """Policy-gradient update (BN-GSPO / GRPO) of a checkpoint. Data-parallel / ZeRO: launch
    with `torchrun --nproc_per_node N -m marscli update ...`, `deepspeed --no_local_rank
    --module marscli update ...` or `srun`."""
    from marscli.stages.update import run_update

    run_update(adv, policy, out, cfg)


@command(app)
def sft(
    data: Annotated[str, typer.Argument(
        metavar="DATA.jsonl", help="Trajectory rows (rollout's segments) or message rows "
                                   "({messages, images}); - for stdin.")],
    policy: PolicyIn,
    out: OutCkpt,
    cfg: SftConfig,
) -> None:
    """Supervised fine-tuning (cold start) on trajectories or conversations; loss on the
    model's turns only. Data-parallel / ZeRO: launch as `update` (torchrun, deepspeed, srun)."""
    from marscli.stages.sft import run_sft  # validates the options before torch loads

    run_sft(data, policy, out, cfg)


@command(app, "inspect")
def inspect_cmd(
    traj: Annotated[str, typer.Argument(
        metavar="TRAJ.jsonl",
        help="Trajectory rows: rollout, reward or advantages output (- for stdin).")],
    cfg: InspectConfig,
) -> None:
    """Show trajectories turn by turn: thinking, tool calls, observations, answer, reward."""
    from marscli.stages.inspect import main as inspect_main

    inspect_main(traj, **vars(cfg))





@command(app)
def plot(
    source: Annotated[str, typer.Argument(
        metavar="METRICS_OR_RUN", help="A run folder (RUN/iter-K/...) or a metrics JSONL.")],
    output: Annotated[str, typer.Option(
        "-o", "--output", help="PNG file to write (- for stdout).")],
    title: Annotated[str | None, typer.Option(help="Title (default: the run's name).")] = None,
) -> None:
    """Plot per-iteration curves of a run (or each metric of a metrics JSONL) to a PNG."""
    from marscli.stages.plot import main as plot_main

    plot_main(source, output, title)


@command(app)
def report(
    source: Annotated[str, typer.Argument(
        metavar="RUN_OR_TRAJ", help="A run folder (RUN/iter-K/...) or one trajectory JSONL.")],
    output: Annotated[str, typer.Option(
        "-o", "--output", help="HTML file to write (- for stdout).")],
    cfg: ReportConfig,
) -> None:
    """Write one self-contained HTML page: curves, iteration table, filterable trajectories."""
    from marscli.stages.report import main as report_main

    report_main(source, output, **vars(cfg))


@command(app)
def summary(
    runs: Annotated[list[str], typer.Argument(
        metavar="RUN...", help="Run folders of the toy world; seed s of RUN in RUN-seed<s>.")],
    cfg: SummaryConfig,
) -> None:
    """The demo's table: per-iteration accuracy and tool use over RL seeds (RUN/summary.json)."""
    from marscli.stages.summary import main as summary_main

    summary_main(runs, **vars(cfg))


@command(eval_app, callback=True)
def eval_cmd(
    ctx: typer.Context,
    bench: Annotated[str | None, typer.Argument(
        metavar="BENCH", help="Benchmark file or folder (MARS data.jsonl folder, parquet, "
                              "JSONL + images, TSV).")] = None,
    output: Annotated[str | None, typer.Option(
        "-o", "--output", help="Results JSONL, appended to and resumed (with the settings "
        "it was written with: RESULTS.jsonl.settings.json); the summary goes to "
        "RESULTS.summary.json beside it.")] = None,
    check: Annotated[bool, typer.Option(
        "--check", help="No model: load BENCH, open every image, print the normalised rows "
                        "as JSONL on stdout and a summary on stderr.")] = False,
    ev: EvalConfig = use(),
    gen: GenerationOptions = use(temperature=0.0, max_turns=None),
    judge: JudgeConfig = use(),
    job: JobOptions = use(),
    summarize: Annotated[str | None, typer.Option(
        "--summarize", "--summary-only", metavar="RESULTS.jsonl", hidden=True,
        help="Old form of `eval summarize RESULTS.jsonl`.")] = None,
    rescore: Annotated[bool, typer.Option(
        "--rescore", hidden=True,
        help="With --summarize: old form of `eval rescore RESULTS.jsonl`.")] = False,
) -> None:
    """Evaluate a policy on a benchmark (agent or direct); resumable, shardable; summary
    beside the paper's numbers. `eval summarize` and `eval rescore` recompute the summary of a
    results file."""
    if ctx.invoked_subcommand is None:
        from marscli.stages.eval import main as eval_main

        eval_main(bench, output, check, ev, gen, judge, job, summarize, rescore)


Limits = use(only=("max_unscored",))
ToolLimit = use(only=("max_tool_failure_rate",))


@command(eval_app, "summarize")
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
    judge: JudgeConfig = Limits,
    job: JobOptions = ToolLimit,
) -> None:
    """Recompute RESULTS.summary.json from a results file (after `marscli merge`); or, given a
    run folder or summaries, compare checkpoints: accuracy with 95% intervals per benchmark
    and the best checkpoint. No generation."""
    from marscli.stages.eval_summarize import summarize_or_compare

    summarize_or_compare(results, by=by, as_json=as_json, max_unscored=judge.max_unscored,
                         max_tool_failure_rate=job.max_tool_failure_rate)


@command(eval_app, "rescore")
def eval_rescore(
    results: Annotated[str, typer.Argument(metavar="RESULTS.jsonl", help="Results file of eval.")],
    protocol: Annotated[str | None, typer.Option(
        help="Score every record under this protocol (default: each record's own).")] = None,
    judge: JudgeConfig = use(),
    job: JobOptions = ToolLimit,
) -> None:
    """Re-score every record of a results file (under --protocol, with --judge), rewrite it,
    then recompute RESULTS.summary.json; no generation."""
    from marscli.stages.eval_summarize import rescore

    rescore(results, judge, job, rescore=True, protocol=protocol, command="eval rescore")


@command(app)
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
    from marscli.stages.merge import main as merge_main

    merge_main(output, shards, allow_partial)


@command(app, "state")
def state_cmd(
    action: Annotated[str, typer.Argument(
        help="check | redo-from | persist | settle | adopt | prune (docs/rl-loop.md)")],
    run: Annotated[str, typer.Argument(help="The run folder (make's RUN).")],
    k: Annotated[int, typer.Argument(metavar="K", help="The checkpoint ckpt-K (prune: up to).")],
    cfg: StateConfig,
) -> None:
    """The RL loop's training state on node-local storage (make rl STATE_DIR=...): check it,
    copy it durably into the run folder, redo what a lost copy held, prune it."""
    from marscli.stages.state import run_state

    run_state(action, run, k, **vars(cfg))


@command(app, "plan")
def plan_cmd(
    policy: Annotated[str, typer.Argument(
        metavar="POLICY_OR_CONFIG", help="A checkpoint folder (its config.json is read) or a "
        "config.json file (recipes/qwen3-vl-8b.config.json, recipes/qwen3-vl-32b.config.json).")],
    cfg: PlanConfig,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print the plan as JSON (bytes).")] = False,
    check: Annotated[bool, typer.Option(
        "--check", help="Exit 2 with the reason in one line when it does not fit (make rl's "
        "check before a launch).")] = False,
) -> None:
    """Memory per GPU of an RL iteration (update's trainer, the vLLM engine) from a
    config.json, and whether it fits: a table, or --json; --check: exit 2 when it does not."""
    from marscli.stages.plan import run_plan

    run_plan(policy, cfg, as_json=json_out, check=check)


def main() -> None:
    """The `marscli` entry point."""
    run(app)


if __name__ == "__main__":
    main()
