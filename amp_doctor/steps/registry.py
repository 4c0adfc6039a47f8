"""Which GradScalers and optimizers work for the watched models, and their names.

Every scaler and optimizer the AMP API patches show is looked up here: a
scaler gets a :class:`~amp_doctor.steps.scaler.ScalerMirror`, an optimizer a
stable name ("AdamW#0") and a verdict (do its parameters belong to a watched
model?). The first scaler that steps a watched model's optimizer is the
*primary* one: its ``update()`` ends the training steps.

Keyed by ``id()`` with a weak reference beside it: an object born at a dead
one's address is told apart and judged anew.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler, OptState
from torch.optim import Optimizer

from amp_doctor.steps.scaler import ScalerMirror

__all__ = ["AmpRegistry", "FirstCycle", "optimizer_params", "optimizer_stage", "is_deferred"]

# The first step waits at most this many optimizer steps for the other models'
# optimizers (a GAN whose generator starts training late must not make step 0 endless).
# When it gives up, the waited-for optimizer does not step every iteration (a body
# unfrozen later in fine-tuning): the step it lumped counts as as many iterations as
# the closing optimizer stepped in it, so that later steps are the loop's iterations.
FIRST_CYCLE_MAX_STEPS = 16


def optimizer_params(opt: Any) -> list[torch.Tensor]:
    groups = getattr(opt, "param_groups", None) or []
    return [p for g in groups for p in g.get("params", [])]


def optimizer_stage(scaler: GradScaler, opt: Any) -> Any:
    """Where ``opt`` stands in ``scaler``'s step: READY, UNSCALED or STEPPED."""
    # _per_optimizer_states is a defaultdict: .get never adds an entry.
    ost = scaler._per_optimizer_states.get(id(opt))
    return ost.get("stage") if ost else OptState.READY


