"""The streaming output filter: each choice's text is judged as it is generated, word by word, with the rule set
and classifier of shared/safety.py, and a choice that trips a ``block`` policy halts (``content_filter``) before
the offending text leaves the worker.

    detokenizer ─▶ emittable text ─▶ StreamGuard.feed ─▶ tool parser ─▶ TokenDelta
                                       │ holds the trailing partial word ("as" may become "ass")
                                       │ judges the new complete words with the context before them:
                                       │   rules:      last CONTEXT_CHARS released + the new text
                                       │   classifier: last WINDOW_WORDS vocabulary words, scored when a
                                       │               new word can raise the score (about half cannot)
                                       ▼
                                     released text, or "" and halted

Held text is what makes the filter safe to stream: a word is released only once it is complete and judged, so a
bad word split across deltas (or tokens) never reaches the client in part. The cost is that a word's last
characters wait for the next token. A rule spanning several words can only be judged once its last word is
complete; its first words may have been released by then (the choice still halts there).

The engine does no I/O: flagged verdicts are collected here and taken by the worker after each step
(``take_events``), which counts and logs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from switchyard.shared.messages import GenerateRequest
from switchyard.shared.profanity import WINDOW_WORDS
from switchyard.shared.safety import ALLOWED, DefaultFilter, Verdict, filter_for

CONTEXT_CHARS = 256  # released text kept as the rules' context: the longest phrase a rule may span
MAX_HELD_CHARS = 64  # a run of word characters longer than this is no word; released rather than held forever
_NATURAL_ENDS = ("stop", "length", "tool_calls")
_TRAILING_WORD = re.compile(r"\w+\Z")


@dataclass(slots=True)
class SafetyEvent:
    """A flagged output, for the worker's metrics and log (never the text)."""

    request_id: str
    index: int
    tier: str
    category: str
    action: str  # blocked | logged


class StreamGuard:
    """One choice's output filter; see the module docstring."""

    __slots__ = ("_judge", "_block", "_event", "_events", "_context", "_held", "_words", "_done", "is_halted")

    def __init__(self, judge: DefaultFilter, block: bool, event: SafetyEvent, events: list[SafetyEvent]) -> None:
        """``event``: the choice's event, filled in and appended to ``events`` when it is flagged."""
        self._judge = judge
        self._block = block
        self._event = event
        self._events = events
        self._context = ""  # the end of the released text
        self._held = ""  # a partial word, not judged yet
        self._words: list[str] = []  # the last WINDOW_WORDS vocabulary words released
        self._done = False  # flagged under ``log``: no more judging, text passes straight through
        self.is_halted = False  # flagged under ``block``: nothing more is released

    def prime(self, sent: str) -> None:
        """Text the client already has (a continuation on another worker): context for what follows."""
        self._remember(sent)

    def feed(self, text: str, final: bool = False) -> str:
        """New text of the choice; returns what may be sent now. ``final``: nothing follows, judge the rest."""
        if self.is_halted:
            return ""
        if self._done:
            text, self._held = self._held + text, ""
            return text
        text = self._held + text
        held = None if final else _TRAILING_WORD.search(text)
        cut = len(text) - (len(held.group()) if held and len(held.group()) <= MAX_HELD_CHARS else 0)
        ready, self._held = text[:cut], text[cut:]
        if not ready:
            return ""
        words = self._judge.classifier.words(ready) if self._judge.classifier is not None else []
        verdict = self._judge_new(ready, words)
        if not verdict.allowed:
            self._flag(verdict)
            if self._block:
                self._held = ""
                return ""
        self._remember(ready, words)
        return ready

    def finish(self, text: str, reason: str) -> tuple[str, str]:
        """The choice ends (``reason``) with ``text``: what may be sent, and the finish reason, ``content_filter``
        if the end tripped the filter. A cancelled or failed choice sends only what it was given."""
        if self.is_halted:
            return "", "content_filter"
        if reason not in _NATURAL_ENDS:
            return text, reason
        text = self.feed(text, final=True)
        return text, "content_filter" if self.is_halted else reason

    def _judge_new(self, ready: str, words: list[str]) -> Verdict:
        judge = self._judge
        category = judge.rules.match(self._context + ready) if judge.rules else None
        if category is not None:
            return Verdict(category, f"matched a {category} rule")
        classifier = judge.classifier
        if classifier is None or not any(w in classifier.raising_words for w in words):
            # A word that raises no fold's score cannot make the window more offensive by coming in (one sliding
            # out might; the window is judged again at the next word that can raise it).
            return ALLOWED
        return judge.judge_words(self._words + words, windows=len(words) > 1)

    def _remember(self, released: str, words: list[str] | None = None) -> None:
        self._context = (self._context + released)[-CONTEXT_CHARS:]
        if self._judge.classifier is not None:
            if words is None:
                words = self._judge.classifier.words(released)
            self._words = (self._words + words)[-WINDOW_WORDS:]

    def _flag(self, verdict: Verdict) -> None:
        self._event.category = verdict.category or ""
        self._event.action = "blocked" if self._block else "logged"
        self._events.append(self._event)
        self.is_halted, self._done = self._block, True


class OutputSafety:
    """The engine's output filtering: a guard for each choice whose request has a ``safety`` policy, and the
    verdicts flagged since the worker last took them."""

    def __init__(self) -> None:
        # The classifier is not loaded here: only a tenant whose policy uses it needs it (the intake compiles a
        # request's filter before the step sees it, prompts.prepare_prompt), and a worker whose tenants have none
        # never pays its second of loading, nor needs its wheel.
        self._events: list[SafetyEvent] = []

    def guard(self, request: GenerateRequest, index: int) -> StreamGuard | None:
        """Choice ``index`` of ``request``'s guard; None when its tenant's policy is off."""
        policy = request.safety
        if policy is None or policy.mode not in ("log", "block"):
            return None
        return StreamGuard(filter_for(policy), policy.mode == "block",
                           SafetyEvent(request.request_id, index, request.tier, "", ""), self._events)

    def take_events(self) -> list[SafetyEvent]:
        """The verdicts flagged since the last call (the step thread's; the worker reads them with its result)."""
        events = list(self._events)
        self._events.clear()  # in place: the guards of running choices hold this list
        return events
