"""`inferno bench`: flags to a BenchConfig, one run, a rate sweep or a session run, then the report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import sys
from collections.abc import Sequence

from inferno.loadgen.client import BenchError, BenchResult, Show, run_benchmark
from inferno.loadgen.report import (PlotUnavailable, format_result, format_sweep, plot_result, plot_sweep,
                                   write_json)
from inferno.loadgen.sessions import run_sessions
from inferno.loadgen.workload import BenchConfig, SessionConfig, parse_range
from shared.progress import PLAIN_EVERY_S, progress

# Defaults of the flags that depend on the workload (None in the parser, so a flag that does not
# apply to the chosen workload can be told from one left alone).
W2_NUM_REQUESTS = 1000
W2_INPUT_LEN = (100, 340)
W4_TURNS = 8
W4_SYSTEM_LEN = 4000
W4_USER_LEN = (50, 150)


def _positive_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 or inf, got {text!r}")
    return rate


def _rates(text: str) -> list[float]:
    return [_positive_rate(part) for part in text.split(",") if part.strip()]


def _seconds(text: str) -> float:
    seconds = float(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return seconds


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _length(text: str) -> tuple[int, int]:
    try:
        return parse_range(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _pid_pair(text: str) -> tuple[str, int]:
    name, sep, pid = text.partition("=")
    if not sep or not name or not pid.isdigit():
        raise argparse.ArgumentTypeError(f"--pid takes NAME=PID, got {text!r}")
    return name, int(pid)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inferno bench",
        description="Load an OpenAI-compatible endpoint with synthetic streaming requests "
                    "(defaults: workload W2, 1000 requests all at once; --sessions: workload W4).")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    p.add_argument("--model", help="model id (default: the first one GET /v1/models lists)")
    p.add_argument("--endpoint", choices=["completions", "chat"],
                   help="default completions; chat with --sessions (the only one it takes)")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer ...'")
    p.add_argument("--num-requests", type=int, help=f"default {W2_NUM_REQUESTS} (not with --sessions)")
    p.add_argument("--input-len", type=_length, metavar="N|LO:HI",
                   help="prompt length in tokens, uniform over LO..HI (default 100:340; not with --sessions)")
    p.add_argument("--output-len", type=_length, default=(100, 300), metavar="N|LO:HI",
                   help="max_tokens, uniform over LO..HI (default 100:300)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=_positive_rate, default=math.inf, metavar="R",
                      help="Poisson arrivals at R requests/s (default inf: all at once)")
    load.add_argument("--sweep-rates", type=_rates, metavar="R1,R2,...",
                      help="run the Poisson workload at each rate in turn, one row per rate (W3)")
    load.add_argument("--sessions", type=_positive_int, metavar="N",
                      help="workload W4 on the chat endpoint: N sessions at once (at most --concurrency), "
                           "each a run of turns that resend the shared system prompt and the dialogue so far")
    w4 = p.add_argument_group("sessions (W4)")
    w4.add_argument("--turns", type=_positive_int, metavar="T", help=f"turns per session (default {W4_TURNS})")
    w4.add_argument("--system-len", type=_positive_int, metavar="N",
                    help=f"words of the system prompt all sessions share (default {W4_SYSTEM_LEN})")
    w4.add_argument("--user-len", type=_length, metavar="N|LO:HI",
                    help="words of each new user message, uniform over LO..HI (default 50:150)")
    w4.add_argument("--session-affinity", action="store_true",
                    help="send x-session-affinity: SEED-SESSION on every turn of a session")
    p.add_argument("--concurrency", type=int, help="cap on requests in flight (default: none)")
    p.add_argument("--processes", type=int, default=1,
                   help="client processes sending the requests (default 1): one tops out near a CPU core, "
                        "which a fast server outpaces (the report's load generator CPU says when)")
    p.add_argument("--seed", type=int, default=0,
                   help="prompts, lengths and arrivals follow it; a server with prefix caching "
                        "serves a repeated seed's prompts from cache (a sweep uses SEED+i per rate)")
    p.add_argument("--prompt-mode", choices=["tokens", "text"],
                   help="random token ids (default for completions) or random words (default for chat)")
    p.add_argument("--vocab-size", type=int, default=1000, help="token ids are drawn from [10, VOCAB)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens: the model may stop early")
    p.add_argument("--response-format", metavar="FILE",
                   help="a JSON file: a JSON schema, or a list of them, that the answers follow in turn "
                        "(response_format json_schema)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="default 0 (greedy), as vLLM's and SGLang's benchmarks send")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    p.add_argument("--max-duration", type=float, default=3600.0,
                   help="seconds for a whole run; requests still open then fail (default 3600)")
    p.add_argument("--pids-file", help='JSON {"service": pid, ...} as `inferno up` writes it')
    p.add_argument("--pid", type=_pid_pair, action="append", default=[], metavar="NAME=PID",
                   help="a process to charge CPU time to (repeatable)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--save-requests", action="store_true", help="include every request in --out")
    p.add_argument("--plot", help="PNG: TTFT/ITL CDFs, or the latency/throughput curve of a sweep")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="show no progress on stderr (by default: a bar on a terminal, else a line every "
                        "--progress-every seconds)")
    p.add_argument("--progress-every", type=_seconds, default=PLAIN_EVERY_S, metavar="S",
                   help=f"seconds between progress lines when stderr is no terminal (default {PLAIN_EVERY_S:g})")
    return p


def _pids(args: argparse.Namespace) -> dict[str, int]:
    pids: dict[str, int] = {}
    if args.pids_file:
        with open(args.pids_file) as f:
            listed = json.load(f)
        if not isinstance(listed, dict):
            raise ValueError(f"{args.pids_file}: expected a JSON object of service name -> pid")
        for name, pid in listed.items():
            pids[str(name)] = int(pid) if isinstance(pid, str) and pid.isdigit() else pid
    pids.update(dict(args.pid))
    return pids


def _session_config(args: argparse.Namespace) -> SessionConfig | None:
    """The W4 flags; ValueError for a flag that does not apply to the chosen workload."""
    if args.sessions is None:
        given = [flag for flag, value in (("--turns", args.turns), ("--system-len", args.system_len),
                                          ("--user-len", args.user_len)) if value is not None]
        if args.session_affinity:
            given.append("--session-affinity")
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --sessions")
        return None
    given = [flag for flag, value in (("--num-requests", args.num_requests), ("--input-len", args.input_len))
             if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} do not apply with --sessions (see --turns, --system-len, --user-len)")
    if args.endpoint == "completions" or args.prompt_mode == "tokens":
        raise ValueError("--sessions runs on the chat endpoint with text prompts")
    return SessionConfig(sessions=args.sessions, turns=args.turns or W4_TURNS,
                         system_len=args.system_len or W4_SYSTEM_LEN, user_len=args.user_len or W4_USER_LEN,
                         affinity=args.session_affinity)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    sessions = _session_config(args)
    endpoint = args.endpoint or ("chat" if sessions is not None else "completions")
    return BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=endpoint, api_key=args.api_key,
        num_requests=W2_NUM_REQUESTS if args.num_requests is None else args.num_requests,
        input_len=args.input_len or W2_INPUT_LEN, output_len=args.output_len,
        concurrency=args.concurrency, processes=args.processes, request_rate=args.request_rate, seed=args.seed,
        prompt_mode=args.prompt_mode or ("tokens" if endpoint == "completions" else "text"),
        vocab_size=args.vocab_size, ignore_eos=args.ignore_eos, temperature=args.temperature,
        timeout=args.timeout, max_duration=args.max_duration, pids=_pids(args),
        save_requests=args.save_requests, sessions=sessions, schemas=_schemas(args.response_format))


def _schemas(path: str | None) -> tuple[dict, ...]:
    if not path:
        return ()
    with open(path) as f:
        loaded = json.load(f)
    schemas = tuple(loaded) if isinstance(loaded, list) else (loaded,)
    if not schemas or not all(isinstance(s, dict) for s in schemas):
        raise ValueError(f"{path}: expected a JSON schema (an object) or a non-empty list of them")
    return schemas


def _show(cfg: BenchConfig, sweep: bool, every: float) -> Show:
    """The run's progress on stderr, named by what sets it apart: its rate in a sweep."""
    if sweep:
        name = f"rate {cfg.request_rate:g}/s"
    else:
        name = "sessions" if cfg.sessions is not None else "bench"
    return functools.partial(progress, name, unit="requests", every=every)


