"""``statekv stream``: replay a video file as a live stream and ask questions when it reaches given times."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..console import add_output_arguments, interactive, json_sizes, one_line, quiet_libraries, warn_free_form
from ..errors import (CacheLimitError, ConfigurationError, FrameDecodeError, HorizonError, InputError, OutputError,
                      StateKVError)
from ..settings.methods import method, retrieval_rule
from ..settings.options import ModelOptions
from ..user_cache import cache_dir
from ..settings.values import (LARGEST_INT, POSITIVE_INT, STREAM_RATE, check_output_file, format_bytes, is_folder,
                               printable, shown)
from ..stopping import note_kept, stop_point, whole


CLOCK = re.compile(r"(?:(\d+):)?(\d+):(\d\d(?:\.\d*)?):(.*)", re.DOTALL)  # [H:]M:SS:QUESTION


def timed_question(text: str) -> tuple[float, str]:
    """``"12.5:What is on the table?"`` -> ``(12.5, "What is on the table?")``; a clock time too:
    ``"1:30:Who came in?"`` -> ``(90.0, "Who came in?")``, ``"1:02:03:..."`` -> ``(3723.0, ...)``."""
    clock = CLOCK.fullmatch(text)
    if clock:
        hours, minutes, seconds, question = clock.groups()
        separator, time = ":", 3600 * float(hours or 0) + 60 * float(minutes) + float(seconds)
        if float(seconds) >= 60 or hours is not None and int(minutes) >= 60:  # 1:75 is no clock time
            raise argparse.ArgumentTypeError(f"{text[:len(text) - len(question) - 1]} is not a clock time ([H:]M:SS, "
                                             f"minutes and seconds under 60), in {shown(text)}")
    else:
        seconds, separator, question = text.partition(":")
        try:
            time = float(seconds)
        except ValueError:
            time = math.nan
    if not separator or not math.isfinite(time) or time < 0 or not question.strip():
        raise argparse.ArgumentTypeError(f"expected SECONDS:QUESTION or [H:]M:SS:QUESTION (e.g. 12.5:\"What is on the "
                                         f"table?\" or 1:30:\"Who came in?\"), got {text!r}")
    return time, question.strip()


def watched_question(text: str) -> tuple[int, str]:
    """``"4:Is anyone at the door?"`` -> ``(4, "Is anyone at the door?")``."""
    every, separator, question = text.partition(":")
    every = every.strip()
    if not separator or not (every.isascii() and every.isdigit()) or int(every) < 1 or not question.strip():
        raise argparse.ArgumentTypeError(f"expected FRAMES:QUESTION (e.g. 4:\"Is anyone at the door?\"), got "
                                         f"{text!r}")
    if int(every) > LARGEST_INT:  # said before the model loads
        raise argparse.ArgumentTypeError(f"FRAMES must be at most {LARGEST_INT:,}, got {text!r}")
    return int(every), question.strip()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "stream", help="replay a video as a live stream, asking questions at given times or watching for answers",
        description="Push the frames of VIDEO one by one as a live source would (at most --max-fps per second), "
                    "with no horizon (as statekv.VideoQA.stream(): it could go on for ever) unless --max-frames "
                    "declares one. Each --ask question is asked as soon as the stream reaches its time, from the "
                    "frames seen so far; each --watch question is a standing question, evaluated every FRAMES "
                    "frames, printed whenever its answer changes. Later frames keep streaming after each question. "
                    "A progress bar shows on a terminal. If --max-cache-bytes stops the stream (--cache-limit "
                    "refuse), every question left is answered from the frames it holds, marked as asked after "
                    "the cap, with one warning line on stderr (exit status 0).",
    )
    parser.extra_hint = "; give questions as --ask SECONDS:QUESTION (or --watch FRAMES:QUESTION)"
    parser.add_argument("video", metavar="VIDEO", help="video file or folder of frames")
    parser.add_argument("--ask", type=timed_question, action="append", default=[], metavar="SECONDS:QUESTION",
                        help="ask QUESTION when the stream reaches SECONDS (or a clock time, 1:30:QUESTION or "
                             "1:02:03:QUESTION) (repeatable)")
    parser.add_argument("--watch", type=watched_question, action="append", default=[], metavar="FRAMES:QUESTION",
                        help="watch for QUESTION's answer: evaluate it every FRAMES frames and print it whenever it "
                             "changes (repeatable)")
    ModelOptions.add_arguments(parser)
    parser.add_argument("--max-fps", type=STREAM_RATE, default=1.0, metavar="F",
                        help="frames kept per second of stream (default: 1)")
    parser.add_argument("--max-frames", type=POSITIVE_INT, default=None, metavar="N",
                        help="declare the stream for at most N frames: its horizon (default: none; positions stay "
                             "inside the model's range however long it runs)")
    parser.add_argument("--save", metavar="FILE", default=None,
                        help="save the stream at the end, or when it stops early (resume with --resume FILE; a "
                             "frame left waiting for its partner, Qwen3-VL's lone last one, is saved waiting, so a "
                             "resume pairs it as a run over the whole video does); checked before the model loads")
    parser.add_argument("--resume", metavar="PATH", default=None,
                        help="go on with a stream of this VIDEO saved by --save (a file) or kept on the disk tier (its "
                             "folder), given the model options it was made with (its own --vision-batch goes on, and "
                             "its watches that --watch asks again): its frames are not pushed again, and --ask "
                             "questions timed before its last frame are left out (the run that streamed them asked "
                             "them; one answered in the instant before the stop is asked again)")
    add_output_arguments(parser, json_help="print one JSON object per line: each answer as it is made, then a "
                                           "summary (stats, every answer, where the stream was saved)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..api.stats import progress_reporter
    from ..api.videoqa import VideoQA
    from ..video import open_video

    options = ModelOptions.from_args(args, all_used=True)
    keeps = "--save" if args.save is not None else "--resume" if args.resume is not None else None
    if keeps is not None and method(options.method).recent_window:
        raise ConfigurationError(f"{keeps}: a {options.method} stream keeps only its last frames, no cache to save "
                                 "or resume")
    # before hours of encoding, not after
    save = check_output_file(args.save, "--save") if args.save is not None else None
    if save is not None and save.exists() and Path(args.video).exists() and save.samefile(args.video):
        raise OutputError(f"--save {printable(save)} is the video itself; give another file")
    if save is not None and save.is_file() and save.stat().st_size:
        check_replaceable(save)
    video = open_video(args.video)  # check the file before loading the model
    if args.resume is not None and not (is_folder(args.resume) or os.path.exists(args.resume)):
        raise InputError(f"--resume {printable(args.resume)}: no such file or folder")
    warn_past_the_end(args.ask, video.duration)
    warn_free_form("stream", args.model, [question for _, question in [*args.ask, *args.watch]])
    quiet_libraries()
    try:
        stream = begun(args, VideoQA, options, video.name, save)
    except (Exception, KeyboardInterrupt) as error:  # the summary --json promises, of a stream that never began
        if args.json:
            print_summary(args, options, horizon_frames=args.max_frames, positions=None, stats=None, answers=[],
                          watches=[], stopped=None, saved=None, save_error=None, folder=None,
                          error=one_line(error) if str(error) else type(error).__name__)
        raise
    horizon = getattr(stream, "horizon_frames", args.max_frames)  # None: no horizon, as qa.stream()
    replay = _Replay(args, options, stream, save)
    try:
        try:
            replay.watch()
            with progress_reporter(interactive(), frames_expected(video, args.max_fps, horizon), video.name,
                                   stream.stats) as report:
                replay.run(video, horizon, report)
        except (Exception, KeyboardInterrupt) as error:
            replay.stopped(error)
            raise
        replay.finish()
    finally:
        problem = replay.close()  # if nothing above did (an error already raised stays the one raised)
        if problem is not None and replay.folder is not None:
            print(f"statekv stream: warning: the stream's folder {replay.folder} could not be closed: {problem}",
                  file=sys.stderr, flush=True)
    return 0


def begun(args: argparse.Namespace, videoqa, options: ModelOptions, video_name: str, save: Path | None):
    """The model loaded and the stream made, or resumed, checked against the run's questions."""
    try:
        qa = videoqa.from_options(options)
    except KeyboardInterrupt as stop:  # stopped while the model loads: nothing to keep, and that is said
        if save is not None:
            note_kept(stop, f"nothing was streamed yet, so nothing was saved to {printable(save)}")
        raise
    if args.resume is not None:
        stream = resumed(args, qa, video_name)
    else:  # a live stream encodes each frame as it comes unless --vision-batch asks it to wait for a batch
        # named by its absolute path, which a --resume from another folder can still tell apart
        stream = qa.stream(horizon_frames=args.max_frames, max_fps=args.max_fps,
                           name=str(Path(video_name).absolute()), vision_batch=args.vision_batch or 1)
    try:
        refuse_what_cannot_fit(stream, args.ask, args.max_new_tokens)
    except StateKVError:
        stream.close()
        raise
    return stream


