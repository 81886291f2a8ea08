"""`statekv bench serve` against `statekv serve --ray auto --replicas N --store s3://...` on Ray clusters of 1, 2
and 3 nodes, with no shared folder: everything the replicas share in a local S3 server.

For each node count the run starts its own S3 server (moto's server mode on 127.0.0.1, one bucket; replicas reach
it through the standard AWS environment variables), its own Ray cluster on this machine (a head and ``nodes - 1``
worker nodes, each its own raylet with ``--node-cpus`` CPUs, 127.0.0.1 only, no dashboard, token authentication,
its files in a temporary folder of its own; Ray Serve's one HTTP proxy on the head), then the service on it with
one replica per node (each replica reserves all of a node's CPUs, so Ray can place only one on each; the run
checks where each landed), and loads it with ``statekv bench serve --url`` (live cameras at ``--fps``, questions
as a Poisson process, open loop; docs/serving.md, "Measured load"). Everything it started is stopped after each
count, on failure and on Ctrl-C (its own processes by pid, never another Ray cluster on the machine).

    python benchmarks/serve_nodes.py --out docs/serving.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from report import write_section  # noqa: E402

KEY = "benchmark-key"
BUCKET = "statekv-bench"
REPO = Path(__file__).resolve().parents[1]
SECTION = "Measured on 1, 2 and 3 nodes"
START_SECONDS = 600  # a cluster and its replicas on a busy 2-core machine take minutes

# A head and worker nodes of this machine; Ray Serve started with its one proxy on the head (every node's proxy
# would want the same port of 127.0.0.1). Prints the cluster's address and each node's raylet, then waits for stdin
# to close.
CLUSTER = """
import json, sys
import ray
from ray import serve
from ray.cluster_utils import Cluster

temp, port, nodes, cpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "include_dashboard": False,
                                                        "temp_dir": temp})
