"""Prints one table from the JSON files bench/gpu_bench.sh leaves in its output folder."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path, name: str):
    """A JSON document, or the last line of a file that ends with one (tee'd output)."""
    try:
        text = (folder / name).read_text()
    except OSError:
        return None
    for candidate in (text, text.strip().splitlines()[-1] if text.strip() else ""):
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            continue
    return None


def main() -> int:
    folder = Path(sys.argv[1])
    rows = []
    if (w1 := load(folder, "w1.json")):
        rows.append(("W1 batch-1 decode", f"{w1['decode_tokens_per_s']:.1f} tok/s", "≥ 170"))
    if (w1x := load(folder, "w1_overlap.json")):
        rows.append(("W1 with --overlap", f"{w1x['decode_tokens_per_s']:.1f} tok/s", ""))
    if (e := load(folder, "engine_b256_overlap.json")):
        rows.append(("engine batch 256 with --overlap", f"{e['decode_tokens_per_s']:.0f} tok/s "
                     f"({e['decode_step_ms']:.1f} ms/step)", ""))
    for b in (16, 64, 256):
        if (e := load(folder, f"engine_b{b}.json")):
            rows.append((f"engine batch {b} decode", f"{e['decode_tokens_per_s']:.0f} tok/s "
                         f"({e['decode_step_ms']:.1f} ms/step), prefill {e['prefill_tokens_per_s']:.0f} tok/s", ""))
    for run in (1, 2, "cold"):
        if (w5 := load(folder, f"w5_run{run}.json" if run != "cold" else "w5_cold.json")):
            label = f"run {run}" if run != "cold" else "page cache dropped"
            rows.append((f"W5b start→ready / first token ({label})",
                         f"{w5['start_to_ready_s']:.2f} s / {w5['start_to_first_token_s']:.2f} s "
                         f"(imports {w5.get('imports_s') or 0:.2f}, device {w5.get('device_s') or 0:.2f}, "
                         f"weights {w5['load_weights_s'] or 0:.2f}, KV {w5.get('kv_s') or 0:.2f}, "
                         f"graphs {w5['graph_capture_s'] or 0:.2f} s)", "≤ 8 s" if run != "cold" else ""))
            mem = w5.get("memory") or {}
            if run == 1 and mem.get("kv_gib"):
                rows.append(("KV capacity", f"{mem['kv_gib']:.1f} GiB, {mem['kv_tokens']:,} tokens", "≥ 60 GiB"))
    if (w5a := load(folder, "w5a.json")):
        for key, label in (("first", "W5a load on a running worker"), ("replace", "W5a replace (KV reused)")):
            b = w5a[key].get("load") or {}
            rows.append((f"{label}: ready / first token",
                         f"{w5a[key]['ready_s']:.2f} s / {w5a[key]['first_token_s']:.2f} s (unload "
                         f"{b.get('unload_s', 0):.2f}, weights {b.get('weights_s', 0):.2f}, KV {b.get('kv_s', 0):.2f}, "
                         f"graphs {b.get('graphs_s', 0):.2f} s + {b.get('graphs_deferred', 0)} after)",
                         "≤ 2.5 s" if key == "first" else ""))
    if (w2 := load(folder, "w2.json")):
        s = w2["summary"]
        rows.append(("W2 total tok/s (HTTP)", f"{s['total_throughput']:.0f} (out {s['output_throughput']:.0f}, "
                     f"{s['request_throughput']:.2f} req/s, failed {s['failed']})", "≥ 20,000"))
        cpu = w2.get("cpu")
        if cpu:
            per = ", ".join(f"{k} {v:.1f}" for k, v in (cpu.get("us_per_token") or {}).items() if v is not None)
            rows.append(("CPU per output token", f"{cpu['total_us_per_token']:.1f} µs ({per})", "≤ 15 µs"))
    if (w3 := load(folder, "w3.json")):
        for r in w3.get("runs", []):
            s = r["summary"]
            rows.append((f"W3 @ {r['config']['request_rate']} req/s",
                         f"ITL p99 {s['itl']['p99']:.1f} ms, TTFT p99 {s['ttft']['p99']:.1f} ms", "ITL p99 ≤ 30 @20"))
    for mode in ("affinity", "plain"):
        if (w4 := load(folder, f"w4_{mode}.json")) and (w4.get("sessions") or {}).get("hit_ratio") is not None:
            ss = w4["sessions"]
            rows.append((f"W4 sessions, {mode}", f"hit ratio {100 * ss['hit_ratio']:.1f} %, TTFT p50 first "
                         f"{ss['ttft_first']['p50']:.0f} ms / later {ss['ttft_later']['p50']:.0f} ms", ""))
    for mode in ("mixed", "pd"):
        for kind in ("w3", "long"):
            if (w := load(folder, f"pd_{kind}_{mode}.json")):
                for r in w.get("runs", []):
                    sm = r["summary"]
                    rows.append((f"{'2 mixed' if mode == 'mixed' else '1P+1D'} {kind} @ {r['config']['request_rate']} req/s",
                                 f"ITL p50/p90/p99 {sm['itl']['p50']:.1f}/{sm['itl']['p90']:.1f}/{sm['itl']['p99']:.1f} ms, "
                                 f"TTFT p50/p99 {sm['ttft']['p50']:.0f}/{sm['ttft']['p99']:.0f} ms, "
                                 f"out {sm['output_throughput']:.0f} tok/s", ""))
    if (h := load(folder, "handoff_summary.json")):
        for key, label in (("all", "hand-off, all"), ("prompt_ge_2800", "hand-off, prompts ≥ 2,800 tokens")):
            x = h.get(key) or {}
            if x.get("count"):
                rows.append((label, f"n={x['count']} total p50/p99 {x['total_ms_p50']:.2f}/{x['total_ms_p99']:.2f} ms "
                             f"(push {x['push_ms_p50']:.2f}, offer {x['offer_ms_p50']:.2f}, export {x['export_ms_p50']:.2f}), "
                             f"{x['mib_p50']:.0f} MiB at {x['push_gbps_p50']:.1f} GB/s", "≤ 3 / 10 ms"))
    one, two = load(folder, "tp1_w1.json"), load(folder, "tp2_w1.json")
    if one and two:
        rows.append(("8B W1 TP=1 / TP=2", f"{one['decode_tokens_per_s']:.1f} / {two['decode_tokens_per_s']:.1f} tok/s "
                     f"(× {two['decode_tokens_per_s'] / one['decode_tokens_per_s']:.2f})", "TP=2 ≥ 1.6 × one GPU"))
    if one and (nccl := load(folder, "tp2_nccl_w1.json")):
        rows.append(("8B W1 TP=2, NCCL for every all-reduce", f"{nccl['decode_tokens_per_s']:.1f} tok/s "
                     f"(× {nccl['decode_tokens_per_s'] / one['decode_tokens_per_s']:.2f})", ""))
    for ranks, target in ((2, "≥ 80 % of roofline"), (4, "≥ 75 % of roofline")):
        if (w := load(folder, f"tp{ranks}_70b_w1.json")):
            rows.append((f"70B W1 TP={ranks} (dummy weights)", f"{w['decode_tokens_per_s']:.1f} tok/s "
                         f"({w['decode_step_ms']:.2f} ms/step), KV {w.get('kv_gib') or 0:.1f} GiB", target))
    for tag in ("tp2", "pp2", "tp4", "tp2pp2"):
        if (w := load(folder, f"w2_70b_{tag}.json")):
            s = w["summary"]
            rows.append((f"70B W2 {tag.upper()} (HTTP)", f"{s['total_throughput']:.0f} tok/s (failed {s['failed']})", ""))
    if (c := load(folder, "smol_check.json")):
        rows.append(("SmolLM2 GGUF on the GPU", f"ready {c['engine_ready_s']:.2f} s (weights {c['load_weights_s']:.2f} s), "
                     f"{c['answers'][0]!r}", ""))
    for name, label in (("smol_w1.json", "SmolLM2 batch-1 decode"), ("smol_w1_overlap.json", "SmolLM2 batch-1 --overlap"),
                        ("smol_b256_overlap.json", "SmolLM2 engine batch 256 --overlap")):
        if (e := load(folder, name)):
            rows.append((label, f"{e['decode_tokens_per_s']:.0f} tok/s ({e['decode_step_ms']:.2f} ms/step)", ""))
    for tag in ("default", "big"):
        if (w2 := load(folder, f"smol_w2_{tag}.json")):
            s = w2["summary"]
            cpu = (w2.get("cpu") or {}).get("total_us_per_token")
            rows.append((f"SmolLM2 W2 shape ({tag} flags)", f"{s['total_throughput']:.0f} total tok/s (out "
                         f"{s['output_throughput']:.0f}, failed {s['failed']}, CPU {cpu or 0:.1f} µs/token)", ""))
    summary = machine_summary(folder)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    width = max((len(r[0]) for r in rows), default=10)
    print("\n" + "=" * 100)
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<60} {target}")
    return 0