def resumed(args: argparse.Namespace, qa, video_name: str):
    """The stream ``--resume`` names, loaded with ``qa`` and checked against this run's video and flags (one line
    each: another video's stream, another --max-fps, another --max-frames); the stream is closed on a refusal."""
    from ..api.stream import Stream

    again = _PushedAgain()  # the library's line calls them lost: this run pushes them again from the video
    logging.getLogger("statekv").addFilter(again)
    try:
        stream = Stream.load(args.resume, qa)  # a folder's watches reopened as its close kept them
    finally:
        logging.getLogger("statekv").removeFilter(again)
    problem = None
    if not same_video(stream.name, video_name):
        problem = f"it is a stream of {printable(stream.name)}, not of {video_name}"
    elif stream.max_fps is None:
        problem = "it was pushed with no frame rate (max_fps=None), which only Python's Stream.load resumes"
    elif stream.max_fps != args.max_fps:
        problem = f"it was streamed at --max-fps {stream.max_fps:g}, not --max-fps {args.max_fps:g}"
    elif args.max_frames is not None and args.max_frames != stream.horizon_frames:
        made = "no horizon" if stream.horizon_frames is None else f"--max-frames {stream.horizon_frames}"
        problem = f"it was made with {made}, not --max-frames {args.max_frames}"
    if problem is not None:
        stream.close()
        raise InputError(f"--resume {printable(args.resume)}: {problem}")
    if again.frames:
        print(f"statekv stream: --resume {printable(args.resume)}: the {again.frames} "
              f"frame{'s' * (again.frames != 1)} pushed after the {stream.frames} it holds were not durable when its "
              f"run ended; they are streamed again from {video_name}", file=sys.stderr, flush=True)
    return stream


