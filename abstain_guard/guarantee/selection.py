"""Choosing the scorer among K candidates without spending the certificate's δ.

Every candidate is certified at δ/K on the same calibration answers (``"bonferroni"``), so
all K certificates hold together with probability ≥ 1−δ and the shipped one's holds however
it was picked; :func:`select_scorer` picks the most certified participation. K also counts
every name the artifact's ledger records on these answers (:mod:`.ledger`); a choice on a
selection split the certificate never reads costs nothing in δ (:func:`select_on_split`). A
participation target gets a PAC lower bound instead (:func:`participation_lower_bound`).
docs/guarantees.md, section 3 ("Choosing the scorer on the calibration answers").
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats

from abstain_guard.errors import InvalidInputError
from abstain_guard.guarantee import conformal, risk_control
from abstain_guard.guarantee.ledger import LedgerEntry, looked_at

SELECTION_RULE = "bonferroni"
"""The candidates were compared on the calibration answers: every candidate certified at δ/K
(valid for any choice among them)."""

SELECTION_SPLIT = "selection_split"
"""The candidates were compared on a selection split the certificate never reads: the chosen
scorer certifies at δ (divided only by what the ledger records on the calibration answers)."""

FIXED = "fixed"
"""No choice on these answers: the scorer was named before them (K counts only the ledger)."""

RULES = (SELECTION_RULE, SELECTION_SPLIT, FIXED)
"""The selection rules an artifact may record."""

MOST_PARTICIPATION = "most certified participation at the risk target (ties: first listed)"
"""How :func:`select_scorer` chooses among the certified candidates."""


def per_candidate_delta(delta: float, n_candidates: int) -> float:
    """δ/K: the level each of ``n_candidates`` candidates is certified at so that all of
    their certificates hold together with probability ≥ 1−``delta``."""
    if int(n_candidates) < 1:
        raise InvalidInputError(f"n_candidates must be at least 1, got {n_candidates!r}.")
    if not 0.0 < float(delta) < 1.0:
        raise InvalidInputError(f"delta must lie strictly between 0 and 1, got {delta!r}.")
    return float(delta) / int(n_candidates)


def participation_lower_bound(rank: int, n: int, level: float) -> float:
    """The ``level`` quantile of Beta(rank, n+1−rank): for a scorer fixed before calibration
    (continuous scores), P(answered | calibration set) is at least this with probability
    ≥ 1−``level`` when τ is the ``rank``-th smallest of ``n`` calibration scores. 1.0 when
    ``rank > n`` (τ = +∞ answers everything)."""
    if int(rank) > int(n):
        return 1.0
    if int(rank) < 1:
        return 0.0
    return float(stats.beta.ppf(float(level), int(rank), int(n) + 1 - int(rank)))


@dataclass(frozen=True)
class CandidateCertificate:
    """One candidate's risk certificate at the per-candidate level δ/K (threshold None,
    rank 0 and risk 0.0 when infeasible)."""

    name: str
    feasible: bool
    participation: float
    threshold: float | None
    rank: int
    empirical_risk: float

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the artifact's ``selection.certificates`` entries)."""
        return {
            "feasible": self.feasible,
            "participation": self.participation,
            "threshold": self.threshold,
            "rank": self.rank,
            "empirical_risk": self.empirical_risk,
        }

    @classmethod
    def from_json(cls, name: str, data: Mapping[str, Any]) -> CandidateCertificate:
        """Inverse of :meth:`to_json`."""
        threshold = data.get("threshold")
        return cls(
            name=str(name),
            feasible=bool(data["feasible"]),
            participation=float(data["participation"]),
            threshold=None if threshold is None else float(threshold),
            rank=int(data["rank"]),
            empirical_risk=float(data["empirical_risk"]),
        )


