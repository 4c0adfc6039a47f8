"""Which tensors can be summarised: metadata only, no host sync, no kernel.

Sparse, nested, meta, float8, quantized and functorch-wrapped tensors (under
``vmap``/``grad``) are skipped by the probes and counted in an
``unsummarized`` event instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from amp_doctor.devicework import MAX_OUTPUT_DEPTH

__all__ = ["unsummarizable", "values_of", "given_data", "given_data_keyed", "input_label"]

_FLOAT8 = frozenset(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n))


def _is_functorch_wrapped(t: torch.Tensor) -> bool:
    # vmap's BatchedTensor and grad's GradTrackingTensor: summarising them would
    # run inside the transform, and most queries on them assert.
    fn = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return bool(fn(t)) if fn is not None else False


def unsummarizable(t: torch.Tensor) -> str | None:
    """Why ``t`` (a floating-point tensor) cannot be summarised, or None if it can.

    Only metadata is read: no host sync, no kernel.
    """
    if _is_functorch_wrapped(t):
        return "functorch"
    if t.is_nested:
        return "nested"
    if t.layout is not torch.strided:
        return "sparse" if t.is_sparse or t.layout in (
            torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc) else str(
            t.layout).replace("torch.", "")
    if t.is_meta:
        return "meta"
    if t.dtype in _FLOAT8:
        return "float8"
    if t.is_quantized:
        return "quantized"
    return None


def values_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s values: a sparse COO tensor's (an ``Embedding(sparse=True)``
    gradient: every non-zero is there), else ``t``. Its finiteness is ``t``'s. No copy."""
    return t._values() if t.layout is torch.sparse_coo and not t.is_meta else t


def _keyed(obj: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], torch.Tensor]]:
    """``devicework.iter_tensors``'s tensors, in its order, each with its path: indices
    of sequences, keys of dicts, fields of dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif len(path) >= MAX_OUTPUT_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float)):
        return
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _keyed(v, (*path, str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _keyed(v, (*path, str(i)))
    elif isinstance(obj, (set, frozenset)):
        for v in obj:
            yield from _keyed(v, (*path, "?"))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _keyed(getattr(obj, f.name, None), (*path, f.name))


def _is_data(t: torch.Tensor, complex_too: bool) -> bool:
    return ((t.is_floating_point() or (complex_too and t.is_complex())) and t.numel() > 0
            and t.grad_fn is None and unsummarizable(t) is None)


def given_data_keyed(args: Any, complex_too: bool = False) -> list[tuple[str, torch.Tensor]]:
    """:func:`given_data`, each tensor with a key that names where it was given, stable
    when an optional input comes and goes (review 49b): ``args`` is a call's positional
    arguments, or ``(args, kwargs)`` when it had keyword ones (the probes' ``given``).
    A positional argument's key is ``"#<index>"``, a keyword argument's its name; a
    tensor inside a container adds ``"/<index or key>"`` steps."""
    kw = (isinstance(args, tuple) and len(args) == 2 and isinstance(args[0], tuple)
          and isinstance(args[1], dict))
    out = []
    for path, t in _keyed(args):
        if not _is_data(t, complex_too):
            continue
        if kw and path[0] == "1":
            key = "/".join(path[1:])
        else:
            rest = path[1:] if kw else path
            key = "#" + "/".join(rest)
        out.append((key, t))
    return out


def input_label(key: str) -> str:
    """How a report names the input :func:`given_data_keyed` keyed ``key``."""
    if key.startswith("#"):
        first, _, rest = key[1:].partition("/")
        label = f"positional argument {int(first) + 1}" if first.isdigit() else "argument"
    else:
        first, _, rest = key.partition("/")
        label = f"argument `{first}`"
    return label + (f" (at `{rest}` in it)" if rest else "")


def given_data(args: Any, complex_too: bool = False) -> list[torch.Tensor]:
    """The tensors of a model's arguments that are data: floating (or complex, with
    ``complex_too``), non-empty, summarisable, and not made by autograd-tracked work in this
    step. Another watched model's output (a backbone's features given to a head, a
    generator's samples given to a discriminator) or code on the weights has a
    ``grad_fn``: what is wrong with it was made by the model, not brought by the batch
    (review 49a: a backbone's overflow was "the batch given to the head held NaN")."""
    return [t for _, t in _keyed(args) if _is_data(t, complex_too)]
