"""Keyword checking for the attributors' entry points: one name per concept, clear errors.

:func:`keywords` wraps a method so that

* a keyword it does not take raises ``TypeError`` naming the method, the
  unknown keyword (with the closest accepted name) and every accepted name,
  where a method with ``**kwargs`` would otherwise record or drop it silently;
* a documented alias (an older name for the same concept, e.g.
  ``fisher_dir`` for ``fit_dir``) is accepted and renamed; giving both raises
  ``TypeError``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

__all__ = ["keywords"]

F = TypeVar("F", bound=Callable[..., Any])


def keywords(
    *, aliases: Mapping[str, str] | None = None, extra: Iterable[str] = ()
) -> Callable[[F], F]:
    """Check (and rename) the keyword arguments of a method.

    Args:
        aliases: ``{alias: canonical}`` accepted in place of the canonical name.
        extra: keywords a ``**kwargs`` method accepts beyond its named
            parameters (anything else raises).

    Returns:
        the decorator; the wrapped function keeps its signature
        (``functools.wraps``) and lists its aliases in ``__keyword_aliases__``.
    """
    alias_map = dict(aliases or {})
    extras = frozenset(extra)

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        named = {
            name
            for name, param in signature.parameters.items()
            if param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD) and name != "self"
        }
        accepted = sorted(named | extras | set(alias_map))

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for alias, canonical in alias_map.items():
                if alias in kwargs:
                    if canonical in kwargs:
                        raise TypeError(
                            f"{func.__qualname__}() got both {canonical!r} and its alias "
                            f"{alias!r}; pass {canonical!r} only"
                        )
                    kwargs[canonical] = kwargs.pop(alias)
            unknown = [key for key in kwargs if key not in named and key not in extras]
            if unknown:
                hints = []
                for key in unknown:
                    close = difflib.get_close_matches(key, accepted, n=1)
                    hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
                raise TypeError(
                    f"{func.__qualname__}() got unknown keyword argument(s) "
                    f"{', '.join(hints)}; it accepts {accepted}"
                )
            return func(*args, **kwargs)

        wrapper.__keyword_aliases__ = dict(alias_map)  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
