"""Schema-driven fuzzing of the HTTP API: schemathesis generates requests (valid and invalid) from
the gateway's own /openapi.json, they are sent to a running stack, and every server error counts
as a failure: a 5xx status, or a stream that ends with an error event of a 5xx code.

    python bench/fuzz_api.py --cases 10000                    # starts a stack with the tiny model
    python bench/fuzz_api.py --base-url http://127.0.0.1:8000 --cases 10000 [--api-key K]

Generation bodies get a small max_tokens (--max-tokens, default 4) so that cases stay fast on a
CPU; every other field is left as generated, except that a share of the bodies (--bad-unicode,
default 2%) get a lone surrogate in one of their strings (hypothesis writes only valid Unicode,
and a lone "\ud800" once was a 500). Exits 1 when any case got a server error.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import hypothesis
import requests
import schemathesis
from hypothesis import HealthCheck, Phase

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
POST_SHARE = 0.9  # of the cases, for the routes that take a body (split over them and both modes)


@dataclass
class FuzzReport:
    cases: int = 0
    by_status: Counter = field(default_factory=Counter)
    by_operation: Counter = field(default_factory=Counter)
    server_errors: list[str] = field(default_factory=list)  # a curl command and what came back, per failure
    transport_errors: list[str] = field(default_factory=list)
    generate_seconds: float = 0.0
    run_seconds: float = 0.0

    @property
    def num_5xx(self) -> int:
        return len(self.server_errors)

    def summary(self) -> str:
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(self.by_status.items()))
        return (f"{self.cases} cases in {self.generate_seconds:.1f} s generation + {self.run_seconds:.1f} s "
                f"requests; 5xx: {self.num_5xx}; transport errors: {len(self.transport_errors)}; "
                f"statuses: {statuses}")


def _generate(operation: Any, mode: schemathesis.GenerationMode, n: int, seed: int) -> list:
    cases: list = []
    if n <= 0:
        return cases

    @hypothesis.settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate],
                         suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
    @hypothesis.seed(seed)
    @hypothesis.given(operation.as_strategy(generation_mode=mode))
    def collect(case: Any) -> None:
        cases.append(case)

    try:
        collect()
    except hypothesis.errors.Unsatisfiable:  # nothing to vary (e.g. a GET without parameters, negated)
        pass
    except Exception as e:  # a strategy schemathesis cannot build for this mode
        print(f"  {operation.method.upper()} {operation.path} {mode.value}: no cases ({e!r:.120})", file=sys.stderr)
    return cases


def generate_cases(schema: Any, total: int, seed: int) -> list:
    """About `total` cases over every operation, both generation modes; most go to the routes with a body."""
    operations = [r.ok() for r in schema.get_all_operations()]
    with_body = [op for op in operations if op.method.upper() == "POST"]
    without = [op for op in operations if op.method.upper() != "POST"]
    cases: list = []
    round_ = 0
    while len(cases) < total and round_ < 5:
        missing = total - len(cases)
        per_body = int(missing * POST_SHARE / (2 * len(with_body))) + 1
        per_other = int(missing * (1 - POST_SHARE) / (2 * max(1, len(without)))) + 1
        for op in operations:
            n = per_body if op in with_body else per_other
            for mode in schemathesis.GenerationMode:
                cases += _generate(op, mode, n, seed + 7919 * round_)
        round_ += 1
    return cases


def _shrink_generation(case: Any, max_tokens: int) -> None:
    """A generation body asks for at most max_tokens (a missing bound would mean the whole context)."""
    body = case.body
    if case.path not in GENERATION_PATHS or not isinstance(body, dict):
        return
    asked = False
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > max_tokens:
            body[key] = max_tokens
        asked |= v is not None
    if not asked:
        body["max_tokens"] = max_tokens


def _break_unicode(case: Any, rng: random.Random) -> None:
    """Append a lone surrogate to one string value of the body, where it has one."""
    spots: list[tuple[Any, Any]] = []  # (container, key or index) of every string
    stack = [case.body]
    while stack:
        node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            if isinstance(v, str):
                spots.append((node, k))
            elif isinstance(v, (dict, list)):
                stack.append(v)
    if spots:
        node, k = rng.choice(spots)
        node[k] += "\ud800"


def _stream_error(response: Any) -> str | None:
    """The error event that ended a stream with a 5xx code, if one did."""
    if "text/event-stream" not in response.headers.get("Content-Type", ""):
        return None
    for line in response.content.split(b"\n\n"):
        if line.startswith(b'data: {"error"'):
            code = json.loads(line[6:])["error"].get("code")
            if isinstance(code, int) and code >= 500:
                return line.decode(errors="replace")
    return None


def run_cases(cases: list, base_url: str, report: FuzzReport, api_key: str | None, max_tokens: int,
              workers: int, progress: Callable[[int], None] | None = None, bad_unicode: float = 0.02,
              seed: int = 0) -> None:
    rng = random.Random(seed)
    for case in cases:
        _shrink_generation(case, max_tokens)
        if case.method.upper() == "POST" and rng.random() < bad_unicode:
            _break_unicode(case, rng)
    local = threading.local()
    lock = threading.Lock()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None

    def one(case: Any) -> None:
        session = getattr(local, "session", None)
        if session is None:
            session = local.session = requests.Session()
        name = f"{case.method.upper()} {case.path}"
        try:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=120)
        except Exception as e:
            with lock:
                report.cases += 1
                report.transport_errors.append(f"{name}: {e!r:.300}")
            return
        failure = f"status {response.status_code}" if response.status_code >= 500 else _stream_error(response)
        with lock:
            report.cases += 1
            report.by_status[response.status_code] += 1
            report.by_operation[name] += 1
            if failure is not None:
                report.server_errors.append(f"{case.as_curl_command()}\n  -> {failure}: {response.text[:500]}")
            if progress is not None:
                progress(report.cases)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(one, cases))


def fuzz(base_url: str, cases: int, *, api_key: str | None = None, seed: int = 0, max_tokens: int = 4,
         workers: int = 2, bad_unicode: float = 0.02, progress: Callable[[int], None] | None = None,
         openapi: dict | None = None) -> FuzzReport:
    """Generate about `cases` requests from the gateway's /openapi.json (or the document given) and
    send them to it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    schema = (schemathesis.openapi.from_dict(openapi) if openapi is not None else
              schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers, timeout=30))
    report = FuzzReport()
    started = time.monotonic()
    generated = generate_cases(schema, cases, seed)
    report.generate_seconds = time.monotonic() - started
    started = time.monotonic()
    run_cases(generated, base_url, report, api_key, max_tokens, workers, progress, bad_unicode, seed)
    report.run_seconds = time.monotonic() - started
    return report


