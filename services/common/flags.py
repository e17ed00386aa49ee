"""Command-line flags that also read `DFLASH_<NAME>` environment variables (flag wins)."""
from __future__ import annotations

import argparse
import os
import re
from typing import Any


def env_name(flag: str) -> str:
    return "DFLASH_" + flag.lstrip("-").replace("-", "_").upper()


def add(parser: argparse.ArgumentParser, flag: str, default: Any = None, type: Any = str,
        help: str = "", secret: bool = False, **kw: Any) -> None:
    """Adds --flag whose default comes from $DFLASH_FLAG when set (secret: --help does not
    print the value)."""
    env = os.environ.get(env_name(flag))
    if env is not None:
        if kw.get("action") == "store_true":
            default = env.lower() in ("1", "true", "yes", "on")
        elif kw.get("nargs") in ("*", "+"):
            default = [type(x) for x in env.split(",") if x]
        else:
            default = type(env)
    if kw.get("action") == "store_true":
        parser.add_argument(flag, default=bool(default), help=f"{help} [env {env_name(flag)}]", **kw)
    else:
        shown = "(hidden)" if secret and default else default
        parser.add_argument(flag, default=default, type=type,
                            help=f"{help} [env {env_name(flag)}; default {shown}]", **kw)


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_switch(text: str) -> bool:
    """'on' / 'off' (also true/false, yes/no, 1/0) -> bool."""
    value = str(text).strip().lower()
    if value in ("on", "true", "yes", "1"):
        return True
    if value in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"not a switch: {text!r} (on or off)")


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1.5G', '1000000' -> bytes."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GB, 1000000)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])
