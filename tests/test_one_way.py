"""One way through the engine: an engine setting is one table entry (it reaches every stream and its saved
file), a single stream's step is a batch of one through the batcher's code with one attention function, every
family's question goes through the engine's checks, the cache layers keep or refuse transformers' whole layer
contract, no private name crosses a module of the product or the benchmarks, no test reaches a private name of
statekv, and no deprecated alias is left."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import CacheLayerMixin

import statekv
import statekv.core.step.batching as batching
import statekv.core.cache.two_state as cache_module
from statekv.core.cache.layer import StreamingLayer
from statekv.core.answering.decoding import Prompt
from statekv.settings.engine import ENGINE_SETTINGS, EngineSettings
from statekv.errors import ConfigurationError, InputError, UnsupportedModelError
from statekv.models import load_adapter
from statekv.settings.options import ModelOptions, options_table
from statekv.settings.setting import Setting, settings_class
from statekv.settings.values import one_of

from conftest import random_frames

ROOT = Path(statekv.__file__).parent.parent


# -- an engine setting is one entry of the table ---------------------------------------------------------------
NOTE = Setting("step_note", "plain", one_of(lambda: ("plain", "noted")), "a note every step carries", binding=True)


@settings_class(ENGINE_SETTINGS + (NOTE,))
class NotedEngine(EngineSettings):
    """The engine's settings plus one, added as one table entry."""


@settings_class(options_table(ENGINE_SETTINGS + (NOTE,)))
class NotedOptions(ModelOptions):
    """ModelOptions made the way `statekv.settings.options` makes them, from the longer engine table."""

    ENGINE = NotedEngine


def test_an_engine_setting_added_to_the_table_reaches_every_stream_and_its_saved_file(checkpoint, tmp_path):
    options = NotedOptions.from_strings({"model": str(checkpoint), "step_note": "noted", "budget": "12",
                                         "attention": "eager", "reserve_tokens": "40"})
    with pytest.raises(ConfigurationError, match="unknown step_note 'loud'"):
        NotedOptions(step_note="loud")
    qa = statekv.VideoQA.from_options(options)
    assert qa.engine == NotedEngine(attention="eager", offload=False, step_note="noted")
    stream = qa.stream(horizon_frames=6)
    assert stream.prefill.settings.step_note == "noted"  # VideoQA -> EncodedVideo -> StreamingPrefill, whole
    for second, image in enumerate(random_frames(3)):
        stream.push(image, float(second))
    answer = stream.ask_tokens("Why?", max_new_tokens=4)
    saved = stream.save(tmp_path / "noted.safetensors")
    resumed = statekv.Stream.load(saved, qa)
    assert resumed.prefill.settings == stream.prefill.settings
    assert torch.equal(resumed.ask_tokens("Why?", max_new_tokens=4), answer)
    plain = statekv.VideoQA.from_options(options.with_changes(step_note="plain"))
    with pytest.raises(InputError, match="saved with step_note=noted, but it is being loaded as plain"):
        statekv.Stream.load(saved, plain)  # a binding setting: the saved state depends on it


def test_the_engine_settings_are_checked_once_and_travel_whole(checkpoint):
    with pytest.raises(ConfigurationError, match="kv_cache_dtype must be auto, int8 or int4"):
        EngineSettings(kv_cache_dtype="int3")
    with pytest.raises(ConfigurationError, match="unknown positions 'relative'; choose one of stream, bounded"):
        EngineSettings(positions="relative")
    with pytest.raises(ConfigurationError, match="unknown engine setting 'budget'"):
        EngineSettings().with_changes(budget=3)
    assert EngineSettings(kv_cache_dtype="auto").kv_cache_dtype is None
    assert ModelOptions(method="rekv").engine.offload is True  # the method's default, resolved
    assert ModelOptions(max_cache_bytes="1K").max_cache_bytes == 1024  # as the engine reads it

    class Strict(EngineSettings):
        def __post_init__(self) -> None:
            super().__post_init__()
            if self.compile_step and not self.cuda_graph:
                raise ConfigurationError("strict: compile_step needs cuda_graph")

    @settings_class(options_table())
    class StrictOptions(ModelOptions):
        ENGINE = Strict

    with pytest.raises(ConfigurationError, match="strict: compile_step needs cuda_graph"):
        StrictOptions(compile_step=True, cuda_graph=False)  # the options check the engine's settings by its class
    adapter = load_adapter(checkpoint)
    qa = statekv.VideoQA(adapter, statekv.StateKV(budget=12), kv_cache_dtype="int8", attention="eager")
    video = statekv.EncodedVideo(qa, 200)
    assert video.prefill.settings is video.engine  # decided once for this video (positions), then whole
    assert video.engine.positions == "stream" and video.engine.with_changes(positions=None) == qa.engine
    unbounded = statekv.EncodedVideo(qa, None)
    assert unbounded.prefill.settings.positions == "bounded" and unbounded.prefill.horizon is None
    assert video.prefill.settings.kv_cache_dtype == "int8" and video.prefill.attention == "eager"


