"""Typed server configuration: dataclasses loaded from YAML plus environment overrides.

Every config is a dataclass whose fields are declared with :func:`setting`
(default + one line of help). :func:`load_config` reads the YAML file once,
applies ``<PREFIX>__<KEY>[__<SUBKEY>]`` environment overrides and explicit
overrides (command-line flags), checks every value against the field's type,
rejects unknown keys, and runs each dataclass's ``validate()``. A dataclass
with ``accepts_verl_async_training = True`` (the ``async_training`` sections; ``accepts_verl_multi_turn``
for ``multi_turn``)
also accepts every key of verl's block and reports the ones it does not act
on (:func:`config_notes`, :mod:`mesh_runtime.verl_config`). Every problem
is a :class:`ConfigError` that names the key and says what is wrong.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .failures import ConfigError

if typing.TYPE_CHECKING:
    from .identity import Identity

_MISSING = dataclasses.MISSING


def setting(default: Any = _MISSING, *, help: str, secret: bool = False, path: bool | str = False,
            default_factory: Any = _MISSING) -> Any:
    """Declare a config field with its default and its one-line documentation. ``path`` True: a file or
    directory (or a list of them); a relative one given in a config file is relative to that file.
    ``path="existing"``: the same for a value that may also be a name (a model preset): only when the
    file's directory holds it."""
    meta = {"help": help, "secret": secret, "path": path}
    if default_factory is not _MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it (converted if lossless)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as err:
                errors.append(err.why)
        raise ConfigError(key, "; ".join(errors))
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(key, f"must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping, got {type(value).__name__}")
        return _build(typing.cast(type, tp), value, key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        names = [m.value for m in tp]
        if value not in names:
            raise ConfigError(key, f"must be one of {', '.join(map(repr, names))}, got {value!r}")
        return tp(value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {type(value).__name__}")
        item_tp = args[0] if args else Any
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping, got {type(value).__name__}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(v, val_tp, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    raise ConfigError(key, f"unsupported config type {_type_name(tp)}")


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    notes: list[str] = []
    if getattr(cls, "accepts_verl_async_training", False):
        from .verl_config import split_async_training  # noqa: PLC0415

        data, notes = split_async_training(data, prefix, fields)
    elif getattr(cls, "accepts_verl_multi_turn", False):
        from .verl_config import MULTI_TURN_NO_EFFECT, split_async_training  # noqa: PLC0415

        data, notes = split_async_training(data, prefix, fields, honoured_by={},
                                           no_effect_keys=MULTI_TURN_NO_EFFECT, section="multi_turn")
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{_join(prefix, close[0])}'?)" if close else ""
            raise ConfigError(_join(prefix, str(key)), f"unknown key{hint}")
    kwargs = {}
    for name, field in fields.items():
        key = _join(prefix, name)
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], key)
        elif field.default is _MISSING and field.default_factory is _MISSING:
            raise ConfigError(key, "is required")
    obj = cls(**kwargs)
    if notes:
        object.__setattr__(obj, "_config_notes", notes)
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError as err:
            if prefix and err.key and not err.key.startswith(prefix):
                raise ConfigError(_join(prefix, err.key), err.why) from None
            raise
        except (ValueError, TypeError, LookupError) as err:
            raise ConfigError(prefix, str(err)) from None
        except Exception as err:  # noqa: BLE001 - domain validators (e.g. a core config) raise their own errors
            field = (getattr(err, "metadata", None) or {}).get("field", "")
            raise ConfigError(_join(prefix, field) if field else prefix, str(err)) from None
    return obj


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _set_path(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def build_config(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    """Build ``cls`` from a mapping already in memory (a section of a host framework's config), checked as
    :func:`load_config` checks a file; every :class:`ConfigError` names its key under ``prefix``."""
    return _build(cls, data, prefix)


def load_config(cls: type, path: str | Path | None = None, *,
                env: Mapping[str, str] | None = None, env_prefix: str = "",
                overrides: Mapping[str, Any] | None = None) -> Any:
    """Build ``cls`` from a YAML file, environment overrides and explicit overrides.

    ``env`` is passed in by the caller (the command line reads ``os.environ``
    once); keys look like ``ROLLMESH_LB__MAX_VERSION_LAG`` for ``env_prefix``
    ``ROLLMESH_LB`` and are parsed as YAML scalars. ``overrides`` uses dotted keys.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ConfigError("", f"cannot read config file {path}: {err.strerror}") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError("", f"config file {path} is not valid YAML: {err}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError("", f"config file {path} must hold a mapping at the top level")
        data = resolve_paths(cls, loaded, Path(path).resolve().parent)
    if env and env_prefix:
        marker = env_prefix + "__"
        for name, raw in sorted(env.items()):
            if name.startswith(marker):
                keys = [p.lower() for p in name[len(marker):].split("__") if p]
                try:
                    value = yaml.safe_load(raw) if raw != "" else ""
                except yaml.YAMLError:
                    value = raw
                _set_path(data, keys, value)
    for dotted, value in (overrides or {}).items():
        _set_path(data, dotted.split("."), value)
    return _build(cls, data)


def resolve_paths(cls: type, data: Any, base: Path) -> Any:
    """``data`` (a config file's mapping for ``cls``) with the relative paths of its ``path`` fields made
    relative to ``base`` (the file's directory); a value that is not a plain relative path (absolute, a URL,
    empty) is left alone. Keys the class does not know are left for :func:`_build` to report."""
    if not isinstance(data, dict) or not dataclasses.is_dataclass(cls):
        return data
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for field in dataclasses.fields(cls):
        if field.name not in out:
            continue
        value, kind = out[field.name], field.metadata.get("path", False)
        if kind:
            out[field.name] = ([_relative_to(v, base, kind) for v in value] if isinstance(value, list)
                               else _relative_to(value, base, kind))
            continue
        inner = _dataclass_of(hints[field.name])
        if inner is not None:
            out[field.name] = ([resolve_paths(inner, v, base) for v in value] if isinstance(value, list)
                               else resolve_paths(inner, value, base))
    return out


def _relative_to(value: Any, base: Path, kind: bool | str) -> Any:
    if not isinstance(value, str) or not value or "://" in value or Path(value).is_absolute():
        return value
    resolved = base / value
    if kind == "existing" and not resolved.exists():
        return value
    return str(resolved)


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass a field holds (itself, optional, or as list items), if any."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        found = _dataclass_of(arg)
        if found is not None:
            return found
    return None


def config_notes(cfg: Any) -> list[str]:
    """Lines to print at start about keys accepted without effect (e.g. verl's ``async_training`` keys)."""
    notes = list(getattr(cfg, "_config_notes", ()))
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if dataclasses.is_dataclass(value):
            notes.extend(config_notes(value))
    return notes


def summary(cfg: Any) -> dict[str, Any]:
    """The effective config as plain data, with secret fields redacted."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.metadata.get("secret") and value:
            out[field.name] = "<redacted>"
        elif dataclasses.is_dataclass(value):
            out[field.name] = summary(value)
        elif isinstance(value, enum.Enum):
            out[field.name] = value.value
        elif isinstance(value, list):
            out[field.name] = [summary(v) if dataclasses.is_dataclass(v) else v for v in value]
        else:
            out[field.name] = value
    return out


def describe(cls: type, indent: int = 0) -> str:
    """Render the documented defaults of ``cls`` as commented YAML."""
    lines: list[str] = []
    pad = "  " * indent
    for field in dataclasses.fields(cls):
        help_text = field.metadata.get("help", "")
        if help_text:
            lines.append(f"{pad}# {help_text}")
        if field.default is not _MISSING:
            default = field.default
        elif field.default_factory is not _MISSING:
            default = field.default_factory()
        else:
            lines.append(f"{pad}{field.name}:  # required")
            continue
        if dataclasses.is_dataclass(default):
            lines.append(f"{pad}{field.name}:")
            lines.append(describe(type(default), indent + 1))
            continue
        if isinstance(default, enum.Enum):
            default = default.value
        rendered = yaml.safe_dump({field.name: default}, default_flow_style=True).strip()
        lines.append(pad + rendered.removeprefix("{").removesuffix("}"))
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """PEM files of one process's mesh identity (mutual TLS, :mod:`mesh_runtime.tls`)."""

    cert: str = setting(help="PEM certificate of this process (rollmesh certs create)", path=True)
    key: str = setting(help="PEM private key of cert", path=True)
    ca: str = setting(help="PEM CA bundle that peers' certificates must chain to", path=True)

    def validate(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if not path:
                raise ConfigError(name, "is required")
            if not Path(path).is_file():
                raise ConfigError(name, f"no such file: {path[:200]}")
        self.identity()   # a certificate without a rollmesh identity is refused at start

    def identity(self) -> Identity:
        """The identity ``cert`` names; :class:`ConfigError` if it names none."""
        from .identity import identity_from_pem  # noqa: PLC0415

        try:
            identity = identity_from_pem(Path(self.cert).read_bytes())
        except ValueError as err:
            raise ConfigError("cert", f"{self.cert[:200]} is not a PEM certificate ({err})") from None
        if identity is None:
            raise ConfigError("cert", f"{self.cert[:200]} names no rollmesh identity "
                                      "(a URI SAN spiffe://rollmesh/<role>/<name>; see rollmesh certs create)")
        return identity


@dataclasses.dataclass
class ServerConfig:
    """Settings every rollmesh server has. Server configs subclass this."""

    listen: str = setting("127.0.0.1:0", help="HOST:PORT to serve gRPC on; port 0 picks a free port "
                                               "(the chosen one is printed in the readiness line)")
    node_id: str = setting("", help="name of this node in status, events and traces; empty = the host name")
    shutdown_grace_s: float = setting(10.0, help="seconds in-flight RPCs may take to finish after "
                                                 "SIGTERM/SIGINT before they are cancelled")
    tls: TlsConfig | None = setting(None, help="mutual TLS: {cert, key, ca} PEM paths; required to listen on a "
                                               "non-loopback address (unless insecure)")
    insecure: bool = setting(False, help="serve plaintext on a non-loopback address (flag --insecure); "
                                         "warned at every start and shown in GetStatus")
    health_listen: str = setting("", help="HOST:PORT of a plaintext listener serving only grpc.health.v1 "
                                          "(for probes that speak no TLS); empty = off")

    def validate(self) -> None:
        from .net import AddressError, is_loopback, parse_host_port  # noqa: PLC0415 - import cycle at load

        try:
            host, _ = parse_host_port(self.listen)
        except AddressError as err:
            raise ConfigError("listen", str(err)) from None
        if self.tls is None and not self.insecure and not is_loopback(host):
            raise ConfigError("tls", f"listen {self.listen[:64]} is not a loopback address and no tls is "
                                     "configured: give tls {cert, key, ca} (rollmesh certs create) or start "
                                     "with --insecure to serve plaintext")
        if self.health_listen:
            try:
                parse_host_port(self.health_listen)
            except AddressError as err:
                raise ConfigError("health_listen", str(err)) from None
            if self.health_listen == self.listen and not self.listen.endswith(":0"):
                raise ConfigError("health_listen", "must differ from listen")
        if not 0 < self.shutdown_grace_s <= 600:
            raise ConfigError("shutdown_grace_s", f"must be in (0, 600] seconds, got {self.shutdown_grace_s}")


def check_addresses(config: Any, *keys: str, listen_keys: tuple[str, ...] = (),
                    list_keys: tuple[str, ...] = ()) -> None:
    """Raise ``ConfigError`` for any non-empty ``keys`` value that is not HOST:PORT.

    Keys in ``listen_keys`` are addresses to bind, where port 0 (pick one) is fine; keys in ``list_keys`` may
    hold several addresses, comma-separated (the controllers of an etcd store, followed to the leader).
    """
    from .net import AddressError, parse_host_port  # noqa: PLC0415

    for key in (*keys, *listen_keys, *list_keys):
        value = getattr(config, key)
        if not value:
            continue
        parts = [p.strip() for p in value.split(",")] if key in list_keys else [value]
        for part in parts:
            try:
                parse_host_port(part, allow_zero_port=key in listen_keys)
            except AddressError as err:
                raise ConfigError(key, str(err) if len(parts) == 1 else f"{part[:64]!r}: {err}") from None
