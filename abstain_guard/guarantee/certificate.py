"""`Certificate`: what a decision rule guarantees, as it crosses packages and as JSON.

One frozen dataclass for the participation and the risk certificate (``kind``) and for the
rule of a group without a rule of its own (``scope="abstain"``). :meth:`Certificate.to_dict`
gives the JSON form every decision carries (``guarantee``): its keys in the order of its
kind, a field left out when it does not apply; :meth:`Certificate.from_dict` reads it back.
Sub-blocks that other certificates produce (the scorer selection, the judge's measured
quality, the action and partial-release risks, the batch variance) stay their JSON blocks.
See ``docs/guarantees.md`` for what each field states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from abstain_guard.errors import InvalidInputError

JsonBlock = Mapping[str, Any]

#: The JSON keys of a risk certificate, in order (then the group and deployment keys); a
#: participation certificate's follow the fields' order (:data:`_PARTICIPATION`).
_RISK = (
    "kind",
    "statement",
    "risk_target",
    "delta",
    "confidence",
    "feasible",
    "certified_bound",
    "calibration_participation",
    "calibration_risk",
    "rank",
    "n",
    "method",
    "warnings",
    "labels",
    "reviewed",
    "judge_quality",
    "delta_per_candidate",
    "selection",
    "action_risk",
    "partial_release",
)
_GROUP = ("group", "scope", "group_n", "delta_sharing", "delta_total")
_ABSTAIN = ("kind", "group", "scope", "statement", "warnings")
_DEPLOYMENT = ("unverified", "batch_variance")
#: Fields whose None is written (``null``) rather than left out.
_NULLABLE = ("on_infeasible", "conditional_correctness_bound")
_TUPLES = ("participation_interval", "warnings", "unverified")


@dataclass(frozen=True)
class Certificate:
    """What a rule guarantees (``docs/guarantees.md``).

    Attributes:
        kind: ``"participation"`` or ``"risk"``.
        statement: the guarantee in words.
        warnings: what weakens or qualifies it (degenerate thresholds, ties, mismatches).
        participation, alpha, participation_interval, infinite_threshold, on_infeasible,
            ties_at_threshold: the participation certificate (conformal rank ``rank`` of
            ``n``; ``on_infeasible`` set when the threshold is infinite).
        conditional_correctness_bound, coverage_correct, beta, sigma, accuracy, c: the
            conditional correctness bound and its parts (None bound: unavailable).
        risk_target, delta, confidence, feasible, certified_bound,
            calibration_participation, calibration_risk, method, delta_per_candidate: the
            risk certificate.
        labels, reviewed, judge_quality: whose labels it is about (``"judge"`` or
            ``"human"``, m reviewed answers) and the judge's measured quality.
        selection, action_risk, partial_release: the JSON blocks of the scorer selection
            and of the action and partial-release certificates.
        group, scope, group_n, delta_sharing, delta_total: a per-group rule's group and
            whose rule it is (``"group"``, ``"pooled"`` or ``"abstain"``).
        unverified, batch_variance: what the deployment cannot verify or moves the score.
    """

    kind: str
    statement: str
    participation: float | None = None
    alpha: float | None = None
    participation_interval: tuple[float, float] | None = None
    rank: int | None = None
    n: int | None = None
    infinite_threshold: bool | None = None
    on_infeasible: str | None = None
    ties_at_threshold: int | None = None
    conditional_correctness_bound: float | None = None
    coverage_correct: float | None = None
    beta: float | None = None
    sigma: float | None = None
    accuracy: float | None = None
    c: int | None = None
    selection: JsonBlock | None = None
    partial_release: JsonBlock | None = None
    labels: str | None = None
    reviewed: int | None = None
    judge_quality: JsonBlock | None = None
    warnings: tuple[str, ...] = ()
    risk_target: float | None = None
    delta: float | None = None
    confidence: float | None = None
    feasible: bool | None = None
    certified_bound: float | None = None
    calibration_participation: float | None = None
    calibration_risk: float | None = None
    method: str | None = None
    delta_per_candidate: float | None = None
    action_risk: JsonBlock | None = None
    group: str | None = None
    scope: str | None = None
    group_n: int | None = None
    delta_sharing: str | None = None
    delta_total: float | None = None
    unverified: tuple[str, ...] | None = None
    batch_variance: JsonBlock | None = None

    def replace(self, **changes: Any) -> Certificate:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def with_warnings(self, extra: list[str] | tuple[str, ...]) -> Certificate:
        """A copy with ``extra`` warnings after its own."""
        return self.replace(warnings=(*self.warnings, *extra)) if extra else self

    def _keys(self) -> tuple[str, ...]:
        if self.scope == "abstain":
            return (*_ABSTAIN, *_DEPLOYMENT)
        own = _RISK if self.kind == "risk" else _PARTICIPATION
        return (*own, *_GROUP, *_DEPLOYMENT)

    def _written(self, key: str) -> bool:
        value = getattr(self, key)
        if value is not None:
            return True
        if key == "group":
            return self.scope is not None
        if key == "sigma":
            return self.coverage_correct is not None
        return self.kind == "participation" and key in _NULLABLE and self.scope != "abstain"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the ``guarantee`` of a decision)."""
        return {key: json_form(getattr(self, key)) for key in self._keys() if self._written(key)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Certificate:
        """Read :meth:`to_dict`'s form back.

        Raises:
            InvalidInputError: a key no certificate has, or no ``kind`` / ``statement``.
        """
        values, unknown = read_fields(cls, data, _TUPLES)
        if unknown or "kind" not in data or "statement" not in data:
            raise InvalidInputError(
                f"not a guarantee: unknown keys {unknown}"
                if unknown
                else "not a guarantee: it needs 'kind' and 'statement'"
            )
        return cls(**values)


def json_form(value: Any) -> Any:
    """A field's JSON form: a certificate's :meth:`~Certificate.to_dict`, a tuple as a list,
    a mapping as a dict, anything else as it is."""
    if isinstance(value, Certificate):
        return value.to_dict()
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def read_fields(
    cls: type, data: Mapping[str, Any], tuples: tuple[str, ...]
) -> tuple[dict[str, Any], list[str]]:
    """:func:`json_form` read back for the dataclass ``cls``: ``data`` with its ``tuples``
    keys as tuples, and the keys ``cls`` has no field for."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if k in tuples and v is not None else v for k, v in data.items()}
    return values, sorted(set(data) - names)


_FIELDS = tuple(f.name for f in dataclasses.fields(Certificate))
_PARTICIPATION = _FIELDS[: _FIELDS.index("warnings") + 1]
