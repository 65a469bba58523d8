"""Times the sampler at B = 256 in a few modes and prints its kernels' registers and spills (H100 probe).

    python3 bench/sampling_variants.py [--rows B] [--block-v N] [--chain-rounds N] [--chain-splits N]
                                      [--collect-splits N] [--collect-maxnreg N] [--bf16] [LABEL]

--bf16: the logits in bf16, as the engine's LM head gives them (the same values rounded).
--rows: the batch (256 by default). --collect-splits 0: the second read by the row program alone;
N: split over N chunks of the row; unset: as the batch size picks (sampling._collects).

For A/B runs of kernel variants in one device call: run it from each variant's tree.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.gpu_kernels import engine_rounds, graph_us, sampling_inputs  # noqa: E402
from services.worker.kernels import sampling as K  # noqa: E402
from services.worker.kernels import sampling_chain  # noqa: E402

MODES = ("topk1", "topk50-topp0.9", "topp0.9", "topp0.9-broad", "topp0.95-minp0.05", "mixed")


def main() -> None:
    args = sys.argv[1:]
    dtype = torch.bfloat16 if "--bf16" in args else torch.float32
    args = [a for a in args if a != "--bf16"]
    kw = {}
    while args[:1] in (["--rows"], ["--block-v"], ["--chain-rounds"], ["--chain-splits"], ["--collect-splits"],
                       ["--collect-maxnreg"]):
        kw[args[0][2:].replace("-", "_")] = int(args[1])
        args = args[2:]
    if "chain_splits" in kw:  # chain_splits() reads the module's constant at each launch
        sampling_chain.CHAIN_SPLITS = kw.pop("chain_splits")
    if "collect_maxnreg" in kw:
        K.COLLECT_MAXNREG = kw.pop("collect_maxnreg")
    n_rows = kw.pop("rows", 256)
    label = args[0] if args else "?"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    row = []
    for mode in MODES:
        a = sampling_inputs(n_rows, mode, dev, dtype)
        kw_mode = {**engine_rounds(a), **kw}  # the engine's rounds unless --chain-rounds says
        reads = torch.zeros(n_rows, dtype=torch.int32, device=dev)
        ok = bool(torch.equal(K.sample(*a, reads=reads, **kw_mode), K.sample_ref(*a)))
        spread = "/".join(str(int((reads == r).sum())) for r in range(1, 7))  # rows read once, twice, ...
        row.append(f"{mode} {graph_us(lambda: K.sample(*a, **kw_mode)):.1f}{'' if ok else '!'} [{spread}]")
    regs = []
    for kern in (K._stats_kernel, K._bounds_kernel, K._collect_kernel, K._collect_end_kernel, K._sample_kernel,
                 K._chain_round_kernel, K._chain_finish_kernel):
        for cache in kern.device_caches.values():
            for c in cache[0].values():
                regs.append(f"{kern.__name__} regs {c.n_regs} spills {c.n_spills}")
    print(label, "|", " | ".join(row))
    print("   ", "; ".join(sorted(set(regs))))


if __name__ == "__main__":
    main()
