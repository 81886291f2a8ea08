"""`statekv serve --ray` on a real Ray cluster on this machine (127.0.0.1 only, no dashboard), two replicas of the
built-in model behind Ray Serve, as docs/serving.md runs it: streams from several clients placed on both replicas,
every answer equal to `VideoQA` alone, keys isolating streams across replicas, metrics per replica; then one
replica's process killed with kill -9 while clients push, and every stream answering again from the other replica
with nothing lost beyond the unsaved tail (clients only retry, from where the stream says to resume) and no stream
written by two replicas (the leases' history and the records' fencing tokens); a stream one replica finds damaged
listed so whichever replica answers, and deleted; then Ctrl-C saving every stream. The cluster is this test's own,
shut down at the end with every process it started."""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("ray.serve", reason="statekv[ray] is part of .[test]")
psutil = pytest.importorskip("psutil")
from PIL import Image  # noqa: E402

import statekv  # noqa: E402

from conftest import random_frames  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.xdist_group("ray")]
CHROMIUM = shutil.which("chromium")  # the page through Ray Serve's proxies, when Debian's Chromium is there
REPO = Path(__file__).resolve().parents[1]
KEY, OTHER_KEY = "ray-key-one", "ray-key-two"
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."
NEW_TOKENS = 6
FRAMES = 8  # pushed to each stream
SIZE = (48, 64)  # the frames a client sends: height, width
SAVE_EVERY = 2  # frames: what a kill may lose is at most this (a stream is saved before the push after them)
LEASE_SECONDS = 3
BOUND_SECONDS = 240  # the whole scenario, cluster included
STOP_SECONDS = 45  # a Ctrl-C's stop with clients following events (before: `serve.delete` gave up at 60 s, unsaved)

CLUSTER = """
import json, sys, ray
context = ray.init(include_dashboard=False, num_cpus=2, _temp_dir=sys.argv[1], log_to_driver=False)
print(json.dumps({"address": context.address_info["gcs_address"]}), flush=True)
sys.stdin.read()  # until the test closes it, or dies
ray.shutdown()
"""

# What the replicas tell the routers (`StreamReplica.record_routing_stats`), asked through the application's handle.
ROUTING_STATS = """
import json, sys, ray
from ray import serve
ray.init(address=sys.argv[1], log_to_driver=False)
handle = serve.get_app_handle("statekv")
print(json.dumps([handle.record_routing_stats.remote().result(timeout_s=60) for _ in range(int(sys.argv[2]))]))
"""


RAY_FORWARDED = re.compile(r"^\((?:raylet|\w+ pid=\d+)[^)]*\) ")  # a line Ray forwards from one of its processes