def is_deferred(opt: Any) -> bool:
    """Optimizers whose skip GradScaler does not decide on the host."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False)) or not isinstance(
        opt, Optimizer)


class AmpRegistry:
    """The scalers and optimizers seen so far, and which of them are the watch's."""

    def __init__(self, owns_param: Callable[[torch.Tensor], bool],
                 scaler: GradScaler | None = None,
                 optimizers: Iterable[Optimizer] = ()) -> None:
        self._owns_param = owns_param
        self._explicit_scaler = scaler
        self._explicit_opts = {id(o) for o in optimizers}
        self.scalers: dict[int, ScalerMirror] = {}
        self.primary_scaler: int | None = None
        # The primary's mirror, kept when its id is dropped (a new scaler at the dead
        # one's address): what a new primary replaced.
        self._primary_st: ScalerMirror | None = None
        # The first optimizer of the watched models to step: without a scaler, its
        # steps end the training steps.
        self.primary_opt: int | None = None
        self._opt_names: dict[int, str] = {}
        self._opt_count = 0
        self._opt_relevant: dict[int, bool] = {}
        self._opts: dict[int, weakref.ref[Any]] = {}
        # Told when an optimizer id is reused, to forget what was decided about it.
        self.forget_hooks: list[Callable[[int], None]] = []
        if scaler is not None:
            self.mirror(scaler)
        for o in optimizers:
            self.relevant(o)

    # -- scalers -----------------------------------------------------------
    def mirror(self, scaler: GradScaler, optimizer: Any = None) -> ScalerMirror | None:
        """``scaler``'s mirror (made on first sight); None for a scaler the watch ignores.

        With a scaler named to the watch (``watch(scaler=...)``, the framework callbacks),
        another scaler is ignored, unless it steps or unscales (``optimizer``) one of the
        named scaler's optimizers: the loop replaced the named one (a GradScaler built
        anew each epoch), and the new one is the watch's from then on."""
        explicit = self._explicit_scaler
        if explicit is not None and scaler is not explicit:
            named = self.scalers.get(id(explicit))
            if optimizer is None or not (
                    id(optimizer) in self._explicit_opts
                    or (named is not None and id(optimizer) in named.opt_ids)):
                return None
            self._explicit_scaler = scaler
        st = self.scalers.get(id(scaler))
        if st is None or st.ref() is not scaler:
            st = ScalerMirror.of(scaler, f"scaler{len(self.scalers)}")
            self.scalers[id(scaler)] = st
            if self.primary_scaler == id(scaler):  # a new scaler at a dead one's address
                self.primary_scaler = None
            if scaler is self._explicit_scaler:
                self.claim(scaler, st)
        return st

    def claim(self, scaler: GradScaler, st: ScalerMirror) -> ScalerMirror | None:
        """``scaler`` works for the watched models (it stepped or unscaled one of
        their optimizers). The first such scaler drives step boundaries; a new
        one takes over when that one is gone (a training function called again).
        Scalers of other models, seen by an overlapping watch, never do.

        Returns the primary's mirror that ``scaler`` replaced, if it took over from
        one that worked for the watched models: never for a second scaler used beside
        the primary (a GAN's), which steps other optimizers while the primary lives.
        """
        st.relevant = True
        cur = self._primary_st
        if cur is None or cur.ref() is None or not cur.relevant or (
                cur is not st and cur.opt_ids & st.opt_ids):
            # A new scaler for the same optimizer replaced the old one (a resumed or
            # restarted loop), even while the old object is still alive.
            self.primary_scaler = id(scaler)
            self._primary_st = st
            if cur is not None and cur is not st and cur.relevant:
                return cur
        return None

    def primary(self) -> ScalerMirror | None:
        return self.scalers[self.primary_scaler] if self.primary_scaler is not None else None

    def is_primary(self, scaler: GradScaler) -> bool:
        return id(scaler) == self.primary_scaler

    def enabled(self) -> list[tuple[GradScaler, ScalerMirror]]:
        """The live, enabled scalers with their mirrors."""
        out = []
        for st in self.scalers.values():
            s = st.ref()
            if s is not None and s._enabled:
                out.append((s, st))
        return out

    # -- optimizers --------------------------------------------------------
    def _known(self, opt: Any) -> None:
        if id(opt) not in self._opts or self._opts[id(opt)]() is not opt:
            if id(opt) in self._opts:
                # A new optimizer at a dead one's address: forget what was decided about it.
                self._opt_relevant.pop(id(opt), None)
                self._opt_names.pop(id(opt), None)
                for hook in self.forget_hooks:
                    hook(id(opt))
            try:
                self._opts[id(opt)] = weakref.ref(opt)
            except TypeError:  # pragma: no cover - optimizer wrappers without __weakref__
                pass

    def relevant(self, opt: Any) -> bool:
        """Does ``opt`` step a watched model's parameters (or was it named to the watch)?"""
        key = id(opt)
        self._known(opt)
        if key not in self._opt_relevant:
            if self._explicit_opts:
                rel = key in self._explicit_opts
            else:
                rel = any(self._owns_param(p) for p in optimizer_params(opt))
            self._opt_relevant[key] = rel
        if key not in self._opt_names:
            self._opt_names[key] = f"{type(opt).__name__}#{self._opt_count}"
            self._opt_count += 1
        return self._opt_relevant[key]

    def foreign_optimizers(self) -> list[str]:
        """Names of the live optimizers seen stepping that hold none of the watched
        models' parameters (a parameter dict given to ``torch.func.functional_call``)."""
        return [self._opt_names[k] for k, ref in self._opts.items()
                if ref() is not None and self._opt_relevant.get(k) is False
                and k in self._opt_names]

    def models_changed(self) -> None:
        """The watch gained a model: optimizers judged "not ours" before may be ours now.

        An LR scheduler's constructor, for one, shows us the optimizer before the
        ``diagnose`` CLI has seen the model's first forward pass.
        """
        self._opt_relevant = {k: v for k, v in self._opt_relevant.items() if v}

    def first_cycle(self, roots: list[list[torch.Tensor]]) -> FirstCycle | None:
        """A :class:`FirstCycle` for these watched roots; None when it has nothing to
        decide: a scaler named to the watch (its updates end the steps, and the other
        scalers' steps are not seen)."""
        if self._explicit_scaler is not None:
            return None
        explicit = self._explicit_opts
        return FirstCycle(roots, lambda opt: not explicit or id(opt) in explicit)

    def opt_name_of(self, key: int) -> str:
        """The name given to the optimizer of id ``key`` (see :meth:`opt_name`)."""
        return self._opt_names.get(key, "an optimizer")

    def opt_name(self, opt: Any) -> str:
        self.relevant(opt)
        return self._opt_names[id(opt)]

    def optimizers(self) -> list[Any]:
        """The live optimizers seen so far."""
        return [o for o in (ref() for ref in list(self._opts.values())) if o is not None]

    def owns_param(self, p: torch.Tensor) -> bool:
        return self._owns_param(p)


