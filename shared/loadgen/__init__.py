"""Load generator for any OpenAI-compatible endpoint: `inferno bench` (workloads W2, W3, W4, CPU cost)."""

from shared.loadgen.client import BenchError, BenchResult, RequestRecord, run_benchmark
from shared.loadgen.session_stats import SessionSummary, TurnSummary
from shared.loadgen.sessions import run_sessions
from shared.loadgen.workload import BenchConfig, SessionConfig

__all__ = ["BenchConfig", "BenchError", "BenchResult", "RequestRecord", "SessionConfig", "SessionSummary",
           "TurnSummary", "run_benchmark", "run_sessions"]