def _own_lines(printed: str) -> list[str]:
    """What statekv itself printed: ``printed`` less the lines Ray forwards from its own processes (its controller
    may log a traceback for a replica that statekv ends before it was placed; that is Ray's log, not an error)."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", printed)
    return [line for line in plain.splitlines() if line.strip() and not RAY_FORWARDED.match(line)]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ray_env() -> dict[str, str]:
    """A loopback-only cluster (Ray's local mode of addressing), token-authenticated with a token of its own."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0"}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "STATEKV_API_KEYS"):
        env.pop(name, None)
    return env


@pytest.fixture(scope="module")
def cluster(ray_env):
    """A Ray head on 127.0.0.1 run by a helper process of this test; at the end it is shut down and every
    process it started is checked gone (any left is killed by its id, and the test fails)."""
    temp = tempfile.mkdtemp(prefix="skv-ray-", dir="/tmp")  # short: Ray's socket paths must fit
    helper = subprocess.Popen([sys.executable, "-c", CLUSTER, temp], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=ray_env, text=True)
    started: set[int] = set()
    try:
        line = helper.stdout.readline()
        assert line, "the Ray head did not start"
        yield {"address": json.loads(line)["address"], "helper": helper, "started": started}
    finally:
        started |= {child.pid for child in psutil.Process(helper.pid).children(recursive=True)}
        helper.stdin.close()
        helper.wait(timeout=60)
        deadline, left = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            left = [pid for pid in started if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
            if not left:
                break
            time.sleep(0.5)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray processes outlived the cluster: {left}"


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", budget=64)


def _png(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def _alone(qa, frames: list[np.ndarray], new_tokens: int = NEW_TOKENS) -> str:
    with qa.stream(horizon_frames=16, max_fps=None) as stream:
        for index, image in enumerate(frames):
            stream.push(image, float(index))
        return stream.ask(QUESTION, max_new_tokens=new_tokens)


class Client:
    """A client that only retries: a failed request (a replica gone, a stream on its way to another) is sent
    again after a pause; pushing resumes from the frame the stream says it needs next."""

    RETRIED = (500, 502, 503, 504)

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        self.retries = 0
        self.resumed: list[tuple[str, int, int]] = []  # (stream, frames acknowledged, frame it resumed from)

    def call(self, method: str, path: str, **kwargs) -> httpx.Response:
        deadline = time.monotonic() + 90
        while True:
            try:
                response = self.http.request(method, path, **kwargs)
                if response.status_code not in self.RETRIED:
                    return response
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{method} {path} kept failing"
            self.retries += 1
            time.sleep(0.3)

    def feed(self, stream_id: str, frames: list[np.ndarray], stop_at: int | None = None,
             pause: float = 0.0) -> int:
        """Push ``frames`` from where the stream needs its next one; returns how many were acknowledged."""
        index = self.call("GET", f"/v1/streams/{stream_id}").json()["resume_from"]
        while index < (len(frames) if stop_at is None else stop_at):
            try:
                response = self.http.post(f"/v1/streams/{stream_id}/frames?t={index}", content=_png(frames[index]),
                                          headers={"Content-Type": "image/png"})
                ok = response.status_code == 200
            except httpx.TransportError:
                ok = False
            if ok:
                index += 1
                time.sleep(pause)
            else:  # the push may or may not have landed: the stream says where to resume
                self.retries += 1
                time.sleep(0.3)
                acknowledged, index = index, self.call("GET", f"/v1/streams/{stream_id}").json()["resume_from"]
                self.resumed.append((stream_id, acknowledged, index))
        return index

    def ask(self, stream_id: str) -> dict:
        response = self.call("POST", f"/v1/streams/{stream_id}/ask",
                             json={"question": QUESTION, "max_new_tokens": NEW_TOKENS})
        assert response.status_code == 200, response.text
        return response.json()


class Follower:
    """A client following a stream's watch events (``GET /v1/streams/{id}/events``) on a thread of its own, from
    when its feed has begun."""

    def __init__(self, url: str, key: str, stream_id: str):
        self.begun, self.outcome = threading.Event(), None
        self.thread = threading.Thread(target=self._follow, args=(url, key, stream_id), daemon=True)
        self.thread.start()
        assert self.begun.wait(60), self.outcome

    def _follow(self, url: str, key: str, stream_id: str) -> None:
        try:
            with httpx.stream("GET", f"{url}/v1/streams/{stream_id}/events", timeout=None,
                              headers={"Authorization": f"Bearer {key}"}) as response:
                assert response.status_code == 200, response.status_code
                self.begun.set()
                for _ in response.iter_lines():
                    pass
            self.outcome = "ended"
        except Exception as error:  # noqa: BLE001 - said by `ended`
            self.outcome = repr(error)
        finally:
            self.begun.set()

    def ended(self) -> bool:
        """Whether the server ended the feed, as a finished response (within ten seconds)."""
        self.thread.join(10)
        return self.outcome == "ended"


def _replica_processes(state: Path) -> dict[str, int]:
    """Each live replica's process, from the replicas' board in the state folder."""
    found = {}
    for path in (state / "replicas").glob("*.json"):
        try:
            posted = json.loads(path.read_text())
        except ValueError:
            continue
        found[posted["replica"]] = posted["pid"]
    return found


def _streams_per_replica(client: Client, expected: dict[str, int]) -> dict[str, int]:
    """``statekv_streams`` per replica (those holding any) from ``GET /metrics``, once it is ``expected`` or ten
    seconds have passed (each replica posts its metrics every two seconds)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = client.call("GET", "/metrics").text
        counts = {name: int(float(value)) for name, value in
                  re.findall(r'^statekv_streams\{replica="(\w+)"\} (\S+)$', metrics, re.MULTILINE) if float(value)}
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


def test_two_replicas_on_a_local_ray_cluster_survive_a_kill_9_with_only_the_unsaved_tail_lost(cluster, ray_env,
                                                                                           qa, tmp_path):
    began = time.monotonic()
    state, server, log = tmp_path / "state", None, None
    try:
        for attempt in range(3):  # a free port can be taken by one of Ray's own processes before its proxy binds it
            port = _free_port()
            log = open(tmp_path / "serve.log", "w")
            command = [sys.executable, "-m", "statekv.cli", "serve", "--ray", cluster["address"], "--replicas", "2",
                       "--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state), "--api-key", KEY,
                       "--api-key", OTHER_KEY, "--save-every-frames", str(SAVE_EVERY), "--save-every-seconds", "600",
                       "--lease-seconds", str(LEASE_SECONDS)]
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=ray_env)
            deadline = time.monotonic() + 150
            while "ready (pid" not in (tmp_path / "serve.log").read_text() and server.poll() is None:
                assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
                time.sleep(0.5)
            printed = (tmp_path / "serve.log").read_text()
            if server.poll() is None or "Ray Serve's proxy could not bind it" not in printed or attempt == 2:
                break
            assert not any("Traceback" in line for line in _own_lines(printed))  # one line, not a traceback
            log.close()
        assert "ready (pid" in printed and server.poll() is None, printed[-3000:]
        assert f"listening on http://127.0.0.1:{port} (Ray Serve, 2 replicas)" in printed
        url = f"http://127.0.0.1:{port}"
        client, other = Client(url, KEY), Client(url, OTHER_KEY)

        # -- placement, answers, keys ------------------------------------------------------------------------
        seeds = {}
        for seed in (11, 12, 13):
            response = client.call("POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None})
            assert response.status_code == 201, response.text
            seeds[response.json()["id"]] = seed
        theirs = other.call("POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None}).json()["id"]
        seeds[theirs] = 14
        owners = {stream_id: (other if stream_id == theirs else client) for stream_id in seeds}
        placed = {stream_id: owners[stream_id].call("GET", f"/v1/streams/{stream_id}").json()["replica"]
                  for stream_id in seeds}
        assert sorted(list(placed.values()).count(name) for name in set(placed.values())) == [2, 2]  # least-loaded
        asked = subprocess.run([sys.executable, "-c", ROUTING_STATS, cluster["address"], "12"], env=ray_env,
                               capture_output=True, text=True, timeout=120)
        reports = json.loads(asked.stdout.splitlines()[-1])  # from either replica, as the handle routes them
        assert {stream for report in reports for stream in report["held"]} == set(seeds)
        answered = {request for report in reports for request in report["answered"]}
        assert len(answered) >= len(seeds) and all(answered)  # each creation listed by its request's id
        half = FRAMES // 2
        feeders = [threading.Thread(target=owners[stream_id].feed,
                                    args=(stream_id, random_frames(FRAMES, seed, *SIZE), half))
                   for stream_id, seed in seeds.items()]
        for feeder in feeders:
            feeder.start()
        for feeder in feeders:
            feeder.join()
        for stream_id, seed in seeds.items():  # the streams of both replicas answer as each stream alone
            answer = owners[stream_id].ask(stream_id)
            assert answer["answer"] == _alone(qa, random_frames(FRAMES, seed, *SIZE)[:half])
            assert answer["frames"] == half
        mine = next(iter(seeds))  # through Ray's proxy, a streamed reply waits for its answer's generation to begin
        streamed = client.http.post(f"/v1/streams/{mine}/ask", json={"question": QUESTION, "stream": True,
                                                                     "max_new_tokens": NEW_TOKENS})
        assert streamed.status_code == 200 and "event: answer" in streamed.text, streamed.text[-300:]
        too_long = client.http.post(f"/v1/streams/{mine}/ask", json={"question": "1," * 3900, "stream": True})
        assert too_long.status_code == 413 and "the question is" in too_long.json()["error"]["message"]
        assert other.call("GET", f"/v1/streams/{next(iter(seeds))}").status_code == 404  # another key's
        assert other.call("POST", f"/v1/streams/{next(iter(seeds))}/ask", json={"question": "q"}).status_code == 404
        assert {s["id"] for s in other.call("GET", "/v1/streams").json()["data"]} == {theirs}
        assert {s["id"] for s in client.call("GET", "/v1/streams").json()["data"]} == set(seeds) - {theirs}
        assert {stream_id: owners[stream_id].call("GET", f"/v1/streams/{stream_id}").json()["replica"]
                for stream_id in seeds} == placed  # nobody's request moved a stream
        expected = dict.fromkeys(placed.values(), 2)
        assert _streams_per_replica(client, expected) == expected  # /metrics, per replica
        replicas = sorted(expected)

        # -- a second `statekv serve --ray` on the cluster is refused; the first serves on ---------------------------
        second = subprocess.run([sys.executable, "-m", "statekv.cli", "serve", "--ray", cluster["address"], "--host",
                                 "127.0.0.1", "--port", str(_free_port()), "--state-dir", str(tmp_path / "second")],
                                capture_output=True, text=True, env=ray_env, timeout=120)
        said = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"statekv serve on http://127.0.0.1:{port} (pid {server.pid} on " in said[-1], said
        assert "already serves the application 'statekv' on this Ray cluster" in said[-1], said
        assert not (tmp_path / "second" / "keys.json").exists()  # a refused start keeps no key
        assert {s["id"] for s in client.call("GET", "/v1/streams").json()["data"]} == set(seeds) - {theirs}

        # -- the OpenAI route and the page, through the same proxies --------------------------------------------
        from openai import OpenAI

        mine = [stream_id for stream_id in seeds if stream_id != theirs]
        openai = OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        for stream_id, headers in ((mine[0], {"serve_multiplexed_model_id": mine[0]}), (mine[1], {})):
            reply = openai.chat.completions.create(
                model="builtin", max_tokens=NEW_TOKENS, extra_body={"statekv": {"stream_id": stream_id}},
                extra_headers=headers, messages=[{"role": "user", "content": QUESTION}])
            assert reply.choices[0].message.content == _alone(qa, random_frames(FRAMES, seeds[stream_id], *SIZE)[:half])
        assert client.call("GET", f"/v1/streams/{mine[0]}").json()["replica"] == placed[mine[0]]  # the header routes
        page_replica = min(placed.values())  # the page's replica: the same for every tab
        if CHROMIUM is not None:
            from statekv.serve.page import PAGE_NEW_TOKENS

            elsewhere = next(stream_id for stream_id in seeds if owners[stream_id].call(
                "GET", f"/v1/streams/{stream_id}").json()["replica"] != page_replica)
            key, listed = (OTHER_KEY, [theirs]) if elsewhere == theirs else (KEY, mine)
            sync_api = pytest.importorskip("playwright.sync_api")
            with sync_api.sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
                    "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
                try:
                    page = browser.new_page()
                    page.goto(f"{url}/?key={key}")
                    page.wait_for_function(  # every stream of the key, on both replicas
                        f"() => document.querySelectorAll('.statekv-stream').length == {len(listed)}", timeout=60_000)
                    page.locator(f".statekv-stream-{elsewhere}").get_by_role("button", name="open").click()
                    page.wait_for_selector(f".statekv-stats:has-text('{half} frames ·')", timeout=60_000)
                    page.get_by_label("Question").fill(QUESTION)
                    page.get_by_role("button", name="Ask").click()
                    page.wait_for_selector(".statekv-answer", timeout=60_000)
                    shown = page.inner_text(".statekv-answer")
                finally:
                    browser.close()
            assert shown == _alone(qa, random_frames(FRAMES, seeds[elsewhere], *SIZE)[:half], PAGE_NEW_TOKENS)
            assert owners[elsewhere].call("GET", f"/v1/streams/{elsewhere}").json()["replica"] == page_replica
        placed = {stream_id: owners[stream_id].call("GET", f"/v1/streams/{stream_id}").json()["replica"]
                  for stream_id in seeds}

        # -- kill -9 one replica while every client pushes -----------------------------------------------------
        victim = placed[mine[0]]
        moved = {stream_id for stream_id, name in placed.items() if name == victim}
        survivor = next(name for name in replicas if name != victim)
        pid = _replica_processes(state)[victim]
        acknowledged: dict[str, int] = {}
        def feed(stream_id: str, seed: int) -> None:
            acknowledged[stream_id] = owners[stream_id].feed(stream_id, random_frames(FRAMES, seed, *SIZE), pause=0.2)

        feeders = [threading.Thread(target=feed, args=item) for item in seeds.items()]
        for feeder in feeders:
            feeder.start()
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        for feeder in feeders:
            feeder.join(timeout=120)
        assert acknowledged == dict.fromkeys(seeds, FRAMES)
        holders = {}
        for stream_id, seed in seeds.items():  # every stream answers again, as the whole stream alone
            stats = owners[stream_id].call("GET", f"/v1/streams/{stream_id}").json()
            holders[stream_id] = stats["replica"]
            assert stats["frames"] == FRAMES and holders[stream_id] != victim
            assert owners[stream_id].ask(stream_id)["answer"] == _alone(qa, random_frames(FRAMES, seed, *SIZE))
        assert {holders[stream_id] for stream_id in seeds if stream_id not in moved} <= {survivor}
        resumed = [entry for client_ in (client, other) for entry in client_.resumed]
        # only the killed replica's streams were retried (on a loaded machine, one whose feeder had not pushed yet
        # when the replica died asks where to resume as it starts, and is not retried)
        assert {stream_id for stream_id, _, _ in resumed} <= moved
        for stream_id, acknowledged, resume_from in resumed:  # and lost at most their unsaved tail (a push cut
            assert acknowledged - resume_from <= SAVE_EVERY and resume_from % SAVE_EVERY == 0  # off may have landed)

        # -- nothing lost but the unsaved tail; no stream written by two replicas ------------------------------
        from statekv.serve.cluster.leases import Leases

        leases = Leases(state, "reader")
        for stream_id in seeds:
            history = leases.history(stream_id)
            tokens = [line["token"] for line in history if line["event"] == "taken"]
            assert tokens == list(range(1, len(tokens) + 1))  # every taking under a new token
            record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
            assert record["lease"]["token"] == tokens[-1]  # the last write was made under the last token
            assert record["lease"]["holder"] == holders[stream_id] == history[-1]["holder"]
            if stream_id in moved:  # taken under the next token, only once the dead replica's lease had lapsed
                taken = history[-1]
                assert taken["event"] == "taken" and taken["before"]["holder"] == victim
                assert taken["token"] == taken["before"]["token"] + 1
                assert killed_at - 1 < taken["before"]["expires"] <= taken["at"]
                assert all(line["holder"] != victim for line in history if line["at"] > killed_at)
            else:
                assert history[-1]["at"] < killed_at  # the survivor's streams stayed where they were
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        expected = {name: list(holders.values()).count(name) for name in set(holders.values())}
        held = _streams_per_replica(client, expected)
        assert held in (expected, {**expected, victim: len(moved)})  # the dead one drops off within ten seconds

        # -- a stream one replica finds damaged: listed so whichever replica answers, deleted from any ------------
        from statekv.serve.auth import owner_of
        from statekv.serve.cluster.shared import LIST_SECONDS

        broken = "st_" + "d" * 24
        (state / "streams" / f"{broken}.json").write_text(json.dumps({
            "id": broken, "owner": owner_of(KEY), "settings": {}, "horizon_frames": 16, "max_fps": None,
            "name": "broken", "created": time.time(), "owned": True}))
        (state / "streams" / f"{broken}.safetensors").write_bytes(b"not a saved stream")
        refused = client.call("GET", f"/v1/streams/{broken}")
        assert refused.status_code == 409, refused.text
        time.sleep(LIST_SECONDS + 0.5)  # past every replica's reused listing
        for _ in range(6):
            listed = {s["id"]: s for s in client.call("GET", "/v1/streams").json()["data"]}
            assert listed[broken]["state"] == "damaged", listed[broken]
            assert listed[broken]["damaged"] in refused.json()["error"]["message"]
        assert client.call("DELETE", f"/v1/streams/{broken}").status_code == 200
        assert not list(state.glob(f"*/{broken}*"))

        # -- clients following every stream's watch events do not hold the stop: their feeds end ---------------
        followers = [Follower(url, KEY if owners[stream_id] is client else OTHER_KEY, stream_id) for stream_id in seeds]
    finally:
        asked = time.monotonic()
        if server is not None and server.poll() is None:
            server.send_signal(signal.SIGINT)  # Ctrl-C: the application is deleted, every replica saves first
            try:
                server.wait(timeout=90)
            except subprocess.TimeoutExpired:
                server.kill()
        stopped_in = time.monotonic() - asked
        if log is not None:
            log.close()
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert stopped_in < STOP_SECONDS
    assert [follower.ended() for follower in followers] == [True] * len(seeds)
    for stream_id in seeds:
        record = json.loads((state / "streams" / f"{stream_id}.json").read_text())
        assert record["saved"]["frames"] == FRAMES  # the graceful stop saved every stream whole
    assert not list((state / "replicas").glob("*.json")) or all(
        json.loads(path.read_text())["replica"] == victim for path in (state / "replicas").glob("*.json"))
    assert time.monotonic() - began < BOUND_SECONDS


def test_a_port_ray_serves_proxy_cannot_bind_is_one_line(monkeypatch):
    """Ray Serve's proxy binds its port itself and reports a port in use as its actor's failure: the command says so
    in one `ConfigurationError` naming the address."""
    from types import SimpleNamespace

    from ray import serve

    from statekv.errors import ConfigurationError
    from statekv.serve.cluster import launch

    def refused(**_):
        raise RuntimeError("ray::ProxyActor.ready() ... RuntimeError: Failed to bind to address '127.0.0.1:8123'.")

    monkeypatch.setattr(launch, "connect", lambda address: None)
    monkeypatch.setattr(launch, "claim_application", lambda name, holder: None)
    monkeypatch.setattr(serve, "status", lambda: SimpleNamespace(proxies={"node": "HEALTHY"}, applications={}))
    monkeypatch.setattr(serve, "start", refused)
    monkeypatch.setattr(serve, "delete", lambda name: None)
    monkeypatch.setattr("ray.shutdown", lambda: None)
    with pytest.raises(ConfigurationError, match=r"^cannot listen on 127\.0\.0\.1:8123: Ray Serve's proxy could not "
                                                 r"bind it \(in use, or not an address of this machine\)"):
        launch.run_on_ray(None, launch.ClusterSettings(), "auto", "127.0.0.1", 8123, lambda url: None)


def test_a_sigterm_while_the_replicas_wait_for_room_stops_the_start(cluster, ray_env, tmp_path):
    """Replicas asking for more CPUs than the cluster has are never placed, so Ray Serve's deployment never ends;
    a SIGTERM then stops the start as Ctrl-C does (before: it was taken for a stop of the running service, and
    waited for until the replicas would be up, which was never), and promptly: the replica never placed is ended
    at once, not after Ray Serve's graceful timeout."""
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "statekv.cli", "serve", "--ray", cluster["address"], "--replica-cpus", "64",
             "--host", "127.0.0.1", "--port", str(_free_port()), "--state-dir", str(tmp_path / "state")],
            stdout=out, stderr=subprocess.STDOUT, env=ray_env)
        try:
            deadline = time.monotonic() + 120
            while not list((tmp_path / "state").glob("keys.json")):  # kept just before the replicas are asked for
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            time.sleep(2)
            server.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            server.wait(timeout=90)
            stopping = time.monotonic() - signalled
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    printed = log.read_text()
    assert server.returncode == 128 + signal.SIGTERM, printed[-3000:]
    own = _own_lines(printed)
    assert own[-1] == "statekv serve: stopped by SIGTERM" and not any("Traceback" in line for line in own), own
    assert "the key above was not kept" in printed and not (tmp_path / "state" / "keys.json").exists()
    # the replica never placed is ended at once (before: the deletion waited 60 s for it, then failed in the log)
    assert stopping < 30 and "stopping the application failed" not in printed, (stopping, printed[-3000:])


PROXIES = """
import sys, ray
from ray import serve
from statekv.serve.cluster.launch import proxies_address
ray.init(address=sys.argv[1], logging_level="ERROR")
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
try:
    print("proxies", proxies_address(), flush=True)
finally:
    serve.shutdown()
"""


def test_where_a_running_ray_serves_proxies_listen_is_read_from_its_controller(cluster, ray_env):
    """Before: a `statekv serve --ray` finding Ray Serve already running printed the --port it was given, where
    nothing may listen; the address it prints now is the controller's."""
    port = _free_port()
    found = subprocess.run([sys.executable, "-c", PROXIES, cluster["address"], str(port)], capture_output=True,
                           text=True, env=ray_env, timeout=180)
    assert f"proxies ('127.0.0.1', {port})" in found.stdout.splitlines(), found.stdout[-2000:] + found.stderr[-2000:]
