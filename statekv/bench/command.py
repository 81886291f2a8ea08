"""``statekv bench serve``: how many live cameras a server holds at real time (see docs/serving.md, "Measured
load")."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shlex
import sys
import time
import urllib.parse
from dataclasses import replace
from typing import Any

from ..console import check_extra, omp_threads
from ..errors import ConfigurationError
from ..plotting import check_plot_file
from ..settings.options import ModelOptions
from ..settings.values import (NON_NEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT, check_output_file, positive_int,
                               shown)

ROUTES = ("ask", "chat")
SERVER_ASKS = 1024  # the started server's --max-asks: questions are load here, not something to refuse
STARTED_STREAMS = 256  # the started server's --max-streams, and the most cameras --find-max tries against it
URL_CAMERAS = 1024  # the most cameras --find-max tries against a running server (--url), unless told
MAX_CAMERA_FRAMES = 10**7  # frames (or questions, on average) one camera's run may schedule, each a request made ahead


def stream_counts(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (positive, ascending, each once)."""
    try:
        counts = [positive_int(part.strip(), "--streams") for part in text.split(",")]
    except (ValueError, ConfigurationError):
        raise argparse.ArgumentTypeError(f"expected stream counts like 1,4,16, got {text!r}") from None
    return sorted(set(counts))


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="load tests of the service (statekv bench serve)",
                                  description="Benchmarks of statekv measured from outside: bench serve.")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK",
                                    parser_class=type(bench))
    parser = commands.add_parser(
        "serve", help="how many live cameras a server holds at real time",
        description="Load a statekv server as N cameras would: each pushes frames in real time at --fps, "
                    "questions arrive per stream as a Poisson process (--question-rate; --burstiness), every "
                    "request sent at its time whether or not earlier ones returned (open loop). Drives a running "
                    "server (--url, --api-key) or starts one (--model and the model options). Per N: frames/s, lag "
                    "behind real time, time to first token, inter-token latency and time per output token "
                    "(p50/p90/p95/p99), answer latency (p50/p90/p99), goodput (cameras held "
                    "at real time with p95 TTFT under --ttft-target), failed requests, the server's mean batch.")
    target = parser.add_argument_group("the server")
    target.add_argument("--url", default=None, help="a running statekv serve, http://HOST:PORT (or its OpenAI base "
                                                    "URL, ending in /v1) (default: start one with --model)")
    target.add_argument("--api-key", default=None, metavar="KEY",
                        help="its API key (default: the first of STATEKV_API_KEYS)")
    target.add_argument("--max-streams", type=POSITIVE_INT, default=None, metavar="N",
                        help="the started server's stream limit, and the most cameras a run drives (--streams) "
                             "or --find-max tries (default: 256; against --url, 1024 cameras)")
    target.add_argument("--server-threads", type=POSITIVE_INT, default=None, metavar="N",
                        help="torch threads of the started server (default: OMP_NUM_THREADS if set, else one core "
                             "fewer than the machine's, leaving one to the cameras)")
    ModelOptions.add_arguments(parser, model_required=False)
    parser.set_defaults(model=None)
    load = parser.add_argument_group("the load")
    load.add_argument("--streams", type=stream_counts, default=None, metavar="N,N,...",
                      help="camera counts to run, one run each (default: 1,4,16)")
    load.add_argument("--find-max", action="store_true",
                      help="instead, find the most cameras held at real time with p95 TTFT under --ttft-target "
                           "(doubling from the first of --streams, default 1, then bisecting)")
    load.add_argument("--time-limit", type=POSITIVE_FLOAT, default=None, metavar="S",
                      help="with --find-max: start no run that would end more than S seconds after the search "
                           "began; report the most held so far (default: no limit)")
    load.add_argument("--fps", type=POSITIVE_FLOAT, default=1.0, metavar="F",
                      help="frames each camera pushes per second (default: 1)")
    load.add_argument("--duration", type=POSITIVE_FLOAT, default=30.0, metavar="S",
                      help="seconds each run lasts (default: 30)")
    load.add_argument("--question-rate", type=non_negative_float, default=0.1, metavar="R",
                      help="questions per second per stream, a Poisson process (default: 0.1; 0: none)")
    load.add_argument("--burstiness", type=POSITIVE_FLOAT, default=1.0, metavar="B",
                      help="gamma shape of the gaps between a stream's questions: 1 Poisson, below 1 in bursts, "
                           "above 1 more regular (default: 1)")
    load.add_argument("--question", default="What is shown now?", help="the question asked")
    load.add_argument("--max-new-tokens", type=POSITIVE_INT, default=8, metavar="N",
                      help="answer tokens per question (default: 8)")
    load.add_argument("--route", choices=ROUTES, default="ask",
                      help="ask through POST /v1/streams/{id}/ask (default) or the OpenAI-compatible chat route")
    load.add_argument("--video", action="append", default=[], metavar="FILE",
                      help="a video file the cameras show, sampled at --fps (repeatable: camera i shows file i mod "
                           "n; default: a synthetic test pattern)")
    load.add_argument("--frame-size", type=POSITIVE_INT, default=224, metavar="PX",
                      help="side of the synthetic frames (default: 224)")
    load.add_argument("--warm-frames", type=POSITIVE_INT, default=16, metavar="N",
                      help="frames pushed to each stream before the clock starts, unmeasured: cameras live for a while "
                           "(their carried state full, their steps steady) (default: 16)")
    load.add_argument("--seed", type=NON_NEGATIVE_INT, default=0,
                      help="seed of the cameras' phases and the questions' times")
    goals = parser.add_argument_group("targets and output")
    goals.add_argument("--ttft-target", type=POSITIVE_FLOAT, default=0.5, metavar="S",
                       help="p95 seconds to the first answer token a camera must get (default: 0.5)")
    goals.add_argument("--lag-target", type=POSITIVE_FLOAT, default=1.0, metavar="S",
                       help="p95 seconds behind real time a camera's frames may be streamed (default: 1)")
    goals.add_argument("--drain", type=non_negative_float, default=None, metavar="S",
                       help="seconds past a run's end to wait for requests under way (default: the duration)")
    goals.add_argument("--json", dest="json_out", default=None, metavar="OUT", help="write the results as JSON")
    goals.add_argument("--plot", default=None, metavar="OUT", help="write frames/s and TTFT against cameras (PNG)")
    goals.add_argument("--quiet", action="store_true", help="no progress line")
    parser.set_defaults(run=run)


