"""The streams a server holds, who owns each, what each is doing, and keeping them on disk (`store.StreamFiles`).

`StreamRegistry` is the one stream service behind the routes, the OpenAI route and the page: creating, finding (per
owner), pushing, feeding files (its ``feeds``, `feeding.FileFeeds`), asking, saving, deleting and listing streams.
Where its streams are held is its `Placement` (this process alone, or a replica of several under leases); the
registry's work is the same under either.

A stream is saved once it holds ``save_every_frames`` unsaved frames (before its next push, so a save that fails
refuses that push and changes nothing), after ``save_every_seconds`` with unsaved frames, when a file source has
been fed in full, and on shutdown. A restarted server loads every stream back; one whose record, save or disk-tier
file set cannot be loaded is quarantined (`DamagedStream`: listed as damaged, never served, its files kept) and the
others are served. Why is noted in the state folder's ``quarantine/`` (`store.StreamFiles.write_note`), so every
server sharing the folder lists it; a disk-tier file set that cannot be resumed is moved there whole, and its
stream stays quarantined until it is deleted (DELETE removes the moved files too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import OtherSetupError, OutputError, StateKVError
from .answer_notes import answer_note
from .answering import ClientLeft, ServerStopped, StreamDeleted, answer_arguments, check_answer, prompt_tokens
from .config import ServeConfig
from .creations import CreationNotes, end_creation
from .entries import ANSWERS, DamagedStream, StreamEntry, failure_reason, remove_tier
from .errors import ServiceError, reason_of
from .feeding import FileFeeds
from .bringing_back import BROUGHT_BACK, closed_by_handover, to_bring_back, unforced
from .healing import StreamHealer, check_has_frames, check_here, unforced_at_stop
from .loading import StreamLoader, unreadable
from .metrics import Metrics
from .page_record import HISTORY
from .placement import Placement
from .store import STREAM_ID, StreamFiles, remove_folder
from .stream_settings import StreamSettings, shown
from .tier_saves import drop_whole_save, not_written, save_stream, saved_in_tier, tier_in_place, tier_kept
from .worker import ModelExecutor

log = logging.getLogger("statekv.serve")


class StreamRegistry:
    """Every stream of one server: creating, finding (per owner), pushing, feeding files, asking, saving and
    bringing back. Model work goes through ``worker``; files through ``files`` (`StreamFiles`); where the streams
    are held is ``placement`` (default: this process alone, `Placement`)."""

    def __init__(self, config: ServeConfig, qa: Any, worker: ModelExecutor, metrics: Metrics | None = None,
                 files: StreamFiles | None = None, placement: Placement | None = None):
        self.config, self.qa, self.worker, self.metrics = config, qa, worker, metrics
        self.files = files or StreamFiles(config.state_dir)
        self.placement = placement or Placement()
        self.settings = StreamSettings(config, qa)
        self.loader = StreamLoader(self.files, self.settings, self.placement.resume_tiers)
        self.entries: dict[str, StreamEntry] = {}
        self.damaged: dict[str, DamagedStream] = {}  # quarantined: listed, never served
        self.arriving = 0  # streams being made or taken here (counted against max_streams before they finish)
        self.feeds = FileFeeds(self)  # video files being fed into streams
        self.answers_stopping = threading.Event()  # the server can wait for answers no longer (`stop_answers`)
        self.watch_listener = None  # (stream id) -> what its watches report each evaluation to (`serve.watches`)
        self.end_watch_feeds = None  # (stream id, why) -> ends its clients' feeds of watch events (`WatchHub.end`)
        self.healer = StreamHealer(self)  # streams a stopped handover closed, brought back (`heal`)
        kept_in = (str(Path(config.state_dir).resolve()) if config.state_dir is not None
                   else f"store {getattr(getattr(self.files, 'store', None), 'url', '')}")
        self.creations = CreationNotes(kept_in, self.record_of)  # disk-tier creations a kill cut short

    # -- lookup --------------------------------------------------------------------------------------------
    def get(self, owner: str, stream_id: str) -> StreamEntry:
        """The caller's stream; 404 for an unknown id and for another key's (which must not be told apart)."""
        entry = self.entries.get(stream_id) if isinstance(stream_id, str) and STREAM_ID.match(stream_id) else None
        if entry is None and isinstance(stream_id, str):
            self.check_damaged(owner, stream_id)
        if entry is None or entry.owner != owner or entry.deleted:
            raise ServiceError(404, f"no stream {shown(str(stream_id)[:80])}")
        return entry

    def check_damaged(self, owner: str, stream_id: str) -> None:
        """Refuse (409, one line) work on a quarantined stream the caller may see."""
        damaged = self.damaged.get(stream_id)
        if damaged is not None and damaged.sound and damaged.owner in (owner, None):
            raise ServiceError(409, f"stream {stream_id} is not served by this start ({damaged.reason}); its files are "
                               "sound and kept where they are: start the server with the model and settings it was "
                               "saved with (deleting the stream deletes its files)")
        if damaged is not None and damaged.owner in (owner, None):
            raise ServiceError(409, f"stream {stream_id} is damaged ({damaged.reason}); it is not served and its "
                               f"files are kept in {self.files.where}: {self.placement.repair}, or delete the stream")

    async def remove_damaged(self, owner: str, stream_id: str) -> bool:
        """Delete a quarantined stream of the caller's (its files too, those moved into the quarantine included:
        its owner asked); False when there is none. One whose record names no owner stays (409): nobody can be
        told apart as its owner."""
        if not isinstance(stream_id, str) or stream_id in self.entries:
            return False
        await self.placement.look_for_damage(self, stream_id)
        damaged = self.damaged.get(stream_id)
        if damaged is None or damaged.owner not in (owner, None):
            return False
        if damaged.owner is None:
            files = ", ".join(self.files.files_of(stream_id))
            raise ServiceError(409, f"stream {stream_id} is damaged and its record names no owner that can be read; "
                               f"remove its files from {self.files.where} by hand: {files}")
        engine = self.settings.qa.engine
        reached = engine.offload_dir if engine.offload == "disk" and self.placement.resume_tiers else None
        tier, found = await asyncio.to_thread(lambda: tier_kept(self.record_of(stream_id), stream_id, self.files,
                                                                reached))
        if tier and found is None:
            raise ServiceError(409, f"stream {stream_id}'s frames are kept in its disk-tier file set {tier}, which "
                               "this server does not reach; nothing was deleted: delete it from one server started "
                               "alone with --offload disk and the --offload-dir it was served with")
        in_place = await asyncio.to_thread(tier_in_place, self.record_of(stream_id), stream_id, self.files, reached)
        await self.placement.remove_files(self, stream_id, in_place)  # whole, or refused (409, 503), nothing removed
        self.damaged.pop(stream_id, None)
        if tier and not found:  # lost with its disk, or in another folder
            log.warning("stream %s is deleted, but its disk-tier file set %s was not in --offload-dir %s: if it is "
                        "elsewhere, remove it by hand", stream_id, tier, engine.offload_dir)
        return True

    async def find(self, owner: str, stream_id: str, *, heal: bool = True) -> StreamEntry:
        """The caller's stream, as `get`, brought here first by the placement (from another replica), and back
        from its folder if a stopped handover closed it (`heal`; not for a deletion)."""
        await self.placement.bring(self, owner, stream_id)
        entry = self.get(owner, stream_id)
        self.placement.check(entry)
        entry.used = time.monotonic()
        if heal:
            await self.heal(entry)
        return entry

    async def remove(self, owner: str, stream_id: str) -> None:
        """Delete the caller's stream (``DELETE``): a damaged one, or one found damaged as it is brought here."""
        if await self.remove_damaged(owner, stream_id):
            return
        try:
            entry = await self.find(owner, stream_id, heal=False)  # a stream that cannot be brought back goes too
        except ServiceError as error:
            if error.status == 409 and await self.remove_damaged(owner, stream_id):
                return
            raise
        await self.delete(entry)

    def owned(self, owner: str) -> list[Any]:
        """The owner's streams as the placement lists them (alone: `held`; a replica adds those held elsewhere)."""
        return self.placement.listed(self, owner)

    def held(self, owner: str) -> list[Any]:
        """The owner's streams held here, newest first, then its damaged ones."""
        entries = [entry for entry in self.entries.values() if entry.owner == owner and not entry.deleted]
        return sorted(entries, key=lambda entry: entry.created, reverse=True) + [
            damaged for damaged in self.damaged.values() if damaged.owner in (owner, None)]

    def cache_bytes(self) -> int:
        return sum(entry.stream.stats.cache_bytes for entry in list(self.entries.values()))

    # -- creating and deleting -----------------------------------------------------------------------------
    async def create(self, owner: str, body: dict[str, Any]) -> StreamEntry:
        settings, horizon, max_fps, name = self.settings.check(body)
        # counted before the first await: creations arriving together cannot all pass the check
        if len(self.entries) + self.arriving >= self.config.max_streams:
            raise ServiceError(429, f"the server holds its limit of {self.config.max_streams} streams; delete one "
                               "or retry later", headers={"Retry-After": "30"})
        self.arriving += 1
        try:
            entry = await self._create(owner, settings, horizon, max_fps, name)
            self.entries[entry.id] = entry
        finally:
            self.arriving -= 1
            self.let_go_unused_models()  # also the model of a creation that failed
        return entry

    async def _create(self, owner: str, settings: dict[str, Any], horizon: int | None, max_fps: float | None,
                      name: str) -> StreamEntry:
        stream_id = f"st_{secrets.token_hex(12)}"
        qa = self.settings.qa_for(settings)
        # a note beside its file set until its record is written: a kill in between leaves no file set for good
        note = await self.creations.begin(stream_id, qa.engine)
        try:
            stream = await self.worker.run(qa.stream, horizon, max_fps=max_fps, name=name, stream_id=stream_id,
                                           owner=owner)
        except StateKVError:  # nothing made: the stream's own failure let its file set go
            await asyncio.to_thread(end_creation, note)
            raise
        entry = StreamEntry(stream_id, owner, settings, horizon, max_fps, name, time.time(), stream,
                            replica=self.placement.replica)
        try:
            self.files.claim(stream_id)
            entry.write_record(self.files)  # the creation is durable before it is answered
        except (OSError, StateKVError) as error:
            await self.worker.run(stream.close)
            remove_tier(entry)
            await asyncio.to_thread(self.files.withdraw, stream_id)
            if entry.tier is None or not entry.tier.exists():
                await asyncio.to_thread(end_creation, note)
            if isinstance(error, StateKVError):
                raise
            raise ServiceError(503, f"cannot record the stream in {self.files.where} "
                               f"({error.strerror or error}); no stream was made") from None
        await asyncio.to_thread(end_creation, note)
        return entry

    def record_of(self, stream_id: str) -> dict[str, Any] | Exception | None:
        """The stream's record; None when it has none; the error when it cannot be read (damaged, or a folder or store
        that cannot answer now)."""
        try:
            return self.files.record_or_error(stream_id)
        except FileNotFoundError:
            return None
        except Exception as error:  # noqa: BLE001 -- told apart from no record: nothing is removed for it
            return error

    async def delete(self, entry: Any) -> None:
        """Delete a stream as listed (`owned`): one held here, or one damaged or held elsewhere (by its id)."""
        if not isinstance(entry, StreamEntry):
            await self.remove(entry.owner or "", entry.id)
            return
        async with entry.removal:  # a second deletion waits for the first, then finds the stream gone (404)
            check_here(entry)
            await self._delete(entry)

    async def _delete(self, entry: StreamEntry) -> None:
        await self.begin_removal(entry.id, entry.tier)  # refused (503) with nothing changed, or the stream is gone
        await asyncio.to_thread(entry.retire, deleted=True)  # from here on `get` answers 404
        if self.end_watch_feeds is not None:
            self.end_watch_feeds(entry.id, f"stream {entry.id} was deleted")
        async with entry.lock:
            try:
                try:
                    await self.worker.run(entry.stream.close)
                except (OSError, StateKVError) as error:  # what it would have kept is being deleted anyway
                    log.warning("stream %s did not close cleanly (%s); its files are removed all the same",
                                entry.id, error)
                if entry.tier is not None:
                    remove_folder(entry.tier)  # whole, or its deletion note stays for the next start
                self.files.remove(entry.id)  # the save, the record, the note last
            except OSError as error:  # begun: never served again, and finished at the next start
                log.error("stream %s is deleted, but not all its files could be removed (%s); the rest are removed "
                          "at the next start", entry.id, error)
            finally:
                self.entries.pop(entry.id, None)
                self.placement.forget(entry.id)
                self.healer.unhealed.pop(entry.id, None)
                self.let_go_unused_models()

    async def begin_removal(self, stream_id: str, tier: Path | None) -> None:
        """Mark the stream as being deleted where its files are (`StreamFiles.begin_removal`); a one-line 503 when
        that cannot be written, and then nothing is changed."""
        try:
            await asyncio.to_thread(self.files.begin_removal, stream_id, tier)
        except OSError as error:
            why = error.strerror or type(error).__name__
            raise ServiceError(503, f"cannot delete stream {stream_id}: {self.files.where} cannot be changed ({why}); "
                               "nothing was deleted and the stream is as it was: retry once it can be written",
                               headers={"Retry-After": "5"}) from None

    def dismiss(self, entry: StreamEntry) -> None:
        """Forget why the stream's last feed failed (the page's "dismiss")."""
        if entry.feed is not None and not entry.feed.running:
            entry.feed = None

    # -- pushing -------------------------------------------------------------------------------------------
    async def push(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        """Push one frame. Pushes to several streams that wait together step together (`ModelWorker.push`); a
        stream's pushes are queued in order without waiting for each other (`ModelWorker.queue_push`), so a stream
        that fell behind has a push in every drain."""
        self.placement.admit_push(entry)
        if entry.feeding:
            raise ServiceError(409, f"stream {entry.id} is being fed {entry.feed.source}; push after it is done")
        queue = getattr(self.worker, "queue_push", None)
        if queue is None:
            async with entry.lock:
                return await self.push_held(entry, image, seconds)
        async with entry.lock:  # in order, behind a feed, hand-over or deletion under way
            stream = entry.stream
            answer = queue(stream, image, seconds, before=lambda: self._before_push(entry, stream),
                           after=lambda frames, kept: self._after_push(entry, image, seconds, frames, kept))
            entry.pushing += 1
        try:
            return await self.healer.stopped_handover(entry, answer)
        finally:
            entry.pushing -= 1

    async def push_held(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        batched, stream = getattr(self.worker, "push", None), entry.stream
        if batched is None:
            return await self.healer.stopped_handover(entry, self.worker.run(self.push_now, entry, image, seconds))
        return await self.healer.stopped_handover(entry, batched(
            stream, image, seconds, before=lambda: self._before_push(entry, stream),
            after=lambda frames, kept: self._after_push(entry, image, seconds, frames, kept)))

    def push_now(self, entry: StreamEntry, image: Any, seconds: float | None) -> bool:
        """Push one frame (on the model's thread), first saving the stream when enough frames are unsaved."""
        frames = self._before_push(entry, entry.stream)
        return self._after_push(entry, image, seconds, frames, entry.stream.push(image, seconds))

    def _before_push(self, entry: StreamEntry, stream: Any) -> int:
        """Checks before a push to ``stream`` (the entry's when it was queued), and the save that is due (before
        the push: a save that fails refuses the push, so the frame is not streamed and a retry does not stream it
        twice). A stream whose hold lapsed while the push waited is refused (503): a frame streamed here could
        no longer be saved."""
        check_here(entry, stream)
        self.placement.check(entry)
        if entry.stream.pushed - entry.saved["pushed"] >= self.config.save_every_frames:
            try:
                self.save_now(entry)
            except (OSError, StateKVError) as error:
                if isinstance(error, ServiceError) and error.status != 400:
                    raise
                why = str(error).split(";")[0] if isinstance(error, StateKVError) else \
                    f"cannot save the stream ({error.strerror or type(error).__name__})"
                unsaved = entry.stream.pushed - entry.saved["pushed"]
                self.note_save_failure(entry, error)
                if unforced(entry) is not None:  # it checkpoints no more: a retry never saves it (`StreamHealer`)
                    raise ServiceError(503, f"{why}; {BROUGHT_BACK}", headers={"Retry-After": "1"}) from None
                raise ServiceError(503, f"{why}; this frame was not streamed and the stream is as it was: "
                                   f"{entry.stream.frames} frames ({unsaved} pushed since its last save, kept in "
                                   f"memory only); push the frame again once {not_written(entry, error, self.files)} "
                                   "can be written",
                                   headers={"Retry-After": "5"}) from None
        return entry.stream.frames

    def _after_push(self, entry: StreamEntry, image: Any, seconds: float | None, frames: int, kept: bool) -> bool:
        entry.last_seconds = seconds if seconds is not None else _next_time(entry)
        entry.updated = time.time()
        for _ in range(entry.stream.frames - frames):
            if self.metrics:
                self.metrics.frame_done()
        if kept:
            stats = entry.stream.stats
            entry.last_frame = image
            entry.last_frame_at = {"index": entry.stream.frames + len(entry.stream.pending),
                                   "pushed": entry.stream.pushed, "seconds": entry.last_seconds}
            entry.history.append({"seconds": entry.last_seconds, "frames": entry.stream.frames,
                                  "tokens": entry.stream.tokens, "carried": stats.carried_tokens,
                                  "cache_bytes": stats.cache_bytes})
            del entry.history[:-HISTORY]
        return kept

    def let_go_unused_models(self) -> None:
        """Let go of the VideoQAs of method settings no stream held here has any more (`StreamSettings.let_go_unused`),
        unless a stream is being made or taken here (it may have chosen one already)."""
        if not self.arriving:
            self.settings.let_go_unused(getattr(entry.stream, "qa", None) for entry in list(self.entries.values()))

    # -- asking --------------------------------------------------------------------------------------------
    def stop_answers(self) -> None:
        """The server can wait no longer: every answer still being given stops at its next token, answering with a
        one-line 503 (`ServerStopped`), and is not recorded."""
        self.answers_stopping.set()

    async def ask(self, entry: StreamEntry, question: str, max_new_tokens: int, retrieve: Any,
                  streamer: Any = None) -> dict[str, Any]:
        """Answer from everything the stream holds; the result also names the frames and stream time it refers
        to, the tokens it read and wrote (``usage``) and how long it took (``latency``, queueing included)."""
        await self.heal(entry)  # the page asks a stream it holds, not found again
        kwargs = {"max_new_tokens": max_new_tokens, "retrieve": retrieve,
                  **answer_arguments(self.answers_stopping, streamer, entry)}
        started = time.perf_counter()
        queue = getattr(self.worker, "queue_ask", None)
        try:
            if queue is None:
                result = await self.worker.run(self._ask_now, entry, question, kwargs)
            else:  # questions waiting together are answered together (`ModelWorker.queue_ask`)
                stream = entry.stream
                result = await queue(stream, question, kwargs,
                                     before=lambda: self._before_ask(entry, question, kwargs, stream),
                                     after=lambda prompt, tokens: self._after_ask(entry, prompt, tokens, kwargs))
        except (ClientLeft, ServerStopped, StreamDeleted):
            if self.metrics:
                self.metrics.stopped.inc()
            raise
        result["latency"] = round(time.perf_counter() - started, 4)
        entry.answers.append(answer_note(question, result))
        del entry.answers[:-ANSWERS]
        await entry.keep_record(self.files, "an answer")  # the answer is given; only its note may be lost
        return result

    def _ask_now(self, entry: StreamEntry, question: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The answer with the frames and the stream time it refers to (read on the model's thread, before any
        later push). A question that does not fit the room left in the stream's horizon is refused first."""
        prompt = self._before_ask(entry, question, kwargs, entry.stream)
        return self._after_ask(entry, prompt, entry.stream.ask_tokens(question, **kwargs), kwargs)

    def _before_ask(self, entry: StreamEntry, question: str, kwargs: dict[str, Any], stream: Any) -> int:
        """The checks before a question to ``stream`` (the entry's when it was queued; on the model's thread): the
        stream is here and open, still surely this replica's (a hold that lapsed while the question waited: 503,
        the retry reaches the new holder), and has a frame, and the question fits the room left in its horizon;
        returns its prompt's length in tokens."""
        check_here(entry, stream)
        self.placement.check(entry)
        check_has_frames(entry)
        prompt = prompt_tokens(entry.stream, question, kwargs["max_new_tokens"])
        check_answer(kwargs)
        return prompt

    @staticmethod
    def _after_ask(entry: StreamEntry, prompt: int, tokens: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The answer ``tokens`` ``[1, N]`` with the frames and stream time it refers to (on the model's thread,
        right after it, before any later push)."""
        stream = entry.stream
        prefill = getattr(stream, "prefill", None)  # none for a simplestream stream (its question reads a clip)
        check_answer(kwargs, tokens, stream.adapter.decoder)
        completion = int(tokens.shape[1])
        context = stream.read_tokens if prefill is None else stream.tokens + prompt
        read = stream.answer_info.read_frames if stream.answer_info is not None else None
        # the time of the last frame the answer read: a frame pushed since may wait for its step (Qwen3-VL's
        # pairs) or have been dropped (max_fps), as a watch's event says
        encoded = getattr(stream, "encoded_timestamp", None)
        seconds = entry.last_seconds if encoded is None else encoded
        return {"answer": stream.adapter.decode(tokens), "frames": stream.frames, "seconds": seconds,
                "id": entry.id, "read_frames": None if read is None else list(read),
                "usage": {"prompt_tokens": context, "completion_tokens": completion,
                          "total_tokens": context + completion}}

    # -- saving --------------------------------------------------------------------------------------------
    def save_now(self, entry: StreamEntry) -> None:
        """Save the stream (on the model's thread: `tier_saves.save_stream`) and note what was saved in its record
        (its record alone for a stream with no cache to save: a simplestream stream's last frames are not kept)."""
        in_tier = saved_in_tier(entry, self.placement.resume_tiers)
        if entry.deleted or not entry.dirty and (entry.tier_saved if in_tier else self.files.has_state(entry.id)):
            return
        saved_watches = save_stream(entry, self.files, in_tier)
        stream, pushed, seconds = entry.stream, entry.stream.pushed, entry.last_seconds
        if in_tier and stream.encoded_pushed < pushed:  # its file set holds its steps, not the frames pushed since
            pushed, seconds = stream.encoded_pushed, stream.encoded_timestamp  # (waiting for a step, or dropped)
        with entry.recording:  # together: a record written meanwhile cuts its watches' events where it says
            entry.saved = {"pushed": pushed, "frames": stream.frames, "seconds": seconds}
            entry.saved_watches, entry.tier_saved = saved_watches, in_tier
        entry.saved_at = time.monotonic()
        if entry.save_error is not None:
            log.warning("stream %s is saved again (its saves had failed: %s)", entry.id, entry.save_error)
            entry.save_error = None
        entry.write_record(self.files)
        if in_tier:  # only now that its record says its file set holds it all: a whole save left is never read
            drop_whole_save(entry.id, self.files)

    async def save_due(self) -> None:
        """Save every stream whose unsaved frames have waited ``save_every_seconds``. A save that fails is tried
        again a save period later; its failure is logged once (again if its reason changes), and once it saves."""
        now = time.monotonic()
        for entry in list(self.entries.values()):
            if entry.dirty and not entry.deleted and not to_bring_back(entry) and \
                    now - max(entry.saved_at, entry.save_tried_at) >= self.config.save_every_seconds:
                try:
                    await self.worker.run(self.save_now, entry)
                except (StateKVError, OSError) as error:  # the store's failures too: the other streams are saved
                    self.note_save_failure(entry, error)

    def note_save_failure(self, entry: StreamEntry, error: BaseException) -> None:
        """A save of ``entry`` failed (timed, or due before a push): counted, kept as its ``save_error`` (the
        server's paths left out, as in every message a client sees), and logged once until it saves or fails for
        another reason; the next timed try waits a save period."""
        entry.save_tried_at = time.monotonic()
        if self.metrics is not None:
            self.metrics.save_failures.inc()
        reason = self.config.public(reason_of(error))
        kind = failure_reason(error)  # the same full disk, whichever partial file it refused
        if entry.save_error is None or kind != entry.save_failure:
            log.error("cannot save stream %s: %s; tried again every %g s and at each push that needs it, logged "
                      "again once it saves or fails otherwise", entry.id, error, self.config.save_every_seconds)
        entry.save_error, entry.save_failure = reason, kind

    def save_all(self) -> None:
        """Save every stream with unsaved frames (at shutdown, from outside the event loop); one a stopped handover
        closed is not (its folder holds every frame it took: the next start resumes it), nor one whose force failed
        (`unforced_at_stop`: the next start resumes it at its last checkpoint forced)."""
        for entry in list(self.entries.values()):
            if closed_by_handover(entry) or unforced_at_stop(entry, self.files):
                continue
            try:
                self.worker.run_blocking(self.save_now, entry)
            except (StateKVError, OSError) as error:  # the store's failures too: the other streams are saved
                since = entry.stream.pushed - entry.saved["pushed"]
                lost = ("the next start resumes it from its disk-tier folder, at its last durable step" if entry.tier
                        else f"the {since} frames pushed since its last save are lost when the server stops" if since
                        else "no frame is lost: its last save holds every one it took")
                log.error("cannot save stream %s at shutdown: %s; %s", entry.id, error, lost)
                with contextlib.suppress(OSError, StateKVError):  # what its record keeps (watches, answers) at least
                    entry.write_record(self.files)
                continue
            if entry.tier is not None and not entry.deleted and not entry.tier_saved:  # its save holds every frame:
                entry.stopped = True  # a start without the disk tier may serve it from there
                try:
                    entry.write_record(self.files)
                except (StateKVError, OSError) as error:
                    log.error("cannot record that stream %s was saved whole at shutdown (%s): a start without "
                              "--offload disk will not serve it", entry.id, error)

    def close_all(self) -> None:
        """Close every stream (at shutdown, once saved): a disk-tier stream lets go of its file set's lock."""
        for entry in list(self.entries.values()):
            entry.retire(closed=True)
            try:
                self.worker.run_blocking(entry.stream.close)
            except Exception as error:  # noqa: BLE001 -- shutting down: the others are closed still
                if not (isinstance(error, OutputError) and unforced(entry) is not None):  # its refused checkpoint:
                    log.error("cannot close stream %s: %s", entry.id, error)  # said at its save (`save_all`)

    # -- bringing back -------------------------------------------------------------------------------------
    def restore(self, owners: Any = None) -> int:
        """Bring back the streams at start, as the placement does it (alone: `load_all`); returns how many."""
        return self.placement.restore(self, owners)

    def load_all(self, owners: Any = None) -> int:
        """Load every stream recorded in the state folder; returns how many. ``owners``: load only streams of
        these owner digests (the others are left on disk untouched). Deletions cut short are finished first."""
        self.files.sweep_partials()
        self.finish_removals()
        self.creations.finish(self.settings.qa.engine.offload_dir)
        for stream_id, record in self.files.records():
            if isinstance(record, Exception):
                reason = unreadable(self.files.record_name(stream_id), record)
                self.quarantine(stream_id, self.files.owner_named(stream_id), reason, {})
                continue
            if owners is not None and record["owner"] not in owners:
                continue
            try:
                entry = self.worker.run_blocking(self.restore_one, record)
            except Exception as error:  # noqa: BLE001 -- whatever a damaged file raises, the others are served
                self.quarantine(record["id"], record["owner"], reason_of(error), record,
                                sound=getattr(error, "sound", False) or isinstance(error, OtherSetupError))
                continue
            self.entries[entry.id] = entry
        for name in self.files.unrecorded_saves():
            log.warning("streams/%s in the state folder has no record (streams/%s.json): it is not served, and left "
                        "as it is", name, name.removesuffix(".safetensors"))
        return len(self.entries)

    def finish_removals(self) -> None:
        """Finish the deletions begun and cut short (a kill, a crash): the streams stay deleted, never loaded."""
        self.files.finish_removals(self.settings.qa.engine.offload_dir)

    def restore_one(self, data: dict[str, Any], healing: bool = False) -> StreamEntry:
        """Load one recorded stream (`StreamLoader.load`, ``healing`` as there); it is no longer damaged once it
        loads. A stream in a new disk-tier file set has its record written once its watches and page are back."""
        # a load from the save makes a new file set: a note until the record names it (a kill in between)
        note = None if healing else self.creations.begin_load(data["id"], self.settings.qa.engine)
        try:
            entry = self.loader.load(data, healing=healing)
            recorded = self.loader.bring_back(entry, data, None if self.watch_listener is None
                                              else self.watch_listener(entry.id), healing)
        except BaseException:  # not served: a file set the load made is no record's
            self.creations.settle(note)
            raise
        if recorded:
            end_creation(note)  # else kept: the next start removes the file sets its record does not name
        if entry.tier_saved and not healing:  # a kill between its record saying so and its whole save's removal
            drop_whole_save(entry.id, self.files)
        self.damaged.pop(entry.id, None)
        return entry

    async def heal(self, entry: StreamEntry) -> None:
        """Bring back a disk-tier stream a stopped handover closed under the server (`StreamHealer.heal`)."""
        await self.healer.heal(entry)

    def quarantine(self, stream_id: str, owner: str | None, reason: str, record: dict[str, Any],
                   setup: str | None = None, sound: bool = False) -> DamagedStream:
        """Quarantine a stream: logged, listed as damaged, and noted in the state folder (for every server that
        shares it; ``setup``: for those of that setup alone, its files being sound; ``sound``: so are they, saved
        with another setup than this server's)."""
        damaged = self.loader.damaged(stream_id, owner, reason, record)
        damaged.setup, damaged.sound = setup, sound
        log.error("stream %s is %s: %s", stream_id, "not served by this start (its files are sound, left where they "
                  "are)" if sound else "damaged and quarantined (not served; its files are kept)", damaged.reason)
        self.damaged[stream_id] = damaged
        try:
            self.files.write_note(damaged.note())
        except (OSError, StateKVError) as error:  # it is quarantined here all the same
            log.error("cannot note stream %s's quarantine in the state folder: %s", stream_id, error)
        return damaged

    # -- the placement's own work --------------------------------------------------------------------------
    async def keep_leases(self) -> None:
        """One pass of the placement's work beside the server (a replica: renew its leases, hand streams over)."""
        await self.placement.keep(self)

    def let_all_go(self) -> None:
        """At shutdown, once every stream is saved: the placement lets every stream go (a replica: its leases)."""
        self.placement.let_go(self)


def _next_time(entry: StreamEntry) -> float:
    step = 1.0 / entry.max_fps if entry.max_fps else 1.0
    return 0.0 if entry.last_seconds is None else entry.last_seconds + step