class _PushedAgain(logging.Filter):
    """Holds back the warning of a resumed file set whose frames not durable can be pushed again (`frames`: how
    many; 0 when none), which a replay of the video does."""

    def __init__(self):
        super().__init__()
        self.frames = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "pushable_again", False):
            self.frames = int(record.frames_lost)
            return False
        return True


def same_video(recorded: str, given: str) -> bool:
    """Whether the video a stream recorded (its absolute path; a relative one, in a stream an earlier statekv made,
    is read from this folder) is the one given now: the same file, or, once the recorded path names no file (moved
    since), one of the same name."""
    recorded_path, given_path = Path(recorded), Path(given)
    if recorded_path.exists() and given_path.exists():
        return recorded_path.samefile(given_path)
    return Path(os.path.abspath(recorded)).name == Path(os.path.abspath(given)).name  # `..` and `.` named too


def refuse_what_cannot_fit(stream, asks: list[tuple[float, str]], max_new_tokens: int) -> None:
    """Refuse (one line) an --ask question that with its answer fits the stream at no point, before the first frame
    (the engine's one check, `StreamingPrefill.fit_question`), rather than when it is asked, hours in."""
    prefill = getattr(stream, "prefill", None)
    if prefill is None:  # simplestream: each question encodes its last frames afresh, with room for it
        return
    for time, question in asks:
        prompt = int(stream.adapter.question_ids(question, stream.state).shape[1])
        try:
            prefill.fit_question(prompt, max_new_tokens)
        except HorizonError as error:
            raise InputError(f"--ask at {time:g} s: {one_line(error)}") from None


def warn_past_the_end(asks: list[tuple[float, str]], duration: float | None) -> None:
    """One line on stderr when questions are timed after the video ends (they are asked after its last frame)."""
    late = sorted(time for time, _ in asks if duration and time > duration)
    if late:
        times = ", ".join(f"{time:g} s" for time in late)
        print(f"statekv stream: warning: --ask at {times} is past the end of the video ({duration:g} s); asked "
              "after its last frame", file=sys.stderr, flush=True)


