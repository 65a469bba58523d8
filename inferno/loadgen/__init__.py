"""Load generator for any OpenAI-compatible endpoint: `inferno bench` (workloads W2, W3, W4, CPU cost)."""

from inferno.loadgen.client import BenchError, BenchResult, RequestRecord, run_benchmark
from inferno.loadgen.session_stats import SessionSummary, TurnSummary
from inferno.loadgen.sessions import run_sessions
from inferno.loadgen.workload import BenchConfig, SessionConfig

__all__ = ["BenchConfig", "BenchError", "BenchResult", "RequestRecord", "SessionConfig", "SessionSummary",
           "TurnSummary", "run_benchmark", "run_sessions"]
