"""marscli's command line: thin typer commands over plain functions.

Every command parses options, calls one function of the library and maps `MarsError` to one
stderr line and an exit code (2 bad input, 1 runtime failure). Nothing heavy is imported here:
`marscli --help` must not load torch or transformers.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer

from marscli.errors import BadInput, MarsError

app = typer.Typer(
    name="marscli",
    help="SenseNova-MARS as composable stages: rollout | reward | advantages, then update.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
index_app = typer.Typer(help="Build search indexes (text: SQLite FTS5; images: perceptual hashes).",
                        no_args_is_help=True)
app.add_typer(index_app, name="index")


def fail(err: MarsError) -> None:
    """Print `error: ...` on one line and exit with the error's code."""
    msg = " ".join(str(err).split("\n"))
    print(f"error: {msg}", file=sys.stderr)
    raise typer.Exit(err.exit_code)


def main() -> None:
    try:
        app()
    except MarsError as e:  # raised outside a command body (option callbacks)
        if os.environ.get("MARSCLI_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


class _Guard:
    """`with guard():` around a command body maps MarsError to exit codes."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, MarsError) and not os.environ.get(
            "MARSCLI_DEBUG"
        ):
            fail(exc)
        return False


guard = _Guard


def check_range(name: str, value: float | None, lo: float | None = None,
                hi: float | None = None, *, lo_open: bool = False) -> None:
    """Reject an option outside its range with `BadInput` naming the option."""
    if value is None:
        return
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise BadInput(f"{name}: {value} is out of range — must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and value > hi:
        raise BadInput(f"{name}: {value} is out of range — must be <= {hi}")


# ---------------------------------------------------------------------------------- commands


@app.command()
def env() -> None:
    """Print versions of Python, torch, transformers, vLLM, DeepSpeed and CUDA (for bug reports)."""
    from marscli.envinfo import describe

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
    seed: Annotated[int, typer.Option(help="Seed of the minibatch shuffle.")] = 0,
    output: Annotated[str, typer.Option("-o", "--output", help="Output JSONL (- for stdout).")] = "-",
) -> None:
    """Add `advantage` and `group` statistics to scored rows (numpy only, no torch)."""
    with guard():
        check_range("--minibatches", minibatches, 1)
        from marscli.advantages import main as advantages_main

        advantages_main(scored, output, estimator, minibatches, filter_zero_std, seed)


@app.command()
def reward(
    traj: Annotated[str, typer.Argument(
        metavar="TRAJ.jsonl", help="Trajectory rows (JSONL; - for stdin).")],
    judge: Annotated[str, typer.Option(
        help="exact (no judge: non-exact answers score 0) or openai:MODEL@URL "
             "(an OpenAI-compatible chat API; key from OPENAI_API_KEY or JUDGE_API_KEY).")] = "exact",
    format_weight: Annotated[float, typer.Option(
        help="Format reward for a clean trajectory ending in an answer.")] = 0.5,
    max_unscored: Annotated[float, typer.Option(
        help="Exit 1 when more than this fraction of rows could not be judged.")] = 0.05,
    judge_timeout: Annotated[float, typer.Option(help="Seconds per judge request.")] = 60.0,
    judge_retries: Annotated[int, typer.Option(
        help="Retries after a failed judge request (0: one attempt).")] = 2,
    judge_concurrency: Annotated[int, typer.Option(help="Judge requests in flight.")] = 8,
    judge_cache: Annotated[str | None, typer.Option(
        metavar="PATH", help="SQLite verdict cache (default: $MARSCLI_CACHE_DIR/judge.sqlite "
                             "or ~/.cache/marscli/judge.sqlite).")] = None,
    output: Annotated[str, typer.Option("-o", "--output", help="Output JSONL (- for stdout).")] = "-",
) -> None:
    """Add `reward` (accuracy + format) to trajectory rows; torch-free with --judge exact."""
    with guard():
        check_range("--format-weight", format_weight, 0)
        check_range("--max-unscored", max_unscored, 0, 1)
        check_range("--judge-timeout", judge_timeout, 0, lo_open=True)
        check_range("--judge-retries", judge_retries, 0)
        check_range("--judge-concurrency", judge_concurrency, 1)
        from marscli.rewards import main as reward_main

        reward_main(traj, output, judge, format_weight, max_unscored, judge_timeout,
                    judge_retries, judge_concurrency, judge_cache)


@app.command()
def ask(
    image: Annotated[str, typer.Argument(help="Image file (any size; the zoom tool crops it).")],
    question: Annotated[str, typer.Argument(help="The question.")],
    policy: Annotated[str, typer.Option(help="Checkpoint folder or hub id.")] = "sensenova/SenseNova-MARS-8B",
    json_out: Annotated[bool, typer.Option("--json", help="Print the trajectory record to stdout.")] = False,
    max_turns: Annotated[int, typer.Option(help="Assistant turns at most.")] = 10,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per reply at most.")] = 2048,
    temperature: Annotated[float, typer.Option(help="0: greedy.")] = 0.0,
    seed: Annotated[int, typer.Option()] = 0,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    crops_dir: Annotated[str | None, typer.Option(help="Where crops are saved (default: a new temp folder).")] = None,
    system_prompt: Annotated[str | None, typer.Option(help="File replacing the system prompt.")] = None,
    text_search: Annotated[str | None, typer.Option(help="Text search backend: local:PATH, retriever:URL, serper.")] = None,
    image_search: Annotated[str | None, typer.Option(help="Image search backend: data, local:PATH, serper-lens.")] = None,
) -> None:
    """Ask the agent about an image: the live trace on stderr, the answer on stdout."""
    with guard():
        check_range("--max-turns", max_turns, 1)
        check_range("--max-new-tokens", max_new_tokens, 1)
        check_range("--temperature", temperature, 0)
        from marscli.ask import ask as run_ask

        rec = run_ask(image, question, policy=policy, device=device, max_turns=max_turns,
                      max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                      crops_dir=crops_dir, system_prompt_file=system_prompt,
                      text_search=text_search, image_search=image_search, live=not json_out)
        if json_out:
            from marscli.jsonl import dumps

            sys.stdout.buffer.write(dumps(rec))
        else:
            print(rec["final_answer"] if rec["final_answer"] is not None else "")


@index_app.command("text")
def index_text(
    corpus: Annotated[str, typer.Argument(
        metavar="CORPUS.jsonl", help="Rows {id, title, text} (or Search-R1's {id, contents}).")],
    output: Annotated[str, typer.Option("-o", "--output", help="Index file to write (SQLite).")],
) -> None:
    """Build a SQLite FTS5 (BM25) index for `--text-search local:INDEX`."""
    with guard():
        import time

        from marscli.jsonl import write_sidecar
        from marscli.search.text_index import build_text_index

        if output == "-":
            raise BadInput("-o -: an index is a SQLite file, not a stream — name a file")
        t0 = time.time()
        n = build_text_index(corpus, output)
        write_sidecar(output, stage="index text", inputs=[corpus], stats={"documents": n},
                      started=t0)
        print(f"indexed {n:,} documents into {output}", file=sys.stderr)


@index_app.command("images")
def index_images(
    source: Annotated[str, typer.Argument(
        metavar="FOLDER_OR_JSONL", help="A folder of images, or JSONL rows {path, title}.")],
    output: Annotated[str, typer.Option("-o", "--output", help="Index file to write (SQLite).")],
) -> None:
    """Build a perceptual-hash index for `--image-search local:INDEX`."""
    with guard():
        import time

        from marscli.jsonl import write_sidecar
        from marscli.search.image_index import build_image_index

        if output == "-":
            raise BadInput("-o -: an index is a SQLite file, not a stream — name a file")
        t0 = time.time()
        n = build_image_index(source, output)
        write_sidecar(output, stage="index images", inputs=[source], stats={"images": n},
                      started=t0)
        print(f"indexed {n:,} images into {output}", file=sys.stderr)


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
        metavar="ROWS.jsonl[:LINE]", help="Prompt row for the data backend (default: line 1).")] = None,
    k: Annotated[int, typer.Option(help="Text results per query.")] = 5,
    max_chars: Annotated[int, typer.Option(help="Truncate the tool text to this.")] = 8192,
    fetch_pages: Annotated[bool, typer.Option(
        "--fetch-pages", help="serper: read the top pages, not just Google's snippets.")] = False,
    summarizer: Annotated[str | None, typer.Option(
        metavar="URL", help="OpenAI-compatible base URL that summarises the results "
                            "(key from SUMMARIZER_API_KEY or OPENAI_API_KEY).")] = None,
    summarizer_model: Annotated[str | None, typer.Option(help="Model name at --summarizer.")] = None,
    no_cache: Annotated[bool, typer.Option(
        "--no-cache", help="Skip the result cache ($MARSCLI_CACHE_DIR or ~/.cache/marscli).")] = False,
    json_out: Annotated[bool, typer.Option(
        "--json", help="Print {ok, text, images: [{title, thumbnail}]} as JSON.")] = False,
) -> None:
    """Print what text_search_tool(QUERY) or image_search_tool() would return to the model."""
    with guard():
        check_range("--k", k, 1)
        check_range("--max-chars", max_chars, 1)
        if (query is None) == (image is None and row is None):
            raise BadInput("give either a QUERY (text search) or --image/--row (image search)")
        from marscli.errors import RuntimeFailure
        from marscli.tools.search import load_row, query_image, query_text, result_json, tool_failed

        opts = dict(k=k, max_chars=max_chars, fetch_pages=fetch_pages, summarizer=summarizer,
                    summarizer_model=summarizer_model)
        if no_cache:
            opts["cache"] = None
        if query is not None:
            if not text_search:
                raise BadInput("a QUERY needs --text-search SPEC — e.g. local:index.sqlite, "
                               "retriever:http://127.0.0.1:8000, serper")
            res = query_text(query, text_search, **opts)
        else:
            res = query_image(image, image_search, load_row(row) if row else None, **opts)
        if tool_failed(res):
            raise RuntimeFailure(res.text)
        if not res.ok:
            raise BadInput(res.text.removeprefix("error: "))
        if json_out:
            import orjson

            print(orjson.dumps(result_json(res)).decode())
        else:
            print(res.text)


@app.command("tiny-model")
def tiny_model(
    out: Annotated[str, typer.Argument(metavar="OUT", help="Checkpoint folder to create.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
    text: Annotated[list[str] | None, typer.Option(
        metavar="FILE", help="Extra tokenizer training text (text or JSONL: string values); "
                             "repeatable. Pass the task's corpus and prompts.")] = None,
    size: Annotated[str, typer.Option(help="tiny (about 1 M parameters) or small (demo).")] = "tiny",
    force: Annotated[bool, typer.Option("--force", help="Replace a non-empty OUT.")] = False,
) -> None:
    """Build a random Qwen3-VL checkpoint (HF format, tokenizer, processor) for tests and demos."""
    with guard():
        from marscli.tiny import main as tiny_main

        tiny_main(out, seed=seed, text_files=text or [], size=size, force=force)


if __name__ == "__main__":
    main()
