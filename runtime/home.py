"""Where prepared models live: `$DFLASH_HOME` (default `~/.cache/dflash`)."""
from __future__ import annotations

import os
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")


def models_home() -> Path:
    """The dflash home: `$DFLASH_HOME` if set and non-empty, else `~/.cache/dflash`."""
    return Path(os.environ.get("DFLASH_HOME") or Path.home() / ".cache" / "dflash").expanduser()


def model_dir(name: str, dtype: str, home: Path | None = None) -> Path:
    """`<home>/models/<name>/<dtype>` (home: `models_home()` if None); rejects unknown dtypes."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return (home or models_home()) / "models" / name / dtype