# -- one step protocol -------------------------------------------------------------------------------------------
def test_a_single_step_is_a_batch_of_one_through_one_attention(tiny_lm, monkeypatch):
    rows, attended = [], []
    run_rows, attend = batching.run_rows, cache_module.attend

    def counted_rows(prefills, *args, **kwargs):
        rows.append(len(prefills))
        return run_rows(prefills, *args, **kwargs)

    def counted_attend(caches, layer_idx, q, *args):  # the rows attending at once (a pooled batch is one cache)
        attended.append(q.shape[0])
        return attend(caches, layer_idx, q, *args)

    monkeypatch.setattr(batching, "run_rows", counted_rows)
    monkeypatch.setattr(cache_module, "attend", counted_attend)  # one stream's cache
    monkeypatch.setattr(batching, "attend", counted_attend)  # a batch's
    model = tiny_lm("qwen3")
    layers = model.config.num_hidden_layers
    chunks = [torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(s)) for s in range(6)]
    alone = statekv.StreamingPrefill(model, statekv.StateKV(budget=8), attention="eager")
    for chunk in chunks:
        alone.step(input_ids=chunk)
    assert rows == [1] * 6 and attended == [1] * layers * 6
    rows.clear(), attended.clear()
    pair = [statekv.StreamingPrefill(model, statekv.StateKV(budget=8), attention="eager") for _ in range(2)]
    batcher = batching.StepBatcher()
    for chunk in chunks:
        batcher.step([batching.StepRequest(prefill, input_ids=chunk) for prefill in pair])
    assert batcher.batched_steps > 0 and 2 in rows and 2 in attended  # steady steps: both rows at once


def test_every_step_of_a_video_or_stream_takes_one_prologue_and_one_device_path(checkpoint, monkeypatch):
    """A video's prompt prefix, its frames, a stream's pushes and several streams pushed together: every step is
    begun by `begin_step` and runs through `device_step` (one stream's own cache, or a batch's)."""
    import statekv.core.stream.prefill as prefill_module
    from statekv.video import open_video

    begun, device_rows = [], []
    begin_step, device_step = batching.begin_step, batching.device_step

    def counted_begin(request):
        begun.append(request.prefill)
        return begin_step(request)

    def counted_device(prefills, *args):
        device_rows.append(len(prefills))
        return device_step(prefills, *args)

    monkeypatch.setattr(batching, "begin_step", counted_begin)
    for module in (batching, prefill_module):  # a batch's graphs, and one stream's own
        monkeypatch.setattr(module, "device_step", counted_device)
    qa = statekv.VideoQA(load_adapter(checkpoint, layout="chat"), statekv.StateKV(budget=12), attention="eager",
                         reserve_tokens=40)
    video = qa.encode(open_video(random_frames(3), fps=1), max_fps=1)
    assert len(begun) == len(device_rows) == video.stats.chunks == 4  # the prefix, then each frame
    begun.clear(), device_rows.clear()
    streams = [qa.stream(horizon_frames=12) for _ in range(2)]
    for second, image in enumerate(random_frames(8, seed=1)):
        qa.push_many([(stream, image, float(second)) for stream in streams])
    steps = sum(stream.stats.chunks for stream in streams)
    assert len(begun) >= steps == 18 and sum(device_rows) == steps and 2 in device_rows  # steady steps batched