@dataclass(frozen=True)
class ScorerSelection:
    """How the shipped scorer was chosen, and what keeps the certificate valid (the
    artifact's ``selection`` block).

    Attributes:
        candidates, chosen: every scorer compared, in order, and the shipped one.
        risk_target, delta, method: ε, the total δ and the procedure they were certified at.
        data, n: which answers (how many) they were compared and certified on.
        choice: how ``chosen`` was picked (any rule keeps δ under Bonferroni).
        certificates: each candidate's certificate where computed (the chosen one's only
            for a choice recorded after the fact; on the split under
            :data:`SELECTION_SPLIT`).
        rule: one of :data:`RULES`.
        evaluated: the ledger's names on these calibration answers (set when the artifact
            is loaded, never stored): they join K.
    """

    candidates: tuple[str, ...]
    chosen: str
    risk_target: float | None
    delta: float
    data: str
    n: int
    method: str
    choice: str
    certificates: dict[str, CandidateCertificate] = field(default_factory=dict)
    rule: str = SELECTION_RULE
    evaluated: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.candidates) < 1 or len(set(self.candidates)) != len(self.candidates):
            raise InvalidInputError(
                f"selection candidates must be distinct names, at least one: {self.candidates}"
            )
        if self.chosen not in self.candidates:
            raise InvalidInputError(
                f"the chosen scorer {self.chosen!r} is not among the candidates "
                f"{list(self.candidates)}."
            )
        if self.rule not in RULES:
            raise InvalidInputError(
                f"unknown selection rule {self.rule!r}; the supported ones are {list(RULES)}."
            )
        unknown = sorted(set(self.certificates) - set(self.candidates))
        if unknown:
            raise InvalidInputError(f"certificates for scorers not compared: {unknown}.")
        per_candidate_delta(self.delta, len(self.candidates))  # validates δ

    @property
    def certified_among(self) -> tuple[str, ...]:
        """The scorers whose certificates must hold together, before the ledger: every
        candidate when they were compared on the calibration answers, else the chosen one."""
        return self.candidates if self.rule == SELECTION_RULE else (self.chosen,)

    @property
    def n_candidates(self) -> int:
        """K: :attr:`certified_among` and every name the ledger records on these calibration
        answers, counted once each."""
        return len(set(self.certified_among) | set(self.evaluated))

    def account(self) -> str:
        """How K is made up, in words (the decision's guarantee statements quote it)."""
        extra = [n for n in self.evaluated if n not in self.certified_among]
        if self.rule == SELECTION_RULE:
            text = (
                f"the scorer was chosen among {len(self.candidates)} candidates on this "
                "calibration data"
            )
        elif self.rule == SELECTION_SPLIT:
            text = (
                f"the scorer was chosen among {len(self.candidates)} candidates on a selection "
                "split this certificate never reads"
            )
        else:
            text = "the scorer was named before this calibration data was read"
        if extra:
            text += (
                f"; the artifact's ledger records {len(extra)} more scorers or rules evaluated "
                "on this calibration data"
            )
        return f"{text} (K = {self.n_candidates})"

    def with_ledger(self, entries: Sequence[LedgerEntry]) -> ScorerSelection:
        """This selection with the ledger's names on the calibration answers joining K."""
        return replace(self, evaluated=looked_at(entries))

    @property
    def delta_per_candidate(self) -> float:
        """δ/K, the level every candidate is certified at."""
        return per_candidate_delta(self.delta, self.n_candidates)

    def summary(self) -> dict[str, Any]:
        """The part a decision's guarantee carries (no per-candidate certificates)."""
        return {
            "rule": self.rule,
            "candidates": list(self.candidates),
            "n_candidates": self.n_candidates,
            "chosen": self.chosen,
            "data": self.data,
            "ledger": [n for n in self.evaluated if n not in self.certified_among],
        }

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (stored under ``metadata["selection"]`` of the artifact)."""
        return {
            "rule": self.rule,
            "candidates": list(self.candidates),
            "chosen": self.chosen,
            "choice": self.choice,
            "data": self.data,
            "n": self.n,
            "risk_target": self.risk_target,
            "delta": self.delta,
            "delta_per_candidate": self.delta_per_candidate,
            "method": self.method,
            "certificates": {k: v.to_json() for k, v in self.certificates.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScorerSelection:
        """Inverse of :meth:`to_json`.

        Raises:
            InvalidInputError: a missing or malformed field, or a ``delta_per_candidate``
                that is not ``delta / len(candidates)``.
        """
        try:
            selection = cls(
                candidates=tuple(str(c) for c in data["candidates"]),
                chosen=str(data["chosen"]),
                risk_target=None if data["risk_target"] is None else float(data["risk_target"]),
                delta=float(data["delta"]),
                data=str(data["data"]),
                n=int(data["n"]),
                method=str(data["method"]),
                choice=str(data["choice"]),
                certificates={
                    str(k): CandidateCertificate.from_json(str(k), v)
                    for k, v in dict(data.get("certificates") or {}).items()
                },
                rule=str(data["rule"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidInputError):
                raise
            raise InvalidInputError(f"malformed selection block: {exc!r}") from exc
        stored = data.get("delta_per_candidate")  # before any ledger: K = certified_among
        if stored is not None and not math.isclose(
            float(stored), selection.delta_per_candidate, rel_tol=1e-12
        ):
            raise InvalidInputError(
                f"selection delta_per_candidate {stored!r} is not delta / K = "
                f"{selection.delta_per_candidate!r}."
            )
        return selection


def certify_candidate(
    name: str,
    scores: ArrayLike,
    correct: ArrayLike,
    risk_target: float,
    level: float,
    method: str = risk_control.DEFAULT_RISK_METHOD,
) -> CandidateCertificate:
    """``name``'s Learn-then-Test certificate of ``risk_target`` at ``level`` (δ/K)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", conformal.ConformalWarning)
        res = conformal.risk_threshold(scores, correct, risk_target, level, method=method)
    return CandidateCertificate(
        name=name,
        feasible=res.feasible,
        participation=res.participation,
        threshold=res.threshold if res.feasible else None,
        rank=res.rank,
        empirical_risk=res.empirical_risk,
    )