def _own_stack(workdir: Path):
    """The tiny random-weight model behind the whole stack, as `inferno up` starts it."""
    from services.launcher import Stack, StackConfig, free_port
    from inferno.tools.make_model import write_model

    model = write_model(workdir / "tiny", preset="tiny", seed=0, dtype="float32")
    cfg = StackConfig(model_dir=model, model_name="tiny-fuzz", port=free_port(), nats_port=free_port(),
                      run_dir=workdir / "run", log_format="json", worker_args=("--num-blocks", "512"),
                      gateway_args=("--max-body-bytes", "65536"))
    stack = Stack(cfg).start()
    try:
        stack.wait_ready(timeout=120)
    except Exception:
        stack.stop()
        raise
    return stack


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running gateway (default: start a stack with the tiny model)")
    p.add_argument("--cases", type=int, default=10_000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--workers", type=int, default=4, help="requests in flight at once")
    p.add_argument("--bad-unicode", type=float, default=0.02, help="share of bodies given a lone surrogate")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="inferno-fuzz-") as tmp:
        stack = None if args.base_url else _own_stack(Path(tmp))
        base_url = args.base_url or stack.url
        try:
            def progress(done: int) -> None:
                if done % 500 == 0:
                    print(f"  {done} cases", file=sys.stderr, flush=True)

            report = fuzz(base_url, args.cases, api_key=args.api_key, seed=args.seed, max_tokens=args.max_tokens,
                          workers=args.workers, bad_unicode=args.bad_unicode, progress=progress)
        finally:
            if stack is not None:
                stack.stop()
    print(report.summary())
    for operation, n in sorted(report.by_operation.items()):
        print(f"  {operation}: {n}")
    for failure in report.server_errors[:20] + report.transport_errors[:20]:
        print(failure)
    if args.json is not None:
        args.json.write_text(json.dumps({"cases": report.cases, "5xx": report.num_5xx,
                                         "transport_errors": len(report.transport_errors),
                                         "statuses": dict(report.by_status), "operations": dict(report.by_operation),
                                         "generate_seconds": round(report.generate_seconds, 1),
                                         "run_seconds": round(report.run_seconds, 1),
                                         "failures": report.server_errors}, indent=1))
    return 1 if report.server_errors or report.transport_errors else 0


if __name__ == "__main__":
    sys.exit(main())
