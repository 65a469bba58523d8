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


def test_a_flag_without_spaces_passes_as_the_value_of_worker_arg(tmp_path):
    """argparse takes `--speculative-config={...}` for an option of its own; the launcher glues it on."""
    spec = '--speculative-config={"method":"ngram","num_speculative_tokens":4}'
    got = _argv_of_workers(tmp_path, ["--worker-arg", spec])
    assert got["worker-0"][-1] == spec


def test_a_decode_worker_keeps_room_for_hand_offs_whatever_its_own_step_budget():
    from services.worker.model_build import DECODE_HANDOFF_TOKENS, handoff_buffer_tokens
    from shared.config import WorkerServiceConfig

    def tokens(role, budget, device="cuda"):
        return handoff_buffer_tokens(WorkerServiceConfig(role=role, device=device, max_num_batched_tokens=budget))

    assert tokens("decode", 512) == DECODE_HANDOFF_TOKENS  # its own small steps do not shrink the slots
    assert tokens("decode", 16384) == 32768
    assert tokens("prefill", 512) == 1024  # a prefill worker exports its own steps' prompts
    assert tokens("mixed", 8192) == 0 and tokens("decode", 8192, device="cpu") == 0
