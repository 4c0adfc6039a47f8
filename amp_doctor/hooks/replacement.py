"""Steps in which the watched model did not train, and the search for its replacement.

An in-code ``watch(model)`` hooks one object. A loop that replaces it mid-run
(``model = torch.load(path, weights_only=False)`` to resume, ``model =
copy.deepcopy(model)``) trains an object nobody hooked: its steps go on (the
optimizer and the GradScaler are watched globally), with no layer recorded. The
``diagnose`` CLI's discovery sees every model call and follows the new object
(``ModelSet.replaced``); an in-code watch has no global module hooks, which would
cost every module call of every step.

So :class:`ReplacementSearch` counts the backward passes and the steps without a
training forward of any watched model, and after the first such backward looks for
the new object: a global forward pre-hook, installed for at most
:data:`SEARCH_BACKWARDS` such backward passes, that passes the loop's first
top-level module of a watched model's class to the watch (which takes it if its
architecture is the same, see ``same_architecture``). The backward pass, not the
step's end, arms it: a loop that made a new optimizer and a new GradScaler with the
new model ends no step the watch sees until the new model is found (the scaler
steps parameters nobody watched yet). What it does not find stays counted, for a
warning that the report's figures stop there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from amp_doctor.hooks.discovery import GlobalDiscovery

__all__ = ["ReplacementSearch", "SEARCH_BACKWARDS", "STOPPED_MIN_STEPS"]

# Backward passes without the watched model the search stays installed for (one a step
# in a plain loop). The new object runs in the very next forward of a loop that
# replaced it; a loop that trains another model for a while (a GAN's second network
# alone, a frozen phase) pays the global hook for these passes only.
SEARCH_BACKWARDS = 3
# Untrained steps at the end of a run that make the "model stopped training" warning:
# one is a loop's last optimizer step with nothing of the model in it.
STOPPED_MIN_STEPS = 2

Found = Callable[[nn.Module, str | None, tuple[Any, ...] | None, nn.Module | None],
                 tuple[Any, ...] | None]


class ReplacementSearch:
    """Counts untrained steps and, after one, looks for the model's new object.

    ``wanted(module)``: a module the loop called may be a watched model's new object
    (cheap: the class). ``found(module, name, args, None)``: the watch takes it or not, as
    :class:`~amp_doctor.hooks.discovery.GlobalDiscovery` calls it.
    """

    def __init__(self, wanted: Callable[[nn.Module], bool], found: Found,
                 searching: bool = True) -> None:
        self._wanted = wanted
        self._found = found
        # False where a discovery watches every call anyway (the CLI): only counted.
        self._searching = searching
        self._hooks: GlobalDiscovery | None = None
        self._left = SEARCH_BACKWARDS
        # The untrained steps since the watched models last trained: first, and how many.
        self.idle_since: int | None = None
        self.idle_steps = 0
        # The backward passes without them since, and the step of the first: counted
        # also where no step ends any more (a new optimizer and scaler of another model).
        self.untrained_since: int | None = None
        self.untrained_backwards = 0

    @property
    def active(self) -> bool:
        return self._hooks is not None

    def step_ended(self, step: int, trained: bool, backward: bool) -> None:
        """Step ``step`` ended; a watched model trained in it, or else a backward ran in
        it (another model trained: a step of the optimizer alone is not counted)."""
        if trained:
            self.idle_since = self.untrained_since = None
            self.idle_steps = self.untrained_backwards = 0
            self._left = SEARCH_BACKWARDS
            self.stop()
            return
        if not backward:
            return
        if self.idle_since is None:
            self.idle_since = step
        self.idle_steps += 1

    def untrained_backward(self, step: int) -> None:
        """A backward pass ran in step ``step``, in which no watched model has trained
        (after one did in earlier steps): the loop trains another module. Look for the
        watched model's new object, for a few such passes."""
        if self.untrained_since is None:
            self.untrained_since = step
        self.untrained_backwards += 1
        if not self._searching:
            return
        if self._hooks is None and self._left > 0:
            self._hooks = GlobalDiscovery(self._wanted, self._found)
            self._hooks.start()
        elif self._hooks is not None:
            self._left -= 1
            if self._left <= 0:
                self.stop()

    def taken(self) -> tuple[int, int] | None:
        """The new object was found and taken: the search ends; returns the untrained
        steps before it (first, count), which nothing recorded, or None."""
        self.stop()
        self._left = SEARCH_BACKWARDS
        idle = (self.idle_since, self.idle_steps) if self.idle_since is not None else None
        self.idle_since = self.untrained_since = None
        self.idle_steps = self.untrained_backwards = 0
        return idle

    def stopped(self) -> tuple[int, int, bool] | None:
        """At the end of the run: the untrained steps it ended with (first, count, and
        whether the steps stopped being counted), when enough to say the watched model
        stopped training, else None. Where no step ended after the model stopped (the
        loop's new optimizer and scaler step no watched parameter), the backward passes
        without it are what is counted."""
        if self.idle_since is not None and self.idle_steps >= STOPPED_MIN_STEPS:
            return self.idle_since, self.idle_steps, False
        if self.untrained_since is not None and self.untrained_backwards >= STOPPED_MIN_STEPS:
            return self.untrained_since, self.untrained_backwards, self.idle_since is None
        return None

    def stop(self) -> None:
        """Remove the search's global hooks (safe inside one of them, and at close)."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.stop()