def server_options(args: argparse.Namespace) -> list[str]:
    """The model options given, as ``statekv serve`` flags (those left at their defaults are not repeated)."""
    argv = []
    for setting in ModelOptions.SETTINGS:
        value = getattr(args, setting.name, None)
        if setting.name == "model" or value is None or value == setting.default:
            continue
        argv.append(setting.flag if isinstance(value, bool) else f"{setting.flag}={value}")
    return argv


def run(args: argparse.Namespace) -> int:
    check_extra("serve", ("httpx", "prometheus_client"), "statekv bench serve")
    from .cameras import Cameras
    from .load import LoadSettings
    from .server import LocalServer, ServerError
    from .summary import (Targets, default_progress, failure_lines, machine, nothing_through, plot, table,
                          write_json)

    ModelOptions.from_args(args)  # every model option checked before anything starts
    model_flags = server_options(args)
    started_only = model_flags + (["--server-threads"] if args.server_threads is not None else [])
    if args.url is not None and (args.model is not None or started_only):
        given = "--model" if args.model is not None else started_only[0].split("=")[0]
        raise ConfigurationError(f"{given} is for the server bench serve starts; --url drives a running one")
    key = args.api_key or next(filter(None, map(str.strip, os.environ.get("STATEKV_API_KEYS", "").split(","))), None)
    if args.url is not None and key is None:
        raise ConfigurationError("--url needs --api-key (or STATEKV_API_KEYS)")
    outputs = {name: check(value, flag) for name, value, flag, check in (
        ("json", args.json_out, "--json", check_output_file), ("plot", args.plot, "--plot", check_plot_file))
        if value is not None}
    if not args.duration * args.fps <= MAX_CAMERA_FRAMES:
        raise ConfigurationError(f"--duration {args.duration:g} s at --fps {args.fps:g} schedules more frames a camera "
                                 f"than a run can send (at most {MAX_CAMERA_FRAMES:,})")
    if not args.duration * args.question_rate <= MAX_CAMERA_FRAMES:  # scheduled ahead as frames are
        raise ConfigurationError(f"--duration {args.duration:g} s at --question-rate {args.question_rate:g} schedules "
                                 f"more questions a camera than a run can send (at most {MAX_CAMERA_FRAMES:,})")
    if math.floor(args.duration * args.fps) < 1:
        raise ConfigurationError(f"--duration {args.duration:g} s at --fps {args.fps:g} schedules no frame to measure; "
                                 f"run at least {1 / args.fps:g} s")
    if not args.question.strip():
        raise ConfigurationError("--question must be a question, not empty")
    settings = LoadSettings(fps=args.fps, duration=args.duration, question_rate=args.question_rate,
                            burstiness=args.burstiness, question=args.question, max_new_tokens=args.max_new_tokens,
                            route=args.route, drain=args.duration if args.drain is None else args.drain,
                            seed=args.seed, warm_frames=args.warm_frames)
    targets = Targets(ttft_target=args.ttft_target, lag_target=args.lag_target)
    cameras = Cameras(args.video, size=args.frame_size, fps=args.fps,
                      limit=int(args.duration * args.fps) + 1)
    cameras.check()  # a bad video file is one line before any server starts
    model = args.model or "builtin"
    options = ["--model", model, *model_flags, "--max-streams", str(args.max_streams or STARTED_STREAMS),
               "--max-asks", str(SERVER_ASKS)]

    limit = args.max_streams or (STARTED_STREAMS if args.url is None else URL_CAMERAS)  # --find-max's cap
    if args.streams and args.streams[-1] > limit:  # each camera is a client made before the first frame
        held = "the server bench serve starts holds" if args.url is None else "against --url a run drives"
        raise ConfigurationError(f"--streams {args.streams[-1]}: {held} at most {limit} cameras (--max-streams "
                                 f"{limit}); give --max-streams to run more")
    client = machine()  # its load before the run adds its own

    probes: list[Probe] = []

    def sweep(url: str, server_key: str, check_server=lambda: None) -> tuple[list[dict[str, Any]], int | None]:
        probe = Probe(url, server_key, settings, targets, cameras, quiet=args.quiet, progress=default_progress,
                      check_server=check_server)
        probes.append(probe)
        probe.reach()
        probe.warm_up()
        if args.find_max:
            deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
            return probe.find_max(limit, start=(args.streams or [1])[0], deadline=deadline)
        return [probe(count) for count in args.streams or [1, 4, 16]], None

    def server_limit() -> float:
        """The most streams the server made in the search, where it refused more."""
        found = probes[0].stream_limit if probes else None
        return math.inf if found is None else found

    def report(rows: list[dict[str, Any]], most: Any, where: dict[str, Any], interrupted: bool = False) -> None:
        document = {"command": _command(), "machine": client, "server": where,
                    "settings": {**settings.__dict__, "ttft_target_s": targets.ttft_target,
                                 "lag_target_s": targets.lag_target, "videos": args.video or None,
                                 "frame_size": None if args.video else args.frame_size},
                    "results": rows}
        if interrupted:
            document["interrupted"] = True  # the runs finished before the stop; the sweep or search was cut short
        elif args.find_max:
            document["max_streams_held"], document["search_complete"] = most
            # every count up to the cap held (or up to the streams the server would make): the most may be more
            document["search_capped"] = most[0] >= min(limit, server_limit())
            document["server_stream_limit"] = probes[0].stream_limit
        if rows:
            print(table(rows))
        failed = failure_lines(rows)
        if failed:
            print("\n" + "\n".join(failed))
        if interrupted:
            print("\ninterrupted: the runs above finished before the stop" if rows
                  else "stopped before a run finished: nothing was measured")
        elif args.find_max:
            held, complete = most
            why = "" if complete else f" (--time-limit {args.time_limit:g} s reached)"
            if held >= limit:
                why = f" (the search's cap, --max-streams {limit})"
            elif server_limit() == 0:  # its limit held with streams of others: how many it holds is not known
                why = " (then the server refused every stream of a run, 429: its limit of streams)"
            elif held >= server_limit():
                why = f" (the server's limit of {server_limit()} streams: it refused more, 429)"
            if held == 0 and server_limit() == 0:
                print("\nthe server refused every stream (429: it holds its limit of streams): no camera was measured")
            else:
                print(f"\nheld at real time at {args.fps:g} fps with p95 TTFT <= {targets.ttft_target:g} s: "
                      f"{'at least ' if why else ''}{held} stream{'s' * (held != 1)}{why}")
        if "json" in outputs:
            write_json(outputs["json"], document)
        if "plot" in outputs and rows:
            plot(rows, outputs["plot"], targets, f"statekv bench serve: {where.get('model') or where.get('url')}, "
                                                 f"{args.fps:g} fps")

    if args.url is not None:
        where = {"url": args.url}
    else:
        threads = args.server_threads or omp_threads() or max(1, (os.cpu_count() or 2) - 1)
        where = {"model": model, "options": options, "torch_threads": threads}
    try:
        if args.url is not None:  # a server that stopped answering ends the runs as a dead one started here does
            rows, most = sweep(server_root(args.url), key, lambda: probes[0].reach(stopped=True))
        else:
            with LocalServer(options, threads=threads) as server:
                rows, most = sweep(server.url, server.key, server.check_running)
    except (KeyboardInterrupt, ServerError) as error:  # a stop, or the server died: the runs that finished are
        finished = [probes[0].rows[count] for count in sorted(probes[0].rows)] if probes else []  # reported first
        if finished or isinstance(error, KeyboardInterrupt):  # a stop before any run writes its JSON all the same,
            report(finished, None, where, interrupted=True)  # so an earlier sweep's file is not taken for this one
        raise
    report(rows, most, where)
    if rows and all(nothing_through(row) for row in rows):
        print("statekv bench serve: every request failed (the errors above): nothing of the server was measured",
              file=sys.stderr)
        return 1
    return 0


