"""`statekv serve --ray auto --replicas 2 --store s3://bucket/prefix` with no shared folder, on a Ray cluster of
a head and two worker nodes on this machine (127.0.0.1 only, no dashboard; `ray.cluster_utils.Cluster` run by a
helper process), against a real S3 server (moto's server mode, `tests/s3.py`) reached through the standard AWS
environment variables. One replica is placed on each worker node; streams are fed from both; then a whole worker
node is killed under load (its raylet and every process of it) and every stream answers again from the surviving
node with only its unsaved tail lost, as the stream alone answers; the node comes back, a replica is placed on it
again and the replicas rebalance (streams handed over until each holds its share); Ctrl-C saves every stream.
The cluster is this test's own, shut down at the end with every process it started."""

from __future__ import annotations

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
pytest.importorskip("s3fs", reason="statekv[ray] brings s3fs")
pytest.importorskip("moto.server", reason="moto[server] is part of .[test]")
psutil = pytest.importorskip("psutil")

import statekv  # noqa: E402
from conftest import answered_alone, png_bytes, random_frames  # noqa: E402

from s3 import S3Server  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.xdist_group("ray")]
REPO = Path(__file__).resolve().parents[1]
KEY = "nodes-key"
QUESTION = "What colour was the triangle?\nA. red\nB. green\nC. blue\nD. yellow\nAnswer with the letter."
NEW_TOKENS = 6
FRAMES = 6  # pushed to each stream
SAVE_EVERY = 2  # frames: what a node's loss may cost a stream is at most this
LEASE_SECONDS = 8  # a replica stalled this long drops its streams; a loaded CI machine stalls for seconds

