"""ModelRunner: the model and its memory, and the one forward of a scheduler batch.

It owns the model, the memory plan and what it pays for (the request-slot table, the KV pool, the state pool of a
hybrid model, the page allocator), the backends and the static-buffer runner (graph_runner.py). `forward(batch)`
builds the step's ForwardBatch (forward_batch.py), its mode set once from the batch, and runs the model on it:

    Batch (scheduler) --> ForwardMode: prefill -> EXTEND; mixed -> MIXED (prompts, then decodes); decode -> DECODE,
                          or TARGET_VERIFY with drafts
                      --> ForwardBatch (slots, positions, KV locations, pools, backend: prepared once)
                      --> model: attention layers -> attention backend -> KV pool
                                 Gated DeltaNet layers -> GDN backend -> state pool
                      --> final hidden states and float32 logits of the rows asked for

DECODE and TARGET_VERIFY steps go through the static-buffer runner where it is on (always on CUDA, captured as CUDA
graphs unless cuda_graphs=False; on the CPU with cuda_graphs=True, run eagerly, which is how CI tests it), and so
does the first prefill of a single request (the runner's `takes_prefill`); other steps are eager. After SGLang's
ModelRunner; the Engine (engine.py) drives it.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from a4.core import Batch, ForwardMode, Req, to_device
from a4.engine.config import EngineConfig
from a4.engine.factories import create_backends, create_kv_pool, create_memory_plan, create_state_pool
from a4.engine.forward_batch import build_forward_batch
from a4.engine.graph_runner import GraphRunner
from a4.engine.logprobs import prompt_logprob_rows
from a4.kvcache.allocator import PageAllocator
from a4.models.config import ModelConfig
from a4.scheduler.cache import pages_for
from a4.scheduler.table import TableManager

if TYPE_CHECKING:
    from a4.engine.tp_driver import TPDriver


class ModelOutput(NamedTuple):
    hidden: torch.Tensor  # [S, hidden]: final hidden states (after the model's norm) of the rows asked for
    logits: torch.Tensor  # [S, vocab] float32


# The forward mode of each kind of step the scheduler makes.
FORWARD_MODES = {"prefill": ForwardMode.EXTEND, "mixed": ForwardMode.MIXED, "decode": ForwardMode.DECODE,
                 "verify": ForwardMode.TARGET_VERIFY}  # fmt: skip


def forward_mode(batch: Batch) -> ForwardMode:
    return FORWARD_MODES[batch.phase]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model: nn.Module,
        draft_kv_layers: int = 0,
        tp: TPDriver | None = None,
    ):
        """`draft_kv_layers`: attention layers of a draft model (Qwen3.5's MTP module) whose KV lives in the same
        pool, after the main model's layers (the memory plan counts them). `tp`: rank 0 of a tensor-parallel engine
        (a4/engine/tp_driver.py): `model_config` is then one rank's share, and so are the plan and the pools;
        the model's calls and the state pool's operations are mirrored to the other ranks."""
        if tp is not None:
            model = tp.mirror(model, "model")
        self.model_config, self.model = model_config, model
        self.device, dtype, page_size = config.torch_device, config.torch_dtype, config.page_size
        self.ledger, self.memory_plan = create_memory_plan(config, model_config, draft_kv_layers)
        plan = self.memory_plan
        # The longest request (prompt + output) the engine can hold: what the model accepts, and what fits in the
        # pool on its own. Whole pages, because pages are recorded in the table whole.
        context = min(model_config.max_position_embeddings, plan.num_tokens)
        self.max_context_len = context - context % page_size
        if self.max_context_len == 0:
            raise ValueError(
                f"page_size {page_size} is larger than the longest context this engine can hold, {context} tokens "
                f"(max_position_embeddings {model_config.max_position_embeddings}, KV pool "
                f"{plan.num_tokens} tokens): lower page_size or raise memory_budget_bytes"
            )
        self.tokens_per_decode = config.speculative_tokens + 1
        on_cuda = self.device.type == "cuda"
        static = on_cuda or config.cuda_graphs is True
        # Overlap scheduling (engine.py) launches a step before the last one is booked: a request whose EOS that
        # booking finds has run one step more, on the padding slot's state (`_inputs`).
        self.masks_finished = config.overlap and model_config.is_hybrid
        self.eos_token_ids = torch.tensor(model_config.eos_token_ids, dtype=torch.int64, device=self.device)
        # Padded requests of a static batch need a slot and KV locations that no request owns, beyond the plan
        # (SGLang keeps a padding slot likewise): one slot, and pages for its tokens_per_decode positions.
        has_padding = static or self.masks_finished
        self.padding_pages = padding_pages = pages_for(self.tokens_per_decode, page_size) if has_padding else 0
        num_slots = plan.max_running_requests + int(has_padding)
        self.kv_pool = create_kv_pool(model_config, plan.num_pages + padding_pages, page_size, dtype, self.device,
                                      draft_kv_layers)  # fmt: skip
        self.state_pool = create_state_pool(model_config, num_slots, dtype, self.device)
        if tp is not None:
            self.state_pool = tp.mirror_state_pool(self.state_pool)
        if self.state_pool is not None and config.speculative_tokens:
            self.state_pool.allocate_verify_states(self.tokens_per_decode)
        self.backend, static_backend = create_backends(model_config, self.device, dtype)
        self.table_manager = TableManager(num_slots, self.max_context_len, self.device)
        self.allocator = PageAllocator(plan.num_pages + padding_pages, page_size)
        # Each slot's last sampled token, on the device: what its next decode step feeds, even before the host has it.
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        self.graph_runner = None
        self.padding_slot = None
        if has_padding:
            self.padding_slot = padding_slot = self.table_manager.allocate()
            padding_locations = self.allocator.pages_to_locations(self.allocator.allocate(padding_pages))
            self.table_manager.write(padding_slot, 0, padding_locations)
        if static:
            # A speculative engine's prefill returns every row (its drafter reads them), and a tensor-parallel
            # worker would need the static prefill mirrored: both prefill eagerly.
            eager_prefill = config.speculative_tokens or tp is not None
            extend_tokens = 0 if eager_prefill else min(config.max_prefill_tokens, self.max_context_len)
            modes = {ForwardMode.DECODE: 1}
            if config.speculative_tokens:
                modes = {ForwardMode.TARGET_VERIFY: self.tokens_per_decode}
            self.graph_runner = GraphRunner(
                model,
                tokens_per_request=modes,
                max_batch=plan.max_running_requests,
                max_seq_len=self.max_context_len,
                req_to_token=self.table_manager.req_to_token,
                kv_pool=self.kv_pool,
                state_pool=self.state_pool,
                backend=static_backend,
                padding_slot=padding_slot,
                # A graph cannot replay a tensor-parallel step, which starts with a broadcast to the other ranks.
                capture=on_cuda and config.cuda_graphs is not False and tp is None,
                max_extend_tokens=extend_tokens,
            )

    def forward(self, batch: Batch, input_ids: list[int] | None = None, every_row: bool = False) -> ModelOutput:
        """Run the model on the batch's tokens: the requests' next ones unless `input_ids` gives them (a verify
        step: last tokens and drafts). The rows returned are the last of each sampled request (their logits
        predict its next token), then the prompt rows that score prompt tokens for the requests that ask for prompt
        logprobs (logprobs.py), or with `every_row` all of them (a speculative engine's drafter reads them)."""
        mode = forward_mode(batch)
        reqs, extend_lens, prefix_lens = batch.reqs, batch.extend_lens, batch.prefix_lens
        state_slots = None
        if input_ids is None:
            input_ids, state_slots = self._inputs(batch)
        runner = self.graph_runner
        prompt_rows = prompt_logprob_rows(batch) if mode.is_extend() and not every_row else []
        static_prefill = mode is ForwardMode.EXTEND and runner is not None and not every_row and not prompt_rows
        if static_prefill and runner.takes_prefill(prefix_lens, extend_lens):
            hidden, logits = runner.prefill(input_ids, reqs[0].slot)
            rows = int(batch.sample[0])  # a chunk that does not end its prompt samples nothing
            return ModelOutput(hidden[:rows], logits[:rows])
        if not mode.is_extend() and runner is not None:
            # Every row of a decode or verify step is wanted: each request samples from each of its tokens.
            positions = [p + j for p, n in zip(prefix_lens, extend_lens) for j in range(n)]
            return ModelOutput(*runner.forward(mode, input_ids, positions, [req.slot for req in reqs], state_slots))
        if every_row:
            sample_indices = list(range(len(input_ids)))
        else:
            ends = itertools.accumulate(extend_lens)
            sample_indices = [end - 1 for end, sampled in zip(ends, batch.sample) if sampled]
            sample_indices += [r.first_row + j for r in prompt_rows for j in range(r.count)]
        slots = [req.slot for req in reqs]
        fb = self.forward_batch(mode, input_ids, slots, prefix_lens, extend_lens, sample_indices, state_slots,
                                sum(batch.decode_rows) if mode is ForwardMode.MIXED else 0)  # fmt: skip
        return ModelOutput(*self.model(fb, with_hidden=True))

    def _inputs(self, batch: Batch) -> tuple[list[int] | torch.Tensor, torch.Tensor | None]:
        """The tokens the batch feeds, and the requests' state rows where they are not their slots (None).

        Prompt tokens come from the host; a decoding request feeds the token it sampled last, read from
        `last_tokens` on the device (under overlap scheduling the host does not have it yet). With overlap
        scheduling (`masks_finished`), a decoding request whose last token is an end-of-sequence token it may stop
        at (or one of its stop token ids) finished in the step before, booked only after this one was launched: it
        runs on the padding slot's state, so that its own stays the state after its tokens (the prefix cache saves
        it); this step's token is dropped."""
        decode_rows = batch.decode_rows
        if not any(decode_rows):
            return [t for req, p, n in zip(batch.reqs, batch.prefix_lens, batch.extend_lens)
                    for t in req.input_ids[p : p + n]], None  # fmt: skip
        # The decoding requests come last (a mixed step puts them after the prompts), one token each.
        num_prompts = decode_rows.index(True)
        prompts = zip(batch.reqs[:num_prompts], batch.prefix_lens, batch.extend_lens)
        prompt_ids = [t for req, p, n in prompts for t in req.input_ids[p : p + n]]
        decoding = batch.reqs[num_prompts:]
        may_stop = [not req.sampling_params.ignore_eos for req in decoding]
        # A request's own stop token ids, as (decoding row, token) pairs.
        stop_ids = [(row, token) for row, req in enumerate(decoding) for token in req.sampling_params.stop_token_ids]
        # One copy to the device: every slot, the prompts' tokens, which decoding requests may stop at an EOS, and
        # their stop token ids.
        flat_stop_ids = [value for pair in stop_ids for value in pair]
        packed = to_device([req.slot for req in batch.reqs] + prompt_ids + may_stop + flat_stop_ids, self.device)
        slots, prompt_ids, stoppable, stop_pairs = packed.split(
            [len(batch.reqs), len(prompt_ids), len(may_stop), len(flat_stop_ids)])
        last_tokens = self.last_tokens[slots[num_prompts:]]
        input_ids = torch.cat([prompt_ids, last_tokens])
        if not (self.masks_finished and (any(may_stop) or stop_ids)):
            return input_ids, None
        stops = torch.isin(last_tokens, self.eos_token_ids) & stoppable.bool()
        if stop_ids:
            rows, tokens = stop_pairs.view(-1, 2).unbind(dim=1)
            hits = torch.zeros_like(last_tokens).index_add_(0, rows, (last_tokens[rows] == tokens).long())
            stops |= hits > 0
        return input_ids, torch.cat([slots[:num_prompts], torch.where(stops, self.padding_slot, slots[num_prompts:])])

    def keep_last_tokens(self, reqs: list[Req], tokens: torch.Tensor) -> None:
        """Record on the device the token each of reqs just sampled (tokens [len(reqs)], on the device)."""
        self.last_tokens[to_device([req.slot for req in reqs], self.device)] = tokens

    def forward_batch(self, mode: ForwardMode, input_ids, slots, prefix_lens, extend_lens, sample_indices,
                      state_slots: torch.Tensor | None = None, num_decodes: int = 0):  # fmt: skip
        """A ForwardBatch over this runner's table, pools and eager backend (the drafter's steps are built here
        too)."""
        return build_forward_batch(
            mode,
            input_ids=input_ids,
            slots=slots,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            sample_indices=sample_indices,
            req_to_token=self.table_manager.req_to_token,
            kv_pool=self.kv_pool,
            state_pool=self.state_pool,
            attn_backend=self.backend,
            state_slots=state_slots,
            num_decodes=num_decodes,
        )