workers = [cluster.add_node(num_cpus=cpus) for _ in range(nodes - 1)]
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False)
serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
ray.shutdown()
raylets = [node.all_processes["raylet"][0].process.pid for node in [cluster.head_node, *workers]]
print(json.dumps({"address": cluster.address, "raylets": raylets}), flush=True)
sys.stdin.read()
cluster.shutdown()
"""

COLUMNS = ("| nodes | replicas | streams | held at real time | frames/s | lag p95 (s) | TTFT p50 (s) | TTFT p95 (s) | "
           "goodput streams | failed | mean batch |")


def say(message: str) -> None:
    print(f"serve_nodes: {message}", flush=True)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def undisturbed() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back while something started is being stopped (a second Ctrl-C would leave it)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def descendants(pid: int) -> set[int]:
    import psutil

    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def stop_processes(pids: set[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for ``pids`` to end, then kill those left; returns the ones that had to be killed."""
    import psutil

    deadline, left = time.monotonic() + seconds, list(pids)
    while True:
        left = [pid for pid in left if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """moto's S3 server on a free port of 127.0.0.1 with one bucket: the AWS environment that reaches it."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
        yield env
    finally:
        with undisturbed():
            server.stop()


@contextlib.contextmanager
def ray_cluster(env: dict[str, str], temp: Path, nodes: int, cpus: float, port: int) -> Iterator[list[int]]:
    """A cluster of ``nodes`` nodes of this machine (a head and ``nodes - 1`` workers) noted under ``temp`` (where
    ``--ray auto`` finds it through ``RAY_TMPDIR``), Ray Serve's proxy on ``port``: each node's raylet pid."""
    with open(temp / "cluster.log", "w") as log:
        helper = subprocess.Popen([sys.executable, "-c", CLUSTER, str(temp / "s"), str(port), str(nodes), str(cpus)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                                  start_new_session=True)
    try:
        line = helper.stdout.readline()
        if not line:
            raise RuntimeError(f"the Ray cluster did not start:\n{(temp / 'cluster.log').read_text()[-2000:]}")
        yield json.loads(line)["raylets"]
    finally:
        with undisturbed():
            started = descendants(helper.pid)
            helper.stdin.close()
            try:
                helper.wait(timeout=120)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait()
            killed = stop_processes(started, 30)
            if killed:
                say(f"killed {len(killed)} Ray processes that outlived their cluster")


@contextlib.contextmanager
def service(args, env: dict[str, str], temp: Path, nodes: int, port: int, store: str) -> Iterator[str]:
    """``statekv serve --ray auto --replicas <nodes> --store <store>`` (no state folder): its URL once ready."""
    command = [sys.executable, "-m", "statekv.cli", "serve", "--ray", "auto", "--replicas", str(nodes), "--store",
               store, "--replica-cpus", f"{args.node_cpus:g}", "--host", "127.0.0.1", "--port", str(port),
               "--api-key", KEY, "--model", args.model, "--max-streams", "256", "--max-asks", "1024", "--no-page"]
    log_path = temp / "serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_SECONDS
        while "ready (pid" not in log_path.read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"statekv serve did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        with undisturbed():
            started = descendants(process.pid)
            if process.poll() is None:
                process.send_signal(signal.SIGINT)  # Ctrl-C: each replica saves its streams, the app is deleted
                try:
                    process.wait(timeout=180)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            stop_processes(started, 10)


def placement(s3_env: dict[str, str], prefix: str, raylets: list[int], replicas: int) -> list[int]:
    """The node (index into ``raylets``) of each live replica, read from the replicas' board in the bucket once all
    ``replicas`` have posted."""
    import boto3
    import psutil

    client = boto3.client("s3", endpoint_url=s3_env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    deadline, nodes = time.monotonic() + 60, []
    while time.monotonic() < deadline:
        listed = client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/replicas/").get("Contents", [])
        nodes = []
        for item in listed:
            posted = json.loads(client.get_object(Bucket=BUCKET, Key=item["Key"])["Body"].read())
            try:
                ancestors = {parent.pid for parent in psutil.Process(posted["pid"]).parents()}
            except psutil.NoSuchProcess:
                continue
            nodes += [index for index, raylet in enumerate(raylets) if raylet in ancestors]
        if len(nodes) == replicas:
            break
        time.sleep(1)
    return sorted(nodes)


def bench(args, env: dict[str, str], url: str, out: Path, nodes: int) -> dict[str, Any]:
    """``statekv bench serve --url`` with the run's load, its progress lines shown: its JSON document."""
    command = [sys.executable, "-m", "statekv.cli", "bench", "serve", "--url", url, "--api-key", KEY, "--fps",
               f"{args.fps:g}", "--duration", f"{args.duration:g}", "--question-rate", f"{args.question_rate:g}",
               "--json", str(out)]
    if args.find_max:
        command += ["--find-max", "--streams", str(args.streams[0])]
        command += ["--time-limit", f"{args.time_limit:g}"] if args.time_limit else []
    else:
        command += ["--streams", ",".join(map(str, args.streams))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                               start_new_session=True)
    try:
        shown = []
        for line in process.stdout:
            shown.append(line.rstrip())
            if line.strip() and not line.startswith("|"):  # its progress lines; its table is built again below
                say(f"{nodes} node{'s' * (nodes != 1)}: {line.strip()}")
        if process.wait() != 0:
            raise RuntimeError("statekv bench serve failed:\n" + "\n".join(shown[-20:]))
    finally:
        with undisturbed():
            if process.poll() is None:
                process.kill()
                process.wait()
    return json.loads(out.read_text())


def rows_of(nodes: int, document: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows of one node count from ``statekv bench serve``'s JSON: every run, or with ``--find-max``
    the run of the most streams held (``at_least``: the search stopped at its cap or its time limit, so more
    may be held)."""
    results = document["results"]
    at_least = False
    if "max_streams_held" in document:
        most = document["max_streams_held"]
        results = [row for row in results if row["streams"] == most][-1:] or results[:1]
        at_least = document.get("search_capped", False) or not document.get("search_complete", True)
    return [{"nodes": nodes, "replicas": nodes, "at_least": at_least, **row} for row in results]


def table(rows: list[dict[str, Any]]) -> str:
    shown = lambda value: "-" if value is None else f"{value:.3f}"  # noqa: E731
    lines = [COLUMNS, "|" + "---:|" * COLUMNS.count(" | ") + "---:|"]
    for row in rows:
        batch = "-" if row["mean_batch"] is None else f"{row['mean_batch']:.2f}"
        held = f"at least {row['held_streams']}" if row.get("at_least") else str(row["held_streams"])
        lines.append(f"| {row['nodes']} | {row['replicas']} | {row['streams']} | {held} | "
                     f"{row['frames_per_s']:.1f} | {shown(row['lag_p95_s'])} | {shown(row['ttft_p50_s'])} | "
                     f"{shown(row['ttft_p95_s'])} | {row['goodput_streams']} | {row['failures']} | {batch} |")
    return "\n".join(lines)


def report(args, argv: list[str], rows: list[dict[str, Any]], loads: tuple[str, str], commit: str) -> str:
    cores = os.cpu_count() or 1
    machine = f"{platform.machine()}, {cores} CPU cores"
    niceness = os.nice(0)
    load = (f"cameras at {args.fps:g} fps for {args.duration:g} s, {args.question_rate:g} questions per second per "
            f"camera")
    if max(args.nodes) * args.node_cpus + 1 > cores:  # one core at least for the proxy, the bucket and the cameras
        meaning = (f"The nodes are processes of this one machine and share its {cores} cores with each other, Ray "
                   "Serve's proxy, the S3 server and the cameras: these rows show what the cluster costs and that it "
                   "holds its load, not how it scales (a node more adds a replica, not a core). On a host with cores "
                   "for every node, the same command shows the scaling.")
    else:
        meaning = (f"Each node's {args.node_cpus:g} CPU is reserved for it on this {cores}-core host; the nodes "
                   "still share its memory, and the proxy, the S3 server and the cameras run beside them.")
    return "\n".join([
        f"`python benchmarks/serve_nodes.py {shlex.join(argv)}` at commit {commit}"
        f"{f' under `nice -n {niceness}`' if niceness else ''} on {machine} (load average {loads[0]} before, "
        f"{loads[1]} after): `statekv bench serve` (model {args.model}, {load}) against `statekv serve --ray auto "
        f"--replicas N --store s3://...` with no state folder, on a Ray cluster of N nodes of this machine "
        f"({args.node_cpus:g} CPU each, one replica per node), the bucket a local S3 server (moto):",
        "", table(rows), "", meaning])


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 3], help="cluster sizes (default: 1 2 3)")
    parser.add_argument("--node-cpus", type=float, default=1.0, help="CPUs each node offers Ray (default: 1)")
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 16],
                        help="camera counts (default: 8 16); with --find-max, where the search starts")
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per run (default: 20)")
    parser.add_argument("--question-rate", type=float, default=0.1)
    parser.add_argument("--find-max", action="store_true", help="the most cameras held at real time, per node count")
    parser.add_argument("--time-limit", type=float, default=None, help="with --find-max: seconds per node count")
    parser.add_argument("--out", default=None, help=f"markdown file whose '{SECTION}' section is replaced")
    args = parser.parse_args(argv)
    for name in ("nodes", "streams"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    for name in ("node_cpus", "fps", "duration"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def measure(args, nodes: int, env: dict[str, str]) -> list[dict[str, Any]]:
    """One node count: its own S3 server, Ray cluster and service, loaded; everything stopped after."""
    temp = Path(tempfile.mkdtemp(prefix="skvn-", dir="/tmp"))  # short: Ray's socket paths must fit
    try:
        (temp / "ray").mkdir()
        with s3_server() as s3_env:
            env = {**env, **s3_env, "RAY_TMPDIR": str(temp), "RAY_AUTH_TOKEN": secrets.token_hex(32)}
            port, prefix = free_port(), f"nodes-{nodes}"
            say(f"{nodes} node{'s' * (nodes != 1)}: starting the Ray cluster (S3 at {s3_env['AWS_ENDPOINT_URL']})")
            with ray_cluster(env, temp, nodes, args.node_cpus, port) as raylets:
                say(f"{nodes} node{'s' * (nodes != 1)}: starting statekv serve with {nodes} replicas")
                with service(args, env, temp, nodes, port, f"s3://{BUCKET}/{prefix}") as url:
                    placed = placement(s3_env, prefix, raylets, nodes)
                    if placed != list(range(nodes)):
                        raise RuntimeError(f"replicas are not one per node: nodes {placed} of {nodes}")
                    say(f"{nodes} node{'s' * (nodes != 1)}: one replica on each node; loading it")
                    document = bench(args, env, url, temp / "bench.json", nodes)
        return rows_of(nodes, document)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_USAGE_STATS_ENABLED": "0"}
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "STATEKV_API_KEYS"):
        env.pop(name, None)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stopped like Ctrl-C: everything started is stopped
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    before, rows = " ".join(Path("/proc/loadavg").read_text().split()[:3]), []
    try:
        for nodes in args.nodes:
            rows += measure(args, nodes, env)
            say(f"{nodes} node{'s' * (nodes != 1)} done: " + ", ".join(
                f"{row['streams']} streams {row['frames_per_s']:.1f} frames/s, {row['held_streams']} held"
                for row in rows if row["nodes"] == nodes))
    except KeyboardInterrupt:
        say("interrupted; everything it started is stopped")
        return 130
    except RuntimeError as error:
        say(f"failed; everything it started is stopped: {error}")
        return 1
    after = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    text = report(args, argv, rows, (before, after), commit)
    print(text)
    if args.out:
        write_section(Path(args.out), SECTION, text, level=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
