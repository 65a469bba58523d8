"""`inferno up --prefill-worker-arg / --decode-worker-arg`: flags for one role's workers only,
after the flags every worker gets (argparse keeps the last value, so they win)."""

from __future__ import annotations

from pathlib import Path

from services import launcher


def _argv_of_workers(tmp_path: Path, argv: list[str]) -> dict[str, list[str]]:
    args = launcher.parse_args(["--model", str(tmp_path), *argv])
    cfg = launcher.StackConfig(model_dir=tmp_path, run_dir=tmp_path / "run",
                               worker_args=launcher._split(args.worker_arg),
                               prefill_worker_args=launcher._split(args.prefill_worker_arg),
                               decode_worker_args=launcher._split(args.decode_worker_arg))
    stack = launcher.Stack(cfg)
    stack._popen = lambda name, argv: None  # the command lines, no processes
    for i, role in enumerate(("mixed", "prefill", "decode")):
        stack.start_worker(i, role)
    return {c.name: c.argv for c in stack.children}


def test_role_flags_reach_their_role_only_and_come_last(tmp_path):
    got = _argv_of_workers(tmp_path, ["--worker-arg", "--max-num-batched-tokens 8192",
                                      "--decode-worker-arg=--max-num-batched-tokens 512",
                                      "--prefill-worker-arg", "--gil-switch-interval-ms 0.5"])
    tail = {name: argv[argv.index("--device") + 2:] for name, argv in got.items()}
    assert tail["worker-0"] == ["--max-num-batched-tokens", "8192"]
    assert tail["prefill-1"] == ["--max-num-batched-tokens", "8192", "--gil-switch-interval-ms", "0.5"]
    assert tail["decode-2"] == ["--max-num-batched-tokens", "8192", "--max-num-batched-tokens", "512"]
