"""Kernels through Triton's compiler for Hopper (sm_90), ptxas included (Triton's wheel ships it),
on a machine without a GPU: the interpreter runs what the compiler refuses (a module global read
inside a kernel, say), and the PTX shows what a launch will do (grid dependency control). Each
case compiles in a process of its own, where TRITON_INTERPRET is unset."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _compile(fn, signature: dict, constexprs: dict) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, constexprs=constexprs, signature={**signature, **{k: "constexpr" for k in constexprs}})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]


def one_shot_all_reduce_with_pdl() -> None:
    from services.worker.engine.parallel import custom_all_reduce as C

    common = {**{f"b{i}": "*bf16" for i in range(8)}, **{f"s{i}": "*i64" for i in range(8)}, "state_ptr": "*i64"}
    consts = {"WORLD": 2, "RANK": 1, "HALF": 4096, "SLOTS": C.MAX_BLOCKS, "PDL": True}
    ptxs = [
        _compile(C._one_shot_all_reduce_kernel, {"x_ptr": "*bf16", "n": "i32", **common}, {**consts, "BLOCK": 2048}),
        _compile(C._one_shot_add_rmsnorm_kernel, {
            **{p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}, "n_rows": "i32",
            "n_cols": "i32", "eps": "fp32", **common}, {**consts, "BLOCK_H": 4096}),
    ]
    for ptx in ptxs:
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def decode_kernels_with_pdl() -> None:
    from services.worker.kernels import gemv, rmsnorm, silu_mul

    ptxs = [
        _compile(gemv._gemv_kernel, {
            "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "s_ptr": "*bf16", "out_ptr": "*bf16",
            "r_ptr": "*bf16", "nw_ptr": "*bf16", "r_out_ptr": "*bf16",
            "M": "i32", "N": "i32", "K": "i32", "x_stride": "i32", "w_stride": "i32", "out_stride": "i32",
            "r_stride": "i32", "r_out_stride": "i32", "eps": "fp32"},
            {"HAS_BIAS": False, "HAS_SCALE": False, "SILU_MUL": False, "NORM": True, "EVEN_K": True, "BLOCK_M": 1,
             "BLOCK_N": 4, "BLOCK_K": 512, "VEC": 8, "NUM_STAGES": 3, "PDL": True}),
        _compile(rmsnorm._rmsnorm_kernel, {
            **{p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}, "n_rows": "i32",
            "n_cols": "i32", "x_stride": "i32", "res_stride": "i32", "out_stride": "i32", "res_out_stride": "i32",
            "eps": "fp32"}, {"HAS_RESIDUAL": True, "BLOCK_R": 1, "BLOCK_H": 4096, "PDL": True}),
        _compile(silu_mul._silu_mul_kernel, {"x_ptr": "*bf16", "out_ptr": "*bf16", "inter": "i32",
                                             "x_stride": "i32", "out_stride": "i32"}, {"BLOCK": 1024, "PDL": True}),
    ]
    from services.worker.kernels import sampling_chain

    # The chain's rounds: atomics and .cg reads, no PDL (it slowed them on an H100).
    ptxs.append(_compile(sampling_chain._chain_round_kernel, {
        "logits_ptr": "*fp32", "logits_stride": "i32", "temp_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
        "min_p_ptr": "*fp32", "seeds_ptr": "*i64", "offsets_ptr": "*i64", "cand_ptr": "*i32", "arrived_ptr": "*i32",
        "m_ptr": "*fp32",
        "z_ptr": "*fp32", "bound_ptr": "*fp32", "out_ptr": "*i64", "reads_ptr": "*i64", "part_mass_ptr": "*fp32",
        "part_score_ptr": "*fp32", "part_idx_ptr": "*i32", "vocab": "i32", "chunk": "i32", "splits": "i32"},
        {"BLOCK": 2048, "BLOCK_S": 16, "COUNT_READS": False, "FIRST": True}))
    for ptx in ptxs[:-1]:
        # The wait comes before any global load: nothing is read before the kernel before it ended.
        assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
        assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def sampler_kernels_for_bf16_logits() -> None:
    """The sampler's launches before the chain for the engine's bf16 logits: pass 1, the bounds, the
    chunked second read and its end, the row program gated (and the probes' scan-only build of it:
    its early return must match the others' four values)."""
    from services.worker.kernels import sampling as K

    rows = {p: "*fp32" for p in ("temp_ptr", "top_p_ptr", "min_p_ptr")}
    rows.update({"top_k_ptr": "*i32", "seeds_ptr": "*i64", "offsets_ptr": "*i64"})
    _compile(K._stats_kernel, {
        "logits_ptr": "*bf16", "logits_stride": "i32", **rows, "part_score_ptr": "*fp32", "part_idx_ptr": "*i32",
        "part_z_ptr": "*fp32", "part_u_ptr": "*fp32", "part_grid_ptr": "*i32", "part_draw_ptr": "*fp32", "vocab": "i32",
        "chunk": "i32", "num_splits": "i32", "n_u": "i32", "chain_first": "i32"}, {"NL": 256, "BLOCK_V": 2048})
    _compile(K._sample_kernel, {
        "logits_ptr": "*bf16", "logits_stride": "i32", **rows, "out_ptr": "*i64", "reads_ptr": "*i32",
        "times_ptr": "*i64", "part_score_ptr": "*fp32", "part_idx_ptr": "*i32", "part_z_ptr": "*fp32",
        "part_u_ptr": "*fp32", "part_grid_ptr": "*i32", "buf_l_ptr": "*fp32", "buf_i_ptr": "*i32", "cand_ptr": "*i32",
        "m_ptr": "*fp32", "z_ptr": "*fp32", "bound_ptr": "*fp32", "vocab": "i32", "num_splits": "i32", "n_u": "i32"},
        {"BLOCK_S": 64, "BLOCK_U": 1024, "GRID_S": 16, "BLOCK_V": 2048, "SMALL": 256, "SCAN_ONLY": True,
         "COUNT_READS": True, "TIMES": False, "DEFER": True, "GATE": K._SERIAL.value})
    state = {p: "*fp32" for p in ("m_ptr", "z_ptr", "bound_ptr", "beta_ptr", "hi_ptr", "lo_p_ptr", "tail_ptr")}
    _compile(K._bounds_kernel, {
        "logits_ptr": "*bf16", "logits_stride": "i32",
        **{p: t for p, t in rows.items() if p not in ("seeds_ptr", "offsets_ptr")}, "out_ptr": "*i64",
        "reads_ptr": "*i32", "part_score_ptr": "*fp32", "part_idx_ptr": "*i32", "part_z_ptr": "*fp32",
        "part_u_ptr": "*fp32", "part_grid_ptr": "*i32", "part_draw_ptr": "*fp32", "cand_ptr": "*i32",
        "arrived_ptr": "*i32",
        **{p: "*fp32" for p in ("m_ptr", "z_ptr", "bound_ptr", "beta_ptr", "hi_ptr", "lo_p_ptr", "tail_ptr")},
        "vocab": "i32", "num_splits": "i32", "n_u": "i32", "chain_first": "i32"},
        {"BLOCK_S": 64, "BLOCK_U": 1024, "GRID_S": 16, "BAND": 1280, "COUNT_READS": False})
    _compile(K._collect_kernel, {
        "logits_ptr": "*bf16", "logits_stride": "i32", **rows, "cand_ptr": "*i32", "m_ptr": "*fp32",
        "beta_ptr": "*fp32", "hi_ptr": "*fp32", "part_f_ptr": "*fp32", "part_i_ptr": "*i32", "buf_l_ptr": "*fp32",
        "buf_i_ptr": "*i32", "vocab": "i32", "chunk": "i32", "splits": "i32"},
        {"BLOCK": 2048, "REGION": 256, "CAP": 2048})
    _compile(K._collect_end_kernel, {
        **rows, "out_ptr": "*i64", "reads_ptr": "*i32", "cand_ptr": "*i32",
        **{p: t for p, t in state.items() if p != "hi_ptr"}, "part_f_ptr": "*fp32", "part_i_ptr": "*i32",
        "part_u_ptr": "*fp32", "buf_l_ptr": "*fp32", "buf_i_ptr": "*i32", "vocab": "i32", "splits": "i32",
        "n_u": "i32", "rounds": "i32"},
        {"REGION": 256, "CAP": 2048, "BLOCK_S": 8, "BLOCK_U": 1024, "SMALL": 256, "COUNT_READS": True})


@pytest.mark.parametrize("case", ["one_shot_all_reduce_with_pdl", "decode_kernels_with_pdl",
                                  "sampler_kernels_for_bf16_logits"])
def test_compiles_for_hopper(case):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from tests.unit.test_kernels_compile import {case}; {case}()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_pdl_is_chosen_per_process_and_never_on_the_cpu(monkeypatch):
    import torch

    from services.worker.kernels import _common

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_common, "_pdl_capable", lambda device: device.type == "cuda")  # a Hopper here
    monkeypatch.setattr(_common, "_PDL_ENV", None)
    monkeypatch.setattr(_common, "_pdl_chosen", False)
    assert _common.pdl_args(gpu) == {"PDL": False}  # a single GPU launches as before
    _common.use_pdl(True)  # a tensor-parallel rank
    assert _common.pdl_args(gpu) == {"PDL": True, "launch_pdl": True}
    assert _common.pdl_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(_common, "_PDL_ENV", "0")  # INFERNO_PDL=0 wins
    assert _common.pdl_args(gpu) == {"PDL": False}
