"""The worker queues' request format: JSON of ``Request.to_dict()`` that cannot run code when it is
loaded.

Anyone who can write one entry in Redis must not be able to run code in the workers that pop it, so
the default format is data only (scrapy-redis's default, pickle, runs whatever a payload says on
``loads``). Usable as scrapy-redis's ``SCHEDULER_SERIALIZER`` too: the module has ``dumps(dict) ->
bytes`` and ``loads(bytes) -> dict``.

Plain data only, compared by exact type so that nothing comes back as something else: None, bool,
int, float, str, bytes, list, tuple and dict (keys of those types). JSON carries the first five and
lists; the rest are one-key objects::

    {"$b": "text"}       bytes that are UTF-8 (headers, most bodies: readable in the queue)
    {"$b64": "..."}      other bytes, base64
    {"$t": [...]}        a tuple
    {"$d": [[k, v]...]}  a dict with a key that is not a str, or whose only key starts with "$"

Anything else (a datetime, a set, an Item, a str subclass) is refused by :func:`dumps` with a
:class:`~scrapy_redislock.errors.RequestFormatError` naming the field (``meta['when']``), never
converted.
:func:`loads` takes only that shape back; a ``_class`` (a Request subclass, set by ``to_dict``) must
name a Request subclass that is already imported: nothing is imported or called on a payload's say.

:func:`serializer_of` reads scrapy-redis's SCHEDULER_SERIALIZER (a module, or its import path, with
``loads`` and ``dumps``; e.g. ``"scrapy_redis.picklecompat"`` to choose pickle knowingly). Reads no
settings itself.
"""

from __future__ import annotations

import base64
import binascii
import importlib
import inspect
import json
import sys
from typing import Any

from scrapy import Request
from scrapy.utils.request import request_from_dict

from scrapy_redislock.errors import ConfigError, RequestFormatError

SCALARS = (type(None), bool, int, float, str)


def _short(value: Any) -> str:
    """A payload's value for a message: repr (escaped), cut short."""
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _encode(value: Any, path: str) -> Any:
    kind = type(value)
    if kind in SCALARS:
        return value
    if kind is bytes:
        try:
            return {"$b": value.decode("utf-8")}
        except UnicodeDecodeError:
            return {"$b64": base64.b64encode(value).decode("ascii")}
    if kind is list:
        return [_encode(item, f"{path}[{n!r}]") for n, item in enumerate(value)]
    if kind is tuple:
        return {"$t": [_encode(item, f"{path}[{n!r}]") for n, item in enumerate(value)]}
    if kind is dict:
        if all(type(key) is str for key in value) and not (
            len(value) == 1 and next(iter(value)).startswith("$")
        ):
            return {key: _encode(item, f"{path}[{key!r}]") for key, item in value.items()}
        return {"$d": [[_encode(key, f"{path} key {key!r}"), _encode(item, f"{path}[{key!r}]")]
                       for key, item in value.items()]}  # fmt: skip
    raise RequestFormatError(
        f"{path} is a {kind.__module__}.{kind.__qualname__}, not plain data (None, bool, int, float, str, bytes, list, tuple, dict); store it elsewhere or as plain data, or choose SCHEDULER_SERIALIZER knowingly"  # noqa: E501
    )


def dumps(request_dict: dict[str, Any]) -> bytes:
    """``request.to_dict(spider=...)`` as JSON bytes; RequestFormatError naming the field that is
    not plain data."""
    if type(request_dict) is not dict:
        raise RequestFormatError(f"a request dict is expected, got a {type(request_dict).__name__}")
    encoded = {key: _encode(value, str(key)) for key, value in request_dict.items()}
    return json.dumps(encoded, separators=(",", ":")).encode("ascii")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        tag, inner = next(iter(value.items()))
        if tag == "$b" and isinstance(inner, str):
            return inner.encode("utf-8")
        if tag == "$b64" and isinstance(inner, str):
            return base64.b64decode(inner, validate=True)
        if tag == "$t" and isinstance(inner, list):
            return tuple(_decode(item) for item in inner)
        if (
            tag == "$d"
            and isinstance(inner, list)
            and all(isinstance(p, list) and len(p) == 2 for p in inner)
        ):
            return {_decode(k): _decode(v) for k, v in inner}
        if tag.startswith("$"):
            raise RequestFormatError(f"unknown or malformed tag {_short(tag)}")
    return {key: _decode(item) for key, item in value.items()}


