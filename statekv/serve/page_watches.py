"""The page's parts for what a stream was asked: the choices form the built-in model needs, the stream's watches
(a list with their latest answers, a form to add one), and the timeline that draws, over the stream's frames,
which frames each answer read and when each watch's answer changed.

They work on the same registry and watch hub as the API (`statekv.serve.watches`): a watch made here is the API's.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from ..builtin import is_builtin_kind
from ..errors import StateKVError
from ..synthetic.prompts import question_prompt
from .answer_notes import read_frames
from .page_parts import ErrorNote
from .watch_routes import close_recorded, open_recorded
from .watches import changing_watches, described, watch_settings

CHOICES = ("red", "green", "blue", "yellow")  # the built-in model's colours: a first question that suits it
BUILTIN_EXAMPLE = "What colour was the circle?"
BUILTIN_HINT = ("The built-in model answers only multiple-choice questions like those of its training videos (the "
                "colour of a shape, the shape of a colour, how many times a colour was shown, which came first), "
                "with a letter: give its options A-D below.")
TIMELINE_ANSWERS = 8  # the latest answers drawn on the timeline
TIMELINE_POINTS = 400  # the most points a row of the timeline draws (an answer that read every frame: sampled)
TIMELINE_ROW_PIXELS = 18  # each row's height on the timeline, which grows with its rows (every label drawn)
WATCH_EVERY = 4


def with_choices(question: str, choices: list[str]) -> str:
    """``question`` with the options ``choices`` as the built-in model was trained to read them, unless it
    already lists options (a line starting ``A.``), no choice is given or the question is blank (refused as the
    API refuses it, not asked as the options alone)."""
    filled = [choice.strip() for choice in choices if choice and choice.strip()]
    if not filled or not question.strip() or any(line.strip().startswith("A.") for line in question.splitlines()):
        return question
    return question_prompt(question.strip(), filled)


class ChoicesForm:
    """The options A-D, shown for the built-in model (which answers only multiple choice), with what it can
    answer; `compose` turns a question into what is asked."""

    def __init__(self, model: str | None):
        from nicegui import ui

        self.shown = is_builtin_kind(model)
        self.inputs = []
        with ui.column().classes("w-full gap-1 statekv-choices") as self.box:
            ui.label(BUILTIN_HINT).classes("text-caption text-grey-8 statekv-choices-hint")
            with ui.row().classes("w-full items-center no-wrap gap-2 statekv-wraps"):
                for letter, choice in zip("ABCD", CHOICES):
                    self.inputs.append(ui.input(f"{letter}.", value=choice).props("dense outlined").classes(
                        f"grow statekv-choice statekv-choice-{letter.lower()}"))
        self.box.set_visibility(self.shown)

    @property
    def example(self) -> str:
        return BUILTIN_EXAMPLE if self.shown else "What is happening now?"

    def compose(self, question: str) -> str:
        return with_choices(question, [field.value or "" for field in self.inputs]) if self.shown else question


class WatchPanel:
    """A stream's watches on the page: each with its question, cadence, latest answer and events, a button to
    delete it, and a form to add one (its question in the choices form's terms)."""

    def __init__(self, page: Any, choices: ChoicesForm):
        from nicegui import ui

        self.page, self.choices = page, choices
        self.shown: Any = None
        self.adding = False  # one add at a time: a second click arrives before the button shows it is busy
        with ui.column().classes("w-full gap-2 statekv-watches-panel"):
            ui.label("Watches: standing questions, answered as frames arrive").classes("text-subtitle1")
            with ui.row().classes("w-full items-start no-wrap gap-2 statekv-wraps"):
                self.question = ui.input("Watch for", placeholder=choices.example).props("outlined dense").classes(
                    "grow statekv-watch-question")
                self.every = ui.number("every (frames)", value=WATCH_EVERY, step=1).props(
                    "outlined dense").classes("w-32 statekv-watch-every")
                self.button = ui.button("Watch", on_click=self.add).classes("statekv-watch-add")
            self.error = ErrorNote("watch")
            self.list = ui.column().classes("w-full gap-1 statekv-watches")

    async def add(self) -> None:
        """Open the form's watch on the stream open as it was clicked; the form and the list answer for that stream
        only while it is still the one open."""
        page = self.page
        entry = page.entry
        if entry is None or self.adding:
            return
        every = self.every.value
        if every is None:  # the field left blank (the API's own message names a field the page has not)
            self.error.show("every (frames) must be a whole number of frames from 1")
            return
        self.adding = True
        self.button.props("loading")
        try:
            settings = watch_settings({"question": self.choices.compose(self.question.value or ""),
                                       "every": int(every) if float(every).is_integer() else every})
            await open_recorded(page.service, entry, settings)
            if page.entry is entry:
                self.error.clear()
                self.question.set_value("")
        except StateKVError as failure:
            if page.entry is entry:
                self.error.show(page.service.public(str(failure)))
        finally:
            self.adding = False
            self.button.props(remove="loading")
        if page.entry is entry:
            self.refresh(entry, force=True)

    async def delete(self, entry, watch) -> None:
        """Close ``watch`` of ``entry``'s stream (the stream its card was drawn for) once that stream's record is
        written without it; the form says why when it cannot be (the watch stays)."""
        async with changing_watches(entry):
            if entry.deleted or entry.moved or watch not in entry.stream.watches:
                return
            try:
                await close_recorded(self.page.service, entry, watch)
            except StateKVError as failure:
                if self.page.entry is entry:
                    self.error.show(self.page.service.public(str(failure)))
                return
        if self.page.entry is entry:
            self.error.clear()
            self.refresh(entry, force=True)

    def refresh(self, entry, force: bool = False) -> None:
        from nicegui import ui

        watches = list(entry.stream.watches)
        state = (entry.id, id(entry.stream), [(watch.id, watch.evaluations, watch.answer, watch.error)
                                              for watch in watches])
        if state == self.shown and not force:
            return
        self.shown = state
        self.list.clear()
        with self.list:
            if not watches:
                ui.label("none yet").classes("text-caption text-grey-7")
            for watch in watches:
                info = described(watch)
                every = (f"every {info['every']} frames" if info["every"] else
                         f"every {info['every_seconds']:g} s" if info["every_seconds"] else "on demand")
                with ui.card().classes(f"w-full p-2 statekv-watch statekv-watch-{watch.id}").props("flat bordered"):
                    with ui.row().classes("w-full items-start no-wrap gap-2"):
                        ui.label(watch.question).classes("grow text-body2 whitespace-pre-wrap statekv-watch-text")
                        ui.button(icon="delete", on_click=lambda w=watch, e=entry: self.delete(e, w)).props(
                            "flat dense round size=sm aria-label=delete-watch").tooltip("delete this watch")
                    answer = info["answer"] if info["answer"] is not None else "(no answer yet)"
                    ui.label(f"{answer}").classes("text-body1 statekv-watch-answer")
                    changes = len(info["events"])
                    ui.label(f"{every} · {info['evaluations']} evaluations · {changes} change"
                             f"{'s' * (changes != 1)}" + (f" · {info['error']}" if info["error"] else "")).classes(
                        "text-caption text-grey-7 statekv-watch-line")


def timeline_options() -> dict[str, Any]:
    """The timeline chart: frames across, one row per answer (the frames it read) and per watch (its events)."""
    return {
        "animation": False, "grid": {"left": 150, "right": 20, "top": 30, "bottom": 40},
        "tooltip": {"trigger": "item"},
        "legend": {"top": 0, "data": ["frames an answer read", "a watch's answer changed"]},
        "xAxis": {"type": "value", "name": "frame", "nameLocation": "middle", "nameGap": 26, "min": 0},
        "yAxis": {"type": "category", "data": [], "axisLabel": {"width": 140, "overflow": "truncate", "interval": 0}},
        "series": [
            {"name": "frames an answer read", "type": "scatter", "symbol": "rect", "symbolSize": [4, 10],
             "data": []},
            {"name": "a watch's answer changed", "type": "scatter", "symbol": "pin", "symbolSize": 22, "data": [],
             "label": {"show": True, "formatter": "{@[2]}", "position": "inside", "fontSize": 9}},
        ],
    }


def timeline_height(rows: int) -> int:
    """The timeline's height in pixels for ``rows`` rows: the chart's margins and each row's share (at least the
    height it has with a few rows)."""
    options = timeline_options()["grid"]
    return max(224, options["top"] + options["bottom"] + TIMELINE_ROW_PIXELS * rows)


def timeline_rows(entry) -> tuple[list[str], list[list], list[list]]:
    """``(rows, read, events)`` for the timeline: row names (answers, then watches), the points ``[frame, row]``
    of the frames each of the latest answers read (every frame it held when it read them all: sampled), and the
    points ``[frame, row, answer]`` where each watch's answer changed (frames counted from 0: an event after
    ``n`` frames sits at frame ``n - 1``). Each row's name is its own (numbered): a category axis draws rows of one
    name as one."""
    rows, read, events = [], [], []
    for number, answer in enumerate(entry.answers[-TIMELINE_ANSWERS:]):
        name = f"{number + 1}. {answer['question'].splitlines()[0][:40]}"
        rows.append(name)
        frames = read_frames(answer)
        if frames is None:
            held = int(answer.get("frames") or 0)
            frames = range(0, held, max(1, math.ceil(held / TIMELINE_POINTS)))
        read.extend([frame, name] for frame in itertools.islice(frames, TIMELINE_POINTS))
    for number, watch in enumerate(entry.stream.watches):
        name = f"watch {number + 1}: {watch.question.splitlines()[0][:40]}"
        rows.append(name)
        events.extend([max(event.frame - 1, 0), name, event.answer[:8]] for event in watch.events[-TIMELINE_POINTS:])
    return rows, read, events
