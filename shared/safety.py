"""What the safety filters judge text by: a rule set (regexes and keywords per category) and the offline profanity
classifier (shared/profanity.py), behind one small interface. The input filter (domain/admission/safety.py) and the
workers' streaming output filter (workers/serving/output_filter.py) both judge with the ``DefaultFilter`` made
here, so a word refused in a prompt is a word that halts a reply.

    SafetyConfig ──rule_patterns()──▶ {category: [regex, ...]} ──▶ DefaultFilter ── check(text) ─▶ Verdict
      (gateway)                            │  on the wire: SafetyPolicy.rules (+ threshold, version)
                                           └──▶ worker: filter_for(policy), compiled once per version

Rules are checked first (a regex search per category); the classifier judges what they let through.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from switchyard.shared.config import SafetyConfig
from switchyard.shared.messages import SafetyPolicy
from switchyard.shared.profanity import ProfanityClassifier, load_classifier

PROFANITY = "profanity"  # the classifier's category

# Shipped on (SafetyConfig.builtin_rules): phrases of the commonest prompt injection, and a private key in the
# clear, which a prompt should not send and a reply should not print. Deliberately small: deployment-specific
# words belong in the configuration, and offensive language is the classifier's.
BUILTIN_RULES: dict[str, list[str]] = {
    "prompt_injection": [
        r"\b(?:ignore|disregard|forget)\s+(?:all\s+|any\s+)?(?:of\s+)?(?:the\s+|your\s+)?(?:previous|prior|above|"
        r"earlier)\s+(?:instructions|prompts?|rules)\b",
    ],
    "private_key": [r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"],
}


@dataclass(frozen=True, slots=True)
class Verdict:
    """A filter's judgement of one text: allowed (``category`` None), or flagged with a category and a short
    reason. Neither ever quotes the text (verdicts are logged)."""

    category: str | None = None
    reason: str = ""

    @property
    def allowed(self) -> bool:
        return self.category is None


ALLOWED = Verdict()


class ContentFilter(Protocol):
    """The input filter's interface: plug another one in with ``SafetyConfig.input_filter``."""

    def check(self, text: str) -> Verdict:
        """Judge ``text`` (a prompt, or one message of it). Called for every request: keep it cheap."""
        ...


class RuleSet:
    """Regexes per category, matched case-insensitively; one combined pattern per category."""

    def __init__(self, patterns: dict[str, list[str]]) -> None:
        """Raises ValueError naming the category whose pattern does not compile."""
        self.patterns = {c: list(p) for c, p in patterns.items() if p}
        self._compiled: list[tuple[str, re.Pattern[str]]] = []
        for category, regexes in self.patterns.items():
            try:
                self._compiled.append((category, re.compile("|".join(f"(?:{r})" for r in regexes), re.IGNORECASE)))
            except re.error as exc:
                raise ValueError(f"safety rule of category {category!r} is not a valid regex: {exc}") from None

    def __bool__(self) -> bool:
        return bool(self._compiled)

    def match(self, text: str) -> str | None:
        """The category of the first rule ``text`` matches, or None."""
        for category, pattern in self._compiled:
            if pattern.search(text):
                return category
        return None


class DefaultFilter:
    """The rule set, then the profanity classifier (None: rules only) flagging at ``threshold``."""

    def __init__(self, rules: RuleSet, classifier: ProfanityClassifier | None, threshold: float = 0.9) -> None:
        self.rules = rules
        self.classifier = classifier
        self.threshold = threshold

    def check(self, text: str) -> Verdict:
        category = self.rules.match(text)
        if category is not None:
            return Verdict(category, f"matched a {category} rule")
        if self.classifier is not None:
            return self.judge_words(self.classifier.words(text), windows=True)
        return ALLOWED

    def judge_words(self, words: Sequence[str], windows: bool = False) -> Verdict:
        """The classifier's verdict on vocabulary words (``classifier.words``): as one window, or (``windows``) as
        its most offensive window."""
        classifier = self.classifier
        assert classifier is not None  # the words come from the classifier, so there is one
        p = classifier.max_probability(words) if windows else classifier.probability(words)
        if p >= self.threshold:
            return Verdict(PROFANITY, f"profanity classifier {p:.2f} >= {self.threshold:g}")
        return ALLOWED