def machine_summary(folder: Path) -> dict:
    """The figures of this run under fixed keys (issue 9's list), for bench/results/<device>.json."""
    import datetime
    import os

    gpu = (folder / "gpu.txt").read_text().split(",")[0].strip() if (folder / "gpu.txt").is_file() else ""
    out: dict = {"device": gpu, "date": datetime.date.today().isoformat(), "commit": os.environ.get("COMMIT", "")}
    if (w1 := load(folder, "w1.json")):
        out["w1_tok_s"] = out["w1_plain_tok_s"] = w1["decode_tokens_per_s"]
    if (w1x := load(folder, "w1_overlap.json")):  # overlapped steps: a GPU worker's default, so W1's figure
        out["w1_tok_s"] = out["w1_overlap_tok_s"] = w1x["decode_tokens_per_s"]
    if (k := load(folder, "kernels.json")):
        b256 = [r["graph_us"] for r in k.get("results", [])
                if r["kernel"] == "sampling" and r["shape"].startswith("B=256 ") and "plain" not in r["shape"]
                and r.get("graph_us")]
        if b256:
            out["sampling_b256_us"] = max(b256)
    if (w2 := load(folder, "w2.json")):
        out["w2_total_tok_s"] = w2["summary"]["total_throughput"]
        cpu = w2.get("cpu") or {}
        out["cpu_us_per_token"] = {**(cpu.get("us_per_token") or {}), "total": cpu.get("total_us_per_token")}
    if (w3 := load(folder, "w3.json")):
        runs = w3.get("runs", [])
        out["w3_itl_p99_ms"] = {str(r["config"]["request_rate"]): r["summary"]["itl"]["p99"] for r in runs}
        out["w3_ttft_p99_ms"] = {str(r["config"]["request_rate"]): r["summary"]["ttft"]["p99"] for r in runs}
    for run in (2, 1):
        if (w5 := load(folder, f"w5_run{run}.json")):
            out["w5b_first_token_s"] = w5["start_to_first_token_s"]
            if (w5.get("memory") or {}).get("kv_gib"):
                out["kv_gib"] = w5["memory"]["kv_gib"]
            break
    if (w5a := load(folder, "w5a.json")):
        out["w5a_first_token_s"] = w5a.get("first_token_s")
        out["w5a_replace_first_token_s"] = w5a.get("replace_first_token_s")
    if (w5c := load(folder, "w5_cold.json")):
        out["w5b_cold_first_token_s"] = w5c["start_to_first_token_s"]
    if "kv_gib" not in out:
        for name in ("w1.json", "w1_overlap.json"):
            if (w := load(folder, name)) and w.get("kv_gib"):
                out["kv_gib"] = w["kv_gib"]
                break
    # Tensor/pipeline parallelism (two GPUs: bench/results/h200x2.json).
    parallel = {}
    for key, name in (("w1_8b_tp1_tok_s", "tp1_w1.json"), ("w1_8b_tp2_tok_s", "tp2_w1.json"),
                      ("w1_70b_tp2_tok_s", "tp2_70b_w1.json"), ("w1_70b_tp4_tok_s", "tp4_70b_w1.json")):
        if (w := load(folder, name)):
            parallel[key] = w["decode_tokens_per_s"]
            if "70b" in key:
                parallel[key.replace("tok_s", "kv_gib")] = w.get("kv_gib")
    for tag in ("70b_tp2", "70b_pp2", "70b_tp4", "70b_tp2pp2"):
        if (w := load(folder, f"w2_{tag}.json")):
            parallel[f"w2_{tag}_total_tok_s"] = w["summary"]["total_throughput"]
    if parallel:
        out["parallel"] = parallel
    return out


if __name__ == "__main__":
    sys.exit(main())
