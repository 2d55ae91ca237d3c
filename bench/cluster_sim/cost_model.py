"""The simulated worker's step time: the step-cost model (:class:`LinearCost`) over one
continuous-batching step's shape.

    step_ms = base_ms + per_token_ms · tokens + per_adapter_ms · adapters
              + per_rank_token_ms · rank_tokens + per_attention_ms · attention_units / 1000

``tokens`` are the tokens computed in the step (whole prompts being prefilled plus one per
decoding request), ``adapters`` the distinct adapters in it, ``rank_tokens`` Σ tokens × rank of
their adapter (the LoRA FLOPs), ``attention_units`` Σ new tokens × their mean context length (the
attention FLOPs). The coefficients (:data:`SHAPE_TERMS`) are fitted on the real engine by
``bench.cluster_sim.calibrate`` and stored with the CPU model in a JSON file; the committed ones,
which the experiments and the validation read, are in ``bench/cluster_sim/calibrations/``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from services.gpu_worker.engine.policies.linear_cost import LinearCost

DEFAULT_CALIBRATION = Path(__file__).parent / "calibrations" / "grid_busy.json"
"""The calibration experiments and validations simulate with unless ``--calibration`` names another."""


@dataclass(frozen=True)
class StepShape:
    """What one engine step computes."""

    tokens: int
    """Tokens computed: prompt tokens prefilled plus one per decoding request."""
    adapters: int
    """Distinct adapters among the step's requests."""
    rank_tokens: int
    """Σ over the step's tokens of their adapter's rank (0 for the base model)."""
    attention_units: float
    """Σ over requests of new tokens × mean context they attend over."""

    def row(self) -> tuple[float, ...]:
        """The step's features, in the order of :data:`SHAPE_TERMS`."""
        return (1.0, self.tokens, self.adapters, self.rank_tokens, self.attention_units / 1000.0)


def shape_of(parts: list[tuple[int, int, int, str]]) -> StepShape:
    """The shape of a step over ``(new_tokens, context_before, rank, adapter)`` per request."""
    return StepShape(
        tokens=sum(n for n, _, _, _ in parts),
        adapters=len({a for _, _, _, a in parts if a}),
        rank_tokens=sum(n * r for n, _, r, _ in parts),
        attention_units=sum(n * (c + n / 2) for n, c, _, _ in parts),
    )


SHAPE_TERMS = ("base_ms", "per_token_ms", "per_adapter_ms", "per_rank_token_ms", "per_attention_ms")
"""The step-time model's terms (named by their coefficient, ms), in the order of :meth:`StepShape.row`:
the fixed cost of a step (weights read, Python, sampling), the base-model cost of each computed
token, the cost of each distinct adapter in the step (gathering its pages, one kernel segment),
the LoRA cost per token per unit of rank, the attention cost per 1,000 attention units."""


@dataclass(frozen=True)
class Calibration:
    """A fitted step-time model and where it was measured."""

    model: LinearCost
    """Over :data:`SHAPE_TERMS`, ms."""
    adapter_load_ms: float
    """Measured time to fetch an adapter and page it in (median)."""
    cpu_model: str
    """The CPU the engine ran on (``/proc/cpuinfo`` model name and flags of note)."""
    samples: int
    """Timed steps the fit used."""
    mean_abs_error_pct: float
    """Mean |predicted − measured| / measured over those steps, %."""

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        raw = {**asdict(self), "model": self.model.as_dict()}
        Path(path).write_text(json.dumps(raw, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        raw = json.loads(Path(path).read_text())
        return cls(**{**raw, "model": LinearCost.named(SHAPE_TERMS, **raw["model"])})
