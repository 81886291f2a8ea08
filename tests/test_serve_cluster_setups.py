"""`statekv serve --ray`'s replicas (without a Ray cluster, as tests/test_serve_cluster.py runs them) started with
another setup than their streams were saved with: what they note in the shared state holds for that setup alone and
says the files are sound, naming a save in an object store by its own name; and a record's saved counts that are no
numbers, as another replica lists the stream."""

from __future__ import annotations

import io
import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("ray.serve", reason="statekv[ray] is part of .[test]")

from PIL import Image  # noqa: E402

import statekv  # noqa: E402
from statekv.serve.config import ServeConfig  # noqa: E402

from conftest import random_frames  # noqa: E402

SIZE = (48, 64)  # the frames a client sends: height, width


@pytest.fixture(scope="module")
def qa():
    return statekv.VideoQA.from_pretrained("builtin", budget=64)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_start_with_another_setup_lists_a_stream_damaged_for_that_run_alone(tmp_path, qa, monkeypatch):
    """Before: replicas started with another model, dtype or layout (a mistyped flag) noted every stream asked for as
    damaged in the shared state, and replicas started again with the right flags still listed each as damaged, with
    the other run's reason, until it was asked for by its id; the note was never the files' (they are sound)."""
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster import shared
    from statekv.serve.cluster.hosting import ReplicaHosting

    monkeypatch.setattr(shared, "LIST_SECONDS", 0.0)  # each list read afresh (a replica reuses one for 2 s)
    headers = {"Authorization": "Bearer key"}

    def replica(options, name):
        options = options.with_changes(offload="disk", offload_dir=str(tmp_path / "tier" / name))
        config = ServeConfig(options=options, state_dir=tmp_path / "state", api_keys=("key",), page=False,
                             save_every_seconds=600)
        return TestClient(create_app(config, qa=statekv.VideoQA.from_options(options),
                                     hosting=ReplicaHosting(config, name, lease_seconds=60)))

    with replica(qa.options, "first") as first:
        stream_id = first.post("/v1/streams", json={"horizon_frames": 8}, headers=headers).json()["id"]
        first.post(f"/v1/streams/{stream_id}/frames?t=0", content=_png(random_frames(1, 31, *SIZE)[0]),
                   headers={**headers, "Content-Type": "image/png"}).raise_for_status()
    other = qa.options.with_changes(dtype="bfloat16")
    with replica(other, "second") as second, replica(other, "third") as third:
        refused = second.get(f"/v1/streams/{stream_id}", headers=headers)
        assert refused.status_code == 409 and "saved with dtype" in refused.json()["error"]["message"], refused.text
        for client in (second, third):  # every replica of that run lists it as damaged
            listed = client.get("/v1/streams", headers=headers).json()["data"]
            assert [stream["state"] for stream in listed] == ["damaged"], listed
    assert (tmp_path / "state" / "streams" / f"{stream_id}.safetensors").exists()  # nothing moved
    with replica(qa.options, "fourth") as fourth:
        listed = fourth.get("/v1/streams", headers=headers).json()["data"]
        assert [(stream["id"], stream["state"], stream["frames"]) for stream in listed] == [(stream_id, "ready", 1)]
        assert fourth.get(f"/v1/streams/{stream_id}", headers=headers).json()["frames"] == 1
    assert not list((tmp_path / "state").glob("quarantine/*"))


def _replica(tmp_path, options, name: str, store: str | None = None, folder: bool = True):
    from fastapi.testclient import TestClient

    from statekv.serve.app import create_app
    from statekv.serve.cluster.hosting import ReplicaHosting

    config = ServeConfig(options=options, state_dir=tmp_path / "state" if folder else None, api_keys=("key",),
                         page=False, save_every_seconds=600)
    return TestClient(create_app(config, qa=statekv.VideoQA.from_options(options),
                                 hosting=ReplicaHosting(config, name, lease_seconds=60, store=store)))


