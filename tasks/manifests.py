"""Stage manifests that later stages read, kept apart from their stage's heavy imports.

`Evaluation` is what the evaluation stage returns and what promotion and cleanup read; the
evaluation stage itself imports torch and Ray Data (`training.inference`), which promotion and
cleanup must not pay for in their Ray workers. `tasks.evaluate` still exports it.
"""

from __future__ import annotations

from pydantic import BaseModel

from training.champion import registry


class ChampionScore(BaseModel):
    """The champion a run's gate came from and its accuracy on this run's test set."""

    version: int
    accuracy: float  # on this run's test split
    rescored: bool = False  # scored again here (its data hash is not this run's); else its recorded accuracy


class Evaluation(BaseModel):
    """Test-set metrics of the evaluated checkpoint and where they were saved."""

    checkpoint: str
    accuracy: float
    precision: list[float]
    recall: list[float]
    confusion: list[list[int]]
    rows: int
    metrics_path: str
    predictions_path: str
    passed_gate: bool
    min_accuracy: float = 0.0  # the gate it was held to
    gate: str = ""  # where min_accuracy came from, in a phrase (`tasks.gate.Gate.origin`)
    gate_failures: list[str] = []  # what failed the gate, one phrase each (`tasks.gate.failures`); [] when it passed
    champion: ChampionScore | None = None  # the champion the gate came from, scored on this test set (promotion reuses it)
    tta: bool = False
    accuracy_without_tta: float | None = None
    promotion: registry.Promotion | None = None  # set by the promote stage; None: promotion is off (promote.enabled)
    classes: list[str] = []  # the class names: confusion[i][j] counts images of classes[i] predicted as classes[j]

    def terminal_detail(self) -> str:
        """What the evaluation stage's closing terminal line adds after its name and seconds."""
        verdict = "passed" if self.passed_gate else "FAILED"
        return f": test accuracy {self.accuracy:.2%} (gate {self.min_accuracy:.2%} {verdict})"