class _Replay:
    """A video replayed into ``stream``: answers printed as they are made, the stream saved (or rescued) at the
    end or when something stops it, and a summary."""

    def __init__(self, args: argparse.Namespace, options: ModelOptions, stream, save: Path | None):
        self.args, self.options, self.stream, self.save = args, options, stream, save
        self.folder: Path | None = getattr(stream, "folder", None)  # its disk-tier file set's
        self.closed = False
        self.saved: tuple[Path, str | None] | None = None  # where --save went before the last flush, and why there
        self.questions = sorted(args.ask, key=lambda item: item[0])
        if stream.last_timestamp is not None:  # resumed: what was streamed before was asked then
            before = [time for time, _ in self.questions if time < stream.last_timestamp]
            if before:
                print(f"statekv stream: warning: --ask at {', '.join(f'{time:g} s' for time in before)} is before "
                      f"where the resumed stream goes on ({stream.last_timestamp:g} s): not asked (a run asks what it "
                      "streams)", file=sys.stderr, flush=True)
            self.questions = [item for item in self.questions if item[0] >= stream.last_timestamp]
        self.answers: list[dict] = []
        self.events: list[dict] = []  # the watches' events, as they were printed
        self.cache_full: str | None = None  # why max_cache_bytes stopped the stream (the answers after it are marked)
        self.undecodable = False  # the video's frames stopped decoding (the answers after it are marked)

    def watch(self) -> None:
        """Open the --watch questions, each printing its events as they come. A resumed stream's own watches go on
        where they are asked again, and close where they are not (unheard, they would cost time)."""
        tokens, qa = self.args.max_new_tokens, self.stream.qa
        how = (qa.retrieve, retrieval_rule(qa.retrieval).name, qa.steer)  # what a watch opened now reads and does
        kept: dict[tuple, list] = {}  # the same question may be watched twice: each asked again goes on
        for watch in getattr(self.stream, "watches", []):
            key = (watch.question, watch.every, watch.max_new_tokens, watch.retrieve, watch.retrieval, watch.steer)
            kept.setdefault(key, []).append(watch)
        self.watched = []
        for every, question in self.args.watch:
            same = kept.get((question, every, tokens, *how))
            watch = same.pop(0) if same else None
            opened = watch is None
            if not opened:  # its events before the stop are the summary's too, as a run never stopped lists them
                self.events.extend(self.event_of(watch, event) for event in watch.events)
            watch = watch or self.stream.watch(question, every=every, max_new_tokens=tokens)
            watch.subscribe(lambda watch, event: event is not None and self.heard(watch, event))
            if opened and watch.events:  # evaluated as it opened, on the frames of a resumed stream
                self.heard(watch, watch.events[-1])
            self.watched.append(watch)
        self.events.sort(key=lambda event: event["frame"])
        for watch in (watch for left in kept.values() for watch in left):
            watch.close()

    @staticmethod
    def event_of(watch, event) -> dict:
        return {"frame": event.frame, "seconds": event.seconds, "question": watch.question, "answer": event.answer}

    def warn_unwatched(self) -> None:
        """One line on stderr for each --watch never evaluated: the stream ended before its first period did."""
        for watch in self.watched:
            if not watch.evaluations and watch.error is None:
                print(f"statekv stream: warning: --watch {watch.every}:{shown(watch.question, 60)} was never "
                      f"evaluated: the stream holds {self.stream.frames} frames, fewer than the {watch.every} of its "
                      "first evaluation", file=sys.stderr, flush=True)

    def heard(self, watch, event) -> None:
        self.events.append(self.event_of(watch, event))
        if self.args.json:
            print(json.dumps({"event": "watch", **self.events[-1]}), flush=True)
        else:
            when = "" if event.seconds is None else f"{event.seconds:7.2f} s, "
            head = f"[{when}{event.frame} frames] W: "
            asked = watch.question.replace("\n", "\n" + " " * len(head))
            print(f"{head}{asked}\n{'':>21}A: {event.answer}", flush=True)

    def run(self, video, horizon: int | None, report=lambda done, planned: None) -> None:
        stream = self.stream
        frame = None
        planned = frames_expected(video, self.args.max_fps, horizon)
        resumed_at = stream.last_timestamp
        try:
            for frame in video.sample_at_rate(self.args.max_fps):
                if resumed_at is not None and frame.timestamp <= resumed_at:
                    continue  # streamed before it was resumed
                if stream.frames:  # a question before the first frame waits for it
                    self.ask_due(frame.timestamp - 1e-9)
                if horizon is not None and stream.frames + len(stream.pending) >= horizon:
                    self.warn_stopped(horizon, stream.last_timestamp, getattr(video, "duration", None))
                    break
                stream.push(frame)
                report(stream.frames, planned)
                stop_point()  # a Ctrl-C a library swallowed while the frame was decoded
            else:
                self.warn_cut_short(stream.last_timestamp, video)
            self.save_waiting()
            stream.flush()
            stop_point()  # one swallowed as the video's end was read, or as its last frames were encoded
        except CacheLimitError:  # refused at the cap: the questions left are answered from what it holds
            if not stream.frames:
                raise
            left, held = len(self.questions), stream.frames
            self.cache_full = (
                f"{stream.name}: the detailed cache is full at frame {held + 1} "
                f"(max_cache_bytes={format_bytes(stream.engine.max_cache_bytes)}): the stream stopped"
                + (f" at {stopped_at:.2f} s" if (stopped_at := refused_time(stream, frame)) is not None else "")
                + f"; the {left} question{'s' if left != 1 else ''} left {'are' if left != 1 else 'is'} answered from "
                + (f"the {held} frames before it" if held > 1 else "the frame before it"))
            print(f"statekv stream: warning: {self.cache_full}", file=sys.stderr, flush=True)
        except FrameDecodeError:  # a file cut short: the questions left are answered from what it gave, then it is said
            if not stream.frames:
                raise
            self.undecodable = True
            self.ask_due(math.inf)
            raise
        self.ask_due(math.inf)  # questions at or after the end see the whole video (or what the cap let in)
        self.warn_unwatched()

    def save_waiting(self) -> None:
        """With --save, frames still waiting for their step or batch (Qwen3-VL's lone last frame) are saved waiting,
        before the flush encodes them for this run's last questions: a --resume of the video grown since pairs such a
        frame with the next one, as a run over the whole video does, instead of going on from it repeated."""
        if self.save is not None and self.stream.pending:
            try:
                self.saved = save_or_rescue(self.stream, self.save)
            except OutputError:
                pass  # nowhere to write it: `finish` tries again and says so, after the last answers

    def warn_stopped(self, horizon: int, seconds: float, duration: float | None) -> None:
        """One line on stderr for the questions timed after the frame the horizon stopped the stream at (those past
        the video's end were warned of before it began)."""
        late = [time for time, _ in self.questions if not duration or time <= duration]
        if late:
            print(f"statekv stream: warning: --ask at {', '.join(f'{time:g} s' for time in late)} is past where "
                  f"the stream's horizon of {horizon} frames (--max-frames) stops it (its last frame at {seconds:g} "
                  "s); asked after it", file=sys.stderr, flush=True)

    def warn_cut_short(self, seconds: float | None, video) -> None:
        """One line on stderr for the questions timed after the video's last frame (at ``seconds``), when the file
        ends well before the duration its header gives (`statekv.video.sources.cut_short`)."""
        from ..video.sources import cut_short

        if seconds is None or cut_short(video, seconds, self.args.max_fps) is None:
            return
        duration = video.duration
        late = [time for time, _ in self.questions if seconds < time <= duration]
        if late:
            print(f"statekv stream: warning: the video's frames end at {seconds:g} s, before the {duration:g} s its "
                  f"header gives (a file cut short, or still being written): --ask at "
                  f"{', '.join(f'{time:g} s' for time in late)} asked after its last frame", file=sys.stderr,
                  flush=True)

    def ask_due(self, now: float) -> None:
        while self.questions and self.questions[0][0] <= now:
            time, question = self.questions.pop(0)
            answer = self.stream.ask(question, max_new_tokens=self.args.max_new_tokens)
            self.answers.append({"time": time, "frames": self.stream.frames, "tokens": self.stream.tokens,
                                 "question": question, "answer": answer, "after_cap": self.cache_full is not None,
                                 "after_error": self.undecodable})
            if self.args.json:  # one line per answer, as it is made: nothing is lost if the run stops later
                print(json.dumps({"event": "answer", **self.answers[-1]}), flush=True)
            else:
                mark = (" (after the cache cap stopped the stream)" if self.cache_full else
                        " (after the video's frames stopped decoding)" if self.undecodable else "")
                head = f"[{time:7.2f} s, {self.stream.frames} frames] Q: "
                asked = question.replace("\n", "\n" + " " * len(head))  # its options under its first line
                print(f"{head}{asked}{mark}\n{'':>21}A: {answer}", flush=True)
            stop_point()  # a Ctrl-C a library swallowed while the question was answered: the last frame's is past

    def stopped(self, error: BaseException) -> None:
        """Keep what was streamed before ``error`` (with --save; on the disk tier its folder keeps it) and say where,
        in its message or on stderr. A second Ctrl-C waits for that to be said (it is raised as this ends, carrying
        what the first kept)."""
        with whole():
            self._keep_and_say(error)

    def _keep_and_say(self, error: BaseException) -> None:
        where, problem, kept = None, None, None
        if self.save is not None:
            try:
                where, problem = self.saved or save_or_rescue(self.stream, self.save)
                kept = f"the {self.stream.frames} frames streamed before it were saved to {printable(where)}" + (
                    f" (not to {printable(self.save)}: {problem})" if problem else "")
            except StateKVError as save_error:  # unwritable everywhere, or nothing encoded yet to save
                kept = f"and the {self.stream.frames} frames streamed before it were not saved: {one_line(save_error)}"
        elif self.folder is not None:
            kept = self.closed_folder()
        elif self.args.resume is not None:  # resumed from a file, and nothing names where to keep what followed
            kept = (f"the frames streamed since --resume {printable(self.args.resume)} were not saved (it holds the "
                    "stream as it was; give --save to keep what a run streams)")
        if kept is not None:
            if isinstance(error, StateKVError):
                error.args = (f"{one_line(error)}; {kept}",)
            elif isinstance(error, KeyboardInterrupt):  # `run_command` says it with the stop, in one line
                note_kept(error, kept)
            else:
                print(f"statekv stream: {kept}", file=sys.stderr, flush=True)
        self.summary(where, problem, error=one_line(error) if str(error) else type(error).__name__)

    def closed_folder(self) -> str | None:
        """Close a disk-tier stream and say what its folder keeps (None: nothing was durable yet, and it went)."""
        frames, problem = self.stream.frames, self.close_folder()
        if problem is not None:
            return (f"and the {frames} frames streamed before it may not all be kept in {printable(self.folder)}: "
                    f"{problem}")
        if self.folder is None:
            return None
        folder = printable(self.folder)
        return f"the {frames} frames streamed before it are kept in {folder} (go on with --resume {folder})"

    def close_folder(self) -> str | None:
        """Close a disk-tier stream, which makes every frame streamed durable in its folder; returns why it could
        not, else None (``folder`` None when nothing was durable yet and the folder went with it)."""
        problem = self.close()
        if problem is None and not self.folder.exists():
            self.folder = None
        return problem

    def close(self) -> str | None:
        """Close the stream, once; returns why it could not (on the disk tier: its last checkpoint), else None. A
        disk-tier stream keeps its watches in its folder as it closes, for a --resume of it."""
        if self.closed:
            return None
        self.closed = True
        try:
            self.stream.close()
        except Exception as error:  # noqa: BLE001 - said where the stream's end is said, not raised over the stop
            return one_line(error) if isinstance(error, StateKVError) else f"{type(error).__name__}: {one_line(error)}"
        return None

    def finish(self) -> None:
        where, problem = (self.saved or save_or_rescue(self.stream, self.save) if self.save is not None
                          else (None, None))
        closing = self.close_folder() if self.folder is not None else None
        self.summary(where, problem)
        if problem:
            raise OutputError(f"could not save the stream to {printable(self.save)} ({problem}); it was saved to "
                              f"{printable(where)} instead")
        if closing is not None:
            raise OutputError(f"the stream's folder {printable(self.folder)} could not be closed: {closing}")

    def summary(self, where: Path | None, problem: str | None, error: str | None = None) -> None:
        stats, args = self.stream.stats, self.args
        if args.json:  # the last line, also when the stream stopped early
            print_summary(args, self.options,
                          horizon_frames=getattr(self.stream, "horizon_frames", args.max_frames),
                          positions=getattr(getattr(self.stream, "engine", None), "positions", None),
                          stats=stats.to_dict(), answers=self.answers, watches=self.events, stopped=self.cache_full,
                          saved=None if where is None else str(where), save_error=problem,
                          folder=None if self.folder is None else str(self.folder), error=error)
        elif error is None:
            timed = stats.frame_seconds or stats.earlier_frames  # none when a resumed stream was pushed no frame
            print(f"\n{self.stream.frames} frames{' (stopped at --max-cache-bytes)' if self.cache_full else ''}, "
                  f"{self.stream.tokens} tokens, {self.options.label}, carried {stats.carried_tokens} tokens"
                  + (f", {1e3 * stats.mean_frame_seconds:.1f} ms per frame" if timed else "")
                  + (f"; saved to {printable(where)}" if where else "")
                  + (f"; kept in {printable(self.folder)}" if self.folder is not None else ""), flush=True)


