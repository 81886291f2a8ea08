"""`statekv serve --ray` refuses, in one line naming the flag, what it would otherwise accept and then ignore or
break: a flag that only autoscaling reads given without autoscaling, a scaling target no replica can reach, a
replica's resources Ray refuses, and a ``--store`` whose "create only if absent" is not atomic (fsspec's caching
wrappers) or whose folder is relative to each process (``local://``, as ``file://`` already is)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.serve", reason="statekv[ray] is part of .[test]")

from statekv.cli import main  # noqa: E402

NO_CLUSTER = "127.0.0.1:1"  # nothing listens: a start that got past the flags fails here, naming --ray


def _refused(capsys, argv: list[str]) -> str:
    try:
        code = main(["serve", "--model", "builtin", "--api-key", "k", *argv])
    except SystemExit as refused:  # argparse's own refusal of a flag's value
        code = refused.code
    err = capsys.readouterr().err.strip()
    assert code != 0
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.mark.parametrize("flags, named", [
    (["--scale-on", "requests"], "--scale-on"),
    (["--scale-target", "3"], "--scale-target"),
    (["--replicas", "2", "--scale-on", "streams", "--scale-target", "3"], "--scale-on"),
])
def test_an_autoscaling_flag_without_max_replicas_is_refused(capsys, tmp_path, flags, named):
    line = _refused(capsys, ["--ray", NO_CLUSTER, "--state-dir", str(tmp_path / "state"), *flags])
    assert named in line and "--max-replicas" in line, line


def test_a_streams_target_no_replica_can_reach_is_refused(capsys, tmp_path):
    # each replica holds at most --max-streams, so ceil(streams / target) never exceeds the replicas running
    line = _refused(capsys, ["--ray", NO_CLUSTER, "--state-dir", str(tmp_path / "state"), "--max-streams", "4",
                             "--max-replicas", "4", "--scale-target", "4"])
    assert "--scale-target" in line and "--max-streams" in line, line


@pytest.mark.parametrize("gpus", ["-1", "nan"])
def test_replica_gpus_ray_would_refuse_are_refused_before_joining_the_cluster(capsys, tmp_path, gpus):
    line = _refused(capsys, ["--ray", NO_CLUSTER, "--state-dir", str(tmp_path / "state"), "--replica-gpus", gpus])
    assert "--replica-gpus" in line, line


def test_replica_gpus_in_a_config_files_args_are_one_line(tmp_path):
    from statekv.commands.serve import ray_app
    from statekv.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="replica.gpus"):
        ray_app({"state_dir": str(tmp_path / "state"), "model": "builtin", "api_key": "k", "replica_gpus": -1})


def test_a_relative_local_store_is_refused_as_a_relative_file_store_is(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    file_line = _refused(capsys, ["--ray", NO_CLUSTER, "--store", "file://relstore"])
    assert "relative folder" in file_line
    line = _refused(capsys, ["--ray", NO_CLUSTER, "--store", "local://relstore"])
    assert "relative folder" in line, line
    assert not (tmp_path / "relstore").exists()  # nothing written in this process's own folder


def test_a_cluster_without_a_shared_folder_or_store_is_refused(capsys, tmp_path, monkeypatch):
    # the default ./statekv-state is this machine's own folder, not one every node mounts
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, ["--ray", NO_CLUSTER, "--replicas", "2"])
    assert "--state-dir" in line and "--store" in line, line
    assert not (tmp_path / "statekv-state").exists()


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server")
    from s3 import S3Server

    server = S3Server()
    yield server
    server.stop()


@pytest.mark.parametrize("wrapper", ["simplecache", "blockcache", "filecache"])
def test_a_caching_wrapper_around_the_store_is_refused(capsys, monkeypatch, s3, wrapper):
    # each serves an object replaced by another process as this one first read it (sessions, asks, holders'
    # hints, keys go stale); simplecache:: also makes create-if-absent an overwrite (two replicas both create one
    # version number of a stream's chain)
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    url = f"{wrapper}::{s3.url()}"
    line = _refused(capsys, ["--ray", NO_CLUSTER, "--store", url])
    assert line.startswith(f"statekv serve: error: --store {url}"), line


def test_a_cluster_that_answers_but_refuses_the_driver_is_told_apart_from_no_cluster(monkeypatch):
    # a head started with token authentication accepts the connection, then refuses a driver without the token
    import socket

    import ray

    from statekv.errors import ConfigurationError
    from statekv.serve.cluster.launch import connect

    def refused(**options):
        raise ConnectionError("Failed to connect to GCS within 60 seconds")

    monkeypatch.setattr(ray, "init", refused)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        with pytest.raises(ConfigurationError) as told:
            connect(address)
    line = str(told.value)
    assert "\n" not in line and "RAY_AUTH_TOKEN" in line and "Failed to connect" in line, line


def test_the_address_shown_is_where_a_running_ray_serves_proxies_listen():
    from statekv.serve.cluster.launch import proxies_note

    note, url = proxies_note("127.0.0.1", 28001, ("127.0.0.1", 28000))
    assert url == "http://127.0.0.1:28000" and "127.0.0.1:28000" in note and "--port 28001" in note
    assert proxies_note("127.0.0.1", 28000, ("127.0.0.1", 28000)) == (None, "http://127.0.0.1:28000")
    note, url = proxies_note("::1", 8000, None)  # not known: the address asked for, and a note saying so
    assert url == "http://[::1]:8000" and "cannot change" in note