class FirstCycle:
    """Which update ends an iteration, when several optimizers train the watched
    models (a GAN's generator and discriminator, as two models or as the two halves of
    one LightningModule), with or without GradScalers.

    The first update does not end the first step if watched trainable parameters that
    no optimizer stepped yet are held by a live optimizer: that one steps later in the
    same iteration, whichever part ran forward first (a discriminator update runs the
    generator too). The optimizer whose step leaves none waiting is the iteration's
    last: its update (its own step, or its scaler's ``update()``) ends this step and
    every later one. Parameters no optimizer holds (an EMA copy, a forgotten
    ``requires_grad``) are not waited for. With one optimizer over every trainable
    parameter (most runs) the first update decides at once, with no search.
    """

    def __init__(self, roots: list[list[torch.Tensor]],
                 candidates: Callable[[Any], bool] = lambda opt: True) -> None:
        self._candidates = candidates
        self._params = {id(p) for ps in roots for p in ps if p.requires_grad}
        self._covered: set[int] = set()
        self._stepped: set[int] = set()
        self._holders: set[int] | None = None
        self._steps = 0
        self._counts: dict[int, int] = {}  # optimizer steps, per optimizer
        # The optimizer that stepped last, and whether the first step ever waited.
        self.last: int | None = None
        self.waited = False
        # The wait ended at FIRST_CYCLE_MAX_STEPS, the awaited optimizer still unseen.
        self.gave_up = False

    def stepped(self, optimizer: Any) -> None:
        self._steps += 1
        self._counts[id(optimizer)] = self._counts.get(id(optimizer), 0) + 1
        self._stepped.add(id(optimizer))
        self._covered.update(id(p) for p in optimizer_params(optimizer))
        self.last = id(optimizer)

    def waiting(self) -> bool:
        """Does the first step go on after the updates so far (another optimizer is due)?"""
        untrained = self._params - self._covered
        if not untrained:
            return False
        if self._steps >= FIRST_CYCLE_MAX_STEPS:
            self.gave_up = self.waited
            return False
        if self._holders is None:
            self._holders = _holders_of(untrained, self._candidates)
        if self._holders - self._stepped:
            self.waited = True
            return True
        return False

    @property
    def iterations(self) -> int:
        """The loop's iterations the first step holds: 1, unless the wait gave up; then
        one per step of the optimizer that ends each iteration from now on."""
        if not self.gave_up or self.last is None:
            return 1
        return self._counts.get(self.last, 1)


def _holders_of(param_ids: set[int], candidates: Callable[[Any], bool]) -> set[int]:
    """The live optimizers holding any of ``param_ids``. Optimizers made before the
    watch are seen nowhere else: one walk of the collector's objects, once a run
    (about 0.2 s with transformers imported), and only when the first update left
    trainable parameters unstepped."""
    found = set()
    for obj in gc.get_objects():
        # type(), not isinstance: a proxy's __class__ may run arbitrary code.
        if issubclass(type(obj), Optimizer) and candidates(obj) and any(
                id(p) in param_ids for p in optimizer_params(obj)):
            found.add(id(obj))
    return found
