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
