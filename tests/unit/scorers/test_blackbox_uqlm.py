"""Our discrete semantic entropy and number of semantic sets against UQLM's (0.6.7).

UQLM pins transformers<5, numpy<2 (Python < 3.13), sentence-transformers<6, pandas<3 and
rich<15, all below this project's pins, so the Makefile installs it with ``--no-deps`` and it
is not in the ``dev`` extra. Its package ``__init__`` imports every UQLM scorer (and with them
pandas, rich, datasets, bert-score, optuna); the two modules the compared functions live in
import neither: ``uqlm/nli/entropy_utils.py`` (numpy, math) and ``uqlm/nli/cluster.py``
(``SemanticClusterer``; it names ``uqlm.nli.nli.NLI`` only as a type, so a stub stands in for
that torch module). They are loaded here from UQLM's installed files, without the package
``__init__`` s. UQLM's NLI model is replaced by the equivalence matrix both sides cluster on.

UQLM appends an answer to *every* class whose first member entails it, ours to the first only
(Farquhar et al.); on an equivalence relation (answers grouped by meaning) the two coincide,
and those are the cases compared.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from abstain_guard.scorers._similarity_graph import (
    discrete_semantic_entropy,
    number_of_semantic_sets,
    semantic_ids,
)


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def uqlm(monkeypatch: pytest.MonkeyPatch) -> dict[str, types.ModuleType]:
    spec = importlib.util.find_spec("uqlm")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("uqlm is not installed (make install: pip install --no-deps uqlm==0.6.7)")
    root = Path(next(iter(spec.submodule_search_locations)))
    for name, folder in (("uqlm", root), ("uqlm.nli", root / "nli")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        monkeypatch.setitem(sys.modules, name, package)
    stub = types.ModuleType("uqlm.nli.nli")
    stub.NLI = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "uqlm.nli.nli", stub)
    for name in ("uqlm.nli.entropy_utils", "uqlm.nli.cluster"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    utils = _load("uqlm.nli.entropy_utils", root / "nli" / "entropy_utils.py")
    cluster = _load("uqlm.nli.cluster", root / "nli" / "cluster.py")
    monkeypatch.setitem(sys.modules, "uqlm.nli.entropy_utils", utils)
    monkeypatch.setitem(sys.modules, "uqlm.nli.cluster", cluster)
    return {"utils": utils, "cluster": cluster}


class MatrixNLI:
    """UQLM's NLI interface answering from an equivalence matrix over texts ``a0, a1, ...``."""

    def __init__(self, equivalent: np.ndarray) -> None:
        self.equivalent = equivalent

    def get_nli_results_batch(self, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out = []
        for a, b in pairs:
            same = bool(self.equivalent[int(a[1:]), int(b[1:])])
            out.append(
                {
                    "entailment": same,
                    "entailment_score": float(same),
                    "noncontradiction_score": float(same),
                }
            )
        return out


def _groupings() -> list[list[int]]:
    rng = np.random.default_rng(0)
    fixed = [[0, 0, 0, 0, 0], [0, 1, 2, 3, 4], [0, 0, 1, 1], [0, 1, 0, 2, 1, 0], [3, 3, 1]]
    drawn = [
        rng.integers(0, rng.integers(1, 6), size=rng.integers(2, 11)).tolist() for _ in range(40)
    ]
    return fixed + drawn


@pytest.mark.parametrize("meaning", _groupings())
def test_entropy_and_sets_match_uqlm(uqlm: dict[str, types.ModuleType], meaning: list[int]) -> None:
    labels = np.asarray(meaning)
    equivalent = labels[:, None] == labels[None, :]
    texts = [f"a{i}" for i in range(len(labels))]
    clusterer = uqlm["cluster"].SemanticClusterer(nli=MatrixNLI(equivalent))
    _, indices, _, _ = clusterer.cluster_responses(responses=texts)
    utils = uqlm["utils"]
    k = len(texts)
    _, uniform = utils.compute_response_probabilities(None, num_responses=k)
    probabilities = utils.compute_cluster_probabilities(uniform, [list(c) for c in indices])
    their_entropy = utils.compute_semantic_entropy(probabilities)

    ids = semantic_ids(equivalent)
    assert sorted(sorted(c) for c in indices) == sorted(
        np.flatnonzero(ids == c).tolist() for c in np.unique(ids)
    )
    assert discrete_semantic_entropy(ids) == pytest.approx(their_entropy, abs=1e-12)
    assert number_of_semantic_sets(ids) == len(indices)
    # UQLM's confidences are decreasing maps of ours (its K+1 candidates are our k samples)
    negentropy = 1 - utils.normalize_entropy([their_entropy], num_responses=k - 1)[0]
    assert negentropy == pytest.approx(1 - discrete_semantic_entropy(ids) / math.log(k))
