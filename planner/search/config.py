"""User settings of the search: solver limits and which parallelism dimensions may be used."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.core import MOE_LOAD_IMBALANCE, SettingError
from planner.cost import MemorySemantics

# Every dimension `--allow` can name. Absent from the set = that dimension stays at its trivial value.
ALL_DIMENSIONS = (
    "tp",
    "pp",
    "dp",
    "zero",
    "recompute",
    "sp",
    "interleave",
    "gpipe",
    "layout",
    "mixed",
    "cross_node_tp",
    "cp",
    "ep",  # Mixture-of-Experts: expert parallelism (planner.search.space.expert_layouts)
    "etp",  # and tensor parallel inside the experts; opt-in (runtime: zoo and hf experts, checkpoints too)
)
DEFAULT_DIMENSIONS = frozenset(ALL_DIMENSIONS) - {"etp"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchConfig:
    """Limits of one search.

    ``time_limit_s``, ``gap_rel``, ``threads``: per CBC solve (``PULP_CBC_CMD``). ``top_k``: plans kept,
    the best and its runners-up, each solved exactly; the runners-up are the best of the candidates
    solved before the bound proved the best optimal, unless ``exhaustive_top_k`` (then the search goes
    on until they are proven the k best, which can take much longer). ``allow``: dimensions the search may use
    (:data:`ALL_DIMENSIONS`). ``max_micro_batch``: largest micro-batch size tried. ``memory_fraction``:
    share of device memory the plan may use (the rest is left to the allocator and workspaces).
    ``jobs``: outer candidates solved in parallel (threads, each waiting on its own CBC process); the best
    step time and its proof do not depend on it (runners-up and counters may: cutoffs follow the order in
    which solves finish).
    """

    time_limit_s: float = 30.0
    gap_rel: float = 0.0
    threads: int = 1
    top_k: int = 5
    exhaustive_top_k: bool = False
    allow: frozenset[str] = field(default=DEFAULT_DIMENSIONS)
    max_micro_batch: int = 16
    max_virtual_stages: int = 8
    memory_fraction: float = 0.9
    budget_s: float = 600.0
    jobs: int = 1  # candidates solved at once (each its own CBC process)
    # Cost attention as a fused causal flash kernel that skips the masked blocks (ParallelConfig.flash_attention
    # and causal_skip; no s x s scores saved). Long-context plans need it; off by default so that plans keep the
    # unfused attention the SC21 figures were made with.
    flash_attention: bool = False
    # Context parallelism (planner/cost/context.py): ``cp`` fixes the degree (None: searched, 1 included);
    # the search tries cp > 1 only for sequences of at least ``cp_min_seq_len`` tokens: below that a sequence's
    # activations are small beside the weights (Megatron-Core's CP guide recommends CP for long sequences), and
    # trying every cp would multiply the search time of short-sequence cases (GPT-3 175B at 2,048: 0.6 -> 10 s).
    cp: int | None = None
    cp_min_seq_len: int = 8192
    # Pinned outer choices (planner/search/pins.py): (flag name, value) pairs, e.g. (("tp", 8),); the search
    # proves the best plan under them.
    pins: tuple[tuple[str, object], ...] = ()
    # Dropless MoE routing's load imbalance (ParallelConfig.moe_load_imbalance; plan --moe-imbalance)
    moe_load_imbalance: float = MOE_LOAD_IMBALANCE
    # how the plan's framework holds memory (ParallelConfig.memory_semantics): "fsdp2" as `stratagem launch`,
    # torchtitan and Accelerate do; "textbook" as Megatron-LM and DeepSpeed do (plan --for)
    memory_semantics: MemorySemantics = "fsdp2"

    def __post_init__(self) -> None:
        unknown = set(self.allow) - set(ALL_DIMENSIONS)
        if unknown:
            raise SettingError(
                "allow", sorted(unknown), f"names unknown dimensions; choose from {','.join(ALL_DIMENSIONS)}"
            )
        if not 0 < self.memory_fraction <= 1:
            raise SettingError("memory_fraction", self.memory_fraction, "must be in (0, 1]; e.g. 0.9")
        if not self.time_limit_s > 0:
            raise SettingError("time_limit_s", self.time_limit_s, "must be positive seconds, e.g. 30")
        if self.jobs < 1:
            raise SettingError("jobs", self.jobs, "must be >= 1, e.g. the number of CPU cores")
        if self.cp is not None and self.cp < 1:
            raise SettingError("cp", self.cp, "must be >= 1, e.g. 2, 4 or 8 (a divisor of the sequence / 2)")
        if not self.budget_s > 0:
            raise SettingError("budget_s", self.budget_s, "must be positive seconds, e.g. 600")
        if self.memory_semantics not in ("fsdp2", "textbook"):
            raise SettingError("memory_semantics", self.memory_semantics, "must be 'fsdp2' or 'textbook'")

    def allows(self, dimension: str) -> bool:
        return dimension in self.allow


def parse_allow(text: str | None) -> frozenset[str]:
    """``"tp,pp,dp"`` -> frozenset; None -> everything."""
    if text is None:
        return DEFAULT_DIMENSIONS
    return frozenset(p.strip() for p in text.split(",") if p.strip())
