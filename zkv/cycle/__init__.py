"""RL cycles: one transaction that moves engines and their zkv buses to new
weights, all or nothing (docs/engine-vllm.md, "The RL cycle").

One cycle, written once: the steps as a table (``table.py``) of typed words
(``terms.py``), the decisions sans-IO (``core.py``), a thin runner
(``runner.py``), one report (``report.py``), the cycle's record on each
engine's label (``label.py``), run over one engine protocol (``engine.py``)
with drivers for a vLLM server over HTTP (``vllm_http.py``), a vLLM ``LLM``
in this process (``vllm_inproc.py``) and a prefix cache manager
(``prefix.py``).  No module here imports torch or vLLM."""

from .core import Decision
from .engine import Engine, Look, Staged, StepFailed, WeightSource
from .engines import EngineFleet
from .label import CycleRecord, LabelError
from .plan import CyclePlan
from .prefix import PrefixEngine, drain_and_clear, pause_clear_resume, resume
from .report import CycleReport, EngineReport, StepRecord
from .runner import CycleBusy
from .servers import ReloadWeights, ServerFleet, ServerSpec
from .sources import Update
from .terms import EXIT, EXIT_BUSY, InFlight, Outcome, PauseMode, Phase, Serves, State, Step, Tiers
from .vllm_http import ServerEngine
from .vllm_inproc import CycleError, LlmEngine, update_weights, weights_digest

__all__ = [
    "EXIT",
    "EXIT_BUSY",
    "CycleBusy",
    "CycleError",
    "CyclePlan",
    "CycleRecord",
    "CycleReport",
    "Decision",
    "Engine",
    "EngineFleet",
    "EngineReport",
    "InFlight",
    "LabelError",
    "LlmEngine",
    "Look",
    "Outcome",
    "PauseMode",
    "Phase",
    "PrefixEngine",
    "ReloadWeights",
    "Serves",
    "ServerEngine",
    "ServerFleet",
    "ServerSpec",
    "Staged",
    "State",
    "Step",
    "StepFailed",
    "StepRecord",
    "Tiers",
    "Update",
    "WeightSource",
    "drain_and_clear",
    "pause_clear_resume",
    "resume",
    "update_weights",
    "weights_digest",
]
