"""Fetch the upstream sources that tests/test_io_request_fields.py reads: a few files of vLLM's
source distribution (vLLM itself cannot be installed without CUDA). The sdist is found through
the package index's JSON API (PEP 691), checked against its sha256 and streamed: only the named
files are written. `make install` and `make test` run this once per venv.

    python tests/fetch_upstream.py --version 0.33.0 --dest .venv/upstream
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

INDEX_URL = "https://pypi.org/simple/{name}/"
VLLM_FILES = ("vllm/sampling_params.py", "vllm/entrypoints/openai/chat_completion/protocol.py",
              "vllm/entrypoints/openai/completion/protocol.py")


def sdist_entry(name: str, version: str) -> dict:
    """The index's entry (url, sha256) for NAME-VERSION.tar.gz."""
    request = urllib.request.Request(INDEX_URL.format(name=name),
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    filename = f"{name}-{version}.tar.gz"
    for entry in files:
        if entry["filename"] == filename:
            return entry
    raise SystemExit(f"{filename} is not on the package index")


def fetch(version: str, dest: Path) -> Path:
    entry = sdist_entry("vllm", version)
    target = dest / f"vllm-{version}"
    with tempfile.TemporaryFile() as archive:
        digest = hashlib.sha256()
        with urllib.request.urlopen(entry["url"], timeout=600) as response:
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                archive.write(chunk)
        if digest.hexdigest() != entry["hashes"]["sha256"]:
            raise SystemExit(f"{entry['filename']}: sha256 mismatch")
        archive.seek(0)
        wanted = {f"vllm-{version}/{path}": path for path in VLLM_FILES}
        with tarfile.open(fileobj=archive, mode="r:gz") as tar:
            for member in tar:
                if member.name in wanted and member.isfile():
                    out = target / wanted.pop(member.name)
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_bytes(tar.extractfile(member).read())
    if wanted:
        raise SystemExit(f"vllm {version}'s sdist lacks {sorted(wanted.values())}")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", required=True, help="vLLM version, e.g. 0.33.0")
    parser.add_argument("--dest", required=True, type=Path, help="folder to hold vllm-VERSION/")
    args = parser.parse_args(argv)
    print(f"fetched {fetch(args.version, args.dest)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