def loads(data: bytes | str) -> dict[str, Any]:
    """The request dict back from :func:`dumps`'s bytes; RequestFormatError for anything else
    (pickle, garbage, a truncated entry, a ``_class`` that is not an imported Request subclass)."""
    try:
        decoded = _decode(json.loads(data))
    # UnicodeDecodeError is a ValueError
    except (ValueError, TypeError, binascii.Error, RecursionError) as exc:
        raise RequestFormatError(
            f"not the JSON request format ({type(exc).__name__}: {str(exc)[:80]})"
        ) from None
    if not isinstance(decoded, dict) or not isinstance(decoded.get("url"), str):
        raise RequestFormatError("not a request: a JSON object with a 'url' string is expected")
    if "_class" in decoded:
        request_class(decoded["_class"])
    return decoded


def request_class(path: Any) -> type[Request]:
    """The Request subclass a dict's ``_class`` names, only if its module is already imported (no
    import, no call); RequestFormatError otherwise."""
    module_name, _, name = str(path).rpartition(".")
    found = getattr(sys.modules.get(module_name), name, None) if module_name else None
    if not (isinstance(found, type) and issubclass(found, Request)):
        raise RequestFormatError(f"_class {_short(path)} is not an imported Request subclass")
    return found


def request_from_data(
    data: bytes, serializer: Any, spider: Any, schemes: tuple[str, ...] = ("http", "https")
) -> Request:
    """A queued entry back into a Request: ``serializer.loads``, then ``_class``, the URL's scheme
    and the callbacks checked (an imported Request subclass; one of ``schemes``, the
    REDISLOCK_ALLOWED_SCHEMES; public methods of the spider), then Scrapy's ``request_from_dict``.

    Whoever can push to a queue chooses these: a ``file:`` URL would read the worker's files
    (Scrapy's file handler is on by default), a private method or a classmethod as a callback
    (``_set_crawler``) would rewire the spider."""
    loaded = serializer.loads(data)
    if not isinstance(loaded, dict):
        raise RequestFormatError(f"not a request dict: a {type(loaded).__name__}")
    if "_class" in loaded:
        request_class(loaded["_class"])
    url = loaded.get("url")
    scheme = url.partition(":")[0].strip().lower() if isinstance(url, str) and ":" in url else ""
    if scheme not in schemes:
        raise RequestFormatError(
            f"url {_short(url)} has a scheme that is not in REDISLOCK_ALLOWED_SCHEMES ({', '.join(schemes)})"
        )
    for field in ("callback", "errback"):
        name = loaded.get(field)
        if name is None:
            continue
        if not _public_method(spider, name):
            raise RequestFormatError(
                f"{field} {_short(name)} is not a public method of the spider (no leading underscore, not a class or static method)"  # noqa: E501
            )
    return request_from_dict(loaded, spider=spider)


def _public_method(spider: Any, name: Any) -> bool:
    """Whether ``name`` is a method of the spider object itself: no leading underscore, bound to
    the spider (a classmethod is bound to its class; a staticmethod is no method)."""
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        return False
    method = getattr(spider, name, None)
    return inspect.ismethod(method) and method.__self__ is spider


def serializer_of(value: Any) -> Any:
    """SCHEDULER_SERIALIZER as scrapy-redis reads it: None = this module; a module or import path
    with ``loads`` and ``dumps``. ConfigError naming the setting and the value otherwise."""
    if value in (None, ""):
        return sys.modules[__name__]
    module = value
    if isinstance(value, str):
        try:
            module = importlib.import_module(value)
        except ImportError as exc:
            raise ConfigError(
                f"SCHEDULER_SERIALIZER {value!r} cannot be imported ({exc})"
            ) from None
    if not (callable(getattr(module, "loads", None)) and callable(getattr(module, "dumps", None))):
        raise ConfigError(
            f"SCHEDULER_SERIALIZER {value!r} must be a module (or its import path) with loads and dumps"
        )
    return module


__all__ = ["dumps", "loads", "request_class", "request_from_data", "serializer_of"]
