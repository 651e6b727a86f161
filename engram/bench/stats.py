"""Interleaved A/B runs with an A/A control, bootstrap confidence intervals and honest verdicts. Arms run in rounds of
A, A' (A again: the A/A control), B; order "abba" reverses every other round, so a block of two rounds is a palindrome
that cancels a linear drift ("abab" does not). Each block gives a ratio mean(B)/mean(A); the estimate is their median,
its CI the percentile interval over blocks resampled with a seeded Generator. A B/A difference is reported only when its
CI lies outside the A/A envelope [-f, +f], f = max |A/A CI bound|, else "no difference detectable"; an A/A CI excluding
0 warns that the machine is unstable."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

ORDERS = ("abba", "abab")
AA_LABEL = "A'"
MIN_BLOCKS = 5  # below this a percentile CI of a median rests on too few paired ratios to mean much


@dataclass
class ABConfig:
    """How an A/B run is scheduled and judged."""

    repeats: int = 10  # recorded runs per arm (= rounds); even with order "abba" (a block is two rounds)
    order: str = "abba"  # "abba": rounds alternate forward/reversed; "abab": always forward
    warmup: int = 1  # unrecorded runs of each arm before recording, and after every restart
    restart: bool = False  # stop + start the arm's service around every segment of consecutive same-arm runs
    aa: bool = True  # run the A/A control (A measured again under the label "A'") in the same run
    higher_is_better: bool = False  # samples are throughputs (True) or times (False); only words depend on it
    confidence: float = 0.95  # two-sided level of the bootstrap interval
    n_boot: int = 10_000  # bootstrap resamples
    seed: int = 0  # seed of the bootstrap Generator

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"ABConfig.order={self.order!r} must be one of {ORDERS}")
        if not isinstance(self.repeats, int) or self.repeats < 2:
            raise ValueError(f"ABConfig.repeats={self.repeats!r} must be an int >= 2")
        if self.order == "abba" and self.repeats % 2:
            raise ValueError(f"ABConfig.repeats={self.repeats} must be even with order='abba' "
                             "(a block is a forward and a reversed round)")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"ABConfig.warmup={self.warmup!r} must be an int >= 0")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"ABConfig.confidence={self.confidence!r} must be in [0.5, 1)")
        if not isinstance(self.n_boot, int) or self.n_boot < 100:
            raise ValueError(f"ABConfig.n_boot={self.n_boot!r} must be an int >= 100")

    @property
    def block_rounds(self) -> int:
        """Rounds per block: the smallest stretch over which the order is balanced."""
        return 2 if self.order == "abba" else 1


@dataclass
class Arm:
    """One side of an A/B: ``measure`` runs it once and returns one positive sample (seconds, tok/s, ...)."""

    name: str  # what the user calls it (a command line, "overlap on"); labels are A, A', B
    measure: Callable[[], float]
    start: Callable[[], None] | None = None  # bring the arm's service up (a server process, a loaded model)
    stop: Callable[[], None] | None = None  # take it down again; called once per start


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    """Turn a callable into a ``measure`` that returns its wall time in seconds."""
    def measure() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return measure


def arm_labels(aa: bool) -> list[str]:
    """The labels of a run in round order: A, the A/A control A' (when ``aa``), B."""
    return ["A", AA_LABEL, "B"] if aa else ["A", "B"]


def schedule(labels: Sequence[str], repeats: int, order: str) -> list[tuple[str, int]]:
    """Run order as (label, round) pairs: "abba" reverses every odd round, "abab" never does."""
    if order not in ORDERS:
        raise ValueError(f"order={order!r} must be one of {ORDERS}")
    out = []
    for r in range(repeats):
        seq = labels if order == "abab" or r % 2 == 0 else list(reversed(labels))
        out += [(label, r) for label in seq]
    return out


@dataclass
class Run:
    """One call of an arm, in run order."""

    index: int  # position in the whole run, warm-ups included (the x axis of the drift plot)
    arm: str  # label: "A", "A'" or "B"
    round: int  # recorded round, or -1 for a warm-up
    value: float  # the sample


@dataclass
class ArmStats:
    """Location and spread of one arm's recorded samples."""

    n: int
    median: float
    mean: float
    std: float  # sample standard deviation (ddof=1; 0 for one sample)
    min: float
    max: float
    iqr: float  # interquartile range
    rel_iqr: float  # iqr / median: the arm's noise as a fraction

    @classmethod
    def of(cls, x: Sequence[float]) -> ArmStats:
        a = np.asarray(x, dtype=np.float64)
        q1, med, q3 = np.quantile(a, [0.25, 0.5, 0.75])
        std = float(a.std(ddof=1)) if a.size > 1 else 0.0
        return cls(n=a.size, median=float(med), mean=float(a.mean()), std=std, min=float(a.min()),
                   max=float(a.max()), iqr=float(q3 - q1), rel_iqr=float((q3 - q1) / med))


