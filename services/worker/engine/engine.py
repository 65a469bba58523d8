"""The engine: add requests, step (schedule → run → postprocess), read outputs. Single-threaded;
the worker service drives it from its step thread.

With `EngineConfig.overlap` the host plans and launches step N+1 before it waits for step N's tokens,
so the scheduling, input building and output handling of one step run while the GPU computes
the other (vLLM's async scheduling, SGLang's overlap scheduler). A request that stops at step N
has also been given a row in step N+1; that row's token is dropped.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from services.worker.engine.batcher import Batcher, BatchPlan, SchedulerConfig
from services.worker.engine.block_manager import BlockManager
from services.worker.engine.engine_config import EngineConfig
from services.worker.engine.engine_stats import EngineStats, engine_stats
from services.worker.engine.drafts import advance_matchers, checked_drafts, constrain, make_drafts
from services.worker.engine.kv_cache import CacheLayout, KVCache, kv_cache_dtype
from services.worker.engine.kv_export import Handoff, PageExporter, handoff_buffer_blocks
from services.worker.engine.kv_import import ImportReservation
from services.worker.engine.kv_pages import empty_pages, scatter_pages
from services.worker.engine.loader import load_model
from services.worker.engine.expert_load import ExpertLoad
from services.worker.engine.model_config import ModelConfig
from services.worker.engine.drafting import build_drafter, draft_kv_bytes_per_block, load_drafting_model
from services.worker.engine.ops import make_ops
from services.worker.engine.parallel.layout import ParallelLayout
from services.worker.engine.parallel.sharded_model import join_or_start_group, load_rank_model
from services.worker.engine.request import FINISHED, Request, RequestStatus
from services.worker.engine.request_output import RequestOutput
from services.worker.engine.runner import DeferredDraw, ModelRunner
from services.worker.engine.sampler import PendingSample, SampleResult, Sampler
from services.worker.engine.step_outputs import StepOutputs
from services.worker.kernels import triton_setup
from shared.block_hash import request_block_key
from shared.sampling_params import SamplingParams

DEFAULT_CPU_BLOCKS = 1024


class PromptSink:
    """Where a prompt's computed full blocks go (the worker's cluster KV store client)."""

    def skip(self, hashes: list[bytes]) -> int:
        """How many leading blocks not to send (already stored there, or no room to queue more)."""
        raise NotImplementedError

    def take(self, hashes: list[bytes], pages: torch.Tensor, event) -> None:
        """Pages [n, L, 2, bs, H, D] of these hashes; `event` (CUDA) marks when they are written."""
        raise NotImplementedError


_REASONS = {status: status.value for status in FINISHED if status is not RequestStatus.HANDED_OFF}
# The columns of a step's outputs are read with C-level maps over its requests.
_STATUS = attrgetter("status")
_RID = attrgetter("request_id")
_PROMPT = attrgetter("num_prompt_tokens")
_CACHED = attrgetter("num_cached_tokens")
_TOKENS = attrgetter("all_token_ids")


@dataclass(slots=True)
class LaunchedStep:
    """A step handed to the device whose tokens have not been read yet."""

    plan: BatchPlan
    sample: PendingSample | None
    error: Exception | None = None
    done: object = None  # a CUDA event after the step's kernels, when its KV is copied out later
    # Its logits, when the draw waits for the grammars' matchers to take the tokens of the step
    # before (LLMEngine.step draws it once that step is read).
    deferred: DeferredDraw | None = None


class LLMEngine:
    """One process's engine. With tensor/pipeline parallelism the process the worker starts is
    the group's driver (it starts the other ranks); a rank started by it passes its `rank`."""

    def __init__(self, config: EngineConfig, model=None, rank: int | None = None, init_method: str = "",
                 kv_cache: KVCache | None = None, staging=None):
        """`kv_cache`: a pool of this model's shape to use instead of sizing and allocating one (a
        worker replacing its model keeps the old pool: services/worker/model_build.py). `staging`:
        pinned buffers for the weights' copies (loader.StagingPool, the worker's)."""
        self.config = config
        self.device = torch.device(config.device)
        self.model_config = ModelConfig.from_path(config.model_dir)
        self.layout = ParallelLayout(config.tensor_parallel_size, config.pipeline_parallel_size,
                                     expert_parallel=config.enable_expert_parallel)
        self.layout.check(self.model_config)
        self.group = None
        if self.layout.world_size > 1:
            self.group = join_or_start_group(config, self.layout, rank, init_method)
            self.layout, self.device = self.group.layout, self.group.device
        # The shape this process holds: its heads, MLP columns, vocabulary rows and layers.
        self.rank_config = self.layout.local_config(self.model_config)
        dtype = getattr(torch, config.dtype) if config.dtype else (
            getattr(torch, self.model_config.torch_dtype, torch.bfloat16) if config.is_cuda else torch.float32)
        self.dtype = dtype
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, dtype)
        self.ops = make_ops(config.kernel_backend)
        self.memory_report: dict = {}
        t0 = time.perf_counter()
        if model is not None:
            self.model = model
        elif self.group is not None:
            self.model = load_rank_model(config, self.model_config, self.group, self.device, dtype, self.ops)
        else:
            self.model = load_model(config.model_dir, self.device, dtype, self.ops, config.load_threads,
                                    config.load_format, config.seed, staging=staging,
                                    max_positions=config.max_model_len)
        triton_setup.wait()  # Triton's one-time setup, begun beside the load (warm_device), before any kernel
        if config.quantization == "fp8":
            self.model.quantize_fp8()
            if config.is_cuda:  # the 16-bit weights' memory back to the device before the KV pool is sized
                torch.cuda.empty_cache()
        self.load_seconds = time.perf_counter() - t0
        self.expert_load = ExpertLoad(self.model)
        self.max_model_len = min(config.max_model_len or self.model_config.max_model_len,
                                 self.model_config.max_model_len)
        # Penalties, logprobs and overlap are the driver's business; its pending draws are those of
        # the steps in flight (one more than the pipeline's depth).
        self._depth = self.layout.pp - 1 if self.layout.pp > 1 else int(config.overlap)
        # Speculation's drafting model (draft_model) is the driver's: loaded before the pool is sized,
        # which holds its KV of every page beside the target's (model_drafter.py).
        self._spec = config.speculative if self.layout.pp == 1 else None
        draft = None
        if self._spec is not None and self.layout.is_driver and self._spec.method != "ngram":
            draft = load_drafting_model(self._spec, self.model, self.model_config, config.model_dir, self.group,
                                        self.device, dtype, self.ops)
        self.draft_block_bytes = draft_kv_bytes_per_block(draft, config.block_size, self.kv_dtype)
        self.sampler = Sampler(self.ops, self.model_config.vocab_size, self.device, config.max_num_seqs, dtype)
        if self.layout.is_driver and config.warm_sampler_later:  # the only rank that samples; the KV
            self.sampler.warm_up_later(config.max_num_seqs)  # sizing reserves what its warm-up will hold
        num_blocks = kv_cache.num_blocks if kv_cache is not None else config.num_blocks or self._blocks_from_memory()
        if self.group is not None:
            num_blocks = self.group.min_over_ranks(num_blocks)  # one block table for every rank
        self.kv_cache = kv_cache or KVCache(self.rank_config, num_blocks, config.block_size, self.kv_dtype, self.device)
        extra_key = request_block_key(config.cache_key or config.model_dir, "")
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, extra_key)
        self.batcher = Batcher(SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            chunked_prefill_size=config.chunked_prefill_size,
            enable_prefix_caching=config.enable_prefix_caching,
            micro_batches=self.layout.pp,
        ), self.block_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.sampler, self.device, self.group)
        self.runner.block_tables = self.block_manager.tables
        self.runner.share_ids = self.group is not None and self._depth > 0 and self.layout.pp == 1
        t_warm = time.perf_counter()
        if self.layout.is_driver and not config.warm_sampler_later:  # its kernel variants, before serving
            self.sampler.warm_up(config.max_num_seqs)
        self.sampler_warm_seconds = time.perf_counter() - t_warm
        self.graph_capture_seconds = 0.0
        # Pipeline stages run eagerly: a step's launches are few next to a stage's layers.
        if config.is_cuda and config.cuda_graphs and self.layout.pp == 1:
            from services.worker.engine.cuda_graphs import CudaGraphRunner
            graphs = CudaGraphRunner(self.model, self.kv_cache, config.max_num_seqs,
                                     min(self.max_model_len, config.max_graph_len), self.device)
            self.graph_capture_seconds = graphs.capture()
            self.runner.graphs = graphs
            if config.mixed_graphs and CacheLayout.of(self.rank_config).graphs_mixed_steps:
                from services.worker.engine.mixed_graphs import MixedGraphRunner
                mixed = MixedGraphRunner(self.model, self.kv_cache, config.max_num_seqs,
                                         config.max_num_batched_tokens, min(self.max_model_len, config.max_graph_len),
                                         self.device, config.drafts)
                self.graph_capture_seconds += mixed.capture(graphs.pool)
                self.runner.mixed_graphs = mixed
            self.runner.warm_logits(config.max_num_seqs)
        self.drafter = build_drafter(self._spec, draft, num_blocks, self.block_manager, config, self.device,
                                     self.kv_dtype, self.model_config.vocab_size,
                                     min(self.max_model_len, config.max_graph_len))
        self.steps = 0
        self._rng = random.Random(config.seed)
        self._inflight: deque[LaunchedStep] = deque()
        self._imports: dict[str, ImportReservation] = {}
        # Set by a worker that shares prompt KV with a cluster store: gets each prompt's full blocks.
        self.prompt_sink: PromptSink | None = None
        # Copies out of the pool: hand-offs (from the buffer set aside for them) and the cluster store's.
        self.exporter = PageExporter(self.kv_cache, self.device, handoff_buffer_blocks(config))
        # Drafts (jump-forward, speculation) are checked in one step: not across a pipeline's micro-batches.
        self._jump_forward = config.jump_forward > 0 and self.layout.pp == 1
        # Drafts checked (a request's in a step), their tokens and the confirmed ones, cumulative, by
        # method ("jump_forward", "ngram": [drafts, tokens, confirmed]).
        self.draft_counts: dict[str, list[int]] = {}
        self.last_step_tokens = 0  # tokens computed by the last finished step (prefill speed)
        self.last_step_rows = 0  # ... and the sequences in it

    def _blocks_from_memory(self) -> int:
        if not self.config.is_cuda:
            return DEFAULT_CPU_BLOCKS
        from services.worker.engine.gpu_memory import profile_kv_blocks
        return profile_kv_blocks(self)

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_ids: tuple[int, ...] = (), cache_salt: bytes = b"", handoff: bool = False,
                    matcher=None) -> Request:
        """Raises SamplingParamsError or RequestRejected (both ValueError) for bad input. With
        `handoff` the request stops after its first token and its output carries its KV pages.
        `matcher`: its grammar's (services/worker/grammar.py), for a structured output."""
        if handoff:
            self._need_whole_kv("hand a request's KV to another worker")
        request = self._new_request(request_id, prompt_token_ids, params, eos_token_ids, cache_salt)
        request.handoff = handoff
        if matcher is not None:
            constrain(request, matcher, self._jump_forward)
        self.batcher.add_request(request)
        return request

    def add_resumed(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, first_token: int,
                    seed: int, eos_token_ids: tuple[int, ...] = (), cache_salt: bytes = b"", matcher=None) -> Request:
        """A request another worker prefilled and drew its first token for, whose KV never came (a
        failed hand-off): computed here from the prompt and that token, as a preempted request is
        recomputed, it goes on from its second token with the same seeded draws."""
        request = self._new_request(request_id, prompt_token_ids, params, eos_token_ids, cache_salt, seed=seed)
        if matcher is not None:
            constrain(request, matcher, self._jump_forward)
        self._take_first_token(request, first_token)
        self.batcher.add_request(request)
        return request

    def _take_first_token(self, request: Request, first_token: int) -> None:
        """Append the token another worker drew first (its grammar's matcher, if any, takes it too)."""
        if not 0 <= first_token < self.model_config.vocab_size:
            raise ValueError(f"first token {first_token} is outside the vocabulary")
        if request.matcher is not None and not request.matcher.accept(first_token):
            raise ValueError(f"first token {first_token} is not one the request's grammar allows")
        request.all_token_ids.append(first_token)

    def _new_request(self, request_id, prompt_token_ids, params, eos_token_ids, cache_salt, seed=None) -> Request:
        params.validate(self.model_config.vocab_size)
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary ({self.model_config.vocab_size})")
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        request = Request(request_id, list(prompt_token_ids), params, tuple(eos_token_ids),
                          arrival_time=time.monotonic(), cache_salt=cache_salt, seed=seed & ((1 << 63) - 1))
        # Speculation, unless the request opts out.
        request.speculates = self._spec is not None and params.speculative
        return request

    def abort(self, request_id: str) -> bool:
        if self.cancel_import(request_id):
            return True
        return self.batcher.abort(request_id) is not None

    # -- KV from another worker (the decode side of a hand-off) ---------------------------------
    def reserve_import(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       eos_token_ids: tuple[int, ...] = (), cache_salt: bytes = b"",
                       matcher=None) -> ImportReservation | None:
        """Hold blocks for a request whose prompt another worker prefills (possibly still running
        there); None when it does not fit now (ValueError when it never could). Its pages go into
        `.buffer`, then complete_import() with the first token. `matcher`: a structured output's,
        fresh: the first token, which the prefill worker drew under the same grammar, moves it on."""
        self._need_whole_kv("receive a request's KV from another worker")
        request = self._new_request(request_id, prompt_token_ids, params, eos_token_ids, cache_salt, seed=0)
        if matcher is not None:
            constrain(request, matcher, self._jump_forward)
        skip = self.batcher.reserve(request)
        if skip is None:
            return None
        n = len(request.block_ids) - skip
        slot = self.exporter.receive_slot(n) if n else None
        try:
            buffer, release = slot if slot is not None else (empty_pages(self.kv_cache, n), None)
        except RuntimeError:  # no device memory for the receive buffer now: like no free blocks
            self.batcher.cancel_reserved(request_id)
            return None
        allocated = None
        if buffer.is_cuda:
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(buffer.device))
        reservation = self._imports[request_id] = ImportReservation(request, skip, buffer, allocated, release)
        return reservation

    def complete_import(self, request_id: str, first_token: int, seed: int, num_cached_tokens: int = 0) -> Request:
        """The buffer holds the pages: write them into the reserved blocks, append the first token
        the prefill worker sampled (with its resolved seed, so seeded draws go on) and decode on."""
        res = self._imports[request_id]
        r = res.request
        try:
            self._take_first_token(r, first_token)
        except ValueError:
            self.cancel_import(request_id)
            raise
        del self._imports[request_id]
        r.seed = seed & ((1 << 63) - 1)
        r.num_cached_tokens = max(r.num_cached_tokens, num_cached_tokens)
        scatter_pages(self.kv_cache, r.block_ids[res.skip_blocks:], res.buffer)
        # The pages came, so no write into the slot is still on its way (a prefill worker's push
        # ends before its frame is sent): only the scatter must read it before it is reused.
        res.free_slot(self.exporter, hold_until=0.0)
        return self.batcher.start_imported(request_id)

    def cancel_import(self, request_id: str) -> bool:
        res = self._imports.pop(request_id, None)
        if res is None:
            return False
        self.batcher.cancel_reserved(request_id)
        res.free_slot(self.exporter, res.hold_until)
        return True

    def has_unfinished(self) -> bool:
        return self.batcher.has_unfinished() or bool(self._inflight)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> StepOutputs:
        """Run one step; returns the outputs of the step that finished (with overlap, the one
        launched by the previous call; with pipeline stages, the oldest in flight)."""
        inflight = self._inflight
        if inflight and not self._may_overlap():
            return self._finish(inflight.popleft())
        plan: BatchPlan = self.batcher.schedule()
        launched = None
        if plan.scheduled:
            launched = self._launch(plan)
            inflight.append(launched)
        elif inflight:  # nothing new to launch: read the oldest step
            return self._finish(inflight.popleft())
        parts = []
        while len(inflight) > self._depth:
            parts.append(self._finish(inflight.popleft()))
        if launched is not None and launched.deferred is not None:
            self._draw(launched)
        return StepOutputs.join(parts) if parts else StepOutputs()

    def _may_overlap(self) -> bool:
        # Penalties need the values of every output token, so such a request cannot be
        # planned while its previous token is still on the device. (Pipeline micro-batches
        # never plan a request whose token is in flight.)
        # A draft follows a known token, so speculation runs its steps one after the other, while it
        # is on (up to disable_by_batch_size requests running; past that no drafts are made) and while
        # a draft made before is still to be checked (its step yields more than one token).
        if self.batcher.num_drafting and (self._speculating() or any(
                r.draft_len for r in self.batcher.running_requests())):
            return False
        return self.layout.pp > 1 or (self.config.overlap and (self.batcher.all_plain or not any(
            r.needs_token_history for r in self.batcher.running_requests())))

    # Totals over the methods (tests, benchmarks).
    @property
    def spec_drafts(self) -> int:
        return sum(c[0] for c in self.draft_counts.values())

    @property
    def spec_draft_tokens(self) -> int:
        return sum(c[1] for c in self.draft_counts.values())

    @property
    def spec_accepted_tokens(self) -> int:
        return sum(c[2] for c in self.draft_counts.values())

    def _speculating(self) -> bool:
        spec = self._spec
        return spec is not None and spec.drafts_at(self.batcher.num_running)

    def _launch(self, plan: BatchPlan) -> LaunchedStep:
        self.steps += 1
        # A constrained row's mask needs its grammar to have taken the token of the step in flight:
        # then the forward goes first, and the draw once that step is read (grammar_mask.py). A
        # pipeline never plans a request whose token is in flight.
        constrained = self.batcher.num_constrained > 0
        defer = constrained and bool(self._inflight) and self.layout.pp == 1
        try:
            draw = self.runner.execute(plan.scheduled, plan.sampling, plan.plain, constrained, defer,
                                       plan.draft_rows)
            launched = (LaunchedStep(plan, None, deferred=draw) if isinstance(draw, DeferredDraw)
                        else LaunchedStep(plan, draw))
            if self.drafter is not None and self._speculating():
                self.drafter.after_launch(plan.scheduled, self.model)  # an EAGLE-3 head keeps the target's states
        except Exception as e:  # a bad step fails its requests, never the engine
            self._end_group_on(e)
            return LaunchedStep(plan, None, e)
        if self.device.type == "cuda" and (self.prompt_sink is not None or plan.handoffs):
            launched.done = torch.cuda.Event()
            launched.done.record()
        return launched

    def _end_group_on(self, error: Exception) -> None:
        if self.group is not None:  # the other ranks may be inside the failed step's collectives now
            from services.worker.engine.parallel.group import end_group
            end_group(self.group, "a step failed on the driver", error=repr(error))

    def _draw(self, launched: LaunchedStep) -> None:
        """A deferred draw, now that the matchers have taken the tokens before it."""
        deferred, launched.deferred = launched.deferred, None
        try:
            launched.sample = self.runner.draw(deferred)
        except Exception as e:
            self._end_group_on(e)
            launched.error = e

    def _finish(self, launched: LaunchedStep) -> StepOutputs:
        if launched.deferred is not None:
            self._draw(launched)
        plan = launched.plan
        try:
            if launched.error is not None:
                raise launched.error
            result = launched.sample.result() if launched.sample is not None else None
        except Exception as e:
            return self._fail_step(plan, e)
        reqs = plan.sampling
        # Rows of requests aborted, failed or stopped since the launch produce nothing.
        statuses = list(map(_STATUS, reqs))
        live = None  # None: every row
        if statuses.count(RequestStatus.RUNNING) != len(statuses):
            live = [i for i, st in enumerate(statuses) if st is RequestStatus.RUNNING or st is RequestStatus.PREEMPTED]
        live_reqs = reqs if live is None else [reqs[i] for i in live]
        # Blocks of requests sampling their first token: a hand-off's and a finished one's are freed
        # by the update, but their content stays until the next schedule.
        first_blocks = None
        if plan.handoffs or self.prompt_sink is not None:
            first_blocks = {r.request_id: list(r.block_ids) for r in live_reqs
                            if r.handoff or (self.prompt_sink is not None and r.num_output_tokens == 0)}
        if result is not None and plan.draft_rows is not None:
            result, counts = checked_drafts(plan.draft_rows, result)
            for method, (drafts, drafted, confirmed) in counts.items():
                total = self.draft_counts.setdefault(method, [0, 0, 0])
                total[0], total[1], total[2] = total[0] + drafts, total[1] + drafted, total[2] + confirmed
        tokens = result.token_ids if result is not None else []
        if self.batcher.num_constrained:
            advance_matchers(reqs, tokens)
        finished = self.batcher.update_from_output(plan, tokens)
        self.last_step_tokens = plan.num_batched_tokens
        self.last_step_rows = len(plan.scheduled)
        outputs = self._outputs(live_reqs, tokens, live, result, bool(finished), plan.draft_rows is not None)
        if self.batcher.num_drafting:
            make_drafts(reqs, self._spec if self._speculating() else None, self.config.jump_forward,
                        self.max_model_len, self.drafter)
        if first_blocks:
            for row, rid in enumerate(outputs.request_ids):
                blocks = first_blocks.get(rid)
                if blocks is None:
                    continue
                r = live_reqs[row]
                out = outputs.special.get(row)
                if r.status is RequestStatus.HANDED_OFF:
                    out = outputs.special[row] = outputs.row(row)
                    try:
                        out.handoff = self._export(r, blocks, launched.done)
                    except RuntimeError as e:  # no memory for the copy: the request ends here, cleanly
                        out.finish_reason, out.error = "error", f"the KV could not be copied for the hand-off: {e}"
                if self.prompt_sink is not None:
                    try:
                        self._share_prompt(r, blocks, out.handoff if out is not None else None, launched.done)
                    except RuntimeError:  # sharing is an optimisation; a step's outputs must go out
                        pass
        return outputs

    def _share_prompt(self, r: Request, block_ids: list[int], handoff: Handoff | None, after=None) -> None:
        """Offer the prompt's full blocks, past those the sink already has, to the cluster store."""
        full = r.num_prompt_tokens // self.kv_cache.block_size
        hashes = r.block_hashes[:full]
        if len(hashes) < full:
            return  # prefix caching off: no hashes to address the pages by
        start = self.prompt_sink.skip(hashes)
        if start >= full:
            return
        if handoff is not None:
            pages, event = handoff.pages[start:full], handoff.event
        else:
            pages, event = self.exporter.copy_out(block_ids[start:full], after)
        self.prompt_sink.take(hashes[start:full], pages, event)

    def insert_cached(self, hashes: list[bytes], pages: torch.Tensor) -> int:
        """Pages fetched from the cluster store become cached blocks here, found by the next
        prefix lookup; returns how many were new."""
        self._need_whole_kv("take KV pages from the cluster store")
        placed = self.block_manager.insert_cached(hashes)
        if placed:
            scatter_pages(self.kv_cache, [b for _, b in placed], pages[[i for i, _ in placed]])
        return len(placed)

    def _export(self, r: Request, block_ids: list[int], after=None) -> Handoff:
        blocks = block_ids[:-(-r.num_prompt_tokens // self.kv_cache.block_size)]
        return self.exporter.export(blocks, r.seed, r.num_cached_tokens, after, shared=self.prompt_sink is not None)

    @staticmethod
    def _outputs(reqs: list[Request], tokens: list, live: list[int] | None, result: SampleResult | None,
                 any_finished: bool, drafts: bool = False) -> StepOutputs:
        """The sampled rows' columns, made by C-level maps (a thousand rows a step on a GPU); whole
        RequestOutputs only for the rows that end or carry logprobs. `reqs`: the requests of the rows
        that produce a token, which are rows `live` of the step's draw (None: all of them).
        `drafts`: a row's entry may be a list of tokens (jump-forward)."""
        if live is not None:
            tokens = [tokens[i] for i in live]
        n = len(reqs)
        if not n:
            return StepOutputs()
        counts = np.ones(n, dtype=np.int32)
        if drafts:
            counts = np.array([len(t) if type(t) is list else 1 for t in tokens], dtype=np.int32)
            tokens = [t for entry in tokens for t in (entry if type(entry) is list else (entry,))]
        n_prompt = np.fromiter(map(_PROMPT, reqs), dtype=np.int32, count=n)
        outputs = StepOutputs(list(map(_RID, reqs)), np.array(tokens, dtype=np.int32), counts,
                              n_prompt, np.fromiter(map(_CACHED, reqs), dtype=np.int32, count=n),
                              np.fromiter(map(len, map(_TOKENS, reqs)), dtype=np.int32, count=n) - n_prompt)
        with_logprobs = result.logprobs is not None
        if not (any_finished or with_logprobs):
            return outputs
        special = outputs.special
        for i, r in enumerate(reqs):
            status = r.status
            k = r.sampling_params.logprobs if with_logprobs else None
            if status not in _REASONS and k is None:
                continue
            out = special[i] = outputs.row(i)
            if status in _REASONS:  # a hand-off is not an end: the decode worker goes on
                out.finish_reason = _REASONS[status]
                if status is RequestStatus.FINISHED_STOPPED:
                    out.stop_token_id = out.new_token_ids[-1]
                out.drafted_tokens, out.accepted_tokens = r.drafted_tokens, r.accepted_tokens
            if k is not None:
                row = i if live is None else live[i]
                chosen, top_ids, top_lps = result.logprobs[row], result.top_ids[row], result.top_logprobs[row]
                if drafts and type(chosen) is list:  # a checked draft: one entry per kept token
                    n_kept = len(out.new_token_ids)  # (a stop or max_tokens may have cut the run)
                    out.logprobs = chosen[:n_kept]
                    out.top_logprobs = [list(zip(t[:k], lp[:k])) for t, lp in zip(top_ids[:n_kept], top_lps[:n_kept])]
                else:
                    out.logprobs = [chosen]
                    out.top_logprobs = [list(zip(top_ids[:k], top_lps[:k]))]
        return outputs

    def _fail_step(self, plan: BatchPlan, error: Exception) -> StepOutputs:
        outputs = []
        for s in plan.scheduled:
            r = s.request
            if r.status.finished:
                continue
            self.batcher.finish_with_error(r.request_id, f"{type(error).__name__}: {error}")
            outputs.append(RequestOutput(r.request_id, [], r.num_prompt_tokens, r.num_cached_tokens,
                                         r.num_output_tokens, finish_reason="error", error=str(error)))
        return StepOutputs.of(outputs)

    @property
    def holds_whole_kv(self) -> bool:
        """False when each rank of a parallel group holds a part of every page: KV hand-off and
        the cluster store move whole pages, so they need a single-process engine (for now)."""
        return self.group is None

    def _need_whole_kv(self, what: str) -> None:
        if self.group is not None:
            raise ValueError(f"a worker split over {self.layout.world_size} processes cannot {what} yet")

    def close(self) -> None:
        """Stop the sampler's warm-up thread, if it runs, and the other ranks of a parallel group."""
        self.sampler.close()
        if self.group is not None:
            self.group.close()
            self.group = None

    # -- convenience --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 eos_token_ids: tuple[int, ...] = ()) -> list[list[int]]:
        """Run prompts to completion; returns each request's output tokens (tests, benchmarks)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{self.steps}-{i}-{self._rng.getrandbits(32)}" for i in range(len(prompts))]
        requests = [self.add_request(rid, p, sp, eos_token_ids) for rid, p, sp in zip(ids, prompts, params_list)]
        while any(not r.status.finished for r in requests):
            self.step()
        return [r.output_token_ids for r in requests]

    def stats(self) -> EngineStats:
        return engine_stats(self)
