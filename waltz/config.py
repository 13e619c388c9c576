"""YAML configuration with the original's dotted keys, validated against a key table.

A config file may use dotted keys (``storage.port: 55280``) or nest them
(``storage: {port: 55280}``); both flatten to the same dotted names. Each
daemon or tool declares the keys it accepts as a tuple of :class:`Key`; the
loader fills in defaults, converts and checks every value, and raises
:class:`ConfigError` naming the offending key for anything wrong (missing
required key, bad type or range, unknown key) before anything is started.
"""

import ipaddress
import os

import attr
import yaml


class ConfigError(Exception):
    """A configuration is invalid; the message names the key, and :attr:`key` is it (None when the
    problem is the file or the whole mapping)."""

    def __init__(self, message, key=None):
        super().__init__(message)
        self.key = key


REQUIRED = object()


def _parse_int(value):
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("expected an integer")
    try:
        return int(value)
    except ValueError:
        raise ValueError("expected an integer") from None     # not int()'s "invalid literal for int() ..."


def _parse_bool(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no"):
        return value.lower() in ("true", "yes")
    raise ValueError("expected true or false")


def _parse_str(value):
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise ValueError("expected a string")
    return str(value)


def port(value):
    """A TCP port number 1-65535."""
    number = _parse_int(value)
    if not 1 <= number <= 65535:
        raise ValueError("expected a port number 1-65535, got %d" % number)
    return number


def positive_int(value):
    number = _parse_int(value)
    if number <= 0:
        raise ValueError("expected a positive integer, got %d" % number)
    return number


def non_negative_int(value):
    number = _parse_int(value)
    if number < 0:
        raise ValueError("expected a non-negative integer, got %d" % number)
    return number


#: The longest duration a millisecond key accepts: a day. Anything longer is a mistake (and past about
#: 10**13 ms the reactor's timers overflow).
MAX_MILLISECONDS = 86_400_000


def expiration_ms(timeout):
    """``client.transactionExpiration`` for a run bounded by ``timeout`` seconds, within what the key takes
    (a command's ``--timeout`` may go up to a year and down to a fraction of a millisecond; 0 means never)."""
    return max(1, min(MAX_MILLISECONDS, round(timeout * 1000)))


def _milliseconds_from(minimum, why=""):
    """A parser of durations in milliseconds, ``minimum`` (``why`` says why, in the error) to
    :data:`MAX_MILLISECONDS`."""
    def parse(value):
        number = _parse_int(value)
        if not minimum <= number <= MAX_MILLISECONDS:
            raise ValueError("expected milliseconds from %d%s to %d (a day), got %d"
                             % (minimum, why, MAX_MILLISECONDS, number))
        return number
    return parse


#: A duration in milliseconds, 1 to :data:`MAX_MILLISECONDS`.
milliseconds = _milliseconds_from(1)

#: A duration in milliseconds, 0 to :data:`MAX_MILLISECONDS`.
non_negative_milliseconds = _milliseconds_from(0)

#: The shortest ZooKeeper session timeout accepted (ms). ZooKeeper itself negotiates at least twice its tick
#: (4 s by default); far less is a value meant in seconds, and would make a server give its partitions up
#: at every probe and every request time out.
MIN_SESSION_TIMEOUT_MS = 1000

#: A ZooKeeper session timeout in milliseconds, :data:`MIN_SESSION_TIMEOUT_MS` to :data:`MAX_MILLISECONDS`.
session_timeout_milliseconds = _milliseconds_from(MIN_SESSION_TIMEOUT_MS)

#: The shortest idle timeout accepted (ms): three keep-alive intervals (``waltz.protocols.base``), so that a
#: peer that writes nothing keeps the connection with its keep-alives even when one of them is late.
MIN_IDLE_TIMEOUT_MS = 15000

#: A connection's idle timeout in milliseconds, :data:`MIN_IDLE_TIMEOUT_MS` to :data:`MAX_MILLISECONDS`.
idle_timeout_milliseconds = _milliseconds_from(MIN_IDLE_TIMEOUT_MS, " (three 5 s keep-alive intervals)")


def liveness_of(config, key, reactor):
    """The :class:`~waltz.protocols.base.Liveness` of connections whose idle timeout is the config ``key``."""
    from waltz.protocols.base import Liveness
    return Liveness(reactor, idle_timeout=config[key] / 1000.0)


def bind_address(value):
    """An IP address literal to bind ports to (``0.0.0.0`` every IPv4 interface, ``::`` every one)."""
    text = _parse_str(value).strip()
    try:
        ipaddress.ip_address(text)
    except ValueError:
        raise ValueError("expected an IP address such as 0.0.0.0 or 127.0.0.1, got %r" % text) from None
    return text


def frame_size(value):
    """A frame size limit in bytes: at least DEFAULT_MAX_FRAME_SIZE (16 MiB), which every frame the system
    makes fits in (a transaction's data is at most 15 MiB); a smaller limit would refuse legitimate frames."""
    from waltz.protocols.framing import DEFAULT_MAX_FRAME_SIZE
    number = _parse_int(value)
    if number < DEFAULT_MAX_FRAME_SIZE:
        raise ValueError("expected at least %d bytes (16 MiB), got %d" % (DEFAULT_MAX_FRAME_SIZE, number))
    return number


def connect_string(value):
    """A ZooKeeper connect string: ``host:port[,host:port...]`` with an optional chroot."""
    text = _parse_str(value).strip()
    hosts = text.split("/", 1)[0]
    if not hosts:
        raise ValueError("expected host:port[,host:port...]")
    for item in hosts.split(","):
        host, sep, number = item.rpartition(":")
        if not sep or not host:
            raise ValueError("expected host:port, got %r" % item)
        port(number)
    return text


def znode_path(value):
    """An absolute ZooKeeper path such as ``/waltz_cluster``."""
    text = _parse_str(value)
    if (not text.startswith("/") or text.endswith("/") or "//" in text
            or any(part in (".", "..") for part in text.split("/"))):
        raise ValueError("expected an absolute path like /waltz_cluster, got %r" % text)
    return text


def directory(value):
    """A directory path (made absolute); one that exists must be a directory (it is created otherwise)."""
    text = _parse_str(value)
    if not text:
        raise ValueError("expected a directory path")
    if "\0" in text:
        raise ValueError("a path cannot contain a NUL character")
    path = os.path.abspath(os.path.expanduser(text))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError("%s exists and is not a directory" % path)
    return path


TYPES = {int: _parse_int, bool: _parse_bool, str: _parse_str}


@attr.s(frozen=True, slots=True, auto_attribs=True)
class Key:
    """One accepted configuration key: its dotted name, parser and default."""

    name: str
    parse: object = _parse_str
    default: object = REQUIRED
    doc: str = ""

    def convert(self, raw):
        parse = TYPES.get(self.parse, self.parse)
        try:
            return parse(raw)
        except (ValueError, TypeError) as exc:
            problem = str(exc)
            got = "" if "got %s" % (raw,) in problem or "got %r" % (raw,) in problem else " (got %r)" % (raw,)
            raise ConfigError("config key '%s': %s%s" % (self.name, problem, got), self.name) from None


@attr.s(frozen=True, slots=True)
class Config:
    """A validated configuration: dotted key to converted value."""

    values = attr.ib(converter=dict)

    def __getitem__(self, name):
        return self.values[name]

    def get(self, name, default=None):
        return self.values.get(name, default)

    def with_prefix(self, prefix):
        """The keys starting with ``prefix`` (e.g. ``"storage.ssl."``), prefix removed."""
        return {k[len(prefix):]: v for k, v in self.values.items() if k.startswith(prefix)}


def flatten(mapping, prefix="", _enclosing=()):
    """Flatten nested mappings into dotted keys; a key may not be given twice, nor a mapping contain
    itself (a YAML alias of an enclosing mapping: ``x: &a {b: *a}``)."""
    flat = {}
    enclosing = _enclosing + (id(mapping),)
    for key, value in mapping.items():
        name = prefix + str(key)
        if isinstance(value, dict):
            if id(value) in enclosing:
                raise ConfigError("config key '%s' refers to a mapping that contains it" % name, name)
            nested = flatten(value, name + ".", enclosing)
            duplicate = flat.keys() & nested.keys()
            if duplicate:
                name = sorted(duplicate)[0]
                raise ConfigError("config key '%s' is given twice" % name, name)
            flat.update(nested)
        elif name in flat:
            raise ConfigError("config key '%s' is given twice" % name, name)
        else:
            flat[name] = value
    return flat


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key, mark):
        super().__init__("config key '%s' is given twice" % key)
        self.key, self.problem_mark = key, mark