# -- one path for answers ---------------------------------------------------------------------------------------
def test_every_family_lays_out_a_prompt_and_the_engine_checks_it(checkpoint):
    from statekv.models.base import VideoAdapter

    families = [cls for cls in _subclasses(VideoAdapter) if not inspect.isabstract(cls)]
    assert len(families) >= 3
    assert all("generate" not in vars(cls) for cls in families)  # no adapter decodes by itself
    adapter = load_adapter(checkpoint)
    qa = statekv.VideoQA(adapter, statekv.FullAttention(), attention="eager", reserve_tokens=40)
    video = qa.stream(horizon_frames=3)
    video.push(random_frames(1)[0])
    prompt = adapter.prompt(adapter.question_ids("Why?", video.state), video.state)
    assert isinstance(prompt, Prompt) and prompt.follows == video.tokens
    with pytest.raises(InputError, match="the stream holds .* tokens but the layout state"):
        video.prefill.generate(adapter.prompt(prompt.input_ids, adapter.start(3)), max_new_tokens=2)
    with pytest.raises(InputError, match="token ids outside the vocabulary"):
        video.prefill.generate(Prompt(prompt.input_ids + 10_000, follows=video.tokens), max_new_tokens=2)


def test_a_question_fits_by_one_check_for_the_api_the_engine_and_the_service(checkpoint, monkeypatch):
    from statekv.errors import QuestionTooLong
    from statekv.serve.errors import ServiceError
    from statekv.serve.answering import prompt_tokens

    checked = []
    fit = statekv.StreamingPrefill.fit_question

    def counted(prefill, *args):
        checked.append(args[:2])
        return fit(prefill, *args)

    monkeypatch.setattr(statekv.StreamingPrefill, "fit_question", counted)
    qa = statekv.VideoQA(load_adapter(checkpoint), statekv.FullAttention(), attention="eager", reserve_tokens=40)
    stream = qa.stream(horizon_frames=3)
    stream.push(random_frames(1)[0])
    stream.ask_tokens("Why?", max_new_tokens=4)
    assert len(checked) == 2 and checked[0] == checked[1]  # the front door's, then the engine's: one check
    room = stream.horizon - stream.tokens
    with pytest.raises(QuestionTooLong, match=f"do not fit in the {room} tokens left"):
        stream.ask_tokens("Why?", max_new_tokens=room)
    prompt = stream.adapter.prompt(stream.adapter.question_ids("Why?", stream.state), stream.state)
    with pytest.raises(QuestionTooLong):
        stream.prefill.generate(prompt, max_new_tokens=room)  # the engine alone refuses it the same way
    with pytest.raises(ServiceError, match=f"more than the {room} tokens kept for them") as refused:
        prompt_tokens(stream, "Why?", room)
    assert refused.value.status == 413 and checked[-1][1] == room
    assert not hasattr(statekv, "generate_from_cache") and not hasattr(statekv.core, "generate_from_cache")


def _subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


# -- contracts kept or refused -----------------------------------------------------------------------------------
def _layer_classes() -> list[type]:
    """Every transformers cache layer class the engine defines (each module of statekv.core imported first)."""
    import pkgutil

    for module in pkgutil.walk_packages(statekv.core.__path__, "statekv.core."):
        importlib.import_module(module.name)
    return [cls for cls in _subclasses(CacheLayerMixin) if cls.__module__.startswith("statekv.")]


def test_every_engine_layer_keeps_or_refuses_transformers_whole_layer_contract(tiny_lm):
    """One base (`EngineLayer`) under every layer class: no method of transformers' `CacheLayerMixin` runs its own
    code on an engine layer (each is implemented or refused with one line), and an answer written in the stream's
    own buffer cannot zero it."""
    from statekv.core.answering.answer_cache import AnswerLayer
    from statekv.core.cache.engine_layer import EngineLayer
    from statekv.core.step.batching import BatchLayer

    layers = _layer_classes()
    assert {EngineLayer, StreamingLayer, BatchLayer, AnswerLayer} <= set(layers)
    mixin = {name for name, value in vars(CacheLayerMixin).items() if callable(value) and not name.startswith("__")}
    for cls in layers:
        assert issubclass(cls, EngineLayer), cls
        own = set().union(*(vars(base) for base in cls.__mro__[:cls.__mro__.index(CacheLayerMixin)]))
        assert mixin <= own or inspect.isabstract(cls), (cls, sorted(mixin - own))
    model = tiny_lm("qwen3")
    prefill = statekv.StreamingPrefill(model, statekv.FullAttention(), horizon=64)
    prefill.step(input_ids=torch.arange(6)[None])
    stream = prefill.cache.layers[0]
    answer = AnswerLayer(stream, 4, prefill.device)
    answer.keys, answer.values = stream.storage.answer_in_place(stream.detailed.keys, 4)  # answered in place
    answer.is_initialized = True
    before = stream.detailed.keys[:, :, :6].clone()  # the committed tokens (past them: scratch)
    for layer in (StreamingLayer(lambda: None, 0), BatchLayer(None, 0), answer):
        for call in (layer.offload, layer.prefetch, layer.reset, lambda: layer.reorder_cache(torch.tensor([0]))):
            with pytest.raises(UnsupportedModelError):
                call()
    assert torch.equal(stream.detailed.keys[:, :, :6], before) and before.abs().sum() > 0


