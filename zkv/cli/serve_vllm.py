"""``zkv serve-vllm``: one vLLM OpenAI-compatible server with zkv as its offload
backend and a bus of its own, in the foreground until Ctrl-C: the server the
fleet tests start (``harness/vllm/servers.py``), as a command, so that ``zkv
cycle`` can be tried by hand on two of them (docs/engine-vllm.md, "A fleet of
vLLM servers").  It prints the ``--server NAME URL BUS`` that ``zkv cycle``
takes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .options import fail, sigterm_as_interrupt


@click.command("serve-vllm")
@click.argument("name")
@click.option("--model", default=None, help="The model directory (or hub id) vLLM serves.")
@click.option(
    "--random-model",
    default=None,
    type=click.Path(file_okay=False),
    help="Serve a random-weight Llama written to this directory (nothing downloaded; kept if it is there "
    "already). A second directory with another --seed is new weights for a cycle to load.",
)
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True, help="For --random-model.")
@click.option("--write-only", is_flag=True, help="With --random-model: write it and exit (weights to load later).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True, help="The HTTP port.")
@click.option(
    "--root",
    default=None,
    type=click.Path(file_okay=False),
    help="Where its bus (ROOT/NAME-bus), CPU tier file and log live [default: $ZKV_RUNTIME_DIR/servers].",
)
@click.option("--gpu-blocks", type=click.IntRange(1), default=48, show_default=True, help="vLLM's KV cache, in blocks.")
@click.option("--cpu-blocks", type=click.IntRange(1), default=64, show_default=True, help="zkv's CPU tier, in blocks.")
@click.option("--max-model-len", type=click.IntRange(32), default=1024, show_default=True, help="vLLM's context.")
@click.option(
    "--cpus",
    default=None,
    help="The cores its engine computes on (VLLM_CPU_OMP_THREADS_BIND, e.g. 0 or 2-3): give two servers on one "
    "host cores of their own, or both land on the same one.",
)
@click.option(
    "--log",
    "log_path",
    default=None,
    help="Its log file [default: ROOT/NAME-server.log]; '-' for this terminal.",
)
def serve_vllm(
    name: str,
    model: str | None,
    random_model: str | None,
    seed: int,
    write_only: bool,
    port: int,
    root: str | None,
    cpus: str | None,
    log_path: str | None,
    **sizes: Any,
) -> None:
    """Run a vLLM server with zkv (vLLM's OpenAI routes, the RL routes, a zkv bus) until Ctrl-C."""
    if (model is None) == (random_model is None):
        raise click.UsageError("give the model: --model DIR, or --random-model DIR for a random-weight Llama")
    if write_only and random_model is None:
        raise click.UsageError("--write-only writes a --random-model")
    _need_vllm()
    if random_model is not None:
        model = _random_model(Path(random_model), seed)
        if write_only:
            click.echo(f"zkv serve-vllm: a random Llama (seed {seed}) is in {model}")
            return
    from ..harness.vllm.servers import ServerProc
    from ..net.endpoints import runtime_dir

    where = Path(root) if root else runtime_dir() / "servers"
    env = {"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else {}
    assert model is not None
    server = ServerProc(name, model, where, port=port, env=env, log_path=log_path, **sizes)
    sigterm_as_interrupt()
    try:
        _serve(server)
    except KeyboardInterrupt:
        click.echo(f"zkv serve-vllm: stopping {name}")
    finally:
        server.stop()


def _serve(server: Any) -> None:
    log = "this terminal" if server.log_path == "-" else str(server.log)
    click.echo(f"zkv serve-vllm: starting {server.name} on {server.model} (its log: {log}) ...")
    server.start()
    try:
        server.wait_ready()
    except RuntimeError as err:
        fail(str(err), "see its log")
    click.echo(f"zkv serve-vllm: {server.name} serves {server.url}; its zkv bus: {server.bus}")
    click.echo(f"zkv serve-vllm: for zkv cycle: --server {server.name} {server.url} {server.bus}")
    click.echo("Ctrl-C to stop.")
    code = server.proc.wait()  # until it exits, or Ctrl-C / SIGTERM
    fail(f"{server.name} exited with code {code}", f"see its log: {log}")


def _need_vllm() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        fail(
            "zkv serve-vllm needs vLLM (Python 3.11+; its own environment, docs/engine-vllm.md)",
            "bash tests/vllm_setup.sh && .venv-vllm/bin/zkv serve-vllm ...",
        )


def _random_model(directory: Path, seed: int) -> str:
    """A random-weight Llama in ``directory`` (the one there if it holds a checkpoint already)."""
    if (directory / "config.json").exists():
        return str(directory)
    from ..harness.vllm.rig import ModelShape, write_llama

    return write_llama(directory, ModelShape(), seed)


__all__ = ["serve_vllm"]
