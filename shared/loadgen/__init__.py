"""Load generator for any OpenAI-compatible endpoint: `inferno bench` (workloads W2, W3, CPU cost)."""

from shared.loadgen.client import BenchError, BenchResult, RequestRecord, run_benchmark
from shared.loadgen.workload import BenchConfig

__all__ = ["BenchConfig", "BenchError", "BenchResult", "RequestRecord", "run_benchmark"]
