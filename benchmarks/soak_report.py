"""The soak's figures and targets (benchmarks/soak.py): per-minute series, each target checked
pass/fail, written as <name>.json, <name>.md and a <name>.png plot of the figures over time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RSS_SETTLE_S = 300.0  # RSS growth is measured after the first 5 minutes (a sixth of shorter runs)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def _windows(out: dict[str, Any]) -> list[tuple[float, float, str]]:
    return [(e["window"][0], e["window"][1], e["fault"]) for e in out["events"] if e["kind"] == "fault"]


def _in(t: float, windows: list[tuple[float, float, str]]) -> bool:
    return any(a <= t <= b for a, b, _ in windows)


def short_name(tier: str) -> str:
    """Returns "cpu", "disk", "redis" or "kvtier" for a tier named `i:url` by the storage manager."""
    return tier.split(":")[1] if ":" in tier else tier


def _tiers(samples: list[dict[str, Any]]) -> list[str]:
    names: list[str] = []
    for s in samples:
        for k in s.get("metrics", {}):
            if k.startswith("kvtier:kv_tier_hit_tokens_total["):
                t = k[k.index("[") + 1:-1]
                if t not in names:
                    names.append(t)
    return names


def per_minute(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Returns one row per minute of the soak: requests, failures, TTFT p50/p99, ITL p99, and
    per tier (and the engine's prefix cache) the share of prompt tokens it served."""
    start, length = out["run"]["soak_start_s"], out["run"]["soak_s"]
    samples = [s for s in out["samples"] if "metrics" in s]
    tiers = _tiers(samples)
    rows = []
    for m in range(int(length // 60 + (length % 60 > 0))):
        a, b = start + 60 * m, start + 60 * (m + 1)
        reqs = [r for r in out["requests"] if a <= r["t"] < b]
        ok = [r for r in reqs if r["ok"]]
        gaps = [g for r in ok for g in r["gaps"]]
        row: dict[str, Any] = {"minute": m + 1, "requests": len(reqs), "failed": len(reqs) - len(ok),
                               "ttft_p50_s": pct([r["ttft"] for r in ok], 50),
                               "ttft_p99_s": pct([r["ttft"] for r in ok], 99), "itl_p99_s": pct(gaps, 99)}
        inside = [s for s in samples if a <= s["t"] <= b]
        if len(inside) >= 2:
            first, last = inside[0]["metrics"], inside[-1]["metrics"]
            prompt = last.get("kvtier:prompt_tokens_total", 0) - first.get("kvtier:prompt_tokens_total", 0)
            row["hit_rate"] = {"engine": (last.get("kvtier:prefix_cache_hits_total", 0)
                                          - first.get("kvtier:prefix_cache_hits_total", 0)) / max(prompt, 1)}
            for t in tiers:
                key = f"kvtier:kv_tier_hit_tokens_total[{t}]"
                row["hit_rate"][short_name(t)] = (last.get(key, 0) - first.get(key, 0)) / max(prompt, 1)
        rows.append(row)
    return rows


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Returns each target with its measured value and pass/fail."""
    start, length = out["run"]["soak_start_s"], out["run"]["soak_s"]
    reqs = out["requests"]
    failed = [r for r in reqs if not r["ok"]]
    wrong = out["answers"]["wrong"]
    settle = start + min(RSS_SETTLE_S, length / 6)
    rss = [(s["t"], s["rss_server"]) for s in out["samples"] if s["t"] >= settle and s["rss_server"]]
    # Growth by the least-squares line, not first vs last sample: the server hands freed heap
    # back when it goes idle, so RSS is a sawtooth and two samples measure its phase.
    growth, slope = _fitted_growth(rss) if len(rss) >= 2 else (float("nan"), float("nan"))
    missing = out["config"].get("unavailable_figures", [])  # not on this engine's /metrics (vllm serve)
    leak_keys = [k for k in ("kv_blocks_in_use", "kv_block_refs", "kv_load_holds", "kv_loads_in_flight")
                 if k not in missing]
    idle_bad = [p for p in out["idle_points"] if any(p.get(k, -1) != 0 for k in leak_keys)]
    win = _windows(out)
    ok = [r for r in reqs if r["ok"] and r["t"] >= start]
    in_f = [r["ttft"] for r in ok if _in(r["t"], win)]
    out_f = [r["ttft"] for r in ok if not _in(r["t"], win)]
    p_in, p_out = pct(in_f, 99), pct(out_f, 99)
    health = out["health"]
    worst = max((h[1] for h in health), default=float("nan"))
    bad_health = [h for h in health if h[2] != 200 or h[1] > 1.0]
    return [
        {"target": "0 wrong answers (greedy, vs a server without a connector)",
         "value": f"{wrong} wrong, {out['answers']['near_tie']} near ties, {out['answers']['same']} identical",
         "pass": wrong == 0},
        {"target": "0 failed requests", "value": f"{len(failed)} of {len(reqs)}", "pass": not failed},
        {"target": "RSS growth after the first 5 min <= 5%", "value":
         f"{growth * 100:+.1f}% by the fitted line ({slope:+.1f} MiB/h); samples {_mib(min(v for _, v in rss))}"
         f"-{_mib(max(v for _, v in rss))} MiB, first {_mib(rss[0][1])}, last {_mib(rss[-1][1])}"
         if rss else "no samples", "pass": bool(rss) and growth <= 0.05},
        {"target": f"{', '.join(leak_keys)} 0 at every idle point", "value":
         f"{len(out['idle_points']) - len(idle_bad)} of {len(out['idle_points'])} idle points at 0",
         "pass": bool(out["idle_points"]) and not idle_bad},
        {"target": "p99 TTFT in fault windows <= 2x outside", "value":
         f"{p_in:.3f}s vs {p_out:.3f}s ({p_in / p_out:.2f}x; {len(in_f)} / {len(out_f)} requests)",
         "pass": bool(in_f) and bool(out_f) and p_in <= 2 * p_out},
        {"target": "/health within 1 s throughout", "value":
         f"worst {worst:.3f}s over {len(health)} probes, {len(bad_health)} slow or failed", "pass": not bad_health},
    ]


def _fitted_growth(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Returns (the least-squares line's rise from the first sample's time to the last's, as a
    fraction of its value at the first; its slope in MiB per hour) over (time s, bytes)."""
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    slope = sum((t - mx) * (v - my) for t, v in points) / den if den else 0.0
    t0, t1 = points[0][0], points[-1][0]
    return slope * (t1 - t0) / (my + slope * (t0 - mx)), slope * 3600 / 2**20


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"


def write_report(out: dict[str, Any], stem: Path) -> None:
    """Writes stem.json, stem.md and stem.png."""
    out["per_minute"] = per_minute(out)
    out["targets"] = targets(out)
    stem.with_suffix(".json").write_text(json.dumps(out, indent=1, default=float))
    _plot(out, stem.with_suffix(".png"))
    stem.with_suffix(".md").write_text(_markdown(out, stem.name))
    print(stem.with_suffix(".md").read_text())


def _markdown(out: dict[str, Any], name: str) -> str:
    run, cfg = out["run"], out["config"]
    lines = [f"# Soak: {cfg['minutes']:g} minutes of load with faults ({name})", ""]
    if cfg["minutes"] < 30:
        lines += [f"**Short functional run ({cfg['minutes']:g} min, one of each fault), on a shared machine: "
                  "the correctness and leak figures hold; timing figures are not meaningful.**", ""]
    server = "kvtier serve" if cfg.get("engine", "kvtier") == "kvtier" else "vllm serve + KVTierConnector"
    lines += [f"{server}, tiers {', '.join(cfg['tiers'])}; {cfg['clients']} streaming openai clients, "
              f"mix {cfg['mix']}, {cfg['max_tokens']} greedy tokens; capacity {run['capacity_rps']:.2f} req/s "
              f"(measured over {run['calibration_s']:.0f} s), offered {run['offered_rps']:.2f} req/s.", "",
              "| target | measured | |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'pass' if t['pass'] else '**FAIL**'} |" for t in out["targets"]]
    if cfg.get("unavailable_figures"):
        lines += ["", f"Not on {server}'s /metrics, so not shown: {', '.join(cfg['unavailable_figures'])} "
                  "(kv_blocks_in_use is vllm:kv_cache_usage_perc, a fraction; benchmarks/soak_engines.py)."]
    lines += ["", f"![figures over time]({name}.png)", "", "## Faults and idle points", "", "| t (s) | what |",
              "|---|---|"]
    lines += [f"| {e['t']:.0f} | {e['kind']}: {e['detail']} |" for e in out["events"]
              if e["kind"] in ("fault", "idle_point")]
    errors = [e for e in out["events"] if e["kind"] not in ("fault", "idle_point", "phase")]
    lines += ["", f"## Errors ({len(errors)})", ""] + [f"- {e['t']:.0f} s {e['kind']}: {e['detail']}"
                                                        for e in errors[:100]]
    tiers = sorted({t for r in out["per_minute"] for t in r.get("hit_rate", {})})
    lines += ["", "## Per minute", "", "| min | requests | failed | TTFT p50 | TTFT p99 | ITL p99 | "
              + " | ".join(f"hit {t}" for t in tiers) + " |", "|" + "---|" * (6 + len(tiers))]
    for r in out["per_minute"]:
        hr = r.get("hit_rate", {})
        lines.append(f"| {r['minute']} | {r['requests']} | {r['failed']} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p99_s']:.3f} | {r['itl_p99_s']:.3f} | "
                     + " | ".join(f"{hr.get(t, float('nan')):.2f}" for t in tiers) + " |")
    return "\n".join(lines) + "\n"


def _plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = out["run"]["soak_start_s"]
    samples = [s for s in out["samples"] if "metrics" in s]

    def minutes(t: float) -> float:
        return (t - start) / 60

    missing = set(out["config"].get("unavailable_figures", []))  # not on this engine's /metrics: not drawn
    server = "kvtier serve" if out["config"].get("engine", "kvtier") == "kvtier" else "vllm serve (all processes)"
    fig, axes = plt.subplots(6, 1, figsize=(11, 19), sharex=True)
    xs = [minutes(s["t"]) for s in out["samples"]]
    axes[0].plot(xs, [s["rss_server"] / 2**20 for s in out["samples"]], label=server)
    axes[0].plot(xs, [s["rss_cache_server"] / 2**20 for s in out["samples"]], label="cache server")
    axes[0].set_ylabel("RSS (MiB)")
    ix = [minutes(p["t"]) for p in out["idle_points"]]
    for key in ("kv_blocks_in_use", "kv_block_refs", "kv_load_holds", "kv_loads_in_flight"):
        if key in missing:
            continue
        axes[1].plot(ix, [p.get(key, -1) for p in out["idle_points"]], "o-", label=key)
    axes[1].set_ylabel("at idle points")
    sx = [minutes(s["t"]) for s in samples]
    m = [s["metrics"] for s in samples]
    for key, label in (("kv_pending_stores", "store queue (chunks)"),
                       ("kv_slow_tier_writes_pending", "slow-tier writes pending"),
                       ("kv_tier_dropped_writes_total", "dropped writes (total)"),
                       ("kv_dropped_store_bytes_total", "dropped store MiB (total)")):
        if key not in missing and any(k.startswith("kvtier:" + key) for x in m for k in x):
            scale = 2**20 if key.endswith("bytes_total") else 1
            axes[2].plot(sx, [sum(v for k, v in x.items() if k.startswith("kvtier:" + key)) / scale for x in m],
                         label=label)
    axes[2].set_ylabel("stores")
    rows = out["per_minute"]
    mx = [r["minute"] - 0.5 for r in rows]
    for t in sorted({t for r in rows for t in r.get("hit_rate", {})}):
        axes[3].plot(mx, [r.get("hit_rate", {}).get(t, float("nan")) for r in rows], "o-", label=t)
    axes[3].set_ylabel("share of prompt tokens")
    for key, label in (("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"), ("itl_p99_s", "ITL p99")):
        axes[4].plot(mx, [r[key] for r in rows], "o-", label=label)
    axes[4].set_ylabel("seconds")
    axes[5].bar(mx, [r["failed"] for r in rows], width=0.8, label="failed requests")
    for key, label in (("kv_tier_breaker_opens_total", "breaker opens (total)"),
                       ("kv_tier_timeouts_total", "deadline misses (total)"),
                       ("kv_load_error_tokens_total", "tokens of failed loads (total)")):
        if key not in missing and any(k.startswith("kvtier:" + key) for x in m for k in x):
            axes[5].plot(sx, [sum(v for k, v in x.items() if k.startswith("kvtier:" + key)) for x in m], label=label)
    axes[5].set_ylabel("errors")
    axes[5].set_xlabel("minutes into the soak (shaded: fault windows)")
    for ax in axes:
        for a, b, _ in _windows(out):
            ax.axvspan(minutes(a), minutes(b), color="red", alpha=0.12)
        ax.legend(loc="upper left", fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{server}: soak, {out['config']['minutes']:g} minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