def test_each_carry_rule_has_a_module_of_its_own_and_rules_compose_by_wrapping():
    import collections
    import dataclasses

    rules = [cls for cls in _subclasses(statekv.CarryPolicy) if cls.__module__.startswith("statekv.core.rules.")]
    assert len(rules) >= 10 and max(collections.Counter(cls.__module__ for cls in rules).values()) == 1
    rekv = statekv.ReKV(frames=3, sinks=2).for_prefix(5)
    assert isinstance(rekv, statekv.WithSinks) and not isinstance(rekv, statekv.Recency)  # sinks around recency
    assert rekv.rule == statekv.Recency(frames=3) and (rekv.sinks, rekv.prefix_tokens, rekv.sink_tokens) == (2, 5, 7)
    assert [field.name for field in dataclasses.fields(rekv)] == ["rule", "sinks", "prefix_tokens"]  # declared once
    assert repr(rekv) == "ReKV(frames=3, sinks=2, prefix_tokens=5)" and rekv == statekv.ReKV(3, 2, 5)
    assert rekv.recent_steps == 3 and rekv.capturable and not rekv.needs_scores


def test_wrapped_rules_say_their_steady_budget():
    assert statekv.StateKV(budget=8).steady_budget(0) == 8
    assert statekv.WithSinks(statekv.StateKV(budget=8), sinks=3).for_prefix(5).steady_budget(1) == 16
    assert statekv.PerLayerBudget(statekv.StateKV(budget=8), (8, 12)).steady_budget(1) == 12
    assert statekv.Recency(frames=2).steady_budget(0) is None  # settles in its ring instead
    assert statekv.FullAttention().steady_budget(0) is None


# -- nothing private crosses a module, nor reaches into statekv from a test; no deprecated alias ---------------
REFLECTION = ("getattr", "hasattr", "setattr", "delattr", "__setattr__", "object")  # object: mock.patch.object
STATEKV_PATH = re.compile(r"statekv(\.\w+)+")  # a dotted target: monkeypatch.setattr("statekv.x.y", ...), patch(...)


def _sources() -> list[Path]:
    return sorted((ROOT / "statekv").rglob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))


