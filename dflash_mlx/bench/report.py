"""The benchmark's terminal report and chart, from its result dict."""

import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

PHASES = ("draft", "verify", "accept", "other")


def ratio(a, b):
    """a / b, or None when either is missing or b is 0."""
    return a / b if a and b else None


class Progress:
    """One live status line on stderr (a line per prompt when not a tty)."""

    def __init__(self, total: int, stream=None):
        self.total, self.out = total, stream or sys.stderr
        self.tty = self.out.isatty()
        self.t0 = time.perf_counter()

    def show(self, done: int, msg: str, final: bool = False) -> None:
        """Update the line; ``final`` marks a finished prompt."""
        width = 20
        fill = int(width * done / max(self.total, 1))
        line = f"[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} {msg} ({time.perf_counter() - self.t0:.0f}s)"
        if self.tty:
            self.out.write("\r\033[K" + line)
        elif final:
            self.out.write(line + "\n")
        self.out.flush()

    def log(self, msg: str) -> None:
        if self.tty:
            self.out.write("\r\033[K")
        self.out.write(msg + "\n")
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\r\033[K")
            self.out.flush()


def fmt(x, spec="{:.1f}", none="-"):
    """``x`` formatted with ``spec``, or ``none`` when it is missing."""
    return none if x is None else spec.format(x)


NAMES = {"plain": "mlx-lm", "dflash": "dflash", "baseline": "mlx-lm spec"}


def method_name(key: str, c: dict) -> str:
    """Table name of a method; with several DFlash columns, each its label."""
    cols = c.get("columns") or {}
    if key in cols and len(cols) > 1:
        return f"dflash {cols[key]}"
    return NAMES[key]


def block_text(c: dict) -> str:
    """The block size(s) of a run: "auto, up to 16", "16", or the columns."""
    cols = c.get("columns") or {}
    if len(cols) > 1:
        return f"{c['block_size']} at most; columns " + ", ".join(cols.values())
    return f"{'auto, up to ' if c.get('adaptive') else ''}{c['block_size']}"


def _temp_label(r: dict) -> str:
    if r["temp"] == 0 or r["seed"] is None:
        return f"temp {r['temp']:g}"
    return f"temp {r['temp']:g} " + ("(DFlash unseeded)" if r["seed"] == "none" else f"(seed {r['seed']})")


def format_categories(cats: Dict[str, dict]) -> List[str]:
    """The per-category table: pooled decode tok/s, speedup, tau."""
    lines = [f"{'category':<12}{'prompts':>8}{'mlx-lm tok/s':>14}{'dflash tok/s':>14}{'speedup':>9}{'tau':>7}"]
    for k, g in cats.items():
        lines.append(
            f"{k:<12}{g['prompts']:>8}{fmt(g['plain_tps']):>14}{fmt(g['dflash_tps']):>14}"
            f"{fmt(g['speedup'], '{:.2f}x'):>9}{fmt(g['tau'], '{:.2f}'):>7}"
        )
    return lines


def format_result(r: dict, c: dict) -> str:
    """The summary of one temperature's pass."""
    s = r["summary"]
    w = max(12, *(len(method_name(k, c)) + 2 for k in s["methods"]))
    lines = [
        f"{_temp_label(r)}: {s['prompts']} prompts ({c['dataset']}), max {c['max_tokens']} tokens, "
        f"block {block_text(c)}",
        f"{'method':<{w}}{'decode tok/s':>13}{'e2e tok/s':>11}{'speedup':>9}{'tau':>7}{'peak GB':>9}",
    ]
    plain = s["methods"]["plain"]
    for k, m in s["methods"].items():
        sp = ratio(m["decode_tps"], plain["decode_tps"])
        lines.append(
            f"{method_name(k, c):<{w}}{fmt(m['decode_tps']):>13}{fmt(m['e2e_tps']):>11}"
            f"{fmt(sp, '{:.2f}x'):>9}{fmt(m.get('tau'), '{:.2f}'):>7}{fmt(m['peak_memory_gb'], '{:.3f}'):>9}"
        )
    check = "required" if r["temp"] == 0 else "not required at temp > 0"
    lines.append(f"identical outputs: {s['identical']}/{s['prompts']} ({check})")
    for k, col in s.get("columns", {}).items():
        if "agreement" in col:
            lines.append(f"{method_name(k, c)} (relaxed acceptance, not exact): output agrees with the "
                         f"target's for {100 * col['agreement']:.0f}% of it, on average")
    if s["round_time_s"]:
        rt, co = s["round_time_s"], s["costs"]
        parts = [f"{k} {rt[k] * 1e3:.2f} ms ({co[k]:.2f} steps)" for k in PHASES]
        lines.append(f"round ({c['profile']} profiled run), {rt['round'] * 1e3:.2f} ms: " + ", ".join(parts))
        lines.append(
            f"ideal speedup tau/(c_draft+c_verify) = {fmt(s['ideal_speedup'], '{:.2f}x')}, "
            f"measured {fmt(s['speedup'], '{:.2f}x')}"
        )
    for k, col in s.get("columns", {}).items():
        if k != "dflash" and col["round_time_s"]:
            rt, co = col["round_time_s"], col["costs"]
            parts = [f"{p} {rt[p] * 1e3:.2f} ms ({co[p]:.2f})" for p in PHASES]
            lines.append(f"round, {method_name(k, c)}, {rt['round'] * 1e3:.2f} ms: " + ", ".join(parts))
    h = s["acceptance_histogram"]
    total = sum(h) or 1
    pct = [(i + 1, 100 * n / total) for i, n in enumerate(h) if n]
    lines.append("acceptance lengths: " + " ".join(f"{k}:{p:.0f}%" if p >= 1 else f"{k}:<1%" for k, p in pct))
    return "\n".join(lines + format_categories(r["categories"]))


def format_summary(result: dict) -> str:
    """The terminal summary: a block per temperature, then sampled against
    greedy speedup."""
    res = result["results"]
    blocks = [format_result(r, result["config"]) for r in res]
    greedy = next((r["summary"]["speedup"] for r in res if r["temp"] == 0), None)
    lines = [
        f"temp {r['temp']:g} speedup = {r['speedup_vs_greedy']:.2f}x the greedy one "
        f"({fmt(r['summary']['speedup'], '{:.2f}x')} vs {fmt(greedy, '{:.2f}x')})"
        for r in res
        if r["speedup_vs_greedy"] is not None
    ]
    return "\n\n".join(blocks + (["\n".join(lines)] if lines else []))


def _chart_row(a, b, r: dict, c: dict) -> None:
    s, recs = r["summary"], r["prompts"]
    h = s["acceptance_histogram"]
    total = sum(h) or 1
    a.bar(range(1, len(h) + 1), [100 * n / total for n in h], color="tab:blue")
    if s["tau"]:
        a.axvline(s["tau"], color="tab:red", ls="--", label=f"tau = {s['tau']:.2f}")
        a.legend()
    a.set_xticks(range(1, len(h) + 1))
    a.set(xlabel="tokens committed per round", ylabel="% of rounds",
          title=f"DFlash acceptance length, {_temp_label(r)}")
    x = list(range(len(recs)))
    bars = [(method_name(k, c), [(p.get("columns") or {}).get(k, p)["speedup"] or 0 for p in recs])
            for k in (s.get("columns") or ["dflash"])]
    if "baseline_speedup" in s:
        bars.append(("mlx-lm speculative", [p.get("baseline_speedup") or 0 for p in recs]))
    w = 0.8 / len(bars)
    for j, (name, ys) in enumerate(bars):
        b.bar([i + (j - (len(bars) - 1) / 2) * w for i in x], ys, w, label=name)
    b.axhline(1.0, color="gray", lw=1)
    b.set_xticks(x, [p["id"] for p in recs], rotation=60, ha="right", fontsize=7)
    b.set(ylabel="decode speedup over mlx-lm",
          title=f"Per-prompt speedup, {_temp_label(r)} (overall {fmt(s['speedup'], '{:.2f}x')})")
    b.legend()


def write_chart(result: dict, path: Path) -> Optional[str]:
    """Save the PNG chart, a row per temperature (acceptance histogram,
    per-prompt speedup); return a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'dflash-mlx[bench]'); no chart written"
    res, c = result["results"], result["config"]
    fig, axes = plt.subplots(len(res), 2, figsize=(12, 4.2 * len(res)), squeeze=False)
    for (a, b), r in zip(axes, res):
        _chart_row(a, b, r, c)
    temps = ", ".join(f"{t:g}" for t in c["temps"])
    fig.suptitle(
        f"{Path(c['model']).name} + {Path(c['draft']).name} | {Path(c['dataset']).name}, "
        f"temp {temps}, block {block_text(c)}, max {c['max_tokens']} tokens", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