def test_a_record_whose_saved_counts_are_no_numbers_is_listed_by_another_replica_without_them(tmp_path, qa):
    """Before: a replica listing a stream it did not hold answered GET /v1/streams with a 500 (ValueError) when the
    stream's record said ``"frames": "x"`` under ``saved``, and showed a ``saved.seconds`` of text as the stream's
    time and where to push again from, which a load (and a server alone) does not take as a stream time."""
    headers = {"Authorization": "Bearer key"}
    with _replica(tmp_path, qa.options, "first") as first:
        stream_id = first.post("/v1/streams", json={"horizon_frames": 8}, headers=headers).json()["id"]
    record_path = tmp_path / "state" / "streams" / f"{stream_id}.json"
    record = json.loads(record_path.read_text())
    record["saved"] = {"pushed": "3", "frames": "x", "seconds": "abc"}
    record_path.write_text(json.dumps(record))
    with _replica(tmp_path, qa.options, "second") as second:
        listed = second.get("/v1/streams", headers=headers)
        assert listed.status_code == 200, listed.text
        [stream] = listed.json()["data"]
        assert (stream["frames"], stream["pushed"], stream["seconds"]) == (0, 0, None), stream
        assert (stream["resume_from"], stream["resume_after_seconds"]) == (0, None), stream


def test_a_replica_of_another_setup_answers_that_the_streams_files_are_sound(tmp_path, qa, caplog):
    """Before: the 409 of a replica started with another setup than a stream was saved with called the stream
    damaged and said to repair its files (they are sound: the setup is what to change), and its log line called it
    damaged and quarantined, as a server alone no longer does for a disk-tier file set saved with another setup."""
    headers = {"Authorization": "Bearer key"}
    with _replica(tmp_path, qa.options, "first") as first:
        stream_id = first.post("/v1/streams", json={"horizon_frames": 8}, headers=headers).json()["id"]
        first.post(f"/v1/streams/{stream_id}/frames?t=0", content=_png(random_frames(1, 31, *SIZE)[0]),
                   headers={**headers, "Content-Type": "image/png"}).raise_for_status()
    with _replica(tmp_path, qa.options.with_changes(dtype="bfloat16"), "second") as second:
        for _ in range(2):  # each request tries it again: refused alike
            refused = second.get(f"/v1/streams/{stream_id}", headers=headers)
            message = refused.json()["error"]["message"]
            assert refused.status_code == 409 and "saved with dtype" in message, refused.text
            assert "files are sound" in message and "repair" not in message, message
    logged = [record.getMessage() for record in caplog.records if stream_id in record.getMessage()]
    assert logged and not [line for line in logged if "damaged and quarantined" in line], logged


@pytest.mark.parametrize("folder", [True, False], ids=["saves-beside-a-folder", "store-alone"])
def test_a_save_in_an_object_store_is_named_by_its_own_name_in_a_refusal(tmp_path, qa, folder):
    """Before: a stream whose save in an object store (``--store``, beside a shared folder or alone) could not be
    loaded was noted in the shared state, and answered, with the server's temporary copy of the save
    (``/tmp/statekv-load-XXXX/ID.safetensors: saved with ...``), a server path; a save in the folder is named
    ``ID.safetensors``."""
    headers, store = {"Authorization": "Bearer key"}, (tmp_path / "bucket").as_uri()
    with _replica(tmp_path, qa.options, "first", store, folder) as first:
        stream_id = first.post("/v1/streams", json={"horizon_frames": 8}, headers=headers).json()["id"]
        first.post(f"/v1/streams/{stream_id}/frames?t=0", content=_png(random_frames(1, 31, *SIZE)[0]),
                   headers={**headers, "Content-Type": "image/png"}).raise_for_status()
    with _replica(tmp_path, qa.options.with_changes(dtype="bfloat16"), "second", store, folder) as second:
        refused = second.get(f"/v1/streams/{stream_id}", headers=headers)
        message = refused.json()["error"]["message"]
        assert refused.status_code == 409 and f"({stream_id}.safetensors: saved with dtype" in message, message
        assert "statekv-load-" not in message and "/" not in message.split("(", 1)[1].split(")", 1)[0], message