def rule_patterns(config: SafetyConfig) -> dict[str, list[str]]:
    """The deployment's rule set as regexes per category: built-ins, ``rules``, ``keywords`` (as whole-word
    regexes) and ``rules_file``. Raises ValueError, saying what to fix, for a file that cannot be read."""
    out: dict[str, list[str]] = {}

    def add(rules: dict[str, list[str]], keywords: dict[str, list[str]]) -> None:
        for category, regexes in rules.items():
            out.setdefault(category, []).extend(regexes)
        for category, words in keywords.items():
            out.setdefault(category, []).extend(_keyword(w) for w in words if w.strip())

    if config.builtin_rules:
        add(BUILTIN_RULES, {})
    add(config.rules, config.keywords)
    if config.rules_file is not None:
        try:
            data = json.loads(config.rules_file.read_text())
            add(dict(data.get("rules", {})), dict(data.get("keywords", {})))
        except (OSError, ValueError, AttributeError, TypeError) as exc:
            raise ValueError(f"safety rules_file {config.rules_file}: {exc}; it must be JSON "
                             '{"rules": {"category": ["regex", ...]}, "keywords": {"category": ["word", ...]}}') \
                from None
    return out


def _keyword(word: str) -> str:
    # Whole words: no word character may touch either end; any run of spaces inside a phrase matches.
    return r"(?<!\w)" + r"\s+".join(re.escape(part) for part in word.split()) + r"(?!\w)"


def wire_policy(mode: str, patterns: dict[str, list[str]], threshold: float | None) -> SafetyPolicy:
    """The ``GenerateRequest.safety`` of a tenant whose policy is ``mode`` (log or block)."""
    digest = hashlib.sha256(json.dumps([patterns, threshold], sort_keys=True).encode()).hexdigest()[:16]
    return SafetyPolicy(mode, patterns, threshold, digest)


def default_filter(config: SafetyConfig) -> ContentFilter:
    """The input filter ``config`` asks for: its own (``input_filter``), else the rule set and classifier.
    Loads the classifier (once per process); raises ValueError or RuntimeError saying what to fix."""
    if config.input_filter:
        module, _, factory = config.input_filter.partition(":")
        try:
            make: Callable[[SafetyConfig], ContentFilter] = getattr(importlib.import_module(module), factory)
            return make(config)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"safety input_filter {config.input_filter!r}: {exc} (expected 'package.module:"
                             "factory', a callable taking the SafetyConfig)") from None
    classifier = load_classifier() if config.classifier else None
    return DefaultFilter(RuleSet(rule_patterns(config)), classifier, config.classifier_threshold)


_MAX_COMPILED = 16  # rule sets a worker keeps compiled (one per configuration its gateways have had)
_compiled: OrderedDict[str, DefaultFilter] = OrderedDict()
_compiled_lock = threading.Lock()


def filter_for(policy: SafetyPolicy) -> DefaultFilter:
    """The filter a request's ``SafetyPolicy`` describes, compiled the first time its version is seen. Raises
    ValueError for a rule that does not compile (the gateway checks its rules at start, so only a bug does)."""
    key = policy.version or hashlib.sha256(
        json.dumps([policy.rules, policy.classifier_threshold], sort_keys=True).encode()).hexdigest()[:16]
    with _compiled_lock:  # a worker's intake thread compiles, its step thread looks up
        found = _compiled.get(key)
        if found is not None:
            _compiled.move_to_end(key)
            return found
    threshold = policy.classifier_threshold
    found = DefaultFilter(RuleSet(policy.rules), load_classifier() if threshold is not None else None,
                          threshold if threshold is not None else 1.0)
    with _compiled_lock:
        _compiled[key] = found
        if len(_compiled) > _MAX_COMPILED:
            _compiled.popitem(last=False)
    return found