def _test_sources() -> list[Path]:
    return sorted((ROOT / "tests").rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignments, attributes set on anything."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return {name for name in names if _private(name)}


def _called(call: ast.Call) -> str | None:
    """The name a call calls: ``f`` of ``f(...)`` and of ``x.f(...)``."""
    return getattr(call.func, "id", None) or getattr(call.func, "attr", None)


def _named(node: ast.AST) -> str | None:
    """The text of a string literal."""
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _tests_own(tree: ast.AST) -> set[str]:
    """Private names that are a test's own, reached as attributes: what its classes define in their bodies
    (methods, class attributes) and what its objects set on themselves (``self._x = ...``, ``setattr(self, "_x",
    ...)``, ``object.__setattr__(self, "_x", ...)``). A module's own helpers are reached by bare name."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    names.update(target.id for target in targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
            names.add(node.attr)
        elif isinstance(node, ast.Call) and _called(node) in ("setattr", "__setattr__") and len(node.args) > 1 \
                and _is_self(node.args[0]) and _named(node.args[1]):
            names.add(_named(node.args[1]))
    return {name for name in names if _private(name)}


def _reaches(where: str, tree: ast.AST, ours: set[str], own: set[str]) -> list[str]:
    """Where ``tree`` reaches a private name of statekv (one of ``ours``) that is not one of its ``own``: an import of
    it (or from a private module), an attribute, a name given to getattr, setattr, monkeypatch.setattr and the
    like, a dotted ``statekv...`` target with a private part."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("statekv")):
            found += [f"{where}:{node.lineno}: imports {alias.name}" for alias in node.names if _private(alias.name)]
            if node.module and any(_private(part) for part in node.module.split(".")):
                found.append(f"{where}:{node.lineno}: imports from {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno}: imports {alias.name}" for alias in node.names
                      if alias.name.startswith("statekv.") and any(_private(p) for p in alias.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr in ours and node.attr not in own:
            found.append(f"{where}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and _called(node) in REFLECTION and len(node.args) > 1 \
                and _named(node.args[1]) in ours and _named(node.args[1]) not in own:
            found.append(f"{where}:{node.lineno}: {_called(node)}(..., {_named(node.args[1])!r})")
        elif _named(node) and STATEKV_PATH.fullmatch(_named(node)) \
                and any(_private(part) for part in _named(node).split(".")):
            found.append(f"{where}:{node.lineno}: {_named(node)!r}")
    return found


def _ours() -> set[str]:
    """Every private name statekv defines."""
    return set().union(*(_defined(ast.parse(path.read_text())) for path in (ROOT / "statekv").rglob("*.py")))


def test_nothing_private_crosses_a_module():
    trees = {path: ast.parse(path.read_text()) for path in _sources()}
    defined = {path: _defined(tree) for path, tree in trees.items()}
    ours = set().union(*defined.values())
    crossing = []
    for path, tree in trees.items():
        crossing += _reaches(str(path.relative_to(ROOT)), tree, ours, defined[path])
    assert crossing == [], "\n".join(crossing)


def test_no_test_reaches_a_private_name_of_statekv():
    """Tests go through what statekv offers: a private name of a statekv module or object is its own to change."""
    trees = {path: ast.parse(path.read_text()) for path in _test_sources()}
    own = set().union(*(_tests_own(tree) for tree in trees.values()))  # helpers' classes serve every test
    ours = _ours()
    reaching = []
    for path, tree in trees.items():
        reaching += _reaches(str(path.relative_to(ROOT)), tree, ours, own)
    assert reaching == [], "\n".join(reaching)


def test_the_private_check_sees_every_way_a_test_reaches_in():
    ours = {"_chunked", "_held", "_step_loss", "_answer", "_prepare", "_scores", "_calls", "_helper", "_frames"}
    reaching = """
from statekv.core.attention.scored import _chunked
import statekv.core._hidden
attention._chunked(q, k, v)
keeper._held = {}
monkeypatch.setattr(training, "_step_loss", fake)
monkeypatch.setattr("statekv.builtin.training._step_loss", fake)
getattr(model, "_answer")
mock.patch.object(StateKV, "_prepare")
"""
    found = _reaches("t.py", ast.parse(reaching), ours, _tests_own(ast.parse(reaching)))
    assert sorted(int(line.split(":")[1]) for line in found) == list(range(2, 10)), found  # each line, once
    own = """
class Fixed:
    _scores = None

    def __init__(self, scores):
        object.__setattr__(self, "_scores", scores)
        self._calls = []

    def _helper(self):
        return self._scores, self._calls, self._helper


def _frames():
    return _frames
"""
    assert _reaches("t.py", ast.parse(own), ours, _tests_own(ast.parse(own))) == []


def test_the_deprecated_aliases_are_gone():
    assert not (ROOT / "statekv" / "tiny.py").exists()
    with pytest.raises(TypeError, match="frames_per_chunk"):
        statekv.make_policy("recency", frames=3, frames_per_chunk=2)
    from statekv.core.positions.rope import FrozenRope
    from statekv.models.base import VideoAdapter

    assert not hasattr(VideoAdapter, "frames_per_chunk") and not hasattr(FrozenRope, "apply")
    assert not {"_append", "_append_steps"} & set(dir(statekv.EncodedVideo))
    assert not hasattr(cache_module, "check_state_dict")  # its one home is statekv.core.cache.persistence
    importlib.import_module("statekv.testing")
    from statekv.models import supported_model_types

    assert "statekv_tiny_eagle" not in supported_model_types()


def test_benchmarks_read_only_public_figures():
    reads = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("graphs", "storage", "keeper", "transaction") \
                    or isinstance(node, ast.Attribute) and node.attr == "layers" \
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "cache":
                reads.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert reads == []