def server_root(url: str) -> str:
    """``url`` without a trailing slash, or the ``/v1`` of an OpenAI client's base URL."""
    try:
        parts = urllib.parse.urlsplit(url.rstrip("/"))
    except ValueError as error:  # a bracket without its pair, a host NFKC makes into another
        raise ConfigurationError(f"--url {shown(url)} is not a URL ({error})") from None
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.removesuffix("/v1"))).rstrip("/")


class Probe:
    """Runs of N cameras against one server (the load of `statekv.bench.load`, summed up by
    `statekv.bench.summary`)."""

    def __init__(self, url: str, key: str, settings, targets, cameras, *, quiet: bool = False, progress=None,
                 check_server=lambda: None):
        self.url, self.key, self.settings, self.targets, self.cameras = url, key, settings, targets, cameras
        self.quiet, self.progress, self.check_server = quiet, progress, check_server
        self.rows: dict[int, dict[str, Any]] = {}
        self.stream_limit: int | None = None  # the most streams the server would make (it refused more: 429)

    def reach(self, *, stopped: bool = False) -> None:
        """The server answers and takes the key: one line before any camera starts, not a table of failures.
        ``stopped``: between runs, said as a server that stopped answering."""
        import httpx

        from ..console import one_line
        from .server import ServerError

        try:
            answered = httpx.get(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {self.key}"}, timeout=30)
        except (httpx.HTTPError, httpx.InvalidURL) as error:  # a port that is not a number is no HTTPError
            if stopped:
                raise ServerError(f"{self.url} stopped answering during the runs: {one_line(error)}") from None
            raise ServerError(f"cannot reach {self.url}: {one_line(error)}") from None
        if answered.status_code == 401:
            raise ServerError(f"{self.url} refused the API key")
        if answered.status_code == 404:
            raise ServerError(f"{self.url} is not a statekv server: it has no /v1/models")
        if answered.status_code != 200:
            said = one_line(Exception(answered.text)) if answered.text.strip() else "no body"
            raise ServerError(f"{self.url}/v1/models answered {answered.status_code}: {said[:200]}")
        try:
            owners = {model.get("owned_by") for model in answered.json()["data"]}
        except (ValueError, KeyError, TypeError, AttributeError):
            owners = set()
        if "statekv" not in owners:  # another OpenAI-compatible server: it has no streams to push to
            raise ServerError(f"{self.url} is not a statekv server: its /v1/models lists no statekv model")

    def warm_up(self) -> None:
        """One camera for a few frames and a question, unmeasured (the first steps and answers load and warm
        the model)."""
        from .load import run_load
        from .server import ServerError

        short = replace(self.settings, duration=min(3.0, self.settings.duration), question_rate=1.0,
                        fps=max(self.settings.fps, 2.0))
        run = asyncio.run(run_load(self.url, self.key, 1, short, self.cameras.frames))
        self.check_server()
        self.check_deleted(run)
        if all(request.error is not None and request.given_up is None for request in run.requests):
            # refused or failed, every one (not merely slow): every run after it would be a table of failures
            errors = [*run.setup_failures, *(request.error for request in run.requests if request.error)]
            raise ServerError(f"{self.url} answered none of the warm-up's requests"
                              + (f", e.g. {errors[0]}" if errors else ""))

    def check_deleted(self, run) -> None:
        """A run whose streams the server did not delete is its last: the next would share the server with them."""
        from .server import ServerError

        if run.undeleted:
            raise ServerError(f"{self.url} did not delete {len(run.undeleted)} of a run's streams "
                              f"({run.undeleted[0]}); the next run would share the server with them")

    def __call__(self, count: int) -> dict[str, Any]:
        from .load import run_load
        from .server import BATCH_METRIC, FIRST_TOKEN_METRIC, QUESTION_BATCH_METRIC, histogram_mean, histogram_totals
        from .summary import summarize

        if count not in self.rows:
            self.check_server()
            show = None if self.quiet else self.progress(f"{count} stream{'s' * (count != 1)}", self.settings)
            # steps per forward, questions per answering batch, the server's own time to a first token
            metrics = (BATCH_METRIC, QUESTION_BATCH_METRIC, FIRST_TOKEN_METRIC)
            before = []
            run = asyncio.run(run_load(self.url, self.key, count, self.settings, self.cameras.frames, show,
                                       ready=lambda: before.append([histogram_totals(self.url, m) for m in metrics])))
            batch, questions, first_token = (
                histogram_mean(before[0][index] if before else None, histogram_totals(self.url, metric))
                for index, metric in enumerate(metrics))
            if show is not None and sys.stderr.isatty():
                print(file=sys.stderr)
            self.check_server()  # a run against a server that died counts nothing of the server's
            self.rows[count] = summarize(run, self.settings.fps, self.settings.duration, self.targets, batch,
                                         mean_question_batch=questions, server_ttft_mean=first_token)
            self.check_deleted(run)  # its row is kept: measured whole, then the server failed to clean up
        return self.rows[count]

    def find_max(self, limit: int, *, start: int = 1, deadline: float | None = None
                 ) -> tuple[list[dict[str, Any]], tuple[int, bool]]:
        """The most cameras held (`summary.held_all`): doubling from ``start`` up to ``limit`` (halving from it
        when it is not held), then bisecting between the last count held and the first not held. A run whose
        streams the server would not all make (its own stream limit, 429) measured that limit, not the cameras it
        holds: the search's cap becomes the streams it made (`stream_limit`). No run starts that would end past
        ``deadline`` (``time.monotonic()``), but the first. Returns every run (by count) and ``(most held, whether
        the search was complete)``."""
        from .summary import held_all

        walls: dict[int, float] = {}

        def held(count: int) -> bool | None:
            if count not in self.rows and deadline is not None and walls:  # the first run runs whatever the time
                # a run's warm-up and drain grow with its cameras: scaled from the largest run so far
                before = max((n for n in walls if n <= count), default=None)
                guess = self.settings.duration + self.settings.drain
                if before is not None:
                    guess = max(guess, walls[before] * count / before)
                if time.monotonic() + guess > deadline:
                    return None  # out of time
            started = time.monotonic()
            row = self(count)
            walls.setdefault(count, time.monotonic() - started)
            if row.get("streams_refused"):
                made = count - row["streams_refused"] - row.get("streams_unmade", 0)
                self.stream_limit = made if self.stream_limit is None else min(self.stream_limit, made)
            return held_all(row)

        def capped(count: int) -> bool:
            """Whether ``count`` ran past the server's stream limit: the search goes no higher."""
            return self.stream_limit is not None and count > self.stream_limit

        good, bad, count = 0, None, min(max(1, start), limit)
        while True:
            outcome = held(count)
            if outcome is None:
                return self.found(good, complete=False)
            if capped(count):
                limit = self.stream_limit
                if good >= limit or limit < 1:
                    break
                count = limit
                continue
            if outcome:
                good = count
                if count >= limit or bad is not None:
                    break
                count = min(2 * count, limit)
            else:
                bad = count
                if count == 1 or good:
                    break
                count //= 2  # a start not held: look below it
        while bad is not None and bad - good > 1:
            middle = (good + bad) // 2
            outcome = held(middle)
            if outcome is None:
                return self.found(good, complete=False)
            if capped(middle):  # fewer streams made than before (the server holds others now): none past them
                bad = self.stream_limit + 1
                good = min(good, self.stream_limit)
                continue
            good, bad = (middle, bad) if outcome else (good, middle)
        return self.found(good, complete=True)

    def found(self, most: int, *, complete: bool) -> tuple[list[dict[str, Any]], tuple[int, bool]]:
        return [self.rows[n] for n in sorted(self.rows)], (most, complete)


def _command() -> str | None:
    """The command line, when this process is ``statekv bench serve``, its API key left out (results are shared)."""
    argv = sys.argv[1:]
    if argv[:2] != ["bench", "serve"]:
        return None
    shown = ["KEY" if before == "--api-key" else "--api-key=KEY" if given.startswith("--api-key=") else given
             for before, given in zip(["", *argv], argv)]
    return "statekv " + shlex.join(shown)
