"""Hostile checks of two surfaces: the page `statekv serve` serves to browsers, driven as a careless person would
(an empty question, a server restarted while the page feeds a file), and the command lines of the scripts in
benchmarks/ (bad counts, NaN, a file where a folder goes, Ctrl-C): each ends in one line naming the problem, never
a traceback, and never destroys an existing docs file.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
SCRIPT_SECONDS = 120


def _script(*argv: str, timeout: float = SCRIPT_SECONDS) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _one_line_error(result: subprocess.CompletedProcess, *naming: str) -> str:
    """The run failed (not a crash by signal), with one stderr line naming each of ``naming`` and no traceback."""
    err = result.stderr
    lines = [line for line in err.splitlines() if line.strip()]
    assert result.returncode not in (0, None) and result.returncode > 0, (result.returncode, err[-2000:])
    assert "Traceback" not in err and "Fatal Python error" not in err, err[-2000:]
    assert len(lines) == 1, err[-2000:]
    for name in naming:
        assert name in lines[0], lines[0]
    return lines[0]


_LOADED: dict[str, object] = {}


def _refused_as_parsed(script: str, argv: list[str], flag: str, capsys, monkeypatch) -> str:
    """``script``'s ``main`` run in this process with ``argv`` (the scripts import torch: a process each took
    seconds) ends as argparse refuses a flag: exit 2 and one stderr line naming ``flag``, before any work."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setattr(sys, "argv", [script, *argv])
    if script not in _LOADED:
        spec = importlib.util.spec_from_file_location(f"hostile_{Path(script).stem}", REPO / script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _LOADED[script] = module
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        _LOADED[script].main()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exited.value.code == 2 and len(lines) == 1 and flag in lines[0], (exited.value.code, err[-2000:])
    return lines[0]


# -- benchmarks/: bad flags --------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["nan", "-5", "0", "inf"])
def test_gpu_suite_refuses_a_budget_that_is_not_a_positive_number(tmp_path, value, capsys, monkeypatch):
    """Before: --budget-s nan/-5 ran, skipped every section for want of time, and exited 0."""
    _refused_as_parsed("benchmarks/gpu_suite.py", ["--smoke", "--out", str(tmp_path / "out"), f"--budget-s={value}",
                                                   "--skip", "tests", "positions", "prefill", "pipeline", "streams",
                                                   "steps", "tiers", "ttft", "live"], "--budget-s", capsys,
                       monkeypatch)


def test_gpu_suite_refuses_a_file_where_its_out_folder_goes(tmp_path, capsys, monkeypatch):
    (tmp_path / "afile").write_text("kept")
    _refused_as_parsed("benchmarks/gpu_suite.py", ["--smoke", "--out", str(tmp_path / "afile"), "--skip", "tests",
                                                   "step", "positions", "prefill", "pipeline", "streams", "steps",
                                                   "tiers", "ttft", "live"], "--out", capsys, monkeypatch)
    assert (tmp_path / "afile").read_text() == "kept"


def test_gpu_suite_interrupted_keeps_the_docs_section_and_says_so_in_one_line(tmp_path):
    """Before: the docs' '## GPU suite' section was replaced by an empty smoke report as the run began, so Ctrl-C
    (or any crash) lost the recorded GPU results, and the interrupt ended in a KeyboardInterrupt traceback."""
    docs = tmp_path / "benchmarks.md"
    original = "# Benchmarks\n\n## GPU suite\n\nThe H200 results, measured once.\n\n## Later\n\nmore\n"
    docs.write_text(original)
    process = subprocess.Popen([sys.executable, "benchmarks/gpu_suite.py", "--smoke", "--out", str(tmp_path / "out"),
                                "--docs", str(docs), "--skip", "positions", "prefill", "pipeline", "streams", "steps",
                                "tiers", "ttft", "live"], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + SCRIPT_SECONDS
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line or line.startswith("== "):  # a section began
                break
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert docs.read_text() == original
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and "interrupted" in lines[0], err[-2000:]
    assert process.returncode != 0


@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_pipeline_overlap_refuses_a_switch_interval_that_is_not_a_positive_number(value, capsys, monkeypatch):
    """Before: --switch-interval nan crashed the interpreter ("Fatal Python error: take_gil"), -1 a traceback."""
    _refused_as_parsed("benchmarks/pipeline_overlap.py", ["--frames", "4", "--repeats", "1", "--width", "64",
                                                          "--height", "48", f"--switch-interval={value}"],
                       "--switch-interval", capsys, monkeypatch)


@pytest.mark.parametrize("flag, value", [("--frames", "0"), ("--repeats", "0"), ("--width", "-64"),
                                         ("--threads", "0")])
def test_pipeline_overlap_refuses_counts_that_are_not_positive(flag, value, capsys, monkeypatch):
    argv = {"--frames": "4", "--repeats": "1", "--width": "64", "--height": "48", flag: value}
    _refused_as_parsed("benchmarks/pipeline_overlap.py", [part for pair in argv.items() for part in pair], flag,
                       capsys, monkeypatch)


@pytest.mark.parametrize("flag, value", [("--new-tokens", "1"), ("--new-tokens", "0"), ("--repeats", "0"),
                                         ("--threads", "0"), ("--checkpoints", "0"), ("--budget", "-1")])
def test_ask_latency_refuses_counts_it_cannot_measure_with(flag, value, capsys, monkeypatch):
    """Before: --new-tokens 1 (a plausible value) ended in ZeroDivisionError, --repeats 0 in StatisticsError."""
    argv = {"--checkpoints": "4", "--repeats": "1", "--new-tokens": "2", flag: value}
    _refused_as_parsed("benchmarks/ask_latency.py", [part for pair in argv.items() for part in pair], flag, capsys,
                       monkeypatch)


def test_ask_latency_refuses_a_folder_as_its_out_file_before_measuring(tmp_path, capsys, monkeypatch):
    """Refused as its flags are read, before the minutes of measuring."""
    _refused_as_parsed("benchmarks/ask_latency.py", ["--checkpoints", "4", "--repeats", "1", "--new-tokens", "2",
                                                     "--out", str(tmp_path)], "--out", capsys, monkeypatch)


@pytest.mark.parametrize("flag, value", [("--repeats", "0"), ("--frames", "0"), ("--threads", "0")])
def test_positions_cost_refuses_counts_that_are_not_positive(flag, value, capsys, monkeypatch):
    argv = {"--frames": "4", "--repeats": "1", "--past-frames": "0", "--paired-frames": "4", "--depths": "24",
            "--depth-frames": "4", flag: value}
    _refused_as_parsed("benchmarks/positions_cost.py", [part for pair in argv.items() for part in pair], flag,
                       capsys, monkeypatch)


def test_retrieval_from_a_missing_json_says_so_in_one_line(tmp_path):
    result = _script("benchmarks/retrieval.py", "--data", str(tmp_path / "data"), "--seed", "1", "--from-json",
                     str(tmp_path / "missing.json"), "--accuracy-out", str(tmp_path / "a.md"))
    _one_line_error(result, "missing.json")


@pytest.mark.parametrize("flag, value", [("--ks", "a,b"), ("--ks", "0"), ("--threads", "0"),
                                         ("--max-frames", "-5"), ("--segment-steps", "0"), ("--methods", "nosuch")])
def test_retrieval_refuses_bad_flags_before_making_its_data_set(tmp_path, flag, value, capsys, monkeypatch):
    """Before: each was found only after the synthetic set was made (minutes at the default size), as a traceback."""
    _refused_as_parsed("benchmarks/retrieval.py", ["--data", str(tmp_path / "data"), "--seed", "1", "--videos", "1",
                                                   "--frames", "12", "--methods", "full", flag, value], flag, capsys,
                       monkeypatch)
    assert not (tmp_path / "data").exists()


def test_a_section_is_not_mistaken_for_a_deeper_heading_of_the_same_title(tmp_path):
    """write_section("Watches") on a file holding "### Watches" (docs/serving.md's API subsection) replaced that
    subsection's text instead of adding a "## Watches" section."""
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "benchmarks" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    path = tmp_path / "serving.md"
    path.write_text("# Serving\n\n## The API\n\n### Watches\n\nthe API's watches\n\n## Later\n\nmore\n")
    report.write_section(path, "Watches", "measured")
    text = path.read_text()
    assert "### Watches\n\nthe API's watches\n" in text
    assert re.search(r"^## Watches\n\nmeasured\n", text, re.MULTILINE), text


@pytest.mark.parametrize("script", sorted(path.name for path in (REPO / "benchmarks").glob("*.py")))
def test_a_command_a_benchmark_records_is_quoted_as_a_shell_reads_it(script):
    """A benchmark's results name the command that made them, to be pasted into a shell: joined with spaces, a path
    or a value holding a space, a quote or a ``$`` ran as another command."""
    source = (REPO / "benchmarks" / script).read_text()
    joined = re.findall(r"""['"] ['"]\.join\((?:argv|sys\.argv|arguments)\b[^\n]*""", source)
    assert not joined, f"{script}: {joined[0]}"


# -- the page ------------------------------------------------------------------------------------------------------
def test_a_blank_question_is_not_filled_with_the_options():
    """The page adds the options A-D to a question that lists none: to a blank one too, so a blank question was
    asked ("A. red ...") and answered with a letter, and a blank watch was made; the API refuses both."""
    from statekv.serve.page_watches import with_choices

    for blank in ("", "   \n  "):
        assert not with_choices(blank, ["red", "green", "blue", "yellow"]).strip()


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from test_serve import Server

    from statekv.cli import main

    media = tmp_path_factory.mktemp("media")
    for folder, seed, frames in (("short", 4301, 12), ("long", 4302, 240)):
        assert main(["synthetic", "make", "--out", str(media / folder), "--videos", "1", "--seed", str(seed),
                     "--frames", str(frames)]) == 0
    running = Server(tmp_path_factory.mktemp("page") / "state", media).start()
    yield running
    running.stop()


@pytest.fixture
def browser_page(page_server):
    from test_serve import CHROMIUM, KEY, launched_chromium

    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = launched_chromium(playwright)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            failures = []
            page.on("pageerror", lambda error: failures.append(str(error)))
            page.goto(f"{page_server.url}/?key={KEY}")
            page.wait_for_selector(".statekv-key-status:has-text('key accepted')", timeout=60_000)
            yield page
            assert failures == []
        finally:
            browser.close()


def _note_text(page, name: str) -> str:
    selector = f".statekv-error-{name} .statekv-error-message"
    page.wait_for_function(f"() => {{ const note = document.querySelector({selector!r}); "
                           "return note && note.offsetParent !== null && note.innerText.trim().length > 0; }",
                           timeout=30_000)
    return page.inner_text(selector)


def test_the_servers_output_holds_no_key_given_to_it_nor_one_in_a_page_url_it_does_not_know(page_server):
    """Before: every start printed the key given with --api-key in its `open` line (to the logs, at each restart),
    and a page URL with a typo logged its whole URL, ?key= and all, at any length."""
    import httpx
    from test_serve import KEY, OTHER_KEY

    for path in (f"/ui/typo?key={KEY}&stream=st_x", f"/ui/{'x' * 5000}?KEY={OTHER_KEY}"):
        assert httpx.get(page_server.url + path, timeout=60).status_code == 404
    deadline = time.monotonic() + 30
    while "(hidden)&stream=st_x" not in page_server.printed():
        assert time.monotonic() < deadline, page_server.printed()[-2000:]
        time.sleep(0.2)
    printed = page_server.printed()
    assert "statekv serve: open http" in printed and KEY not in printed and OTHER_KEY not in printed
    assert max(map(len, printed.splitlines())) < 1000


@pytest.mark.slow
def test_the_page_refuses_a_blank_question_and_a_blank_watch(page_server, browser_page):
    """Before: a blank question was asked as the options alone and answered ("B"); a blank watch was made."""
    page = browser_page
    page.set_input_files(".statekv-upload-new input[type=file]",
                         str(page_server.media / "short" / "videos" / "v0000.mp4"))
    page.wait_for_selector(".statekv-stats:has-text('12 frames ·')", timeout=60_000)
    for blank in ("", "   \n  "):
        page.get_by_label("Question").fill(blank)
        page.get_by_role("button", name="Ask").click()
        assert "question must be a non-empty string" in _note_text(page, "ask")
        page.click(".statekv-error-ask button")
    page.get_by_role("button", name="Watch").click()
    assert "question must be a non-empty string" in _note_text(page, "watch")
    time.sleep(1.0)  # (a refresh's worth)
    assert page.locator(".statekv-answer").count() == 0 and page.locator(".statekv-watch").count() == 0


@pytest.mark.slow
def test_a_file_the_page_was_feeding_when_the_server_restarted_is_named_after_it(page_server, browser_page):
    """Before: after the restart the stream read "ready" with the frames fed so far, and nothing said that the
    rest of the file never went in (the page's upload is gone: the person's only sign is the frame count)."""
    frames, note = _restarted_mid_feed(browser_page, page_server, page_server.stop)
    assert 0 < frames < 240
    assert "v0000.mp4" in note and "240" in note and "add the same file to this stream again" in note, note
    _feed_again_and_hold_it_once(browser_page, page_server)


def _restarted_mid_feed(page, page_server, stop) -> tuple[int, str]:
    """Feed the long file from the page, ``stop`` the server partway, start it again: the frames the stream holds
    and the page's note on the feed."""
    page.set_input_files(".statekv-upload-new input[type=file]",
                         str(page_server.media / "long" / "videos" / "v0000.mp4"))
    page.wait_for_function("() => /: ([1-9]\\d) of 240/.test("
                           "(document.querySelector('.statekv-progress') || {}).innerText || '')", timeout=60_000)
    page.evaluate("window.beforeRestart = true")
    stop()
    page_server.start()
    page.wait_for_function("() => window.beforeRestart === undefined", timeout=120_000)
    page.wait_for_selector(".statekv-stats:has-text('frames ·')", timeout=60_000)
    return int(re.match(r"(\d+) frames", page.inner_text(".statekv-stats")).group(1)), _note_text(page, "feed")


def _feed_again_and_hold_it_once(page, page_server) -> None:
    """Add the file the stream's cut feed named: what the stream holds of it is skipped (before: the file was fed
    from its start again, its first frames twice)."""
    page.set_input_files(".statekv-upload-more input[type=file]",
                         str(page_server.media / "long" / "videos" / "v0000.mp4"))
    page.wait_for_function("() => /^(2[4-9]\\d|[3-9]\\d\\d) frames/.test("
                           "document.querySelector('.statekv-stats').innerText)", timeout=180_000)
    time.sleep(2.0)  # refreshes enough for a feed still under way to show more
    assert page.inner_text(".statekv-stats").startswith("240 frames"), page.inner_text(".statekv-stats")


@pytest.mark.slow
def test_a_feed_stopped_from_the_page_is_saved_and_the_same_file_goes_on_from_there(page_server, browser_page):
    """Before: a feed of the wrong file ran to its end; only deleting its stream, or the server's stop, ended it."""
    page = browser_page
    page.set_input_files(".statekv-upload-new input[type=file]",
                         str(page_server.media / "long" / "videos" / "v0000.mp4"))
    page.wait_for_function("() => /: ([1-9]\\d) of 240/.test("
                           "(document.querySelector('.statekv-progress') || {}).innerText || '')", timeout=60_000)
    page.get_by_role("button", name="stop feeding").click()
    note = _note_text(page, "feed")
    stopped = re.search(r"was stopped as asked after (\d+) of its 240 frames, saved; add the same file", note)
    assert stopped and 10 <= int(stopped.group(1)) < 240, note
    page.wait_for_selector(f".statekv-stats:has-text('{stopped.group(1)} frames ·')", timeout=30_000)
    assert not page.locator(".statekv-progress").is_visible()
    _feed_again_and_hold_it_once(page, page_server)


@pytest.mark.slow
def test_a_feed_cut_by_a_kill_says_what_the_stream_holds_of_its_file(page_server, browser_page):
    """Before: a page's feed was in the stream's record only once a save or an answer wrote it, so after a kill -9
    the stream came back with what its last save held and nothing said that its file had been cut."""
    held, note = _restarted_mid_feed(browser_page, page_server, page_server.kill)
    assert f"the stream holds the first {held} of its 240 frames" in note, note
    _feed_again_and_hold_it_once(browser_page, page_server)


@pytest.mark.slow
def test_the_camera_pressed_twice_runs_once_and_stops_for_its_own_stream_alone(page_server):
    """Before: pressing "from the camera" again left the first capture posting frames with no control left to stop
    it (the camera stayed on); "stop camera" showed on every stream opened after, and deleting any open stream
    stopped the camera feeding another."""
    from test_serve import CHROMIUM, KEY, launched_chromium

    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")

    def frames(stream_id: str) -> int:
        with page_server.client() as client:
            return client.get(f"/v1/streams/{stream_id}").json()["frames"]

    def camera_stream(page, before: set) -> str:
        page.get_by_role("button", name="from the camera").click()
        page.wait_for_function("() => /[?&]stream=/.test(location.search)", timeout=60_000)
        page.wait_for_function(f"() => !{sorted(before)!r}.includes(new URLSearchParams(location.search)"
                               ".get('stream'))", timeout=60_000)
        made = page.evaluate("new URLSearchParams(location.search).get('stream')")
        page.wait_for_function("() => /^[1-9]\\d* frames/.test(document.querySelector('.statekv-stats').innerText)",
                               timeout=60_000)
        return made

    with sync_api.sync_playwright() as playwright:
        browser = launched_chromium(playwright, "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream")
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
            page.goto(f"{page_server.url}/?key={KEY}")
            page.wait_for_selector(".statekv-key-status:has-text('key accepted')", timeout=60_000)
            first = camera_stream(page, set())
            second = camera_stream(page, {first})
            still = frames(first)
            time.sleep(2.5)  # a frame a second: the first capture, were it running, would have posted more
            assert frames(first) == still and frames(second) > 0
            page.set_input_files(".statekv-upload-new input[type=file]",  # a third stream, not the camera's
                                 str(page_server.media / "short" / "videos" / "v0000.mp4"))
            page.wait_for_selector(".statekv-stats:has-text('12 frames ·')", timeout=60_000)
            other = page.evaluate("new URLSearchParams(location.search).get('stream')")
            assert other not in (first, second) and not page.is_visible("button:has-text('stop camera')")
            page.click(f".statekv-stream-{other} button[aria-label=delete]")
            page.get_by_role("button", name="delete it").click()
            page.wait_for_selector(".statekv-status:has-text('was deleted')", timeout=60_000)
            fed = frames(second)
            time.sleep(2.5)
            assert frames(second) > fed  # deleting another stream left the camera running
            page.click(f".statekv-stream-{second} button[aria-label=open]")
            page.get_by_role("button", name="stop camera").click()
            time.sleep(1.5)
            stopped = frames(second)
            time.sleep(2.5)
            assert frames(second) == stopped
        finally:
            browser.close()


@pytest.mark.slow
def test_the_page_fits_a_phone_and_keeps_its_stream_under_a_stale_key(page_server, browser_page, tmp_path):
    """Before, at a phone's width the stream list stayed beside the open stream (a question box 24 px wide, Ask
    under the list); a file name with no space ran the page off its side; a file whose type the browser does not
    know (Matroska on some) was refused; a question the options took past the limit passed the box's check; a blank
    cadence named a field the page has not; and a link with a stale ?key= made the browser forget its stream."""
    page = browser_page
    accept = page.get_attribute(".statekv-upload-new input[type=file]", "accept")
    assert "video/*" in accept and ".mkv" in accept and ".ts" in accept, accept
    named = tmp_path / ("a" * 150 + ".mp4")
    shutil.copy(page_server.media / "short" / "videos" / "v0000.mp4", named)
    page.set_input_files(".statekv-upload-new input[type=file]", str(named))
    page.wait_for_selector(".statekv-stats:has-text('12 frames ·')", timeout=60_000)
    stream_id = page.evaluate("new URLSearchParams(location.search).get('stream')")
    # once laid out: on a loaded machine the upload's notice may still be leaving as the stats show
    page.wait_for_function("() => document.documentElement.scrollWidth <= window.innerWidth + 1", timeout=10_000)
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_function("() => document.querySelector('.statekv-sidebar').getBoundingClientRect().bottom <= "
                           "document.querySelector('.statekv-panel').getBoundingClientRect().top + 1", timeout=10_000)
    assert page.evaluate("document.querySelector('.statekv-question').getBoundingClientRect().width") > 200
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    page.get_by_role("button", name="Ask").click(timeout=10_000)  # not covered by the list
    page.set_viewport_size({"width": 1280, "height": 900})
    page.get_by_label("Question").fill("x" * 7990)  # under the limit alone, over it with the options added
    page.wait_for_selector("text=over the limit of 8000 characters with the options A-D", timeout=10_000)
    page.get_by_label("every (frames)").fill("")
    page.get_by_role("button", name="Watch").click()
    assert _note_text(page, "watch") == "every (frames) must be a whole number of frames from 1"
    page.goto(f"{page_server.url}/?key=stale")
    page.wait_for_selector(".statekv-error-key", timeout=60_000)
    assert page.evaluate("localStorage.getItem('statekv-stream')") == stream_id
    with page_server.client() as client:
        client.delete(f"/v1/streams/{stream_id}").raise_for_status()


@pytest.mark.slow
def test_the_file_pickers_have_names_a_screen_reader_can_say(browser_page):
    """The uploaders' only keyboard control (Quasar's add button) is named by its icon's ligature, "add_box": a
    screen reader says "add_box", not what it does."""
    page = browser_page
    for name in ("new", "more"):
        control = page.locator(f".statekv-upload-{name} [role=button], .statekv-upload-{name} button").first
        label = control.get_attribute("aria-label") or control.inner_text()
        assert "video" in label.lower(), label


# A server whose every answer token takes a while, and whose closed tabs are gone soon after: a tab closed
# mid-answer is found gone long before its answer would be whole. Its watches take a while to open too: the page
# is used meanwhile.
TOKEN_SECONDS = 0.8  # sixteen tokens outlast a closed tab found gone, on a loaded machine too
OPEN_SECONDS = 3.0
SLOW_ANSWERS = f"""
import sys, time
import statekv.serve.page
import statekv.serve.watch_routes
from statekv.cli import main
from statekv.serve.sse import StopOnceSet

statekv.serve.page.RECONNECT_SECONDS = 1.0
checked, opened = StopOnceSet.__call__, statekv.serve.watch_routes.open_on

def slowly(self, *args, **kwargs):
    time.sleep({TOKEN_SECONDS})
    return checked(self, *args, **kwargs)

def opened_slowly(*args, **kwargs):
    time.sleep({OPEN_SECONDS})
    return opened(*args, **kwargs)

StopOnceSet.__call__ = slowly
statekv.serve.watch_routes.open_on = opened_slowly
sys.exit(main(sys.argv[1:]))
"""
STOPPED = r"^statekv_answers_stopped_total (\S+)$"
ANSWERED_ON_THE_PAGE = r'^statekv_asks_total\{route="page"\} (\S+)$'


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    pytest.importorskip("httpx")
    from test_serve import CHROMIUM, Server

    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    folder = tmp_path_factory.mktemp("slow")
    (folder / "media").mkdir()
    running = Server(folder / "state", folder / "media", launch=("-c", SLOW_ANSWERS)).start()
    yield running
    running.stop()


@pytest.fixture
def slow_browser(slow_server):
    from test_serve import chromium_browser

    with chromium_browser() as browser:
        yield browser
    printed = slow_server.printed()
    assert not re.search(r"Traceback|ERROR|WARNING|Client has been deleted", printed), printed[-3000:]


def _get(server, path: str):
    with server.client() as client:
        return client.get(path)


def _metric(server, pattern: str) -> float:
    found = re.search(pattern, _get(server, "/metrics").text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _queued(server) -> int:
    return _get(server, "/health").json()["queued"]


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.05)


def _stream_of_four_frames(server) -> str:
    from PIL import Image

    with server.client() as client:
        stream_id = client.post("/v1/streams", json={"horizon_frames": 16}).json()["id"]
        for second in range(4):
            buffer = io.BytesIO()
            image = np.random.default_rng(second).integers(0, 256, (48, 64, 3), dtype=np.uint8)
            Image.fromarray(image).save(buffer, "PNG")
            pushed = client.post(f"/v1/streams/{stream_id}/frames?t={second}", content=buffer.getvalue(),
                                 headers={"Content-Type": "image/png"})
            assert pushed.status_code == 200, pushed.text
    return stream_id


def _ask_in_a_new_tab(browser, server, stream_id: str):
    """A tab of its own (a browser context) on the stream, asking a question the built-in model answers at length."""
    from test_serve import KEY

    tab = browser.new_context().new_page()
    tab.goto(f"{server.url}/?key={KEY}&stream={stream_id}")
    tab.wait_for_selector(".statekv-stats:has-text('4 frames ·')", timeout=60_000)
    for letter in "abcd":  # no options: the built-in model answers to its last token, not with a letter
        tab.fill(f".statekv-choice-{letter} input", "")
    tab.get_by_label("Question").fill("What colour was the triangle?")
    tab.get_by_role("button", name="Ask").click()
    return tab


@pytest.mark.slow
def test_a_question_asked_in_a_tab_that_is_closed_stops_unrecorded(slow_server, slow_browser):
    """Before: the page asked with no way to stop its answer, so a tab closed mid-answer left the model answering
    it to its last token, and the answer was recorded for nobody."""
    stopped, answered = _metric(slow_server, STOPPED), _metric(slow_server, ANSWERED_ON_THE_PAGE)
    tab = _ask_in_a_new_tab(slow_browser, slow_server, _stream_of_four_frames(slow_server))
    _wait_for(lambda: _queued(slow_server) > 0, 30, "the question to reach the model")
    tab.context.close()
    _wait_for(lambda: _metric(slow_server, STOPPED) + _metric(slow_server, ANSWERED_ON_THE_PAGE) > stopped + answered,
              60, "the answer to end")
    assert _metric(slow_server, STOPPED) == stopped + 1
    assert _metric(slow_server, ANSWERED_ON_THE_PAGE) == answered  # not recorded as answered
    _wait_for(lambda: _queued(slow_server) == 0, 30, "the model to be free")


@pytest.mark.slow
def test_a_question_still_waiting_for_the_model_when_its_tab_is_closed_is_not_answered(slow_server, slow_browser):
    """A question queued behind another tab's answer, its own tab closed meanwhile, is stopped before it begins: the
    model answers the tab still open and is free right after."""
    stopped, answered = _metric(slow_server, STOPPED), _metric(slow_server, ANSWERED_ON_THE_PAGE)
    first, second = _stream_of_four_frames(slow_server), _stream_of_four_frames(slow_server)
    kept = _ask_in_a_new_tab(slow_browser, slow_server, first)
    _wait_for(lambda: _queued(slow_server) > 0, 30, "the first question to reach the model")
    closed = _ask_in_a_new_tab(slow_browser, slow_server, second)
    _wait_for(lambda: _queued(slow_server) > 1, 30, "the second question to wait for the model")
    closed.context.close()
    kept.wait_for_selector(".statekv-answer", timeout=60_000)
    _wait_for(lambda: _queued(slow_server) == 0, 30, "the model to be free")
    assert _metric(slow_server, ANSWERED_ON_THE_PAGE) == answered + 1  # the open tab's
    assert _metric(slow_server, STOPPED) == stopped + 1


@pytest.mark.slow
def test_a_watch_added_as_another_stream_opens_stays_with_its_own_stream(slow_server, slow_browser):
    """Before: a watch add that ended after another stream was opened drew the first stream's watches under the
    second (a delete there closed the first's watch but rewrote the second's record, so a kill brought it back),
    wiped what was typed for the second, and left the first's error note under it; a double click on Watch made
    two watches."""
    from test_serve import KEY

    first, second = _stream_of_four_frames(slow_server), _stream_of_four_frames(slow_server)
    page = slow_browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.goto(f"{slow_server.url}/?key={KEY}&stream={first}")
    page.wait_for_selector(".statekv-stats:has-text('4 frames ·')", timeout=60_000)
    page.get_by_role("button", name="Watch").click()  # blank: refused at once, its note shown
    assert "question must be a non-empty string" in _note_text(page, "watch")
    page.evaluate("""second => { window.foreign = []; new MutationObserver(() => {
        if (!location.search.includes(second)) return;  // a watch card drawn while the second is open: the first's
        document.querySelectorAll('.statekv-watch').forEach(card => window.foreign.push(card.className)); })
        .observe(document.body, {subtree: true, childList: true}); }""", second)
    page.fill(".statekv-watch-question input", "What colour was the circle?")
    page.click(".statekv-watch-add")
    time.sleep(0.3)
    page.click(f".statekv-stream-{second} [aria-label=open]")
    page.wait_for_function(f"() => location.search.includes({second!r})", timeout=30_000)
    page.fill(".statekv-watch-question input", "typed for the second")
    _wait_for(lambda: len(_get(slow_server, f"/v1/streams/{first}/watches").json()["data"]) == 1, 60,
              "the first stream's watch")
    time.sleep(1.5)  # (refreshes of the page's panel)
    assert page.input_value(".statekv-watch-question input") == "typed for the second"
    assert page.locator(".statekv-watch").count() == 0 and page.evaluate("window.foreign") == []
    assert not page.locator(".statekv-error-watch .statekv-error-message").is_visible()
    page.dblclick(".statekv-watch-add")
    _wait_for(lambda: _get(slow_server, f"/v1/streams/{second}/watches").json()["data"], 60, "the second's watch")
    time.sleep(OPEN_SECONDS + 1)
    assert len(_get(slow_server, f"/v1/streams/{second}/watches").json()["data"]) == 1
    page.wait_for_selector(".statekv-watch", timeout=30_000)


def test_the_timeline_draws_each_watch_on_a_row_of_its_own_and_every_rows_label():
    """Before: two watches whose questions began alike were drawn on one row (a category axis merges rows of one
    name), and a timeline of many rows hid every other label."""
    from types import SimpleNamespace

    from statekv.serve.page_watches import timeline_height, timeline_options, timeline_rows

    question = "What colour was the circle?\nA. red\nB. green"
    watches = [SimpleNamespace(question=question, events=[SimpleNamespace(frame=frame, answer="A")])
               for frame in (3, 5)]
    entry = SimpleNamespace(answers=[{"question": question, "frames": 4}] * 2, stream=SimpleNamespace(watches=watches))
    rows, read, events = timeline_rows(entry)
    assert len(set(rows)) == len(rows) == 4
    assert [row for _, row, _ in events] == rows[2:]
    assert timeline_options()["yAxis"]["axisLabel"]["interval"] == 0
    assert timeline_height(4) == 224 and timeline_height(24) >= 24 * 18
