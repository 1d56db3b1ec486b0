"""``WeightSteering``: new blend weights mid-run, recorded in the state (``BlendedStream``, a packed blend).

A mixin for the streams that blend corpora by weight: ``set_weights`` records a
``blend_steer.WeightChange`` at the position where the next pass starts (the ``StreamLoader``
iterating the stream says where it stands), refuses one before the last change, and the changes travel
in the checkpoint (``state["weight_changes"]``) so the stream built with its original weights replays
them. The arithmetic of a steered epoch is pure: ``blend_steer.Steering``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from .blend_schedule import blend_counts
from .blend_steer import Steering, WeightChange, remaining_ranges
from ..errors import StateError
from .resume import Planner, Position
from .state import history_json, int_field, parse_history

MAX_CHANGES = 64  # weight changes a state may record (each ~100 bytes of JSON)


@dataclass(frozen=True)
class SteerSpec:
    """What a steered stream blends: corpus names, the weights it was built with, positions per epoch
    (blend samples, or a pack's sequences), order, seed, and items per corpus (0: an empty corpus)."""

    names: tuple[str, ...]
    weights: np.ndarray
    positions: int
    order: str
    seed: int
    sizes: np.ndarray


class WeightSteering:
    """``set_weights`` and its state, for a ``PlannedStream`` that blends (see the module docstring)."""

    _changes: list[WeightChange]
    _steering: Steering | None
    _loaded_changes: list[WeightChange]
    # PlannedStream's, which the host stream is:
    planner: Planner
    epoch: int
    _stand: Any
    _revision: int
    _cell: Any
    origin: Callable[[], Position]

    def _init_steering(self) -> None:
        self._changes = []  # set_weights, in order
        self._steering = None

    # -- what the host stream provides ------------------------------------------------------------
    @property
    def _steerable(self) -> bool:
        """Whether this stream blends (a pack of one ``ParquetStream`` does not)."""
        return True

    def _steer_spec(self) -> SteerSpec:  # pragma: no cover - interface
        raise NotImplementedError

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Blend by ``weights`` (name -> weight, every corpus named; 0 drops a corpus, a corpus at 0
        may rise) from where the next pass starts: after ``load_state_dict``, between epochs, or
        where the ``StreamLoader`` iterating this blend stands (inside its loop: after the batch just
        handed out; the workers re-plan). The rest of that epoch and the epochs after follow them.

        The epoch keeps its length (``num_samples``); every corpus still delivers each of its rows
        once per corpus epoch (samples a lowered corpus no longer draws stay for later; see
        ``plan/blend_steer.py``). The change is recorded in the state, so a blend built with the original
        weights resumes the steered run exactly, on any topology. Changing weights of positions
        already delivered is refused (``StateError``, field ``weights``).
        """
        if not self._steerable:
            raise TypeError(f"set_weights is for blends; this {type(self).__name__} has one corpus")
        vector = check_weight_names(weights, self._steer_spec().names)
        position = self._steering_position()
        change = WeightChange(position.epoch, tuple(position.history), tuple(vector.tolist()))
        changes = list(self._changes)
        if changes and self._same_position(changes[-1], change):
            changes[-1] = change  # twice at one position: the last call wins
        else:
            if changes and not self._not_before(changes[-1], change):
                last = changes[-1]
                raise StateError(
                    f"weights: set_weights at epoch {change.epoch} (history {history_json(list(change.history))}) would "
                    f"change positions already delivered under the weights set at epoch {last.epoch} (history "
                    f"{history_json(list(last.history))}); weights change only from where the run stands")
            changes.append(change)
        self._use_changes(changes)
        self._revision += 1  # persistent DataLoader workers hold the old plan

    @property
    def weight_changes(self) -> list[list[Any]]:
        """The weight changes recorded so far, as in the state: ``[epoch, history, weights]`` each."""
        return changes_json(self._changes)

    def _steering_position(self) -> Position:
        """Where the next pass starts: the StreamLoader's standing position, else ``origin()``."""
        stand = self._stand() if self._stand is not None else None
        if stand is not None:
            return stand()
        position = self.origin()
        if position.worker is not None:
            raise StateError("weights: set_weights after loading a per-worker state (StatefulDataLoader) is not "
                             "supported; iterate with ss.StreamLoader")
        if position.fresh and self._cell.last_pass == self.epoch:
            raise StateError(
                f"weights: a pass over epoch {self.epoch} has started, so its start is in the past; call set_weights "
                "after set_epoch(next epoch) or load_state_dict, or on a blend iterated by ss.StreamLoader (it knows "
                "where it stands)")
        return position

    def _steered(self) -> Steering:
        if self._steering is None:
            self._steering = self._make_steering(self._changes)
        return self._steering

    def _make_steering(self, changes: list[WeightChange]) -> Steering:
        spec = self._steer_spec()
        return Steering(spec.weights, changes, spec.positions, spec.order, spec.seed, self.planner.layout,
                        self.planner.config, spec.sizes)

    def _use_changes(self, changes: list[WeightChange]) -> None:
        if not changes:  # the plain blend (or a pack of one stream)
            self._changes, self._steering = [], None
            return
        steering = self._make_steering(changes)
        for change in changes:
            steering.epoch_map(change.epoch)  # weights that give an empty corpus samples fail here
        self._changes, self._steering = changes, steering

    def _remaining(self, change: WeightChange) -> np.ndarray:
        return remaining_ranges(self._steer_spec().positions, self.planner.config, change.epoch, change.history,
                                self.planner.layout)

    def _same_position(self, a: WeightChange, b: WeightChange) -> bool:
        return a.epoch == b.epoch and np.array_equal(self._remaining(a), self._remaining(b))

    def _not_before(self, a: WeightChange, b: WeightChange) -> bool:
        """Whether position ``b`` is at or after ``a``: a later epoch, or everything ``a`` consumed consumed."""
        if a.epoch != b.epoch:
            return b.epoch > a.epoch
        outer, inner = self._remaining(a), self._remaining(b)
        for lo, hi in inner.tolist():
            r = int(np.searchsorted(outer[:, 0], lo, side="right")) - 1
            if r < 0 or hi > outer[r, 1]:
                return False
        return True

    # -- state: the changes travel with it --------------------------------------------------------
    def _state_of(self, position: Position) -> dict[str, Any]:
        state = super()._state_of(position)  # type: ignore[misc]
        return {**state, "weight_changes": changes_json(self._changes)} if self._steerable else state

    def _parse_state(self, state: Mapping[str, Any]) -> Position:
        position = super()._parse_state(state)  # type: ignore[misc]
        self._loaded_changes = self._parse_changes(state.get("weight_changes", [])) if self._steerable else []
        return position

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """As ``PlannedStream.load_state_dict``; the weight changes the state records replace this blend's."""
        super().load_state_dict(state)  # type: ignore[misc]
        self._use_changes(self._loaded_changes)
        self._revision += 1

    def _parse_changes(self, raw: Any) -> list[WeightChange]:
        if not isinstance(raw, list) or len(raw) > MAX_CHANGES:
            raise StateError(f"state['weight_changes'] must be a list of at most {MAX_CHANGES} changes, got {raw!r:.80}")
        changes: list[WeightChange] = []
        for i, item in enumerate(raw):
            where = f"state['weight_changes'][{i}]"
            if not isinstance(item, list) or len(item) != 3:
                raise StateError(f"{where} must be [epoch, history, weights], got {item!r:.80}")
            try:
                epoch = int_field({"epoch": item[0]}, "epoch", 0)
                history = parse_history(item[1])
                names = self._steer_spec().names
                vector = check_weight_names(dict(zip(names, item[2])) if isinstance(item[2], list) and
                                            len(item[2]) == len(names) else None, names)
                self.planner.check(Position(epoch, history))
            except (StateError, ValueError) as exc:
                raise StateError(f"{where}: {exc}") from None
            change = WeightChange(epoch, tuple(history), tuple(vector.tolist()))
            if changes and (self._same_position(changes[-1], change) or not self._not_before(changes[-1], change)):
                raise StateError(f"{where} is not after the change before it")
            changes.append(change)
        try:
            self._make_steering(changes).epoch_map(changes[-1].epoch if changes else 0)
        except ValueError as exc:
            raise StateError(f"state['weight_changes']: {exc}") from None
        return changes

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "_steering": None}  # type: ignore[misc]


def changes_json(changes: list[WeightChange]) -> list[list[Any]]:
    """Changes as ``[epoch, history, weights]`` lists (one entry each for DCP, like ``history``)."""
    return [[c.epoch, history_json(list(c.history)), list(c.weights)] for c in changes]


def check_weight_names(weights: Any, names: tuple[str, ...]) -> np.ndarray:
    """``weights`` (name -> weight, the same names) as a vector in ``names`` order; ValueError otherwise."""
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping of corpus name -> weight, got {type(weights).__name__}")
    missing, extra = [n for n in names if n not in weights], [n for n in weights if n not in names]
    if missing or extra:
        raise ValueError(f"weights must name the same corpora as datasets: missing {missing}, unknown {extra}")
    vector = [weights[n] for n in names]
    try:
        blend_counts(vector, 0)
    except ValueError as exc:
        raise ValueError(f"weights (in corpus order {list(names)}): {exc}") from None
    return np.asarray(vector, dtype=np.float64)