def print_summary(args: argparse.Namespace, options: ModelOptions, *, horizon_frames: int | None, positions: Any,
                  stats: dict | None, answers: list, watches: list, stopped: str | None, saved: str | None,
                  save_error: str | None, folder: str | None, error: str | None) -> None:
    """The --json summary line, of a stream that ran or of one that never began (``stats`` None)."""
    print(json.dumps({"event": "summary", "video": args.video, "model": args.model, "method": args.method,
                      **json_sizes(options), "label": options.label, "horizon_frames": horizon_frames,
                      "positions": positions, "stats": stats, "answers": answers, "watches": watches,
                      "stopped": stopped, "saved": saved, "save_error": save_error, "folder": folder,
                      "error": error}), flush=True)


def check_replaceable(save: Path) -> None:
    """Refuse a --save file that holds something other than a saved stream: the save would replace it."""
    from ..api.stream_file import read_metadata

    try:
        read_metadata(save)
    except InputError as error:
        why = one_line(error).removeprefix(f"{printable(save)}: ")
        raise OutputError(f"--save {printable(save)} exists and is not a stream this statekv saved ({why}); the save "
                          "would replace it: give another file, or remove it first") from None


def frames_expected(video, max_fps: float, horizon: int | None) -> int | None:
    """About how many frames the replay streams (for its progress): the video's at ``max_fps``, at most the
    horizon (None: unknown)."""
    duration, count = getattr(video, "duration", None), getattr(video, "num_frames", None)
    if not duration or not count:
        return horizon
    frames = max(1, min(count, math.ceil(duration * max_fps - 1e-9)))  # one per tick of the rate
    return frames if horizon is None else min(frames, horizon)


