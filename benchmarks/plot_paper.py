"""Plot `engram bench paper` results beside the paper's H800 numbers: the headline output tok/s of every arm of every
result (one bar group per result, the paper's none and host bars last, per model), and every pair's B/A estimate with
its 95 % CI over the A/A control's interval:

    python -m benchmarks.plot_paper RESULT.json [RESULT.json ...] --out docs/img/paper-offload.png [--label TEXT ...]

``--label`` names each result's bar group (default: its model and KV budget). Raises SystemExit naming the file when
a result is not an `engram bench paper` JSON.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    if not str(data.get("name", "")).startswith("paper") or "headline" not in data.get("result", {}):
        raise SystemExit(f"{path}: not an `engram bench paper` result (name {data.get('name')!r})")
    return data


def default_label(data: dict) -> str:
    cfg = data["config"]
    return f"{data['result']['model']['name']}, KV {cfg.get('kv_cache_memory') or 'profiled'}"


def groups(results: list[dict], labels: list[str]) -> list[tuple[str, dict[str, float]]]:
    """[(group label, {arm: tok/s})]: per model in order of appearance, each of its results' headline arms, then the
    paper's H800 arms for that model."""
    out = []
    for model in dict.fromkeys(d["result"]["model"]["name"] for d in results):
        out += [(label, {arm: h["tok_s"] for arm, h in d["result"]["headline"].items()})
                for d, label in zip(results, labels) if d["result"]["model"]["name"] == model]
        paper = results[0]["result"]["paper_h800"].get(model)
        if paper:
            out.append((f"paper {model.split('-')[0].upper()}, H800", {"none": paper["none"], "host": paper["host"]}))
    return out


def pairs(results: list[dict], labels: list[str]) -> list[tuple[str, float, float, float, float, float]]:
    """[(label, B/A − 1, CI lo, CI hi, A/A lo, A/A hi)] of every pair of every result."""
    out = []
    for d, label in zip(results, labels):
        for comp in d["result"]["comparisons"]:
            c = comp["ab"]["comparisons"]
            aa = c.get("A'/A", {})
            out.append((f"{comp['a']}:{comp['b']} ({label})", c["B/A"]["estimate"], c["B/A"]["ci_lo"],
                        c["B/A"]["ci_hi"], aa.get("ci_lo", 0.0), aa.get("ci_hi", 0.0)))
    return out


def plot(results: list[dict], labels: list[str], out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"none": "C7", "gpu": "C0", "host": "C1", "disk": "C3", "disk-cache": "C2"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    x, ticks, seen = 0.0, [], set()
    for label, arms in groups(results, labels):
        start = x
        for arm, tok_s in arms.items():
            left.bar(x, tok_s, color=colors.get(arm, "C4"), label=arm if arm not in seen else None)
            left.text(x, tok_s, f"{tok_s:,.0f}", ha="center", va="bottom", fontsize=7)
            seen.add(arm)
            x += 1
        ticks.append(((start + x - 1) / 2, label))
        x += 0.8
    left.set_xticks([t for t, _ in ticks], [lbl for _, lbl in ticks], fontsize=8)
    left.set_ylabel("output tok/s (512 sequences)")
    left.set_title("headline runs", fontsize=10)
    left.legend(fontsize=8)
    rows = pairs(results, labels)
    for i, (label, est, lo, hi, aa_lo, aa_hi) in enumerate(rows):
        right.fill_betweenx([i - 0.3, i + 0.3], 100 * aa_lo, 100 * aa_hi, color="0.85",
                            label="A/A 95 % CI" if i == 0 else None)
        right.errorbar(100 * est, i, xerr=[[100 * (est - lo)], [100 * (hi - est)]], fmt="o", color="C1", capsize=4,
                       label="B/A 95 % CI" if i == 0 else None)
    right.axvline(0, color="k", lw=0.8)
    right.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    right.set_xlabel("B/A − 1 (%)")
    right.set_title("interleaved blocks of 128 sequences", fontsize=10)
    right.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="`engram bench paper` JSON files")
    p.add_argument("--label", action="append", default=None, help="one per result, in order")
    p.add_argument("--out", required=True, help="PNG path")
    args = p.parse_args(argv)
    results = [load(r) for r in args.results]
    labels = args.label or [default_label(d) for d in results]
    if len(labels) != len(results):
        raise SystemExit(f"--label given {len(labels)} times for {len(results)} results")
    plot(results, labels, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