async def _run_all(configs: Sequence[BenchConfig], progress_every: float | None) -> list[BenchResult]:
    """progress_every: seconds between plain progress lines; None shows no progress."""
    results = []
    for cfg in configs:
        if results:  # the model a sweep's first run found
            cfg = dataclasses.replace(cfg, model=results[0].model)
        show = _show(cfg, len(configs) > 1, progress_every) if progress_every is not None else None
        run = run_sessions if cfg.sessions is not None else run_benchmark
        results.append(await run(cfg, show))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """0 when some request completed, 1 when none did or the run could not start, 2 for bad flags."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        try:
            cfg = config_from_args(args)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
    except SystemExit as exc:  # argparse: --help, or bad flags after printing why
        return exc.code if isinstance(exc.code, int) else 2
    configs = [cfg]
    if args.sweep_rates:  # fresh prompts per rate: the same ones again would hit the prefix cache
        configs = [dataclasses.replace(cfg, request_rate=r, seed=cfg.seed + i)
                   for i, r in enumerate(args.sweep_rates)]
    try:
        results = asyncio.run(_run_all(configs, args.progress_every if args.progress else None))
    except BenchError as exc:
        print(f"inferno bench: {exc}", file=sys.stderr)
        return 1
    print(format_sweep(results) if args.sweep_rates else format_result(results[0]))
    if args.out:
        write_json(results, args.out, sweep=bool(args.sweep_rates))
    if args.plot:
        try:
            plot_sweep(results, args.plot) if args.sweep_rates else plot_result(results[0], args.plot)
        except PlotUnavailable as exc:
            print(f"inferno bench: no plot written: {exc}", file=sys.stderr)
    return 0 if any(r.summary.completed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