def save_or_rescue(stream, target: Path) -> tuple[Path, str | None]:
    """Save ``stream`` to ``target`` or, if that fails, to a rescue file; returns where it went and, when it is
    not ``target``, why. Raises `OutputError` (naming every place tried) only when nothing could be written."""
    from ..api.stream_file import UNCHANGED

    try:
        return stream.save(target), None
    except OutputError as error:
        problem = one_line(error).removeprefix(f"cannot save the stream to {printable(target)}: ")
        problem = problem.removesuffix(f"; {UNCHANGED}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"{target.stem}-{stamp}-{os.getpid()}{target.suffix or '.safetensors'}"
    tried, folders = [], [Path(tempfile.gettempdir())]
    try:
        folders.insert(0, cache_dir() / "rescued")
    except ConfigurationError as error:  # a malformed STATEKV_CACHE: the temporary folder still takes it
        tried.append(one_line(error))
    for folder in folders:
        try:
            return stream.save(folder / name), problem
        except OutputError as error:
            tried.append(one_line(error))
    raise OutputError(f"could not save the stream to {printable(target)} ({problem}), nor to a rescue file "
                      f"({'; '.join(tried)})")


def refused_time(stream, frame) -> float | None:
    """The time of the first frame the cache cap refused: the first still waiting when a step of several frames
    (Qwen3-VL's pairs) was refused, else the frame just pushed (None: none was)."""
    if stream.pending:
        return stream.pending[0].timestamp
    return None if frame is None else frame.timestamp