@dataclass
class Comparison:
    """num/den as a relative difference (B/A − 1) with its bootstrap CI, from paired block ratios."""

    num: str
    den: str
    estimate: float  # median over blocks of mean(num)/mean(den), minus 1
    ci_lo: float
    ci_hi: float
    confidence: float
    n_blocks: int
    block_ratios: list[float] = field(default_factory=list)

    def excludes_zero(self) -> bool:
        return self.ci_lo > 0.0 or self.ci_hi < 0.0


def block_means(x: Sequence[float], block_rounds: int) -> np.ndarray:
    """[rounds] samples in round order → [blocks] means; rounds must fill whole blocks."""
    a = np.asarray(x, dtype=np.float64)
    if a.size % block_rounds:
        raise ValueError(f"{a.size} rounds do not fill blocks of {block_rounds} rounds")
    return a.reshape(-1, block_rounds).mean(axis=1)  # [rounds] -> [blocks, block_rounds] -> [blocks]


def compare(num: Sequence[float], den: Sequence[float], cfg: ABConfig,
            names: tuple[str, str] = ("B", "A")) -> Comparison:
    """Paired comparison of two arms' per-round samples (same length, round order), bootstrapped over blocks."""
    if len(num) != len(den):
        raise ValueError(f"arm {names[0]} has {len(num)} rounds but arm {names[1]} has {len(den)}")
    for name, x in zip(names, (num, den)):
        bad = [v for v in x if not (np.isfinite(v) and v > 0)]
        if bad:
            raise ValueError(f"arm {name}: samples must be finite and > 0 to form ratios, got {bad[:3]}")
    ratios = block_means(num, cfg.block_rounds) / block_means(den, cfg.block_rounds)  # [blocks]
    lo, hi = median_ci(ratios, cfg)
    return Comparison(num=names[0], den=names[1], estimate=float(np.median(ratios)) - 1.0,
                      ci_lo=lo - 1.0, ci_hi=hi - 1.0, confidence=cfg.confidence,
                      n_blocks=ratios.size, block_ratios=ratios.tolist())


def median_ci(x: Sequence[float], cfg: ABConfig) -> tuple[float, float]:
    """The percentile bootstrap interval of the median of ``x`` (``cfg``'s resamples, level and seed)."""
    a = np.asarray(x, dtype=np.float64)
    rng = np.random.default_rng(cfg.seed)
    idx = rng.integers(0, a.size, size=(cfg.n_boot, a.size))  # [n_boot, n] resampled indices
    boot = np.median(a[idx], axis=1)  # [n_boot]
    alpha = 1.0 - cfg.confidence
    lo, hi = np.quantile(boot, [alpha / 2, 1 - alpha / 2])
    return float(lo), float(hi)


def _pct(x: float) -> str:
    return f"{100 * x:+.2f} %"


def verdict(ab: Comparison, aa: Comparison | None, higher_is_better: bool = False) -> tuple[str, list[str]]:
    """The sentence a reader may quote, plus warnings (see the module docstring for the rules)."""
    warnings = []
    floor = max(abs(aa.ci_lo), abs(aa.ci_hi)) if aa is not None else 0.0
    if aa is not None and aa.excludes_zero():
        warnings.append(f"A/A control differs: {aa.num}/{aa.den} {_pct(aa.estimate)} "
                        f"(CI {_pct(aa.ci_lo)}…{_pct(aa.ci_hi)}) excludes 0 — the machine is not stable "
                        "enough to judge small differences")
    if aa is None:
        warnings.append("no A/A control: the verdict cannot tell B/A from the machine's own noise")
    if ab.n_blocks < MIN_BLOCKS:
        warnings.append(f"only {ab.n_blocks} blocks: the CI rests on very few paired ratios "
                        f"(use at least {MIN_BLOCKS} blocks)")
    level = f"{100 * ab.confidence:g} % CI"
    if ab.ci_lo > floor or ab.ci_hi < -floor:
        better = (ab.estimate > 0) == higher_is_better
        lo, hi = sorted((abs(ab.ci_lo), abs(ab.ci_hi)))
        text = (f"B {'faster' if better else 'slower'} by {100 * abs(ab.estimate):.2f} % "
                f"({level} {100 * lo:.2f}…{100 * hi:.2f} %)")
    else:
        text = f"no difference detectable (B/A {_pct(ab.estimate)}, {level} {_pct(ab.ci_lo)}…{_pct(ab.ci_hi)}"
        text += f"; A/A envelope ±{100 * floor:.2f} %)" if aa is not None else ")"
    return text, warnings