def choose_candidate(certificates: Sequence[CandidateCertificate]) -> str:
    """The candidate with the most certified participation (ties, and none certified: the
    first listed)."""
    if not certificates:
        raise InvalidInputError("choose_candidate needs at least one certificate.")
    best = max(range(len(certificates)), key=lambda i: (certificates[i].participation, -i))
    return certificates[best].name


def select_scorer(
    scores_by_candidate: Mapping[str, ArrayLike],
    correct: ArrayLike,
    risk_target: float,
    delta: float,
    *,
    data: str,
    method: str = risk_control.DEFAULT_RISK_METHOD,
) -> ScorerSelection:
    """Certify every candidate at δ/K on the same calibration answers (scores ``[n]`` each,
    in tie-breaking order) and choose the one certifying the most participation at ε;
    ``data`` names the answers in the block."""
    names = list(scores_by_candidate)
    level = per_candidate_delta(delta, len(names))
    certs = [
        certify_candidate(name, scores_by_candidate[name], correct, risk_target, level, method)
        for name in names
    ]
    return ScorerSelection(
        candidates=tuple(names),
        chosen=choose_candidate(certs),
        risk_target=float(risk_target),
        delta=float(delta),
        data=data,
        n=int(np.asarray(correct).size),
        method=method,
        choice=MOST_PARTICIPATION,
        certificates={c.name: c for c in certs},
    )


