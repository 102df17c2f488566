"""An engine that serves chats until it is killed: the victim of a kill -9
test (``python -m zkv.harness.vllm.chat_loop MODEL TRANSFER_JSON GPU_BLOCKS``).
It prints ``serving`` once the engine is up, then runs rounds of the
harness's chat (a new seed each round) so that stores and spills never stop."""

from __future__ import annotations

import json
import sys

from .rig import Chat, ModelShape, start_engine


def main(argv: list[str] | None = None) -> None:
    model, transfer, gpu_blocks = argv if argv is not None else sys.argv[1:]
    llm = start_engine(model, json.loads(transfer), int(gpu_blocks), max_model_len=1024)
    print("serving", flush=True)
    seed = 0
    while True:
        Chat(conversations=5, turns=2, first_tokens=700, turn_tokens=64, reply_tokens=8,
             vocab=ModelShape().vocab, seed=seed).run(llm)  # fmt: skip
        seed += 1


if __name__ == "__main__":
    main()