@dataclass
class ABResult:
    """Everything one A/B run produced; ``to_dict`` is what goes into the result JSON."""

    config: ABConfig
    arms: dict[str, str]  # label -> arm name
    runs: list[Run]
    samples: dict[str, list[float]]  # label -> recorded samples in round order
    stats: dict[str, ArmStats]
    comparisons: dict[str, Comparison]  # "B/A" and, with the control, "A'/A"
    verdict: str
    warnings: list[str]

    def to_dict(self) -> dict:
        return {"config": asdict(self.config), "arms": self.arms, "verdict": self.verdict,
                "warnings": self.warnings, "stats": {k: asdict(v) for k, v in self.stats.items()},
                "comparisons": {k: asdict(v) for k, v in self.comparisons.items()},
                "samples": self.samples, "runs": [asdict(r) for r in self.runs]}

    def table(self) -> str:
        from engram.bench.report import format_table
        rows = [{"arm": label, "name": self.arms[label], "n": s.n, "median": s.median, "mean": s.mean,
                 "min": s.min, "max": s.max, "rel IQR": f"{100 * s.rel_iqr:.2f}%"}
                for label, s in self.stats.items()]
        cmp_rows = [{"ratio": k, "estimate": f"{100 * c.estimate:+.2f}%", "CI lo": f"{100 * c.ci_lo:+.2f}%",
                     "CI hi": f"{100 * c.ci_hi:+.2f}%", "blocks": c.n_blocks} for k, c in self.comparisons.items()]
        lines = [format_table(rows), "", format_table(cmp_rows), "", f"verdict: {self.verdict}"]
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def analyze(samples: dict[str, Sequence[float]], cfg: ABConfig, arms: dict[str, str] | None = None,
            runs: list[Run] | None = None) -> ABResult:
    """Statistics and verdict from per-round samples keyed "A", "B" and optionally "A'" (the A/A control)."""
    for label in ("A", "B"):
        if label not in samples:
            raise ValueError(f"samples lack arm {label!r} (have {sorted(samples)})")
    for label, x in samples.items():
        if len(x) != cfg.repeats:
            raise ValueError(f"arm {label} has {len(x)} samples but ABConfig.repeats={cfg.repeats}")
    ab = compare(samples["B"], samples["A"], cfg, ("B", "A"))
    comparisons = {"B/A": ab}
    aa = None
    if AA_LABEL in samples:
        aa = compare(samples[AA_LABEL], samples["A"], cfg, (AA_LABEL, "A"))
        comparisons[f"{AA_LABEL}/A"] = aa
    text, warnings = verdict(ab, aa, cfg.higher_is_better)
    return ABResult(config=cfg, arms=dict(arms or {k: k for k in samples}), runs=list(runs or []),
                    samples={k: [float(v) for v in x] for k, x in samples.items()},
                    stats={k: ArmStats.of(x) for k, x in samples.items()}, comparisons=comparisons,
                    verdict=text, warnings=warnings)


def run_interleaved(a: Arm, b: Arm, cfg: ABConfig,
                    on_run: Callable[[Run], None] | None = None) -> ABResult:
    """Run both arms (and A') interleaved as ``cfg`` says, then ``analyze``; services start once, or with restart fresh
    at every change of label (one up at a time)."""
    labels = arm_labels(cfg.aa)
    arm_of = {"A": a, AA_LABEL: a, "B": b}
    runs: list[Run] = []
    samples: dict[str, list[float]] = {label: [] for label in labels}
    live: list[Arm] = []

    def call(label: str, rnd: int) -> None:
        try:
            value = float(arm_of[label].measure())
        except Exception as e:
            e.add_note(f"while running arm {label} ({arm_of[label].name!r}), "
                       f"{'warm-up' if rnd < 0 else f'round {rnd}'}")
            raise
        run = Run(index=len(runs), arm=label, round=rnd, value=value)
        runs.append(run)
        if rnd >= 0:
            samples[label].append(value)
        if on_run is not None:
            on_run(run)

    def up(arm: Arm) -> None:
        if arm.start is not None:
            arm.start()
        live.append(arm)

    def down_all() -> None:
        while live:
            arm = live.pop()
            if arm.stop is not None:
                arm.stop()

    try:
        if not cfg.restart:
            for arm in (a, b):
                up(arm)
            for label in labels:
                for _ in range(cfg.warmup):
                    call(label, -1)
        previous = None
        for label, rnd in schedule(labels, cfg.repeats, cfg.order):
            if cfg.restart and label != previous:
                down_all()
                up(arm_of[label])
                for _ in range(cfg.warmup):
                    call(label, -1)
            previous = label
            call(label, rnd)
    finally:
        down_all()
    return analyze(samples, cfg, arms={label: arm_of[label].name for label in labels}, runs=runs)


def plot_runs(result: ABResult, path: str, title: str = "A/B samples in run order") -> None:
    """Samples per arm against run index (warm-ups hollow, medians dashed): drift shows up as a slope."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, label in enumerate(result.arms):
        color = f"C{i}"
        rec = [r for r in result.runs if r.arm == label and r.round >= 0]
        warm = [r for r in result.runs if r.arm == label and r.round < 0]
        ax.plot([r.index for r in rec], [r.value for r in rec], "o", color=color,
                label=f"{label}: {result.arms[label]}"[:60])
        if warm:
            ax.plot([r.index for r in warm], [r.value for r in warm], "o", mfc="none", color=color)
        if label in result.stats:
            ax.axhline(result.stats[label].median, color=color, ls="--", lw=1)
    ax.set_xlabel("run index (hollow: warm-up)")
    ax.set_ylabel("sample")
    ax.set_title(f"{title}\n{result.verdict}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
