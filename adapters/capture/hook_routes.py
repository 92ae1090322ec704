"""Capture hooks that stay registered on the model and are routed per calling context.

Each module the capture observes gets one pre-hook and one forward hook for its lifetime
(:func:`install_routes`, when the model is wrapped); what they call is chosen in the calling
context (:func:`routed`, a context variable), so forwards of other threads pass through them
untouched (docs/architecture.md, "Concurrent callers").
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from torch import nn

#: ``(id(module), "pre" | "post")`` -> functions called in the calling context, in order
#: (pre: ``fn(module, args, kwargs)``; post: ``fn(module, args, kwargs, output)``).
ACTIVE_ROUTES: contextvars.ContextVar[
    Mapping[tuple[int, str], tuple[Callable[..., Any], ...]] | None
] = contextvars.ContextVar("abstain_guard_hook_routes", default=None)

_ROUTED = "_abstain_guard_routed"
_INSTALL = threading.Lock()

#: One hook as capture code writes it: module, ``"pre"`` or ``"post"``, the function, and
#: whether it takes the forward's keyword arguments (torch's ``with_kwargs``).
Hook = tuple[nn.Module, str, Callable[..., Any], bool]


def _pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    routes = ACTIVE_ROUTES.get()
    fns = routes.get((id(module), "pre")) if routes else None
    if fns:
        for fn in fns:
            fn(module, args, kwargs)


def _post(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
    routes = ACTIVE_ROUTES.get()
    fns = routes.get((id(module), "post")) if routes else None
    if fns:
        for fn in fns:
            fn(module, args, kwargs, output)


def install_routes(modules: Iterable[nn.Module]) -> None:
    """Give each of ``modules`` its routing pre-hook and forward hook (once per module;
    call before any forward of the model runs in another thread)."""
    with _INSTALL:
        for m in modules:
            if not getattr(m, _ROUTED, False):
                m.register_forward_pre_hook(_pre, with_kwargs=True)
                m.register_forward_hook(_post, with_kwargs=True)
                object.__setattr__(m, _ROUTED, True)


def is_routed(module: nn.Module) -> bool:
    """Whether :func:`install_routes` has been called for ``module``."""
    return bool(getattr(module, _ROUTED, False))


def _uniform(kind: str, fn: Callable[..., Any], with_kwargs: bool) -> Callable[..., Any]:
    """``fn`` called the way the routing hook of ``kind`` calls (kwargs always passed)."""
    if with_kwargs:
        return fn
    if kind == "pre":
        return lambda m, args, kwargs: fn(m, args)
    return lambda m, args, kwargs, output: fn(m, args, output)


@contextmanager
def routed(hooks: Iterable[Hook]) -> Iterator[None]:
    """Call ``hooks`` from forwards run in this context (thread or task), after the ones
    already routed here, until the block ends. Raises RuntimeError for a module without
    routes (the model was not wrapped by :func:`~..model.loading.wrap_model`)."""
    table = dict(ACTIVE_ROUTES.get() or {})
    for module, kind, fn, with_kwargs in hooks:
        if kind not in ("pre", "post"):
            raise ValueError(f"hook kind {kind!r}: use 'pre' or 'post'")
        if not is_routed(module):
            raise RuntimeError(
                f"{type(module).__name__} has no capture routes; wrap the model with "
                "wrap_model (or install_routes) before capturing"
            )
        key = (id(module), kind)
        table[key] = (*table.get(key, ()), _uniform(kind, fn, with_kwargs))
    token = ACTIVE_ROUTES.set(table)
    try:
        yield
    finally:
        ACTIVE_ROUTES.reset(token)
