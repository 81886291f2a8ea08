"""StreamingPrefill: feed a frozen Hugging Face decoder one chunk at a time under a carry policy.

Each :meth:`StreamingPrefill.step` is one ordinary forward of the model's own decoder. The only thing swapped in
for it is a transformers ``Cache`` (:class:`TwoStateCache`). The language model's attention implementation is
switched once per model (never per step, so streams and ordinary calls can share one model from several
threads) to the engine's function, registered through transformers' ``AttentionInterface`` as
``statekv+<original>``: inside a stream's call it computes the chunk's attention over ``[carried; chunk]`` and
lets the policy choose what to carry; any other call falls through to the model's original implementation
(``sdpa``, ``eager``...) with the original's mask. The vision tower of a VLM keeps its own attention.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import DynamicCache

from ...errors import ConfigurationError, HorizonError, InputError, OutputError, QuestionTooLong
from ...settings.values import check_int
from ...weak import weakly
from ..positions import rope as rotary
from ..answering.generation_args import answer_length, check_generation_arguments
from ..answering.answer_cache import Retrieval
from ..attention.scored import resolve_backend
from ..step.batching import StepRequest, device_step, not_taken, step_together
from ..cache import pool
from ..cache.step_runs import StepRuns
from ..cache.two_state import TwoStateCache
from ..step.compiled import compiled
from ..answering.decoding import Prompt, generate_from_cache
from ..answering.together import Asked, together_row
from ..disk.files import Journaled, read_file_set
from ..disk.resume import resume
from ..disk.tier import JOURNAL_STEP_BYTES, DiskTier
from ..step.graphs import StepGraphs
from ..storage.limits import CacheKeeper, check_limit
from ..storage.memory import CacheGeometry, check_cache_fits
from ..attention.switch import language_decoder, prepared_mask, share_language_attention, streaming_through
from ..cache.persistence import check_state_dict
from ..rules.base import CarryPolicy
from ..positions import layouts
from ..positions.placing import QuestionPlan, StreamPositions
from ..storage.tiers import StorageTier
from ..storage.quantized import scale_bytes_per_step, stored_bytes_per_token, summary_bytes_per_step
from ..positions.rope import FrozenRope, check_horizon, model_frequencies, trained_range
from ...settings.engine import EngineSettings
from .holding import counted_bytes, other_bytes
from .inputs import (check_device_present, check_embeds, check_plain_causal, check_positions, check_step_arguments,
                     check_supported)
from .stats import StepRecord, StreamStats, kept_fraction


HISTORY_STEPS = 1024  # step records `stats` keeps (the last ones): a stream that never ends keeps a bounded history


class StreamingPrefill:
    """Stream chunks through ``model`` under ``policy``, building a detailed cache of every token.

    Args:
        model: a transformers causal LM or decoder (Qwen2, Qwen3, Llama...) or a VLM whose language model is
            such a decoder. It is used as is: no weights or modules are replaced.
        policy: the carry rule (:class:`FullAttention`, :class:`Recency`, :class:`StateKV`, ...).
        settings: how the engine runs (:class:`~statekv.settings.engine.EngineSettings`: the attention backend,
            where the detailed cache lives and its cap, its dtype, CUDA graphs, positions); ``changes`` are
            settings to change in it by name (``StreamingPrefill(model, policy, offload=True)``).
        horizon: the most tokens the run will hold, question and answer included. It sizes the detailed
            buffers and fixes the RoPE rotation (required beyond the model's trained length for dynamic RoPE).
            Under ``positions="bounded"`` it is optional (None: the stream never ends).
        freeze_rope: keep True; False leaves dynamic RoPE recomputing per chunk (only to study why freezing is
            needed).
        track_overlap: record, per step, the fraction of the carried state that the step kept (reads the
            carried positions after every step: a host sync on a GPU; for analysis, not for speed).
        protect_tokens: leading tokens (the prompt prefix, sinks) a cache limit never evicts.
        name: how messages and the disk tier's folder name this stream.
        disk_tier: resume in this existing file set (:func:`statekv.core.disk.files.read_file_set`) instead of making
            a new one.

    What the settings mean here: ``offload`` keeps the detailed cache on another device (``True``: CPU memory),
    so accelerator memory stays constant as the stream grows (it is copied back for decoding); ``"disk"`` keeps
    it in an append-only, memory-mapped file set of its own under ``offload_dir`` (only the step summaries stay
    in RAM; see :mod:`statekv.core.disk.tier`). ``max_cache_bytes``/``cache_limit``: a hard cap on the detailed cache
    (:mod:`statekv.core.storage.limits`). ``kv_cache_dtype``: ``"int8"``/``"int4"`` store it quantized (keys per
    channel, values per token; :mod:`statekv.core.storage.quantized`); the carried state and each step's attention stay
    in the model's dtype. ``cuda_graph``: on CUDA, record the first steady step of each input shape as a CUDA
    graph and replay it for the following ones (:mod:`statekv.core.step.graphs`); results are those of the eager step.
    ``positions``: ``"stream"`` (a token's RoPE position is its index in the whole stream: exactly the model's
    one-shot forward, within the RoPE's range; the engine's default, None) or ``"bounded"`` (every position kept
    inside the range the model was trained on, so the stream needs no horizon; see
    :mod:`statekv.core.positions.placing`).
    """

    def __init__(self, model: torch.nn.Module, policy: CarryPolicy, settings: EngineSettings | None = None, *,
                 horizon: int | None = None, freeze_rope: bool = True, track_overlap: bool = False,
                 protect_tokens: int = 0, name: str = "stream", disk_tier: DiskTier | None = None, **changes: Any):
        if not isinstance(policy, CarryPolicy):
            raise ConfigurationError(f"policy must be a CarryPolicy (FullAttention, Recency, StateKV...), "
                                     f"got {type(policy).__name__}")
        settings = EngineSettings.of(settings, **changes)
        if settings.positions is None:  # the engine's default; the front door decides per stream (choose_positions)
            settings = settings.with_changes(positions="stream")
        self.settings = settings
        self.model = model
        self.policy = policy
        self.decoder = language_decoder(model)
        self.config = self.decoder.config
        check_supported(self.config)
        policy.check_layers(self.config.num_hidden_layers)
        share_language_attention(model)
        self.device = next(self.decoder.parameters()).device
        self.dtype = next(self.decoder.parameters()).dtype
        self.step_mask = prepared_mask(self.device)  # the 4D mask every step passes (see model_attention)
        self.attention = resolve_backend(settings.attention, self.device)  # used whenever the policy needs scores
        bounded = settings.positions == "bounded"
        self.horizon = (check_horizon(self.config, horizon) if not bounded else
                        None if horizon is None else check_int(horizon, "horizon (tokens)", error=HorizonError))
        kv_cache_dtype = settings.kv_cache_dtype
        self.geometry = cache_geometry(model)
        self.disk: DiskTier | None = None
        if settings.offload == "disk" or disk_tier is not None:
            layout = (settings.bounded_layout or layouts.DEFAULT_LAYOUT) if bounded else None
            self.disk = disk_tier or DiskTier.create(settings.offload_dir, name, {
                "geometry": self.geometry.to_dict(), "policy": repr(policy), "horizon": horizon,
                "kv_cache_dtype": kv_cache_dtype, "bounded_layout": layout})
            evicts = settings.cache_cap is not None and settings.cache_cap.evicts
            storage = weakly(self.disk, lambda disk, *args, **kwargs: disk.storage(*args, evicts=evicts, **kwargs))
            self.tier = StorageTier(torch.device("cpu"), kv_cache_dtype, storage)
        else:
            offload, limit = settings.offload, settings.cache_cap
            self.tier = StorageTier(torch.device("cpu" if offload is True else offload) if offload else None,
                                    kv_cache_dtype, evicts=limit is not None and limit.evicts)
            check_device_present(self.tier.device, "offload")
        cache_limit = settings.cache_cap
        check_limit(cache_limit, self.tier.device is not None, policy)
        self.bytes_per_token = math.ceil(self.geometry.layers * stored_bytes_per_token(
            self.geometry.kv_heads, self.geometry.head_dim, self.geometry.dtype, kv_cache_dtype,
            tokens_per_step=1 << 30))  # the detailed cache's bytes per token as stored (per-step scales aside)
        if horizon is not None and self.disk is None:  # the detailed buffers are sized for it up front
            tokens = horizon if cache_limit is None else min(horizon, cache_limit.max_bytes // self.bytes_per_token)
            check_cache_fits(self.geometry, tokens, self.tier.device or self.device, kv_cache_dtype)
        limit = trained_range(self.config)
        frozen_for = limit if bounded else self.horizon
        self.rope: FrozenRope | None = rotary.freeze_rope(self.decoder, frozen_for) if freeze_rope else None
        if bounded:
            rotary.settle_rotary(self.decoder)
        layout = settings.bounded_layout or layouts.DEFAULT_LAYOUT
        self.positions = StreamPositions(settings.positions, limit, layout,
                                         model_frequencies(self.decoder, self.rope) if bounded else None,
                                         settings.question_span)
        self.cache = TwoStateCache(self.config.num_hidden_layers, policy, self.attention, capacity_hint=horizon,
                                   tier=self.tier, positions=self.positions)
        self.protect_tokens = check_int(protect_tokens, "protect_tokens", minimum=0)
        geometry = self.geometry
        self.bytes_per_step = geometry.layers * (  # what each step adds besides its tokens: summaries, key scales
            summary_bytes_per_step(geometry.kv_heads, geometry.head_dim, geometry.dtype)
            + scale_bytes_per_step(geometry.kv_heads, geometry.head_dim, geometry.dtype, kv_cache_dtype))
        self.keeper = None if cache_limit is None else CacheKeeper(
            cache_limit, self.cache, self.bytes_per_token, self.protect_tokens, name, self.bytes_per_step,
            weakly(self, other_bytes, (0, 0)),
            JOURNAL_STEP_BYTES if self.disk is not None else 0)
        self.evictions: list[int] = []  # the steps evicted by make_room, in order, until the caller takes them
        # the attention tally of evict-least-attended is kept on the host, which a CUDA graph cannot replay
        tallying = cache_limit is not None and cache_limit.when_full == "evict-least-attended"
        self.cuda_graph = settings.cuda_graph and self.device.type == "cuda" and policy.capturable and not tallying
        self.graphs = StepGraphs(weakly(self, lambda engine, inputs: engine.device_step(inputs)),
                                 weakly(self, lambda engine: engine.cache.read_host_state, False))
        self.compiled_decoder = compiled(self.decoder) if settings.compile_step else None  # steady steps'
        self.track_overlap = track_overlap
        self.last_context: str | None = None  # what the last question read: "whole" (cache) or "retrieved"
        self.last_read_steps: tuple[int, ...] | None = None  # retrieved: the steps some layer read (else None)
        self.last_layer_steps: tuple[tuple[int, ...], ...] | None = None  # retrieved: each layer's chosen steps
        self.history: deque[StepRecord] = deque(maxlen=HISTORY_STEPS)  # the last steps only: flat memory
        self.closed = False
        self.stepping = threading.RLock()  # held while a step runs (`statekv.core.step.batching.stepping`)

    @property
    def seen_tokens(self) -> int:
        """Logical tokens consumed so far (the virtual sequence length)."""
        return self.cache.seen_tokens

    @property
    def detailed_cache(self) -> DynamicCache:
        """Every token's keys/values, in order, as a fresh ``DynamicCache`` of views (decoding never mutates it);
        copies on the model's device when the detailed cache is offloaded."""
        self.check_open()
        return self.cache.to_dynamic_cache(self.device if self.tier.device is not None else None)

    def carried_positions(self, layer: int) -> torch.Tensor:
        """Logical positions carried by ``layer`` into the next step, LongTensor ``[B, H_kv, K]``."""
        return self._stepped_layer(layer).positions()

    def carried(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values carried by ``layer`` into the next step, ``[B, H_kv, K, D]`` each, in time order."""
        return self._stepped_layer(layer).carried()

    def _stepped_layer(self, layer: int):
        """Layer ``layer`` of the cache, once a step has written it; a one-line `InputError` otherwise."""
        self.check_open()
        layers = self.cache.layers
        if isinstance(layer, bool) or not isinstance(layer, int) or not -len(layers) <= layer < len(layers):
            raise InputError(f"layer must be an index of the model's {len(layers)} layers, got {layer!r}")
        if not self.cache.chunk_lengths:
            raise InputError("the stream has taken no step yet: it carries nothing")
        return layers[layer]

    @property
    def stats(self) -> StreamStats:
        """What the stream holds now and what its steps cost (host bookkeeping: never waits for the device)."""
        layers = self.cache.layers
        detailed = sum(layer.storage.nbytes for layer in layers)
        summaries = sum(layer.storage.summary_nbytes for layer in layers)
        journal = 0 if self.disk is None else self.disk.nbytes
        return StreamStats(
            steps=len(self.cache.chunk_lengths), tokens=self.seen_tokens,
            carried_tokens=tuple(layer.carried_length for layer in layers),
            detailed_bytes=detailed, summary_bytes=summaries,
            scale_bytes=sum(layer.storage.scale_nbytes for layer in layers), journal_bytes=journal,
            held_bytes=counted_bytes(self) if self.keeper is None or self.closed else self.keeper.held_bytes,
            device_bytes=self.cache.device_bytes(),
            peak_device_bytes=self.cache.peak_device_bytes, graph_replays=self.graphs.replays,
            history=tuple(self.history), evicted_steps=len(self.cache.evicted_steps),
            evicted_tokens=self.keeper.evicted_tokens if self.keeper is not None else self.cache.evicted_tokens(),
            forms=tuple(layer.form for layer in layers))

    def state_dict(self, *, as_runs: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
        """Everything a resumed stream needs: tensors and metadata (`TwoStateCache.state_dict`), settled first."""
        self.check_open()
        if not self.cache.chunk_lengths:
            raise InputError("the stream has taken no step yet: there is no state to save")
        if self.keeper is not None:
            self.keeper.settle()
        return self.cache.state_dict(as_runs=as_runs)

    def load_state_dict(self, tensors: dict[str, torch.Tensor], metadata: dict) -> None:
        """Resume from :meth:`state_dict`'s output (carried tensors go to the model's device); a state this model
        could not have written is refused with an `InputError` before anything changes."""
        self.check_open()
        check_state_dict(tensors, metadata, self.geometry, self.settings.kv_cache_dtype)
        self.cache.positions.check_mode(metadata.get("positions"))
        if self.horizon is not None and metadata["seen_tokens"] > self.horizon:
            raise InputError(f"the state holds {metadata['seen_tokens']} tokens, past this stream's horizon of "
                             f"{self.horizon}; load it into a stream with a longer horizon")
        self.cache.load_state_dict(tensors, metadata, self.device)
        if self.keeper is not None:
            self.keeper.adopt()

    @property
    def evicted_steps(self) -> StepRuns:
        """A copy of the steps given up under a cache limit (answers read nothing of them)."""
        return self.cache.evicted_steps.copy()

    def resume(self, journal: Journaled, *, just_written: bool = False) -> None:
        """Resume from this stream's disk tier (made with ``disk_tier=``) at the last checkpoint its ``journal``
        (:func:`statekv.core.disk.files.read_file_set`) vouches for, every step's checksum verified first; what the
        journal holds after it is dropped (the evictions recorded after it kept). ``just_written``: a file set this
        process has just written, synced and checkpointed at its last step (a handover's): not verified again, and
        the records after its checkpoint are kept."""
        resume(self.disk, journal, self.cache, self.device, verify=not just_written, keep_after=just_written)
        if self.keeper is not None:
            self.keeper.adopt()

    def commit_durably(self, chunk_len: int, durable_record: dict, ends_vision_call: bool = True,
                       evicted: bool = False) -> None:
        """On the disk tier, the host end of a step: its data appended and journaled (see `DiskTier.commit_step`).
        If the tier cannot write it (a full disk, a folder made read-only; or anything else raising in the middle,
        a `MemoryError`), the step is not taken: the stream is restored as its journal's last step left it (before
        this step; ``evicted``: frames it evicted stay so), and an error other than the disk's is raised as itself."""
        try:
            self.cache.commit_host()
            if self.positions.bounded:  # where the step was placed: resuming needs it
                at = self.positions
                durable_record = {**durable_record, "placed": [at.firsts[-1], at.spans[-1], at.bases[-1]]}
            self.disk.commit_step(self.cache.step_index - 1, chunk_len, self.cache, durable_record,
                                  ends_vision_call=ends_vision_call)
        except BaseException as raised:
            folder = self.disk.folder
            error = raised if isinstance(raised, OutputError) else f"{type(raised).__name__}: {raised}"
            if self.disk.lost:  # what the folder's path names is not this stream's: nothing is read back from it
                self.close()
                raise OutputError(f"{error}; the stream was closed (its files are where the folder was moved)") \
                    from None
            try:
                journal = read_file_set(folder, latest=True)
                if journal.steps:  # the carried state its last step left is kept in memory (checkpoints are rarer)
                    resume(self.disk, journal, self.cache, self.device, verify=False, carried=self.disk.remembered)
            except Exception as failure:  # the files cannot even be read back
                self.close()
                reason = (str(failure).strip() or type(failure).__name__).splitlines()[0]
                raise OutputError(f"{error}; the stream could not be restored ({reason}) and was closed; "
                                  f"Stream.load({str(folder)!r}) resumes it at its last durable step") from None
            if not journal.steps:  # its first step: there is no earlier state to go back to
                self.close()
                raise OutputError(f"{error}; this was the stream's first step, so nothing of it is kept: it was "
                                  "closed; make it again") from None
            if self.keeper is not None:
                self.keeper.adopt()
            if not isinstance(raised, OutputError):
                raise
            raise not_taken(raised, self, evicted) from None

    def journal_loaded(self, step_frames: list[int], record: dict) -> None:
        """On the disk tier, journal every step of the state just loaded (:meth:`load_state_dict`), so the file
        set can itself be resumed: ``step_frames`` the frames of each step, ``record`` what the last step's
        record adds (see ``durable_record``)."""
        if self.disk is not None:
            self.disk.journal_loaded(self.cache, step_frames, record, self.positions.export(as_runs=True).get("steps"))

    def sync(self) -> None:
        """Force the disk tier's files to the storage device (nothing to do for the other tiers)."""
        if self.disk is not None:
            self.disk.sync()

    @torch.no_grad()
    def step(self, inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
             input_ids: torch.Tensor | None = None, durable_record: dict | None = None,
             **forward_kwargs) -> torch.Tensor:
        """Run one chunk; return its last hidden states ``[B, T, D]``.

        Args:
            inputs_embeds: ``[B, T, D]`` chunk embeddings (or pass ``input_ids`` ``[B, T]`` for text).
            position_ids: RoPE positions; default ``arange(seen_tokens, seen_tokens + T)`` as ``[B, T]``.
                Pass them explicitly for M-RoPE (``[3 or 4, B, T]``); under ``stream`` positions, below the horizon.
            durable_record: JSON-able fields the disk tier journals with this step (what a caller needs to
                resume after it, e.g. a stream's layout state).
            forward_kwargs: passed to the decoder's forward unchanged (e.g. DeepStack inputs). An
                ``attention_mask`` is accepted only if it is all ones (plain causal attention).

        Under a cache limit, a step that would pass it first evicts (``evict-*``) or is refused with a one-line
        `CacheLimitError`, the stream unchanged (``refuse``). The step is a batcher's step of one request
        (:func:`statekv.core.step.batching.step_together`): the code that runs several streams' steps together.
        """
        outcome = step_together([StepRequest(self, inputs_embeds, position_ids, input_ids, forward_kwargs,
                                             durable_record)])[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def checked_inputs(self, inputs_embeds: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, *,
                       input_ids: torch.Tensor | None = None, **forward_kwargs) -> dict:
        """The decoder's inputs for one step as :meth:`step` takes them, validated (one-line `StateKVError` s),
        without running anything (`statekv.core.step.batching.begin_step` checks every step first)."""
        chunk = self._check_chunk(inputs_embeds, input_ids)
        check_step_arguments(forward_kwargs)
        check_positions(position_ids, chunk, self.device, None if self.positions.bounded else self.horizon)
        check_plain_causal(forward_kwargs.pop("attention_mask", None))
        chunk_len = chunk.shape[1]
        if self.horizon is not None and self.seen_tokens + chunk_len > self.horizon:
            raise HorizonError(
                f"this chunk would bring the stream to {self.seen_tokens + chunk_len} tokens, beyond the declared "
                f"horizon of {self.horizon}; declare a longer horizon when creating the stream"
            )
        return dict(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, **forward_kwargs)

    def make_room(self, chunk_len: int, batch: int) -> None:
        """Under a cache limit, room for a chunk of ``chunk_len`` tokens (``batch`` rows): the frames evicted now
        (``evict-*``), or a one-line `CacheLimitError` with the stream unchanged (``refuse``). Before the step
        begins."""
        if self.keeper is None:
            return
        evicting = self.keeper.make_room(chunk_len, batch)
        if evicting:
            if self.disk is not None:  # journaled first: a kill while punching leaves them evicted, not damaged
                self.disk.append({"evict": evicting})
            self.keeper.evict(evicting)
            self.evictions.extend(evicting)

    def finish_step(self, chunk_len: int, started: float, carried_before: list[torch.Tensor] | None = None,
                    durable_record: dict | None = None, ends_vision_call: bool = True, evicted: bool = False) -> None:
        """Host end of a step whose device part succeeded: commit its lengths (journaled with
        ``durable_record`` on the disk tier) and record it; ``evicted``: frames were evicted to make room for it."""
        if self.disk is None:
            self.cache.commit_host()
        else:
            self.commit_durably(chunk_len, durable_record or {}, ends_vision_call, evicted)
        overlap = None if carried_before is None else kept_fraction(carried_before, self.positions_snapshot())
        self.history.append(StepRecord(chunk_len, time.perf_counter() - started,
                                        max(layer.carried_length for layer in self.cache.layers), overlap))

    def generate(self, prompt: torch.Tensor | Prompt, *, retrieve: Retrieval | None = None,
                 **generate_kwargs) -> torch.Tensor:
        """Decode after ``prompt`` from the detailed cache, or from the steps ``retrieve`` picks per layer.

        prompt: the ids ``[B, Q]`` that follow the streamed context (positions continue from its length), or a
            `Prompt` as a model family's adapter lays it out (its own positions, the module that decodes, the
            stream length it follows). generate_kwargs: transformers ``generate`` settings (``max_new_tokens``,
            sampling...), checked first; a combination ``generate`` refuses is a one-line `InputError`.

        Returns only the new tokens ``[B, N]``. The stream is not changed: ask again, or keep streaming.
        """
        prompt, retrieve, plan = self.check_question(prompt, retrieve, generate_kwargs)
        positions = {} if prompt.position_ids is None else {"position_ids": prompt.position_ids}
        kept = [(owner, name, getattr(owner, name)) for owner, name in prompt.restores]
        try:
            return generate_from_cache(self, prompt.input_ids, model=prompt.model, retrieve=retrieve,
                                       plan=plan, **generate_kwargs, **positions)
        except (ValueError, TypeError) as error:
            if not generate_kwargs or isinstance(error, InputError):
                raise
            # transformers refuses a combination the checks do not know (e.g. a flag needing another)
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InputError(f"ask(): generate refused {', '.join(generate_kwargs)}: {first}") from None
        finally:
            for owner, name, value in kept:
                setattr(owner, name, value)

    def question(self, prompt: Prompt, *, retrieve: Retrieval | None = None, **generate_kwargs) -> Asked | None:
        """``prompt`` checked as `generate` checks it, as a row of questions answered together
        (`statekv.core.answering.together.answer_together`), or None when it must be answered alone by `generate`
        (sampling, a logits processor, a batch of prompts: `together.together_row`)."""
        prompt, retrieve, plan = self.check_question(prompt, retrieve, generate_kwargs)
        return together_row(self, prompt, retrieve, plan, generate_kwargs)

    def check_question(self, prompt: torch.Tensor | Prompt, retrieve: Retrieval | None, generate_kwargs: dict
                       ) -> tuple[Prompt, Retrieval | None, QuestionPlan | None]:
        """`generate`'s checks of a question: ``(prompt, retrieve, plan)``, the prompt as a `Prompt`, the retrieval
        it reads by (under bounded positions, what the range allows when the whole cache does not fit) and its
        `QuestionPlan` (`fit_question`)."""
        self.check_open()
        if not isinstance(prompt, Prompt):
            if not isinstance(prompt, torch.Tensor):
                raise InputError(f"input_ids (the prompt) must be a tensor, got {type(prompt).__name__}")
            prompt = Prompt(prompt)
        if prompt.follows is not None and self.seen_tokens != prompt.follows:
            raise InputError(f"the stream holds {self.seen_tokens} tokens but the layout state {prompt.follows}; "
                             "pass the state of the video that was streamed")
        if prompt.position_ids is not None and "position_ids" in generate_kwargs:
            raise InputError("position_ids are set by the adapter (M-RoPE continues from the streamed video)")
        if prompt.input_ids.dim() == 2:
            self.check_ids(prompt.input_ids, "input_ids (the prompt)")
            streamed = self.cache.layers[0].storage.batch_heads
            if streamed is not None and prompt.input_ids.shape[0] != streamed[0]:
                raise InputError(f"the prompt has batch size {prompt.input_ids.shape[0]}, but the stream has "
                                 f"{streamed[0]}")
        model = self.model if prompt.model is None else prompt.model
        check_generation_arguments(generate_kwargs, getattr(model, "generation_config", None))
        plan = None
        if prompt.input_ids.dim() == 2:
            prompt_tokens = prompt.input_ids.shape[1]
            answer = answer_length(generate_kwargs, prompt_tokens, getattr(model, "generation_config", None))
            plan = self.fit_question(prompt_tokens, answer, retrieve)
            if plan is not None and not plan.whole and retrieve is None:
                retrieve = Retrieval(plan.retrieve, keep_tokens=self.protect_tokens)
        self.last_context = "whole" if retrieve is None else "retrieved"
        return prompt, retrieve, plan

    def fit_question(self, prompt_tokens: int, answer_tokens: int,
                     retrieve: Retrieval | None = None) -> QuestionPlan | None:
        """Whether a question of ``prompt_tokens`` and its answer of up to ``answer_tokens`` fit this stream, and how
        they read it: the one check every question takes (`generate`, `EncodedVideo.ask`, the service). Under
        ``stream`` positions None once they fit in the room left before the horizon (else a one-line
        `QuestionTooLong`); under ``bounded`` positions their `QuestionPlan` (:meth:`question_plan`)."""
        if self.positions.bounded:
            return self.question_plan(prompt_tokens + answer_tokens, retrieve)
        room = None if self.horizon is None else self.horizon - self.seen_tokens
        if room is not None and prompt_tokens + answer_tokens > room:
            raise QuestionTooLong(prompt_tokens, answer_tokens, room)
        return None

    def steps_kept_whole(self, keep_tokens: int) -> int:
        """How many of the first steps a question keeps at their own positions: those that begin within the first
        ``keep_tokens`` tokens (the prompt prefix and sinks)."""
        steps, start = 0, 0
        for length in self.cache.chunk_lengths:
            if start >= keep_tokens:
                break
            steps, start = steps + 1, start + length
        return steps

    def question_plan(self, room: int, retrieve: Retrieval | None = None) -> QuestionPlan | None:
        """Under bounded positions, how a question whose prompt and answer take ``room`` tokens reads the stream:
        the whole detailed cache when it fits in the model's range (and ``retrieve`` is None), else retrieved
        steps (``retrieve``'s, or as many as fit); a one-line `HorizonError` when nothing fits. None under
        ``stream`` positions (the context is the whole cache, or what ``retrieve`` picks)."""
        if not self.positions.bounded:
            return None
        keep_steps = self.steps_kept_whole(self.protect_tokens if retrieve is None else retrieve.keep_tokens)
        held = None
        if retrieve is not None:  # the steps it chooses among: those after the ones it keeps whole
            first, end = 0, 0
            for length in self.cache.chunk_lengths:
                if end + length > retrieve.keep_tokens:
                    break
                first, end = first + 1, end + length
            held = len(self.cache.chunk_lengths) - first - self.cache.evicted_steps.count_from(first)
        plan = self.positions.question(self.positions.held_span(self.cache.evicted_steps),
                                       self.positions.keep_end(keep_steps), room,
                                       None if retrieve is None else retrieve.steps, held)
        return QuestionPlan(plan.whole, plan.start, plan.retrieve, keep_steps, plan.packed)

    @property
    def peak_device_bytes(self) -> int:
        """The most bytes of cache (carried state, the detailed cache unless offloaded, what answering brought)
        this stream held on the model's device at once."""
        return self.cache.peak_device_bytes

    def close(self) -> None:
        """Release the stream's recorded graphs and its cache's keys and values; it can no longer step or decode
        (the model was never changed by it, beyond the attention switched once per model)."""
        self.closed = True
        self.rope = None
        self.graphs.clear()
        pool.release(self.cache)  # its seat in its model's pool, if it took one (`statekv.core.cache.pool`)
        try:
            if self.disk is not None:
                self.disk.close()  # the files stay: Stream.load resumes from them
        finally:
            self.cache.release()

    def __enter__(self) -> "StreamingPrefill":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def device_step(self, inputs: dict) -> torch.Tensor:
        """The device part of one of this stream's steps, begun (what its CUDA graphs record): positions, the
        decoder's forward, the new carried state (:func:`statekv.core.step.batching.device_step` with one row)."""
        return device_step([self], self.cache, inputs)

    def positions_snapshot(self) -> list[torch.Tensor]:
        """A copy of every layer's carried positions (what ``track_overlap`` compares a step against)."""
        return [layer.positions().clone() for layer in self.cache.layers]

    def check_ids(self, input_ids: torch.Tensor, name: str) -> None:
        """Token ids ``[B, T]``: integers within the vocabulary (reading them: a host sync)."""
        if input_ids.dim() != 2:
            raise InputError(f"{name} must be [B, T], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.long, torch.int32):
            raise InputError(f"{name} must be integer token ids, got {input_ids.dtype}")
        vocab = self.config.vocab_size
        if input_ids.numel() and not bool(((input_ids >= 0) & (input_ids < vocab)).all()):
            raise InputError(f"{name} hold token ids outside the vocabulary [0, {vocab})")

    def check_open(self) -> None:
        """A one-line `InputError` once the stream is closed."""
        if self.closed:
            raise InputError("this stream was closed (its RoPE rotation given back to the model); it can no "
                             "longer step or decode")

    def _check_chunk(self, inputs_embeds, input_ids) -> torch.Tensor:
        """The chunk's ``inputs_embeds [B, T, D]`` or ``input_ids [B, T]``, validated."""
        self.check_open()
        if (inputs_embeds is None) == (input_ids is None):
            raise InputError("pass exactly one of inputs_embeds [B, T, D] or input_ids [B, T]")
        chunk = inputs_embeds if inputs_embeds is not None else input_ids
        name = "inputs_embeds" if inputs_embeds is not None else "input_ids"
        if not isinstance(chunk, torch.Tensor):
            raise InputError(f"{name} must be a tensor, got {type(chunk).__name__}")
        if inputs_embeds is not None:
            check_embeds(inputs_embeds, self.config.hidden_size, self.dtype)
        else:
            self.check_ids(input_ids, "input_ids")
        if chunk.device != self.device:
            raise InputError(f"{name} is on {chunk.device}, but the model is on {self.device}")
        if chunk.shape[1] == 0:
            raise InputError("empty chunk: a step needs at least one token")
        if chunk.shape[0] == 0:
            raise InputError(f"{name} has batch size 0: a step needs at least one row")
        streamed = self.cache.layers[0].storage.batch_heads
        if streamed is not None and chunk.shape[0] != streamed[0]:
            raise InputError(f"chunk has batch size {chunk.shape[0]}, but the stream has {streamed[0]}")
        return chunk

    @contextmanager
    def probing(self, probe: Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], None]):
        """In the block every step calls ``probe(step, layer, queries [B, Hq, T, D], keys, values [B, H_kv, K + T, D])``
        at each layer (``step``: the stream's step index) with what it attends over: the K carried as the step placed
        them, then the chunk's. They are the stream's buffers, valid during the call: clone what you keep, change
        nothing. A step failing after it was shown is shown again if retried. A probed step runs alone, eagerly, on the
        stepping thread: a CUDA graph, compiled step or second probe is refused; a handover's successor isn't probed."""
        if self.cuda_graph or self.compiled_decoder is not None:
            raise ConfigurationError("a probed stream must step eagerly: turn off cuda_graph and compile_step")
        if self.cache.probe is not None:
            raise ConfigurationError("this stream is already probed")
        self.cache.probe = probe
        try:
            yield
        finally:
            self.cache.probe = None

    @contextmanager
    def streaming(self, cache):
        """Calls of the model made in this thread inside the block attend through ``cache`` (this stream's
        `TwoStateCache` while stepping, an `AnswerCache` while answering) and rotate with this stream's RoPE.
        Nothing of the model is changed: other threads' calls are unaffected."""
        with streaming_through(cache), self.rope.active() if self.rope is not None else nullcontext():
            yield


def cache_geometry(model: torch.nn.Module) -> CacheGeometry:
    """What one token costs in the cache of ``model``'s language decoder (layers, KV heads, head dim, dtype)."""
    decoder = language_decoder(model)
    return CacheGeometry.of(decoder.config, next(decoder.parameters()).dtype)
