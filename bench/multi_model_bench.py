"""Issue 38, several models on one GPU: four models of real shapes (random weights drawn on the device)
in one worker, through `inferno up --model ... --memory-share ...` and HTTP.

- alone: each model in a stack of its own: W1 (batch-1 decode tok/s = 1000 / TPOT p50); the 8B's W2.
- together: the four on one GPU (a fifth, `spare`, in standby): each one's W1 while the others idle;
  a mixed W2 (a quarter of W2's requests to each model, all at once).
- reload: the 8B evicted to pinned host memory (a request for `spare` makes the room), then brought
  back by its next request: that request's time to first token, and the worker's own account.
- ITL: the 1B at 10 requests/s, its ITL p99 without and with models loading beside it (spare and the
  8B brought in turn by requests, each evicting the other).

  python bench/multi_model_bench.py [--phases alone,together,reload,itl] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = [("llama-3.1-8b", 0.45), ("llama-3.2-1b", 0.15), ("qwen2.5-1.5b", 0.15), ("llama-3.2-3b", 0.2)]
SPARE = ("spare", "llama-3.2-1b", 0.45)  # a served name, its shapes' directory, its share
PORT = 8011
VOCAB = os.environ.get("MM_VOCAB", "120000")  # prompt ids are drawn below it
PY = sys.executable
DEVICE = os.environ.get("MM_DEVICE", "cuda")  # MM_DEVICE=cpu MM_PRESET=tiny: the script's own check, on a CPU
if os.environ.get("MM_PRESET"):
    MODELS = [(os.environ["MM_PRESET"], s) for _, s in MODELS[:1]] + [("small", s) for _, s in MODELS[1:2]]
    SPARE = ("spare", "small", 0.45)


def model_dir(preset: str) -> Path:
    return Path(f"/tmp/mm-{preset}")


def prepare() -> None:
    for preset, _ in MODELS:
        if not (model_dir(preset) / "config.json").exists():
            subprocess.run([PY, "-m", "services.cli", "make-model", str(model_dir(preset)), "--preset", preset,
                            "--config-only", "--quiet"], check=True)


def up(run_dir: Path, models: list[tuple[str, str]], shares: list[float], extra: list[str] = ()) -> subprocess.Popen:
    argv = [PY, "-m", "services.cli", "up", "--device", DEVICE, "--port", str(PORT), "--run-dir", str(run_dir),
            "--kvstore-capacity-gb", "0", "--log-format", "json", "--worker-arg=--load-format=dummy", *extra]
    for d, name in models:
        argv += ["--model", d, "--model-name", name]
    for s in shares:
        argv += ["--memory-share", str(s)]
    log = open(run_dir.with_suffix(".up.log"), "wb")
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def down(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def models_list() -> dict[str, bool]:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/v1/models", timeout=5) as r:
        return {m["id"]: m.get("resident", True) for m in json.load(r)["data"]}


def wait_resident(names: list[str], timeout: float = 400.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            listed = models_list()
            if all(listed.get(n) for n in names):
                return time.monotonic() - t0
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{names} not resident within {timeout} s")


def bench(model: str, out: Path, *args: str) -> dict:
    subprocess.run([PY, "-m", "services.cli", "bench", "--base-url", f"http://127.0.0.1:{PORT}", "--model", model,
                    "--vocab-size", VOCAB, "--no-progress", "--out", str(out), *args],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    return json.loads(out.read_text())["summary"]


def w1(model: str, out: Path) -> float:
    s = bench(model, out, "--num-requests", "3", "--concurrency", "1", "--input-len", "128", "--output-len", "256",
              "--seed", "3")
    return 1000.0 / s["tpot"]["p50"]


async def first_token(model: str, max_tokens: int = 4) -> float:
    body = {"model": model, "prompt": [100 + i for i in range(128)], "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as s:
        async with s.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body,
                          timeout=aiohttp.ClientTimeout(total=300)) as r:
            first = None
            async for line in r.content:
                if line.startswith(b"data:") and first is None:
                    first = time.perf_counter() - t0
                    if b'"error"' in line:
                        raise RuntimeError(f"{model}: {line[:300]!r}")
            if r.status != 200 or first is None:
                raise RuntimeError(f"{model}: HTTP {r.status}")
            return first


def wait_graphs(run_dir: Path, models: int, timeout: float = 120.0) -> None:
    """Until every model's deferred CUDA graphs are captured (its steps replay graphs from then on)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (run_dir / "worker-0.log").read_text().count('"graphs captured"') >= models:
            return
        time.sleep(0.5)
    print(f"graphs not all captured within {timeout} s", flush=True)


def host_events(run_dir: Path) -> list[dict]:
    out = []
    for line in (run_dir / "worker-0.log").read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") in ("model on the GPU", "model evicted", "model load breakdown"):
            out.append({k: ev.get(k) for k in ("event", "model", "seconds", "source", "kept_gb", "first_token_s",
                                               "weights_s", "kv_s", "graphs_s", "timestamp")})
    return out


def gpu_memory() -> str:
    if DEVICE == "cpu":
        return "cpu"
    return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()