def select_on_split(
    scores_by_candidate: Mapping[str, ArrayLike],
    correct: ArrayLike,
    risk_target: float,
    delta: float,
    *,
    share: float,
    seed: int,
    data: str,
    method: str = risk_control.DEFAULT_RISK_METHOD,
) -> tuple[ScorerSelection, np.ndarray, np.ndarray]:
    """Choose the scorer (:func:`select_scorer`) on a seeded uniform draw of
    ``round(share · n)`` of the ``n`` answers; the chosen one then certifies at δ on the
    others, which no choice has read (:data:`SELECTION_SPLIT`).

    Returns:
        ``(selection, pick, keep)``: the selection block (``n`` = the certifying answers),
        and the sorted indices of the selection split ``[m]`` and of the certifying answers
        ``[n - m]``.

    Raises:
        InvalidInputError: a share that leaves either part empty.
    """
    y = np.asarray(correct)
    n = int(y.size)
    m = round(float(share) * n)
    if not 0.0 < float(share) < 1.0 or not 0 < m < n:
        raise InvalidInputError(
            f"selection share {share!r} of {n} calibration answers leaves a part empty; use a "
            "share in (0, 1) that keeps answers on both sides."
        )
    order = np.random.default_rng(int(seed)).permutation(n)
    pick, keep = np.sort(order[:m]), np.sort(order[m:])
    compared = select_scorer(
        {k: np.asarray(v, dtype=np.float64)[pick] for k, v in scores_by_candidate.items()},
        y[pick],
        risk_target,
        delta,
        data=data,
        method=method,
    )
    selection = replace(
        compared,
        n=int(keep.size),
        rule=SELECTION_SPLIT,
        data=f"{data}: chosen on a seeded draw of {m} of its {n} answers (seed {int(seed)}), "
        f"certified on the other {int(keep.size)}",
        choice=f"{MOST_PARTICIPATION}, on the selection split",
    )
    return selection, pick, keep


def record_choice(
    chosen: str,
    scores: ArrayLike,
    correct: ArrayLike,
    candidates: Sequence[str],
    risk_target: float,
    delta: float,
    *,
    data: str,
    choice: str,
    method: str = risk_control.DEFAULT_RISK_METHOD,
) -> ScorerSelection:
    """The selection block of a scorer already chosen among ``candidates`` on these
    calibration answers (by any rule, ``choice`` says which), certified at δ/K from its
    own stored scores. Bonferroni needs no other candidate's scores: the chosen one's
    certificate at δ/K holds whenever all K would."""
    names = tuple(candidates)
    level = per_candidate_delta(delta, len(names))
    cert = certify_candidate(chosen, scores, correct, risk_target, level, method)
    return ScorerSelection(
        candidates=names,
        chosen=chosen,
        risk_target=float(risk_target),
        delta=float(delta),
        data=data,
        n=int(np.asarray(correct).size),
        method=method,
        choice=choice,
        certificates={chosen: cert},
    )


def recorded_selection(
    block: Any, kind: str, n: int, entries: Sequence[LedgerEntry]
) -> ScorerSelection | None:
    """An artifact's selection: its metadata ``block`` with its ledger joined; without a
    block, a :data:`FIXED` one when the ledger records names other than the artifact's own
    scorer ``kind`` on its ``n`` calibration answers, else None (K = 1)."""
    selection = selection_from_metadata(block, kind, n)
    if selection is not None:
        return selection.with_ledger(entries) if entries else selection
    if not set(looked_at(entries)) - {kind}:
        return None
    return ScorerSelection(
        candidates=(kind,),
        chosen=kind,
        risk_target=None,
        delta=0.1,  # unused: a fixed scorer certifies every δ it is asked for at δ/K
        data="the artifact's calibration answers",
        n=int(n),
        method=risk_control.DEFAULT_RISK_METHOD,
        choice="named before the calibration answers were read; the ledger records other "
        "scorers evaluated on them since",
        rule=FIXED,
    ).with_ledger(entries)


def selection_from_metadata(block: Any, kind: str, n: int) -> ScorerSelection | None:
    """An artifact's ``selection`` block, checked against its scorer and calibration size.

    Raises:
        InvalidInputError: a malformed block, one that chose another scorer, or one made on
            another number of calibration answers.
    """
    if block is None:
        return None
    if not isinstance(block, Mapping):
        raise InvalidInputError("metadata 'selection' must be an object.")
    selection = ScorerSelection.from_json(block)
    if selection.chosen != kind:
        raise InvalidInputError(
            f"metadata 'selection' chose {selection.chosen!r} but the artifact's scorer is "
            f"{kind!r}."
        )
    if selection.n != n:
        raise InvalidInputError(
            f"metadata 'selection' was made on {selection.n} calibration answers, the artifact "
            f"holds {n}."
        )
    return selection
