"""Structured logs: one line per event, `key=value` fields after the message (logfmt: a value
with spaces, quotes or `=` is written as a JSON string, so every line parses back).

Request-scoped events carry `request_id` (gateway) and `seq` (the sequence id the gateway gives
a request on the target and the draft), so one request can be followed through all three logs.
A sequence id is a capability (whoever knows it can drive the sequence on the services), so
above DEBUG it is written as a tag, `h:` and 12 hex digits of its SHA-256 - the same in the three
logs (of the id the gateway sent, without the owner part the services file it under:
callers.py), useless to call with. The level is each service's `--log-level` (env `DFLASH_LOG_LEVEL`)."""
from __future__ import annotations

import hashlib
import json
import logging
import re
import sys

from services.common.callers import external

_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_BARE = re.compile(r"^[^\s\"=]+$")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def format_value(value: object) -> str:
    text = str(value)
    return text if _BARE.match(text) else json.dumps(text, ensure_ascii=False)


class KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = (f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')}.{int(record.msecs):03d} "
                f"{record.levelname:<5} {record.name} {record.getMessage()}")
        extras = {k: v for k, v in vars(record).items() if k not in _RESERVED}
        if "seq" in extras and record.levelno > logging.DEBUG:
            extras["seq"] = seq_tag(external(str(extras["seq"])))
        if extras:
            base += " " + " ".join(f"{k}={format_value(v)}" for k, v in extras.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


def seq_tag(seq_id: str) -> str:
    """What a log line above DEBUG shows of a sequence id."""
    return "h:" + hashlib.sha256(seq_id.encode()).hexdigest()[:12]


def setup_logging(level: str = "INFO", service: str = "") -> None:
    """Unknown level: exit 2 with a message naming the allowed ones."""
    name = str(level).upper()
    if name not in LEVELS:
        print(f"--log-level {level!r} is not a level: use one of {', '.join(LEVELS)}",
              file=sys.stderr)
        raise SystemExit(2)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KeyValueFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(name if name != "DEBUG" else "INFO")     # DEBUG: ours only, not the libraries'
    logging.getLogger("dflash").setLevel(name)
    logging.getLogger("dflash").info("logging configured", extra={"service": service,
                                                                   "level": name})
