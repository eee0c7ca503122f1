"""The planner's knobs: one dataclass, stored in the AP checkpoint manifest under `planner_knobs` (msgpack)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import msgpack


@dataclass(frozen=True)
class PlannerKnobs:
    """Everything the planner's behaviour depends on besides the checkpoint tables (DESIGN.md §2).

    Buckets are ranked hottest first: bucket 0 holds the experts with the largest routing mass of their layer.
    `stage_floors` are the depth stages of PLANSTEP: stage k lets no block go below `stage_floors[k]` bits
    (descending, so the deepest allowed drop grows stage by stage). KV thresholds are in KV blocks.
    """

    # Defaults = the values chosen by the knob search of benchmarks/planner_quality.py on the bundled model
    # (results: benchmarks/results/planner-quality-*.json, "knob-search" rows); `convert` stores them in the
    # AP manifest. The search chose one bucket (mu = 1: the bucketed settings were no better on the calibration
    # windows) and one stage (a stage floor at a uniform footprint forces uniform width there).
    n_buckets: int = 1
    bucket_multipliers: tuple[float, ...] = (1.0,)  # mu per bucket, hottest first
    bucket_floors: tuple[int, ...] = (3,)  # lowest width a block of the bucket may reach
    stage_floors: tuple[int, ...] = (3,)
    alpha: float = 2.0  # strength of the prompt residual
    rho_clip: tuple[float, float] = (-2.0, 2.0)  # clip range of the residual head output (log-ratio)
    eps: float = 1e-12  # damage floor: every drop costs something, so zero-sensitivity blocks still rank by bytes
    routing_decay: float = 0.9  # weight of the old routing mass in the exponential moving average
    trigger_blocks: int = 2  # offload once free KV blocks <= target + trigger_blocks
    lookahead_blocks: int = 8  # the standing plan always covers at least this many KV blocks
    hysteresis_blocks: int = 4  # a reload leaves free blocks more than this many above the offload threshold
    # a reload leaves room for the peak KV need of this many recent planner steps. 64 on the H200 KV-pressure run
    # (Poisson arrivals, ~40 steps/s): 3 mean-width reversals, against 9 at 32 steps and 11 at 8
    # (kv_pressure-nvidia-h200-20261129-s7-win*.json)
    reload_dwell_steps: int = 64
    queue_len: int = 4  # plans kept in the plan queue
    # a reload takes a layer whose blocks all sit in the kernels' narrow class (4 bits or less) above it only for at
    # least this share of its blocks (planner.plan_reload): Qwen3 at 4-bit memory, home 6, batch 1, PagedWeight
    # decoded at 0.963 of uniform 4 bits with 138 blocks at 5 bits spread over 46 layers
    # (engine_bench-nvidia-h200-20261202-s31-qwen3-paired-parent.json). 0 turns the rule off.
    narrow_min_share: float = 0.5
    # a release that would leave a layer above the narrow class for less than this share of its blocks takes the whole
    # layer into it (planner.plan_release_narrow), for the kernels' speed on mixed layers (0.895 / 0.929 of uniform
    # 4 bits at batch 32 / 8 with the parent home, engine_bench-nvidia-h100-80gb-hbm3-20261205-s44-paired-b328.json).
    # Off (0) until measured: on engine_bench's tables it caps 21-22 of 24 layers there and predicts 1.44-1.58x the
    # unruled release's damage, near uniform 4 bits' 1.50-1.69x (class-rule-cpu-2c-20261205-s45.json, computed)
    release_min_share: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "bucket_multipliers", tuple(float(m) for m in self.bucket_multipliers))
        object.__setattr__(self, "bucket_floors", tuple(int(f) for f in self.bucket_floors))
        object.__setattr__(self, "stage_floors", tuple(int(f) for f in self.stage_floors))
        object.__setattr__(self, "rho_clip", (float(self.rho_clip[0]), float(self.rho_clip[1])))
        if self.n_buckets < 1:
            raise ValueError(f"n_buckets must be >= 1, got {self.n_buckets}")
        if len(self.bucket_multipliers) != self.n_buckets or len(self.bucket_floors) != self.n_buckets:
            raise ValueError("bucket_multipliers and bucket_floors need one entry per bucket")
        if any(m <= 0 for m in self.bucket_multipliers):
            raise ValueError("bucket multipliers must be positive")
        if not self.stage_floors or list(self.stage_floors) != sorted(self.stage_floors, reverse=True):
            raise ValueError("stage_floors must be a non-empty descending sequence")
        if self.rho_clip[0] > self.rho_clip[1]:
            raise ValueError("rho_clip must be (min, max)")
        if not 0.0 <= self.routing_decay < 1.0:
            raise ValueError("routing_decay must lie in [0, 1)")
        if self.eps <= 0 or min(self.trigger_blocks, self.lookahead_blocks, self.hysteresis_blocks,
                                self.reload_dwell_steps) < 0:
            raise ValueError("eps must be positive and block counts non-negative")
        if self.queue_len < 1:
            raise ValueError("queue_len must be >= 1")
        if not 0.0 <= self.narrow_min_share <= 1.0 or not 0.0 <= self.release_min_share <= 1.0:
            raise ValueError("narrow_min_share and release_min_share must lie in [0, 1]")

    def to_dict(self) -> dict:
        d = asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict) -> "PlannerKnobs":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown planner knobs: {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_dict(), use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "PlannerKnobs":
        return cls.from_dict(msgpack.unpackb(data, raw=False))
