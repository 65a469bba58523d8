"""The plan as a person reads it (tables in GiB and tokens) and as JSON."""

from __future__ import annotations

from services.worker.plan.layout_plan import LayoutPlan
from services.worker.plan.rank_memory import gib

RANK_COLUMNS = ("rank", "stage", "layers", "usable", "weights", "activations", "graphs", "context", "hand-off",
                "KV GiB", "KV blocks", "KV tokens")
COMPARE_COLUMNS = ("layout", "GPUs", "replicas", "weights/GPU", "KV tokens/replica", "KV tokens in all", "fits")


def table(header: tuple[str, ...], rows: list[tuple]) -> list[str]:
    """Right-aligned columns, the first left-aligned."""
    cells = [header, *[tuple(str(c) for c in row) for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in cells]


def rank_rows(plan: LayoutPlan) -> list[tuple]:
    return [(r.rank, r.stage, f"{r.layers[0]}-{r.layers[1] - 1}", gib(r.usable), gib(r.weights), gib(r.activation_peak),
             gib(r.graph_reserve), gib(r.context), gib(r.handoff), gib(r.kv_bytes), f"{r.kv_blocks:,}",
             f"{r.kv_tokens:,}") for r in plan.ranks]


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def verdict(plan: LayoutPlan, max_model_len: int) -> str:
    if not plan.fits:
        return f"does not fit: {plan.reason}"
    return (f"fits: {plan.kv_tokens:,} KV tokens per replica, {plan.kv_tokens / max_model_len:.1f} sequences of "
            f"{max_model_len:,} tokens")


def text_report(summary: dict, plan: LayoutPlan, compared: list[LayoutPlan] | None) -> str:
    s, g = summary["settings"], summary["gpus"]
    lines = [f"{summary['model']} ({summary['architecture']}) on {g['count']} × {g['kind']}, "
             f"{gib(g['total_bytes'])} GiB each as CUDA counts it",
             f"weights {s['dtype']}{' (fp8 projections)' if s['quantization'] == 'fp8' else ''}, KV cache "
             f"{s['kv_dtype']} in blocks of {s['block_size']}, max_num_batched_tokens {s['max_num_batched_tokens']:,}, "
             f"max_num_seqs {s['max_num_seqs']:,}, gpu_memory_utilization {s['gpu_memory_utilization']}", ""]
    if plan.ranks:
        lines += [f"{plan.name}: {count(plan.replicas, 'replica')} of {count(plan.tp * plan.pp, 'GPU')}; GiB per GPU:",
                  *table(RANK_COLUMNS, rank_rows(plan))]
    lines.append(f"{plan.name} {verdict(plan, s['max_model_len'])}")
    if compared is not None:
        rows = [(p.name, p.tp * p.pp, p.replicas, gib(max(r.weights for r in p.ranks)), f"{p.kv_tokens:,}",
                 f"{p.kv_tokens * p.replicas:,}", "yes" if p.fits else "no") for p in compared]
        lines += ["", "every layout of the GPUs (weights/GPU in GiB, the most a rank holds):",
                  *table(COMPARE_COLUMNS, rows)]
        lines += [f"{p.name}: {p.reason}" for p in compared if not p.fits]
    return "\n".join(lines)


def json_report(summary: dict, plan: LayoutPlan, compared: list[LayoutPlan] | None) -> dict:
    out = {**summary, "plan": plan.as_dict()}
    if compared is not None:
        out["compare"] = [{k: v for k, v in p.as_dict().items() if k != "ranks"} for p in compared]
    return out