# A head (no CPU for replicas: the controller and the one HTTP proxy) and two worker nodes of one CPU each, so Ray
# places one replica per worker node. Nodes are marked dead within about three seconds of losing their raylet.
CLUSTER = """
import json, sys
import psutil, ray
from ray import serve
from ray.cluster_utils import Cluster

temp, port = sys.argv[1], int(sys.argv[2])
cluster = Cluster(initialize_head=True, head_node_args={
    "num_cpus": 0, "include_dashboard": False, "temp_dir": temp,
    "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
ray.init(address=cluster.address, log_to_driver=False)
serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
ray.shutdown()

def raylet(node):
    return node.all_processes["raylet"][0].process.pid

def say(**what):
    print(json.dumps(what), flush=True)

say(address=cluster.address, raylets=[raylet(node) for node in workers])
for line in sys.stdin:
    command = json.loads(line)
    if command["do"] == "kill":
        node = workers[command["node"]]
        tree = psutil.Process(raylet(node))
        pids = [tree.pid] + [child.pid for child in tree.children(recursive=True)]
        cluster.remove_node(node, allow_graceful=False)  # its raylet and every process of it, at once
        for pid in pids:  # a worker process that outlived its raylet goes too
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
        say(killed=pids)
    elif command["do"] == "add":
        workers[command["node"]] = cluster.add_node(num_cpus=1)
        say(raylets=[raylet(node) for node in workers])
cluster.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def env(s3) -> dict[str, str]:
    """A token-authenticated, loopback-only cluster's environment, with the S3 server's standard AWS variables:
    every node's processes (the replicas) reach the bucket through them, as on a real cluster. Ray notes the
    cluster's address under ``RAY_TMPDIR``, where ``--ray auto`` finds it, as on a machine that ran `ray start`."""
    temp = tempfile.mkdtemp(prefix="skv-nodes-", dir="/tmp")  # where Ray notes the cluster's address
    os.makedirs(os.path.join(temp, "ray"))
    env = {**os.environ, **s3.env, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's loopback addressing: every node on 127.0.0.1
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TMPDIR": temp}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "STATEKV_API_KEYS"):
        env.pop(name, None)
    yield env
    shutil.rmtree(temp, ignore_errors=True)


class Nodes:
    """The helper process holding the cluster: kill a worker node, add one back."""

    def __init__(self, env: dict[str, str], port: int):
        self.temp = tempfile.mkdtemp(prefix="skv-", dir="/tmp")  # short: Ray's socket paths must fit
        self.helper = subprocess.Popen([sys.executable, "-c", CLUSTER, self.temp, str(port)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        started = self.read()
        self.address, self.raylets = started["address"], started["raylets"]

    def read(self) -> dict:
        line = self.helper.stdout.readline()
        assert line, "the Ray cluster's helper stopped"
        return json.loads(line)

    def kill(self, node: int) -> list[int]:
        self.helper.stdin.write(json.dumps({"do": "kill", "node": node}) + "\n")
        self.helper.stdin.flush()
        return self.read()["killed"]

    def add(self, node: int) -> None:
        self.helper.stdin.write(json.dumps({"do": "add", "node": node}) + "\n")
        self.helper.stdin.flush()
        self.raylets = self.read()["raylets"]

    def node_of(self, pid: int) -> int | None:
        """Which worker node a process runs on (its raylet among its ancestors), if either."""
        try:
            ancestors = {parent.pid for parent in psutil.Process(pid).parents()}
        except psutil.NoSuchProcess:
            return None
        return next((index for index, raylet in enumerate(self.raylets) if raylet in ancestors), None)

    def close(self) -> None:
        started = {child.pid for child in psutil.Process(self.helper.pid).children(recursive=True)}
        self.helper.stdin.close()
        self.helper.wait(timeout=90)
        deadline, left = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            left = [pid for pid in started if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
            if not left:
                break
            time.sleep(0.5)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp, ignore_errors=True)
        assert not left, f"Ray processes outlived the cluster: {left}"


def _frames(seed: int, count: int = FRAMES) -> list[np.ndarray]:
    return list(random_frames(count, seed, 48, 64))


def _alone(qa, frames: list[np.ndarray]) -> str:
    return answered_alone(qa, frames, QUESTION, NEW_TOKENS)


class Client:
    """A client that only retries (a replica gone, a stream on its way to another), pushing again from the frame
    the stream says it needs next."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        self.resumed: list[tuple[str, int, int]] = []  # (stream, frames acknowledged, frame it resumed from)

    def call(self, method: str, path: str, **kwargs) -> httpx.Response:
        deadline = time.monotonic() + 120
        while True:
            try:
                response = self.http.request(method, path, **kwargs)
                if response.status_code not in (500, 502, 503, 504):
                    return response
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{method} {path} kept failing"
            time.sleep(0.3)

    def feed(self, stream_id: str, frames: list[np.ndarray], stop_at: int, pause: float = 0.0) -> int:
        index = self.call("GET", f"/v1/streams/{stream_id}").json()["resume_from"]
        while index < stop_at:
            try:
                ok = self.http.post(f"/v1/streams/{stream_id}/frames?t={index}", content=png_bytes(frames[index]),
                                    headers={"Content-Type": "image/png"}).status_code == 200
            except httpx.TransportError:
                ok = False
            if ok:
                index += 1
                time.sleep(pause)
            else:
                time.sleep(0.3)
                acknowledged, index = index, self.call("GET", f"/v1/streams/{stream_id}").json()["resume_from"]
                self.resumed.append((stream_id, acknowledged, index))
        return index


def _replicas(s3: S3Server, url: str) -> dict[str, dict]:
    """The live replicas' posts on the board in the bucket, by replica."""
    found = {}
    for name in s3.names(url):
        if name.startswith("replicas/"):
            key = f"{url.split('statekv-test/', 1)[1]}/{name}"
            posted = json.loads(s3.client().get_object(Bucket="statekv-test", Key=key)["Body"].read())
            if time.time() - posted["updated"] < 10:
                found[posted["replica"]] = posted
    return found


def _held(client: Client, expected: dict[str, int] | None = None, seconds: float = 10) -> dict[str, int]:
    """Streams held per replica (those holding any) from ``GET /metrics``, once ``expected`` or after a while."""
    deadline = time.monotonic() + seconds
    while True:
        metrics = client.call("GET", "/metrics").text
        counts = {name: int(float(value)) for name, value in
                  re.findall(r'^statekv_streams\{replica="(\w+)"\} (\S+)$', metrics, re.MULTILINE) if float(value)}
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.5)


def test_a_worker_node_killed_under_load_loses_only_unsaved_tails_and_replicas_rebalance_when_it_returns(s3, env,
                                                                                                       tmp_path):
    began, qa = time.monotonic(), statekv.VideoQA.from_pretrained("builtin", budget=64)
    port, url = _free_port(), s3.url("nodes")
    nodes = Nodes(env, port)
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "statekv.cli", "serve", "--ray", "auto", "--replicas", "2", "--store", url,
         "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY, "--save-every-frames", str(SAVE_EVERY),
         "--save-every-seconds", "600", "--lease-seconds", str(LEASE_SECONDS), "--no-page"],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 240
        while "ready (pid" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        client = Client(f"http://127.0.0.1:{port}")
        replicas = _replicas(s3, url)
        assert sorted(nodes.node_of(posted["pid"]) for posted in replicas.values()) == [0, 1]  # one per node

        # -- streams on both nodes, fed and asked ----------------------------------------------------------------
        deadline, answered = time.monotonic() + 30, set()
        while answered != set(replicas):  # the proxy's router knows both replicas (it learns them after `ready`)
            assert time.monotonic() < deadline, f"only {answered} answered /health"
            answered.add(client.call("GET", "/health").json()["replica"])
        seeds = {}
        for seed in (21, 22, 23, 24):
            made = client.call("POST", "/v1/streams", json={"horizon_frames": 16, "max_fps": None})
            assert made.status_code == 201, made.text
            seeds[made.json()["id"]] = seed
        placed = {stream_id: client.call("GET", f"/v1/streams/{stream_id}").json()["replica"] for stream_id in seeds}
        assert set(placed.values()) == set(replicas)  # new streams go to the least-loaded: both nodes hold some
        half = FRAMES // 2
        for stream_id, seed in seeds.items():
            assert client.feed(stream_id, _frames(seed), half) == half
        for stream_id, seed in seeds.items():
            answer = client.call("POST", f"/v1/streams/{stream_id}/ask",
                                 json={"question": QUESTION, "max_new_tokens": NEW_TOKENS}).json()
            assert answer["answer"] == _alone(qa, _frames(seed)[:half])

        # -- a whole worker node killed while every stream is fed --------------------------------------------------
        victim = next(name for name in replicas if nodes.node_of(replicas[name]["pid"]) == 0)
        survivor = next(name for name in replicas if name != victim)
        moved = {stream_id for stream_id, name in placed.items() if name == victim}
        acknowledged: dict[str, int] = {}
        feeders = [threading.Thread(target=lambda stream_id=stream_id, seed=seed: acknowledged.__setitem__(
            stream_id, client.feed(stream_id, _frames(seed), FRAMES, pause=0.3))) for stream_id, seed in seeds.items()]
        for feeder in feeders:
            feeder.start()
        time.sleep(0.5)
        killed = nodes.kill(0)
        assert replicas[victim]["pid"] in killed
        for feeder in feeders:
            feeder.join(timeout=240)
        assert acknowledged == dict.fromkeys(seeds, FRAMES)
        assert not [pid for pid in killed if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]  # every process of the node is gone
        for stream_id, seed in seeds.items():  # every stream answers again, from the surviving node, as alone
            stats = client.call("GET", f"/v1/streams/{stream_id}").json()
            assert stats["replica"] == survivor and stats["frames"] == FRAMES
            answer = client.call("POST", f"/v1/streams/{stream_id}/ask",
                                 json={"question": QUESTION, "max_new_tokens": NEW_TOKENS}).json()
            assert answer["answer"] == _alone(qa, _frames(seed))
        assert {stream_id for stream_id, _, _ in client.resumed} <= moved  # only the lost node's streams resumed
        for stream_id, acknowledged_then, resume_from in client.resumed:  # losing at most their unsaved tail
            assert acknowledged_then - resume_from <= SAVE_EVERY

        # -- the node comes back: a replica is placed on it again, and the replicas rebalance ------------------------
        nodes.add(0)
        deadline = time.monotonic() + 180
        while True:  # a killed replica's last post stays on the board a while: its process is on no node
            placed = {name: nodes.node_of(posted["pid"]) for name, posted in _replicas(s3, url).items()}
            placed = {name: node for name, node in placed.items() if node is not None}
            if sorted(placed.values()) == [0, 1]:
                break
            assert time.monotonic() < deadline, f"no replica came back on the returned node: {placed}"
            time.sleep(1)
        returned = next(name for name, node in placed.items() if node == 0)
        let_go = _held(client, {survivor: 2}, seconds=60)  # idle streams saved and let go, one at a time
        assert let_go == {survivor: 2}, let_go
        # each answers where it is asked for next, as the whole stream alone, and those let go are taken by the
        # returned replica. Asked again as a client would while they settle: a replica that misses Ray Serve's probe
        # of its queue for seconds on a loaded machine is passed over, and the fuller one lets the stream go again
        # once idle (each replica posts its count every two seconds: a post can lag the asks by several)
        deadline = time.monotonic() + 120
        while True:
            for stream_id, seed in seeds.items():
                answer = client.call("POST", f"/v1/streams/{stream_id}/ask",
                                     json={"question": QUESTION, "max_new_tokens": NEW_TOKENS}).json()
                assert answer["answer"] == _alone(qa, _frames(seed))
            balanced = _held(client, {survivor: 2, returned: 2}, seconds=20)
            if balanced == {survivor: 2, returned: 2} or time.monotonic() > deadline:
                break
        assert balanced == {survivor: 2, returned: 2}, balanced
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGINT)  # Ctrl-C: the application is deleted, every replica saves first
            try:
                server.wait(timeout=120)
            except subprocess.TimeoutExpired:
                server.kill()
        log.close()
        nodes.close()
    assert server.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    names = s3.names(url)
    assert not [name for name in names if name.startswith("holders/")]  # every stream let go
    assert [name for name in names if name.startswith("sessions/")] == [f"sessions/{victim}.json"]  # the dead one's
    assert time.monotonic() - began < 420