class _StrictLoader(yaml.SafeLoader):
    """The safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise _DuplicateKey(key, key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(exc):
    """One line saying what is wrong with a YAML document and where."""
    mark = getattr(exc, "problem_mark", None)
    where = " at line %d, column %d" % (mark.line + 1, mark.column + 1) if mark is not None else ""
    problem = str(exc) if isinstance(exc, _DuplicateKey) else getattr(exc, "problem", None) or str(exc)
    return "%s%s" % (" ".join(str(problem).split()), where)


def read_yaml(path):
    """Read a YAML mapping from ``path``; errors name the file (and for bad YAML, the line and column)."""
    try:
        with open(path, encoding="utf-8") as stream:
            data = yaml.load(stream, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except OSError as exc:
        raise ConfigError("cannot read config file %s: %s" % (path, exc.strerror)) from None
    except UnicodeError as exc:
        raise ConfigError("config file %s is not UTF-8 text: %s" % (path, exc)) from None
    except _DuplicateKey as exc:
        raise ConfigError("config file %s: %s" % (path, _yaml_problem(exc)), str(exc.key)) from None
    except yaml.YAMLError as exc:
        raise ConfigError("config file %s is not valid YAML: %s" % (path, _yaml_problem(exc))) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config file %s must hold a mapping of keys to values" % path)
    return data


def build_config(raw, keys, open_prefixes=()):
    """Validate a raw mapping against ``keys``.

    ``open_prefixes`` lists prefixes (such as ``"storage.ssl."``) under which
    any key is passed through unchecked for a later component to interpret.
    """
    flat = flatten(raw)
    table = {key.name: key for key in keys}
    for name in sorted(flat):
        if name not in table and not name.startswith(tuple(open_prefixes)):
            raise ConfigError("config key '%s' is not a known key" % name, name)
    values = {}
    for key in keys:
        if key.name in flat and flat[key.name] is not None:
            values[key.name] = key.convert(flat[key.name])
        elif key.default is REQUIRED:
            raise ConfigError("config key '%s' is required%s" % (
                key.name, ": " + key.doc if key.doc else ""), key.name)
        else:
            values[key.name] = key.default
    values.update({k: v for k, v in flat.items() if k not in table})
    return Config(values)


def load_config(path, keys, open_prefixes=()):
    """Read and validate the YAML file at ``path``. A key written with no value (``storage.port:``) is refused:
    taking it for the default would hide a value lost in an edit."""
    raw = read_yaml(path)
    for name, value in sorted(flatten(raw).items()):
        if value is None:
            raise ConfigError("config key '%s' in %s has no value: give it one, or leave the key out for its "
                              "default" % (name, path), name)
    return build_config(raw, keys, open_prefixes)


def check_distinct_ports(config, names):
    """Raise :class:`ConfigError` when two of the named port keys share a value."""
    seen = {}
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if value in seen:
            raise ConfigError("config key '%s': port %d is already used by '%s'" % (name, value, seen[value]),
                              name)
        seen[value] = name


# Keys every component that talks to ZooKeeper accepts.
ZOOKEEPER_KEYS = (
    Key("zookeeper.connectString", connect_string, doc="ZooKeeper host:port list, e.g. 127.0.0.1:2181"),
    Key("zookeeper.sessionTimeout", session_timeout_milliseconds, 30000, "ZooKeeper session timeout in ms"),
    Key("zookeeper.connectTimeout", milliseconds, 10000, "ZooKeeper connect timeout in ms"),
    Key("cluster.root", znode_path, doc="the cluster's root znode, e.g. /waltz_cluster"),
)
