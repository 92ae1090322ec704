"""The paper's geometry scorer on the features fast capture produces (ω_dir, Θ, Φ; no ω_prop).

:class:`GeometryFastScorer` is :class:`~.geometry.GeometryScorer` with the token vector
``ν_fast = (ω_dir, Θ, Φ^in, Φ^out) ∈ R^{7L−3}`` (:func:`.features.token_block` with
``capture="fast"``); it reads fast- and full-capture responses alike (of a full one, the
ω_dir columns of Ω). Deployed, :meth:`prepare` installs its reference means into every
``GeometryChatModel`` of the runnable and switches it to ``capture="fast"``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from abstain_guard.scorers._features import CaptureMode, install_reference
from abstain_guard.scorers.geometry import GeometryScorer


class GeometryFastScorer(GeometryScorer):
    """:class:`~.geometry.GeometryScorer` on fast-capture features (ω_dir, Θ, Φ^in, Φ^out;
    ``7L−3`` per token); higher = more uncertain. Same arguments, fit and state."""

    kind = "geometry_fast"
    capture: ClassVar[CaptureMode] = "fast"

    @property
    def name(self) -> str:
        return "geometry_fast" if self.variant == "paper" else "geometry_fast_raw"

    def prepare(self, runnable: Any) -> Any:
        """Every GeometryChatModel inside ``runnable`` switched to ``capture="fast"`` and
        given the fitted means (so its messages carry Φ^in/Φ^out)."""
        self._check_fitted()
        return install_reference(runnable, self.reference_means_, capture=self.capture)
