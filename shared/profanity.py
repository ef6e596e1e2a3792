"""The offline profanity classifier of the safety filters: alt-profanity-check's model (TF-IDF over words, five
linear SVMs with sigmoid calibration, averaged), scored in plain Python from its fitted weights.

The wheel's own ``predict_prob`` goes through scikit-learn's input validation and sparse matrices: milliseconds a
call whatever the text's length, too slow for every request on the event loop and far too slow for every word a
worker generates. The model is linear, so a window of words scores with one dictionary look-up per word and a
few multiplications (microseconds); ``tests/shared/test_safety.py`` checks the scores against the wheel's.

    words (lowercased, \\b\\w\\w+\\b)  ── only words of the model's vocabulary count (the rest have no feature)
      tf-idf, l2-normalised  ─▶  per fold j: d_j = x · coef_j + intercept_j  ─▶  p_j = 1 / (1 + exp(a_j d_j + b_j))
      probability = mean over the five folds

Long texts are judged by windows of ``WINDOW_WORDS`` vocabulary words (half overlapping), not as one document:
the model was trained on short comments, and one offensive word in a long clean prompt would be diluted to
nothing by the l2 normalisation.
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

WINDOW_WORDS = 16  # vocabulary words a window holds: about a tweet's worth, what the model was trained on


class ProfanityClassifier:
    """Probability that a window of words is offensive. Build it with ``load_classifier()`` (once per process)."""

    def __init__(self, vocabulary: dict[str, int], idf: Sequence[float], coefs: Sequence[Sequence[float]],
                 intercepts: Sequence[float], calibration: Sequence[tuple[float, float]], token_pattern: str) -> None:
        """``coefs[j][i]``: fold j's weight of vocabulary index i; ``calibration[j]``: fold j's sigmoid (a, b)."""
        self._folds = [(float(i), float(a), float(b)) for i, (a, b) in zip(intercepts, calibration)]
        # word -> (idf, weight in each fold): one look-up per word on the hot path.
        self._weights: dict[str, tuple[float, tuple[float, ...]]] = {
            word: (float(idf[i]), tuple(float(c[i]) for c in coefs)) for word, i in vocabulary.items()}
        # Words that raise some fold's score. A window whose new word is not one of them cannot have become more
        # offensive by it, so the streaming check scores the window only when one arrives.
        self.raising_words = frozenset(w for w, (_, cs) in self._weights.items() if max(cs) > 0)
        # The vectorizer's default pattern finds what a plain run of two or more word characters does (a greedy run
        # ends at a boundary anyway), and is quicker without the boundary checks.
        self._tokens = re.compile(r"\w\w+" if token_pattern == r"(?u)\b\w\w+\b" else token_pattern)
        self.empty_probability = self.probability(())
        # The same weights as arrays, for judging many windows at once (``max_probability``); the last row is a
        # padding word with no weight at all.
        self._row = {word: i for i, word in enumerate(self._weights)}
        idf_rows = [idf_ for idf_, _ in self._weights.values()] + [0.0]
        self._idf_sq = np.square(np.array(idf_rows))
        self._contrib = np.array([[idf_ * c for c in cs] for idf_, cs in self._weights.values()]
                                 + [[0.0] * len(self._folds)])
        self._intercepts, self._a, self._b = (np.array(column) for column in zip(*self._folds))

    def words(self, text: str) -> list[str]:
        """The words of ``text`` the model knows, in order (lowercased as the model's vectorizer does)."""
        weights = self._weights
        return [w for w in self._tokens.findall(text.lower()) if w in weights]

    def probability(self, words: Iterable[str]) -> float:
        """The model's probability that ``words`` (vocabulary words, as ``words()`` returns) are offensive."""
        counts = Counter(words)
        total, norm = [0.0] * len(self._folds), 0.0
        for word, n in counts.items():
            idf, coefs = self._weights[word]
            x = n * idf
            norm += x * x
            for j, c in enumerate(coefs):
                total[j] += x * c
        norm = math.sqrt(norm) or 1.0
        p = 0.0
        for (intercept, a, b), s in zip(self._folds, total):
            p += 1.0 / (1.0 + math.exp(a * (s / norm + intercept) + b))
        return p / len(self._folds)

    def max_probability(self, words: Sequence[str]) -> float:
        """The most offensive window of ``words``: windows of ``WINDOW_WORDS``, each half over the last (the last
        one may be shorter), all scored at once with numpy: a 64 kB prompt in a few milliseconds."""
        if len(words) <= WINDOW_WORDS:
            return self.probability(words)
        step, width = WINDOW_WORDS // 2, WINDOW_WORDS
        starts = np.arange(0, len(words) - step, step)
        rows = np.array([self._row[w] for w in words] + [len(self._row)] * (int(starts[-1]) + width - len(words)))
        windows = rows[starts[:, None] + np.arange(width)]  # (windows, width) vocabulary rows
        total = self._contrib[windows].sum(axis=1)  # x · coef is a sum over positions: tf counts add up
        # |x|^2 = sum over distinct words of (count * idf)^2 = sum over positions of idf^2 * (2k + 1), k = the
        # occurrences of the same word before it in the window: sorted, k is the distance to the start of its run.
        ordered = np.sort(windows, axis=1)
        column = np.arange(width)
        run_start = np.ones(ordered.shape, dtype=bool)
        run_start[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
        k = column - np.maximum.accumulate(np.where(run_start, column, 0), axis=1)
        norm = np.sqrt((self._idf_sq[ordered] * (2 * k + 1)).sum(axis=1))
        norm[norm == 0] = 1.0
        decision = total / norm[:, None] + self._intercepts
        return float((1.0 / (1.0 + np.exp(self._a * decision + self._b))).mean(axis=1).max())


@functools.cache
def load_classifier() -> ProfanityClassifier:
    """The wheel's model, read once per process (about a second: scikit-learn's import and two pickles).

    Raises RuntimeError, saying how to fix it, when alt-profanity-check is not installed or its model is not the
    kind this scorer reproduces."""
    try:
        from profanity_check import profanity_check as wheel
    except ImportError as exc:
        raise RuntimeError("the safety classifier needs the alt-profanity-check wheel: `pip install "
                           "alt-profanity-check`, or set gateway.safety.classifier=false") from exc
    vectorizer, model = wheel.vectorizer, wheel.model
    expected = (vectorizer.norm == "l2" and vectorizer.use_idf and not vectorizer.sublinear_tf
                and not vectorizer.binary and vectorizer.ngram_range == (1, 1) and vectorizer.lowercase
                and vectorizer.strip_accents is None and vectorizer.analyzer == "word"
                and getattr(model, "method", None) == "sigmoid" and list(model.classes_) == [0, 1])
    if not expected:
        raise RuntimeError("this alt-profanity-check model is not a unigram TF-IDF + sigmoid-calibrated linear "
                           "model; pin alt-profanity-check==1.9.1")
    folds = model.calibrated_classifiers_
    return ProfanityClassifier(
        vocabulary=dict(vectorizer.vocabulary_), idf=vectorizer.idf_.tolist(),
        coefs=[f.estimator.coef_[0].tolist() for f in folds],
        intercepts=[float(f.estimator.intercept_[0]) for f in folds],
        calibration=[(float(f.calibrators[0].a_), float(f.calibrators[0].b_)) for f in folds],
        token_pattern=vectorizer.token_pattern)