def phase_alone(work: Path, result: dict) -> None:
    result["alone"] = {}
    for preset, _ in MODELS[:int(os.environ.get("MM_ALONE", len(MODELS)))]:
        run = work / f"alone-{preset}"
        run.mkdir(parents=True, exist_ok=True)
        proc = up(run, [(str(model_dir(preset)), preset)], [])
        try:
            start = wait_resident([preset])
            wait_graphs(run, 1)
            bench(preset, work / "warm.json", "--num-requests", "100", "--output-len", "16")
            r = {"start_s": round(start, 1), "w1_tok_s": round(w1(preset, work / f"w1-alone-{preset}.json"), 1)}
            if preset == MODELS[0][0]:
                # four client processes, as the mixed W2's four (one client tops out near a core)
                s = bench(preset, work / "w2-alone.json", "--seed", "101", "--processes", "4")
                r["w2_tok_s"] = round(s["output_throughput"])
            result["alone"][preset] = r
            print(f"alone {preset}: {r}", flush=True)
        finally:
            down(proc)


def together_up(work: Path, extra: list[str] = ()) -> tuple[subprocess.Popen, Path]:
    run = work / "together"
    run.mkdir(parents=True, exist_ok=True)
    models = [(str(model_dir(p)), p) for p, _ in MODELS] + [(str(model_dir(SPARE[1])), SPARE[0])]
    proc = up(run, models, [s for _, s in MODELS] + [SPARE[2]], ["--host-memory-gb", "40", *extra])
    return proc, run


def phase_together(work: Path, run: Path, result: dict) -> None:
    names = [p for p, _ in MODELS]
    r = result["together"] = {"start_s": round(wait_resident(names), 1), "resident": models_list()}
    wait_graphs(run, len(names))
    for name in names:
        bench(name, work / "warm.json", "--num-requests", "100", "--output-len", "16")
    r["gpu_memory"] = gpu_memory()
    r["w1_tok_s"] = {name: round(w1(name, work / f"w1-{name}.json"), 1) for name in names}
    print(f"together W1: {r['w1_tok_s']}", flush=True)
    t0 = time.monotonic()
    procs = [subprocess.Popen([PY, "-m", "services.cli", "bench", "--base-url", f"http://127.0.0.1:{PORT}",
                               "--model", name, "--vocab-size", VOCAB, "--num-requests", "250", "--seed",
                               str(200 + i), "--no-progress", "--out", str(work / f"w2-mixed-{name}.json")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i, name in enumerate(names)]
    for p in procs:
        p.wait(300)
    wall = time.monotonic() - t0
    per = {n: json.loads((work / f"w2-mixed-{n}.json").read_text())["summary"] for n in names}
    tokens = sum(s["total_output_tokens"] for s in per.values())
    r["w2_mixed"] = {"output_tok_s": round(tokens / max(s["duration_s"] for s in per.values())),
                     "wall_s": round(wall, 1), "failed": sum(s["failed"] for s in per.values()),
                     "per_model_tok_s": {n: round(s["output_throughput"]) for n, s in per.items()}}
    print(f"together W2 mixed: {r['w2_mixed']}", flush=True)


def phase_reload(run: Path, result: dict) -> None:
    big, small = MODELS[0][0], [p for p, _ in MODELS[1:]]

    async def go() -> dict:
        await first_token(big)
        for name in small:
            await first_token(name)
        spare_s = await first_token(SPARE[0])  # the 8B is the least recently used: it makes the room
        for name in small:
            await first_token(name)  # spare is the least recently used now
        await asyncio.sleep(1.0)
        reload_s = await first_token(big)
        return {"spare_first_token_s": round(spare_s, 3), "big_reload_first_token_s": round(reload_s, 3)}

    r = result["reload"] = asyncio.run(go())
    r["events"] = host_events(run)[-8:]
    print(f"reload: {r}", flush=True)


def phase_itl(work: Path, result: dict) -> None:
    name = MODELS[1][0]
    args = ("--request-rate", "10", "--num-requests", "200", "--input-len", "128", "--output-len", "64:128")
    quiet = bench(name, work / "itl-quiet.json", *args, "--seed", "31")

    async def loads(stop: asyncio.Event) -> int:
        n = 0
        while not stop.is_set():
            await first_token(SPARE[0] if n % 2 == 0 else MODELS[0][0])
            n += 1
        return n

    async def go() -> tuple[dict, int]:
        stop = asyncio.Event()
        task = asyncio.ensure_future(loads(stop))
        busy = await asyncio.to_thread(bench, name, work / "itl-loading.json", *args, "--seed", "32")
        stop.set()
        return busy, await task

    busy, n = asyncio.run(go())
    result["itl"] = {"model": name, "quiet_p99_ms": quiet["itl"]["p99"], "loading_p99_ms": busy["itl"]["p99"],
                     "quiet_p50_ms": quiet["itl"]["p50"], "loading_p50_ms": busy["itl"]["p50"],
                     "loads_during": n, "ratio_p99": round(busy["itl"]["p99"] / quiet["itl"]["p99"], 3)}
    print(f"ITL: {result['itl']}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", default="alone,together,reload,itl")
    ap.add_argument("--out", default="/tmp/mm-out")
    args = ap.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    phases = args.phases.split(",")
    result: dict = {"gpu": gpu_memory()}
    prepare()
    try:
        if {"together", "reload", "itl"} & set(phases):
            proc, run = together_up(work)
            try:
                if "together" in phases:
                    phase_together(work, run, result)
                else:
                    wait_resident([p for p, _ in MODELS])
                    wait_graphs(run, len(MODELS))  # the quiet ITL is no base while graphs are still captured
                if "reload" in phases:
                    phase_reload(run, result)
                if "itl" in phases:
                    phase_itl(work, result)
                result["events"] = host_events(run)
            finally:
                down(proc)
        if "alone" in phases:
            phase_alone(work, result)
    finally:
        (work / "multi_model.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "events"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
