"""CUDA graphs of mixed steps (prefill chunks beside decodes), one per token-count bucket.

Launched one by one, a mixed step's ~300 kernels cost ~11 ms of host time on the H100 VM, more
than the GPU needs for 64 decodes and a 220-token prompt (10 ms; measured 2026-11-24), so every
step that carries a new prompt stalled the decodes beside it (W3's ITL p99). Past a few thousand
tokens the GPU's time exceeds the launches' and eager steps cost nothing extra, so the buckets
stop at 2,048 tokens. Attention reads a host-built work list (extend_attention.query_tiles), so
a graph replays any mix of query lengths up to its bucket.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from services.worker.engine.attention_metadata import AttentionMetadata
from services.worker.engine.cuda_graphs import capture_buckets
from services.worker.engine.step_inputs import HostStep, align_up
from services.worker.kernels.extend_attention import TILE_TOKENS

MAX_GRAPH_TOKENS = 2048


# Steps that check drafts (jump-forward, speculation) are a few tokens: at 64 an 8B verify step cost
# 1.43 x a decode step on an H200 (cuBLAS at 64 rows), so drafting workers capture smaller buckets too.
DRAFT_BUCKETS = [8, 16, 32]


def token_buckets(max_tokens: int, drafts: bool = False) -> list[int]:
    sizes = (DRAFT_BUCKETS if drafts else []) + [64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    limit = min(max_tokens, MAX_GRAPH_TOKENS)
    return [s for s in sizes if s < limit] + [limit]


class MixedGraphRunner:
    """Static buffers shared by every bucket's graph, filled by one host→device copy of the prefix
    in use. Layout: int64 [tokens T | positions T | slots T | logits rows S | feed dst S | feed src S],
    then int32 [qsl S+1 | seq_lens S | tiles 2 × NT | block tables S × W] (tables last, so a step
    copies only the rows it has)."""

    def __init__(self, model, kv_cache, max_seqs: int, max_tokens: int, max_graph_len: int, device: torch.device,
                 drafts: bool = False):
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.buckets = token_buckets(max_tokens, drafts)
        T, S = self.buckets[-1], max_seqs
        self.max_tokens, self.max_seqs = T, S
        self.width = math.ceil(max_graph_len / self.block_size)
        self.max_graph_len = self.width * self.block_size
        self.max_tiles = T // TILE_TOKENS + S
        W, NT = self.width, self.max_tiles
        # Every region starts on a 16-byte boundary, as HostStep's parts do, so the kernels see
        # the pointer alignment of eager steps and one compiled variant serves both.
        self.cuts64 = np.cumsum([0, *(align_up(n, 2) for n in (T, T, T, S, S, S))])
        self.cuts32 = np.cumsum([0, *(align_up(n, 4) for n in (S + 1, S, 2 * NT, S * W))])
        n64, n32 = int(self.cuts64[-1]), int(self.cuts32[-1])
        self.n64 = n64
        self.nbytes = 8 * n64 + 4 * n32
        self.cuda = device.type == "cuda"
        # Two host stages used in turn: the next step is written into one while the copy out of
        # the other may still be queued behind the step in flight.
        self.hosts = [torch.zeros(self.nbytes, dtype=torch.uint8) for _ in range(2)]
        if self.cuda:
            self.hosts = [h.pin_memory() for h in self.hosts]
        self.stages = [self._views(h.numpy()) for h in self.hosts]
        self.turn = 0
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.d = self._views(self.dev)
        self.graphs: dict[int, object] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.aux: dict[int, torch.Tensor | None] = {}
        self.pool = None
        self.capture_seconds = 0.0

    def _views(self, buf):
        """The named regions of a byte buffer (numpy on the host, torch on the device)."""
        T, S, W, NT = self.max_tokens, self.max_seqs, self.width, self.max_tiles
        if isinstance(buf, np.ndarray):
            b64, b32 = buf[:8 * self.n64].view(np.int64), buf[8 * self.n64:].view(np.int32)
        else:
            b64, b32 = buf[:8 * self.n64].view(torch.int64), buf[8 * self.n64:].view(torch.int32)
        cuts64, cuts32 = self.cuts64, self.cuts32
        v = {name: b64[cuts64[i]:cuts64[i] + n] for i, (name, n) in enumerate(
            (("tokens", T), ("pos", T), ("slots", T), ("logits", S), ("feed_dst", S), ("feed_src", S)))}
        v.update({name: b32[cuts32[i]:cuts32[i] + n] for i, (name, n) in enumerate(
            (("qsl", S + 1), ("seq_lens", S), ("tiles", 2 * NT), ("tables", S * W)))})
        v["tiles"] = v["tiles"].reshape(2, NT) if isinstance(buf, np.ndarray) else v["tiles"].view(2, NT)
        v["tables"] = v["tables"].reshape(S, W) if isinstance(buf, np.ndarray) else v["tables"].view(S, W)
        v["tables_at"] = 8 * self.n64 + 4 * int(cuts32[3])
        return v

    def _meta(self, t: int) -> AttentionMetadata:
        d = self.d
        n_tiles = t // TILE_TOKENS + self.max_seqs
        return AttentionMetadata(slot_mapping=d["slots"][:t], block_tables=d["tables"], seq_lens=d["seq_lens"],
                                 query_start_loc=d["qsl"], max_query_len=t, max_seq_len=self.max_graph_len,
                                 tiles=d["tiles"][:, :n_tiles])

    def _forward(self, t: int) -> torch.Tensor:
        hidden = self.model(self.d["tokens"][:t], self.d["pos"][:t], self.kv_cache.layers, self._meta(t))
        self.aux[t] = self.model.aux_hidden  # an EAGLE-3 head's inputs, when the model keeps them
        return hidden

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Capture every bucket (largest first, into `pool`: the decode graphs' memory)."""
        import time
        t0 = time.perf_counter()
        for h in self.stages:
            h["slots"][:] = -1
            h["tiles"][:] = -1
        self.dev.copy_(self.hosts[0])
        if self.cuda:
            torch.cuda.synchronize()
        self.pool = capture_buckets(self.buckets, self._forward, self.graphs, self.outputs, pool, self.cuda)
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def covers(self, step: HostStep) -> bool:
        n_tokens, n_tiles = step.lens[0], step.lens[9] // 2
        return (n_tokens <= self.max_tokens and step.n_seq <= self.max_seqs and step.lens[5] <= self.max_seqs
                and step.max_blocks <= self.width
                and step.max_seq_len <= self.max_graph_len and n_tiles <= self.max_tiles)

    def launch(self, step: HostStep, last_ids: torch.Tensor | None = None):
        """Write the step into the static buffers, feed the tokens still on the device, replay."""
        part = step.parts()
        T, n, nb = step.lens[0], step.n_seq, step.max_blocks
        t = next(x for x in self.buckets if x >= T)
        h, host = self.stages[self.turn], self.hosts[self.turn]
        self.turn ^= 1
        h["tokens"][:T], h["pos"][:T], h["slots"][:T] = part[0], part[1], part[2]
        h["tokens"][T:t], h["pos"][T:t], h["slots"][T:t] = 0, 0, -1
        h["seq_lens"][:n], h["seq_lens"][n:] = part[3], 0
        h["qsl"][:n + 1], h["qsl"][n + 1:] = part[4], T
        k_rows, k_fed = step.lens[5], step.lens[7]
        h["logits"][:k_rows] = part[5]
        h["feed_dst"][:k_fed], h["feed_src"][:k_fed] = part[7], part[8]
        tiles = part[9].reshape(2, -1)
        m = tiles.shape[1]
        h["tiles"][:, :m] = tiles
        h["tiles"][0, m:] = -1
        h["tables"][:n, :nb] = part[6].reshape(n, nb)
        used = h["tables_at"] + 4 * n * self.width
        self.dev[:used].copy_(host[:used], non_blocking=True)
        d = self.d
        if k_fed:
            d["tokens"].index_copy_(0, d["feed_dst"][:k_fed], last_ids.index_select(0, d["feed_src"][:k_fed]))
        if self.cuda:
            self.graphs[t].replay()
            hidden = self.outputs[t]
            self.model.aux_hidden = self.aux[t]
        else:
            hidden = self._forward(t)  # the CPU tests drive the same static path eagerly
        return hidden, d["logits"][:k_rows]
